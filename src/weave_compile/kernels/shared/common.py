"""Constants and small host-side helpers shared by every symmetric-memory kernel module.

Triton is optional: importing this package must work without it (and without CUDA), so the
``triton``/``tl`` names here are None when it is missing and the kernel modules define their
``@triton.jit`` functions only when :data:`HAS_TRITON` is true.
"""

from __future__ import annotations

import os

import torch

from ..spec import DEFAULT_COMM_CTAS, MAX_CTAS  # noqa: F401  (defined with the op's arguments)

try:  # Triton is optional: importing this package must work without it (tests skip).
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VECTOR_BYTES = 16  # one 16-byte vector per access: 8 x 16-bit or 4 x fp32
MAX_HIDDEN = 16384  # a whole row lives in registers
MAX_WORLD_SIZE = 8  # one NVLink domain; also bounds the signal-pad footprint

#: Output regions per workspace. Slot 0 is every copying launch's output staging (the peers'
#: [N, capacity / N] slots); slots 1.. are a ring the push kernel can leave its normed output
#: in (``out_slot``), so nothing copies the peers' rows a second time. Two ring slots let the
#: split's two halves alternate.
OUT_RING_SLOTS = 3
# Spin limit for the pad barriers (iterations per slot; 0 = wait forever).  When it
# trips the kernel increments the workspace's status word and carries on (results of
# that launch are garbage and the pads may be out of step: discard the workspace).
ENV_SPIN_LIMIT = "WEAVE_SYMM_SPIN_LIMIT"


def spin_limit() -> int:
    try:
        return max(0, int(os.environ.get(ENV_SPIN_LIMIT, "0")))
    except ValueError:
        return 0


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the CPU simulations): no inline PTX there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector for ``dtype`` (8 for bf16/fp16, 4 for fp32)."""
    return VECTOR_BYTES // dtype.itemsize


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def sig_dtype(dtype: torch.dtype) -> str:
    """Triton signature string of a pointer to ``dtype`` (offline compilation)."""
    return {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]


def prefetch_fits(inputs: int, elems_per_thread: int, elem_bytes: int, num_warps: int) -> bool:
    """Whether a register-prefetched row loop fits the register file (a model, not a compile):
    two tiles of ``inputs`` packed input tensors of ``elems_per_thread`` elements each, ~2 fp32
    values per element and 40 more, within what a thread gets at ``num_warps`` (64K 32-bit
    registers per SM, at most 255 per thread).  A shape over it spills, which costs far more than
    a smaller tile (docs/performance.md, "Launch shapes")."""
    e = elems_per_thread
    regs = 2 * inputs * e * elem_bytes / 4 + 2 * e + 40
    return regs <= min(255, 65536 // (32 * num_warps))


def needs_int64(*extents: int) -> bool:
    """Whether an element offset a kernel forms can reach 2**31 (an extent: the elements one
    tensor or region spans from its base), so its index arithmetic must be 64-bit."""
    return max(extents, default=0) >= 2 ** 31


def extent(t) -> int:
    """Elements a tensor spans from its base to the end of its last element (any rank, any
    strides, 0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
