"""Tests for kernels/multimem/ptx.py: the addressing, pack and unpack helpers, bit-exact.

The multimem instructions never run here (NVLink multicast stays off; tests/testing/test_ptx.py
checks that ptxas accepts them).  Under Triton's CPU interpreter, plain 32-bit loads and stores
stand in for ``multimem.ld_reduce`` / ``multimem.st`` (one rank): every dtype, with masking.

Script mode: ``TRITON_INTERPRET=1 python tests/kernels/multimem/test_ptx.py``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

THIS_FILE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))))  # script mode

from tests.kernels._symm_cases import DT_NAME, run_script  # noqa: E402
from weave_compile.kernels.shared.common import HAS_TRITON, next_pow2, tl_dtype, vector_width  # noqa: E402


if HAS_TRITON:
    import triton
    import triton.language as tl

    from weave_compile.kernels.multimem.ptx import mm_pack, mm_unpack, mm_vec_addr

    @triton.jit
    def _mm_emulation_kernel(src_addr, dst_addr, VALS, num_rows, DTYPE: tl.constexpr,
                             HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """The multimem path with plain 32-bit loads/stores standing in for
        ``multimem.ld_reduce`` / ``multimem.st`` (one rank): addressing, predication,
        unpack and pack.  Runs under TRITON_INTERPRET=1."""
        rows = tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_ok = rows < num_rows
        addr, pred = mm_vec_addr(src_addr, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        ok = pred != 0
        u0 = tl.load((addr + 0).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        u1 = tl.load((addr + 4).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        u2 = tl.load((addr + 8).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        u3 = tl.load((addr + 12).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        vals = mm_unpack(u0, u1, u2, u3, DTYPE, BLOCK_H, BLOCK_ROWS, VEC)
        r = tl.arange(0, BLOCK_ROWS)
        c = tl.arange(0, BLOCK_H)
        tl.store(VALS + r[:, None] * BLOCK_H + c[None, :], vals)
        w0, w1, w2, w3 = mm_pack(vals.to(DTYPE), DTYPE, BLOCK_H, BLOCK_ROWS, VEC)
        daddr, _ = mm_vec_addr(dst_addr, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        tl.store((daddr + 0).to(tl.pointer_type(tl.uint32)), w0, mask=ok)
        tl.store((daddr + 4).to(tl.pointer_type(tl.uint32)), w1, mask=ok)
        tl.store((daddr + 8).to(tl.pointer_type(tl.uint32)), w2, mask=ok)
        tl.store((daddr + 12).to(tl.pointer_type(tl.uint32)), w3, mask=ok)


def interp_multimem_packing_check() -> int:
    """Bit-exact round trip of the multimem helpers for every dtype, incl. masking."""
    fails = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        vec = vector_width(dt)
        for hidden, block_rows, num_rows in ((40, 4, 3), (64, 2, 2), (8 * vec, 1, 1)):
            block_h = next_pow2(hidden)
            src = torch.randn(block_rows, hidden).to(dt)
            dst = torch.full((block_rows, hidden), -7.0, dtype=dt)
            vals = torch.full((block_rows, block_h), float("nan"))
            _mm_emulation_kernel[(1,)](src.data_ptr(), dst.data_ptr(), vals, num_rows,
                                       DTYPE=tl_dtype(dt), HIDDEN=hidden,
                                       BLOCK_H=block_h, BLOCK_ROWS=block_rows, VEC=vec)
            want = torch.zeros(block_rows, block_h)
            want[:num_rows, :hidden] = src[:num_rows].float()
            ok = torch.equal(vals, want)
            ok &= torch.equal(dst[:num_rows].view(torch.uint8), src[:num_rows].view(torch.uint8))
            ok &= bool((dst[num_rows:] == -7.0).all())
            print(f"multimem pack/unpack {DT_NAME[dt]} H={hidden} rows={num_rows}/{block_rows}: "
                  f"{'ok' if ok else 'FAIL'}")
            fails += not ok
    return fails


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_multimem_helpers_round_trip_in_cpu_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    rc, out = run_script(THIS_FILE, [], timeout=600, env=env)
    assert rc == 0, out[-8000:]
    assert "MULTIMEM-PACK OK" in out, out[-8000:]


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1")
    n = interp_multimem_packing_check()
    print("MULTIMEM-PACK OK" if n == 0 else f"{n} failures")
    sys.exit(1 if n else 0)
