"""Triton's CPU interpreter as one rank of several processes that share memory: 2-byte loads whole.

A kernel whose data are their own flags (``oneshot``: a peer's element counts as arrived once it
is no longer the sentinel) relies on the GPU's aligned 2-byte load being single-copy atomic: it
sees either the old value or the new one. Under ``TRITON_INTERPRET=1`` the interpreter copies each
element with the C library's ``memcpy``, and glibc's copy of 2 bytes reads byte 0 and then bytes
0-1 as two loads (``__memmove_avx_unaligned_erms``, glibc 2.36): an element written by another
process between the two is read as the old low byte under the new high byte, a value that is
neither and not the sentinel. Measured here: one process writing 64 bf16 elements in a loop,
another reading them through the interpreter's load: 8768 torn elements in 244K reads of 64;
through numpy's fancy indexing (one 16-bit load an element): 0 in 265K. A oneshot test on
the 2-core CI machine failed once this way (a bf16 row off by 12x the bound on one rank).

:func:`single_copy_volatile_loads` makes the interpreter's volatile loads of 2-byte elements
(the loads a protocol spins on) single 16-bit loads, as on the GPU. 1-, 4- and 8-byte copies are
whole already (glibc reads them with one load of that size, or two of the full size)."""

from __future__ import annotations

import ctypes

import numpy as np


def _gather_u16(ptrs: np.ndarray, mask: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``other`` with the 2-byte elements at the masked ``ptrs`` (raw addresses) loaded, each by
    one 16-bit load (numpy's indexing of a uint16 array copies element by element as uint16)."""
    flat = ptrs.reshape(-1)
    on = mask.reshape(-1).astype(bool)
    out = np.array(other, copy=True).reshape(-1)
    p = flat[on].astype(np.uint64)
    if p.size:
        lo = int(p.min())
        if bool((p % 2).any()):
            raise ValueError("a 2-byte load from an unaligned address")
        view = np.ctypeslib.as_array((ctypes.c_uint16 * ((int(p.max()) - lo) // 2 + 1)).from_address(lo))
        out.view(np.uint16)[on] = view[((p - lo) // 2).astype(np.int64)]
    return out.reshape(ptrs.shape)


def single_copy_volatile_loads() -> None:
    """Route the interpreter's volatile loads of 2-byte elements through :func:`_gather_u16` (module
    doc). Idempotent; call it in each rank process before its first launch."""
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    orig = builder.create_masked_load
    if getattr(orig, "_weave_single_copy", False):
        return

    def create_masked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        dtype_tt = ptrs.get_element_ty()
        dtype_np = ti._get_np_dtype(dtype_tt)
        if not is_volatile or np.dtype(dtype_np).itemsize != 2:
            return orig(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)
        other_data = (np.zeros_like(ptrs.data, dtype=dtype_np) if other is None
                      else np.broadcast_to(other.data, ptrs.data.shape).astype(dtype_np))
        return ti.TensorHandle(_gather_u16(ptrs.data, mask.data, other_data), dtype_tt)

    create_masked_load._weave_single_copy = True
    builder.create_masked_load = create_masked_load
