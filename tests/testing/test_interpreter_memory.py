"""weave_compile.testing.interpreter_memory: the interpreter's volatile 2-byte loads, whole and right."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import time

import numpy as np
import pytest

pytest.importorskip("triton")

from weave_compile.testing.interpreter_memory import _gather_u16  # noqa: E402

N = 64
OLD, NEW = 0x8000, 0x3F7F  # the bf16 sentinel (-0.0) and a value whose two bytes both differ from it


def test_the_gather_loads_what_the_interpreter_loads(seed):
    """Masked lanes from memory, the others from ``other``: equal to the interpreter's own load on
    random addresses inside an array (any order, repeats)."""
    from triton._C.libtriton import interpreter as native

    rng = np.random.default_rng(seed)
    mem = rng.integers(0, 1 << 16, size=1000, dtype=np.uint16)
    base = mem.ctypes.data
    ptrs = (base + 2 * rng.integers(0, 1000, size=(8, 40))).astype(np.uint64)
    mask = rng.random((8, 40)) < 0.7
    other = rng.integers(0, 1 << 16, size=(8, 40), dtype=np.uint16)
    got = _gather_u16(ptrs, mask, other)
    want = native.load(ptrs, mask, other, np.dtype(np.uint16))
    assert np.array_equal(got, want.reshape(got.shape))
    with pytest.raises(ValueError, match="unaligned"):
        _gather_u16(ptrs + 1, mask, other)


def _writer(path, seconds):
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
        a = np.frombuffer(m, dtype=np.uint16, count=N)
        end, i = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            a[:] = NEW if i & 1 else OLD
            i += 1
        del a
        m.close()


def test_an_element_written_by_another_process_is_never_read_torn(tmp_path):
    """Another process flips 64 elements between two values whose bytes all differ; every element
    read (~1 s of reads) is one of the two. The interpreter's own load, the same way, read
    thousands torn (module doc): that count is printed, not asserted (it depends on timing)."""
    from triton._C.libtriton import interpreter as native

    path = str(tmp_path / "mem.bin")
    with open(path, "wb") as f:
        f.truncate(4096)
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        ptrs = (base + 2 * np.arange(N)).astype(np.uint64)
        mask, other = np.ones(N, dtype=bool), np.zeros(N, dtype=np.uint16)
        counts = {}
        for name, load in (("gather", lambda: _gather_u16(ptrs, mask, other)),
                           ("interpreter", lambda: native.load(ptrs, mask, other, np.dtype(np.uint16)))):
            view = np.frombuffer(m, dtype=np.uint16, count=N)
            view[:] = 0
            w = mp.get_context("spawn").Process(target=_writer, args=(path, 1.2))
            w.start()
            start = time.monotonic()
            while view[0] == 0:  # the writer is running (it starts within seconds)
                assert time.monotonic() - start < 60 and w.exitcode is None, "the writer did not start"
                time.sleep(0.01)
            del view
            reads = torn = 0
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                v = load()
                torn += int(np.count_nonzero((v != OLD) & (v != NEW)))
                reads += 1
            w.join(timeout=30)
            assert w.exitcode == 0
            counts[name] = (reads, torn)
        m.close()
    print(counts)
    assert counts["gather"][0] > 1000 and counts["gather"][1] == 0, counts
