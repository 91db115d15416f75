"""Fused all-reduce + bias/residual add + RMSNorm over PyTorch symmetric memory.

What
----
A TokenWeave-style Triton kernel family that replaces ``all_reduce(x); x + residual;
rms_norm(...)`` on a tensor-parallel group inside one node.  With ``N`` ranks and ``T``
token rows padded to ``Tp = S * N`` (``S = ceil(T / N)``), rank ``r`` owns the rows
``[r*S, (r+1)*S) ∩ [0, T)``.  For every owned row the kernel

1. *reduce-scatter*: reads that row of every peer's symmetric input buffer and sums in
   fp32 (``p2p``), or lets the NVSwitch do it with ``multimem.ld_reduce`` (``multimem``);
2. adds bias / residual, rounds to ``residual_dtype`` (the new residual), RMS-normalises
   in fp32 registers, applies the (optionally Gemma-offset) weight;
3. *all-gather*: stores the normed row (and the new residual unless it stays sharded)
   into every peer's symmetric output buffer (plain peer stores, or ``multimem.st``).

Why
---
The norm costs nothing extra when it runs on the rows a rank reduces anyway, the
all-gather moves the already-normalised activations, and the whole thing needs only a
handful of CTAs (``num_ctas``, typically 2..32) so it can overlap with GEMMs running on
the rest of the GPU (TokenWeave's split-token overlap).

Synchronisation (signal pads)
-----------------------------
Each launch uses ``grid`` CTAs (``grid = min(num_ctas, ceil(S / BLOCK_ROWS))``, a
function of ``(T, N, H, num_ctas)`` only, hence identical on every rank).  CTA ``b`` of
rank ``r`` owns the 32-bit slots ``pad[r][pad_offset + b*N + p]`` (one per peer ``p``)
of its symmetric signal pad; each slot is a counting semaphore written only by CTA ``b``
of peer ``p`` (+1) and CTA ``b`` of ``r`` (-1).  A *block barrier* is

* ``bar.sync``; ``fence.acq_rel.sys``; then thread 0 adds 1 (relaxed, system scope) to
  ``pad[p][pad_offset + b*N + r]`` of every peer ``p != r``.  The fence followed by the
  increment is a release pattern (cumulative over the CTA's writes, which thread 0
  observed through ``bar.sync``); the increments are fire-and-forget, so N-1 peers cost
  one fence, not N-1 round trips;
* thread 0, for every peer ``p != r``: spin on an acquire read (atomic add of 0, system
  scope) of ``pad[r][pad_offset + b*N + p]`` until it is >= 1, then subtract 1: the wait
  *consumes* the signal.  ``bar.sync`` then orders every thread's later accesses after
  the acquires.

Every launch posts exactly two signals per (CTA, peer) and consumes exactly two, so
after every launch all slots are back to 0: replay-safe in CUDA graphs, no host-side
reset.  Signals are counted, not matched: the k-th wait of CTA ``b`` on ``r`` passes
once the count of signals from ``p`` reached k, i.e. once ``p`` reached its k-th
barrier, whatever the interleaving (a slot can transiently hold 2).  Scalar Triton
atomics are executed by one thread of the CTA (the PTX predicates them on thread 0).

The kernel runs two block barriers:

* **entry**, before reading peers: peer ``p`` enqueued its staging copy (or its producer
  GEMM wrote the input buffer directly) *before* this kernel on its stream, so when
  CTA ``b`` of ``p`` signals, ``p``'s input rows are complete and visible (kernel
  boundary + release/acquire at system scope).  It also protects the *outputs*: ``p``'s
  entry signal happens after ``p``'s previous copy-out of the output buffers finished,
  so our stores into ``p``'s output buffers cannot clobber data ``p`` still reads.
* **exit**, after the broadcast stores: CTA ``b`` of rank ``r`` returns only after CTA
  ``b`` of every peer has finished *all* of its reads of ``r``'s input and *all* of its
  stores into ``r``'s outputs.  As every CTA index is paired across ranks, the whole
  kernel on ``r`` completes only when every peer CTA has done so for ``r``; therefore
  (a) the copy-out that follows on ``r``'s stream sees every row, and (b) ``r``'s next
  staging copy into its input buffer cannot race with a slow peer still reading it.

Everything relies on all CTAs of a launch being co-resident with their peers (few CTAs,
so true in practice) and on all ranks issuing the same sequence of launches per channel.

Two launches that may run *concurrently* (two streams, TokenWeave's two token splits)
must use different ``channel`` values: each channel has its own workspace buffers and
its own disjoint slot range ``pad_offset = (32 + channel * _MAX_CTAS) * N``.  The range
starts above the slots used by PyTorch's own symmetric-memory kernels (``block * N +
rank`` for up to 32 blocks; ``barrier(channel)`` uses ``channel * N + rank``).

Memory / limits
---------------
* Vector width: 16 bytes, i.e. 8 elements for bf16/fp16 and 4 for fp32; the hidden
  size must be divisible by the vector width of every dtype involved (input, output,
  residual) so each row starts 16-byte aligned and ``multimem ... .v4`` ops apply.
* A whole row (``BLOCK_H = next_pow2(H)``) lives in registers: ``H <= 16384``.
* ``multimem`` sums bf16/fp16 with ``.acc::f32`` but returns the sum rounded to the input
  dtype (hardware limitation), so it is ~1 ulp of the input dtype less exact than the
  ``p2p`` fp32 accumulation; fp32 inputs are summed in fp32 by both.

Safety
------
The ``multimem`` variant is only ever selected/launched when the symmetric-memory handle
reports a non-zero ``multicast_ptr`` (i.e. PyTorch created a multicast object itself);
this module never creates multicast objects and never touches the environment variables
that disable NVLink multicast.

Outputs are fresh tensors copied out of the symmetric buffers (a later launch overwrites
the buffers, so views would silently change under the caller); a zero-copy *input* path
exists: :func:`input_buffer` returns a view of the symmetric input buffer a producer can
write into, and the staging copy is skipped when ``x`` is that view.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

try:  # Triton is optional: importing this module must work without it (tests skip).
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except Exception:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None
    _HAS_TRITON = False

# --------------------------------------------------------------------------------------
# Configuration / constants
# --------------------------------------------------------------------------------------

# "p2p" pushes (every cross-rank access is a store: no staging copy, no copy-out);
# "p2p_pull" is the load-based sibling of "multimem" (same kernel, peer loads instead of
# multimem.ld_reduce), kept for comparison.
# "p2p_ce" moves the peers' rows with the copy engines (no SMs) around a local add+norm kernel.
VARIANTS = ("p2p", "multimem", "p2p_pull", "p2p_ce")
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VECTOR_BYTES = 16  # one 16-byte vector per access: 8 x 16-bit or 4 x fp32
MAX_HIDDEN = 16384  # a whole row lives in registers
MAX_WORLD_SIZE = 8  # one NVLink domain; also bounds the signal-pad footprint
_MAX_CTAS = 32  # slots reserved per channel: _MAX_CTAS * world_size
# PyTorch's own symmetric-memory kernels use pad slots block * N + rank for up to 32
# blocks (and barrier(channel) uses channel * N + rank): our channels start above them.
_TORCH_RESERVED_BLOCKS = 32
_CAPACITY_ROUND_ROWS = 256  # workspaces grow in multiples of 256 * world_size rows
_REGION_ALIGN = 256  # byte alignment of the regions carved out of one symm buffer
_DEFAULT_NUM_CTAS = 16
# Spin limit for the pad barriers (iterations per slot; 0 = wait forever).  When it
# trips the kernel increments the workspace's status word and carries on (results of
# that launch are garbage and the pads may be out of step: discard the workspace).
_ENV_SPIN_LIMIT = "WEAVE_SYMM_SPIN_LIMIT"


def _spin_limit() -> int:
    try:
        return max(0, int(os.environ.get(_ENV_SPIN_LIMIT, "0")))
    except ValueError:
        return 0


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def vector_width(dtype: torch.dtype) -> int:
    """Elements per 16-byte vector for ``dtype`` (8 for bf16/fp16, 4 for fp32)."""
    return VECTOR_BYTES // dtype.itemsize


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _tl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _sig_dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]


def check_hidden(hidden: int, dtypes) -> Optional[str]:
    """None if ``hidden`` is usable with all of ``dtypes``, else the reason."""
    if hidden <= 0 or hidden > MAX_HIDDEN:
        return f"hidden size {hidden} outside (0, {MAX_HIDDEN}] (a row must fit in registers)"
    for dt in dtypes:
        if dt not in SUPPORTED_DTYPES:
            return f"dtype {dt} not supported (bf16, fp16, fp32 only)"
        vw = vector_width(dt)
        if hidden % vw:
            return f"hidden size {hidden} not divisible by the {dt} vector width {vw} (16 bytes)"
    return None


# --------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------

if _HAS_TRITON:

    @triton.jit
    def _sys_fence():
        """``fence.acq_rel.sys`` on every thread (one is enough for thread 0's pattern)."""
        tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _pad_wait(slot, SPIN_LIMIT: tl.constexpr):
        """Consume one signal from ``slot`` (own pad): spin on an acquire read (system
        scope) until the count is >= 1, then decrement it.  Returns 1 on timeout."""
        v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
        if SPIN_LIMIT > 0:
            spins = 0
            while (v < 1) & (spins < SPIN_LIMIT):
                v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
                spins += 1
            if v >= 1:
                tl.atomic_add(slot, -1, sem="relaxed", scope="sys")
        else:
            while v < 1:
                v = tl.atomic_add(slot, 0, sem="acquire", scope="sys")
            tl.atomic_add(slot, -1, sem="relaxed", scope="sys")
        return (v < 1).to(tl.int32)

    @triton.jit
    def _block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE: tl.constexpr,
                       SPIN_LIMIT: tl.constexpr, FENCE_ASM: tl.constexpr):
        """CTA b of this rank <-> CTA b of every peer (see the module docstring)."""
        base = pad_offset + tl.program_id(0) * WORLD_SIZE
        # Every thread's earlier loads/stores are ordered before thread 0's signals.
        tl.debug_barrier()
        if FENCE_ASM:
            # One system fence, then fire-and-forget relaxed increments to every peer:
            # each (fence, increment) pair is a release pattern, and the increments are
            # not serialised behind each other's round trips.
            _sys_fence()
        for p in tl.static_range(WORLD_SIZE):
            if p != rank:
                peer_pad = tl.load(PTR_TABLE + 3 * WORLD_SIZE + p).to(tl.pointer_type(tl.int32))
                if FENCE_ASM:
                    tl.atomic_add(peer_pad + base + rank, 1, sem="relaxed", scope="sys")
                else:  # TRITON_INTERPRET (no inline asm): release increments instead
                    tl.atomic_add(peer_pad + base + rank, 1, sem="release", scope="sys")
        own_pad = tl.load(PTR_TABLE + 3 * WORLD_SIZE + rank).to(tl.pointer_type(tl.int32))
        timeouts = tl.zeros((), dtype=tl.int32)
        for p in tl.static_range(WORLD_SIZE):
            if p != rank:
                timeouts += _pad_wait(own_pad + base + p, SPIN_LIMIT)
        if timeouts > 0:
            tl.atomic_add(STATUS, timeouts)
        # Every thread's later loads/stores are ordered after thread 0's acquires.
        tl.debug_barrier()

    # ---- p2p primitives ---------------------------------------------------------------

    @triton.jit
    def _p2p_load_reduce(PTR_TABLE, elem_off, mask, IN_DTYPE: tl.constexpr,
                         WORLD_SIZE: tl.constexpr):
        """fp32 sum over ranks 0..N-1 (fixed order) of the peers' input buffers."""
        acc = tl.zeros(elem_off.shape, dtype=tl.float32)
        for p in tl.static_range(WORLD_SIZE):
            buf = tl.load(PTR_TABLE + p).to(tl.pointer_type(IN_DTYPE))
            buf = tl.multiple_of(buf, 16)
            acc += tl.load(buf + elem_off, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        return acc

    @triton.jit
    def _p2p_store_bcast(PTR_TABLE, TABLE_ROW: tl.constexpr, elem_off, val, mask,
                         DTYPE: tl.constexpr, WORLD_SIZE: tl.constexpr):
        """Store ``val`` into the same rows of every rank's buffer ``TABLE_ROW``."""
        for p in tl.static_range(WORLD_SIZE):
            buf = tl.load(PTR_TABLE + TABLE_ROW * WORLD_SIZE + p).to(tl.pointer_type(DTYPE))
            buf = tl.multiple_of(buf, 16)
            tl.store(buf + elem_off, val, mask=mask)

    # ---- multimem primitives (NVLink SHARP through the multicast address) ------------

    @triton.jit
    def _mm_vec_addr(mc_base, rows, row_ok, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                     VEC: tl.constexpr):
        """Byte address and predicate of every 16-byte vector of the [R, BLOCK_H] tile."""
        vi = tl.arange(0, BLOCK_H // VEC)
        elem = rows[:, None] * HIDDEN + (vi * VEC)[None, :]
        addr = mc_base + elem * (16 // VEC)
        pred = (row_ok[:, None] & ((vi * VEC) < HIDDEN)[None, :]).to(tl.int32)
        return addr, pred

    @triton.jit
    def _mm_unpack(u0, u1, u2, u3, DTYPE: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """4 x [R, NV] 32-bit words (word k of 16-byte vector n) -> fp32 [R, BLOCK_H]."""
        # join(join(u0, u2), join(u1, u3)) is [R, NV, 2, 2] with [.., j, i] = u_{2j+i}:
        # flattening gives word 4n + k in memory order.
        words = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)),
                           (BLOCK_ROWS, BLOCK_H // VEC * 4))
        if DTYPE == tl.float32:
            out = words.to(tl.float32, bitcast=True)
        else:  # little endian: element 2m in the low half of word m
            lo = (words & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
            hi = (words >> 16).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
            out = tl.reshape(tl.join(lo, hi), (BLOCK_ROWS, BLOCK_H))
        return out

    @triton.jit
    def _mm_pack(val, DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 VEC: tl.constexpr):
        """[R, BLOCK_H] values (already DTYPE) -> 4 x [R, NV] 32-bit words (inverse of
        :func:`_mm_unpack`)."""
        if DTYPE == tl.float32:
            words = val.to(tl.uint32, bitcast=True)
        else:
            lo, hi = tl.split(tl.reshape(val, (BLOCK_ROWS, BLOCK_H // 2, 2)))
            lo = lo.to(tl.uint16, bitcast=True).to(tl.uint32)
            hi = hi.to(tl.uint16, bitcast=True).to(tl.uint32)
            words = lo | (hi << 16)
        even, odd = tl.split(tl.reshape(words, (BLOCK_ROWS, BLOCK_H // VEC, 2, 2)))
        u0, u2 = tl.split(even)
        u1, u3 = tl.split(odd)
        return u0, u1, u2, u3

    @triton.jit
    def _mm_load_reduce(mc_base, rows, row_ok, IN_DTYPE: tl.constexpr, HIDDEN: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """``multimem.ld_reduce ... add`` of one 16-byte vector per thread-slot; fp32 out."""
        addr, pred = _mm_vec_addr(mc_base, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        if IN_DTYPE == tl.float32:
            u0, u1, u2, u3 = tl.inline_asm_elementwise(
                """{
                .reg .pred %mm_p;
                setp.ne.s32 %mm_p, $5, 0;
                mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
                @%mm_p multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {$0, $1, $2, $3}, [$4];
                }""",
                "=r,=r,=r,=r,l,r", [addr, pred],
                dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=False, pack=1)
        elif IN_DTYPE == tl.bfloat16:
            u0, u1, u2, u3 = tl.inline_asm_elementwise(
                """{
                .reg .pred %mm_p;
                setp.ne.s32 %mm_p, $5, 0;
                mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
                @%mm_p multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {$0, $1, $2, $3}, [$4];
                }""",
                "=r,=r,=r,=r,l,r", [addr, pred],
                dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=False, pack=1)
        else:
            u0, u1, u2, u3 = tl.inline_asm_elementwise(
                """{
                .reg .pred %mm_p;
                setp.ne.s32 %mm_p, $5, 0;
                mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;
                @%mm_p multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {$0, $1, $2, $3}, [$4];
                }""",
                "=r,=r,=r,=r,l,r", [addr, pred],
                dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=False, pack=1)
        return _mm_unpack(u0, u1, u2, u3, IN_DTYPE, BLOCK_H, BLOCK_ROWS, VEC)

    @triton.jit
    def _mm_store_bcast(mc_base, rows, row_ok, val, DTYPE: tl.constexpr, HIDDEN: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """``multimem.st`` of the [R, BLOCK_H] tile ``val`` (already DTYPE) to all ranks."""
        addr, pred = _mm_vec_addr(mc_base, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        u0, u1, u2, u3 = _mm_pack(val, DTYPE, BLOCK_H, BLOCK_ROWS, VEC)
        if DTYPE == tl.float32:
            tl.inline_asm_elementwise(
                """{
                .reg .pred %mm_p;
                setp.ne.s32 %mm_p, $6, 0;
                @%mm_p multimem.st.relaxed.sys.global.v4.f32 [$1], {$2, $3, $4, $5};
                mov.b32 $0, 0;
                }""",
                "=r,l,r,r,r,r,r", [addr, u0, u1, u2, u3, pred],
                dtype=tl.int32, is_pure=False, pack=1)
        elif DTYPE == tl.bfloat16:
            tl.inline_asm_elementwise(
                """{
                .reg .pred %mm_p;
                setp.ne.s32 %mm_p, $6, 0;
                @%mm_p multimem.st.relaxed.sys.global.v4.bf16x2 [$1], {$2, $3, $4, $5};
                mov.b32 $0, 0;
                }""",
                "=r,l,r,r,r,r,r", [addr, u0, u1, u2, u3, pred],
                dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                """{
                .reg .pred %mm_p;
                setp.ne.s32 %mm_p, $6, 0;
                @%mm_p multimem.st.relaxed.sys.global.v4.f16x2 [$1], {$2, $3, $4, $5};
                mov.b32 $0, 0;
                }""",
                "=r,l,r,r,r,r,r", [addr, u0, u1, u2, u3, pred],
                dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _load_reduce_rows(PTR_TABLE, i0, first_row, rows_per_rank, num_tokens, cols, col_ok, mc_in,
                          IN_DTYPE: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, IN_VEC: tl.constexpr, WORLD_SIZE: tl.constexpr,
                          USE_MULTIMEM: tl.constexpr):
        """fp32 sum over ranks of shard rows ``[i0, i0 + BLOCK_ROWS)``; rows past the shard
        or past T load nothing (so the prefetch past the last iteration is free)."""
        local = i0 + tl.arange(0, BLOCK_ROWS)
        rows = (first_row + local).to(tl.int64)
        row_ok = (local < rows_per_rank) & (rows < num_tokens)
        if USE_MULTIMEM:
            acc = _mm_load_reduce(mc_in, rows, row_ok, IN_DTYPE, HIDDEN, BLOCK_H, BLOCK_ROWS, IN_VEC)
        else:
            mask = row_ok[:, None] & col_ok[None, :]
            acc = _p2p_load_reduce(PTR_TABLE, rows[:, None] * HIDDEN + cols[None, :], mask, IN_DTYPE,
                                   WORLD_SIZE)
        return acc

    # ---- the kernel -------------------------------------------------------------------

    @triton.jit(do_not_specialize=["num_tokens", "rows_per_rank", "rank", "pad_offset"])
    def _symm_allreduce_rmsnorm_kernel(
        PTR_TABLE,  # *i64 [4N+3]: in[N], out[N], res[N], pad[N] addresses, mc in/out/res
        RESIDUAL,  # residual input, [T, H] or this rank's shard [S, H]
        BIAS,  # [H]
        WEIGHT,  # [H]
        RESIDUAL_OUT,  # this rank's residual shard [S, H] (RESIDUAL_OUT_SHARDED only)
        STATUS,  # *i32 [1]: barrier timeouts
        num_tokens,  # T
        rows_per_rank,  # S
        rank,
        pad_offset,  # first signal slot of this channel
        stride_res_row,
        stride_res_out_row,
        eps,
        weight_offset,
        WORLD_SIZE: tl.constexpr,
        HIDDEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
        RES_DTYPE: tl.constexpr,
        MID_DTYPE: tl.constexpr,
        IN_VEC: tl.constexpr,
        OUT_VEC: tl.constexpr,
        RES_VEC: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_MID: tl.constexpr,
        RESIDUAL_IN_SHARDED: tl.constexpr,
        RESIDUAL_OUT_SHARDED: tl.constexpr,
        USE_MULTIMEM: tl.constexpr,
        SPIN_LIMIT: tl.constexpr,
        FENCE_ASM: tl.constexpr,
    ):
        pid = tl.program_id(0)
        n_ctas = tl.num_programs(0)

        # Entry barrier: every peer's input rows are written, and every peer finished
        # copying out the previous launch's outputs (we are about to overwrite them).
        _block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT,
                       FENCE_ASM)

        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < HIDDEN
        if HAS_BIAS:
            bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32) + weight_offset
        mc_in = tl.load(PTR_TABLE + 4 * WORLD_SIZE + 0)  # 0 without multicast; unused by p2p
        if USE_MULTIMEM:
            mc_out = tl.load(PTR_TABLE + 4 * WORLD_SIZE + 1)
            mc_res = tl.load(PTR_TABLE + 4 * WORLD_SIZE + 2)

        first_row = rank * rows_per_rank
        # Grid-stride loop over this rank's shard (a while loop: the same code also runs
        # under TRITON_INTERPRET=1, which the CPU tests use to simulate ranks). The peers'
        # rows of the next iteration are loaded before this iteration's norm and stores:
        # remote loads are latency-bound with so few CTAs, and two iterations in flight
        # hide one of them. Loads read input buffers, stores write output buffers: no hazard.
        i0 = pid * BLOCK_ROWS
        acc_next = _load_reduce_rows(PTR_TABLE, i0, first_row, rows_per_rank, num_tokens, cols,
                                     col_ok, mc_in, IN_DTYPE, HIDDEN, BLOCK_H, BLOCK_ROWS, IN_VEC,
                                     WORLD_SIZE, USE_MULTIMEM)
        while i0 < rows_per_rank:
            local = i0 + tl.arange(0, BLOCK_ROWS)  # row index inside this rank's shard
            rows = (first_row + local).to(tl.int64)  # global row index
            in_shard = local < rows_per_rank
            row_ok = in_shard & (rows < num_tokens)
            mask = row_ok[:, None] & col_ok[None, :]
            elem_off = rows[:, None] * HIDDEN + cols[None, :]

            # 1. reduce-scatter: fp32 sum of this row over all ranks (loaded one iteration ahead)
            acc = acc_next
            acc_next = _load_reduce_rows(PTR_TABLE, i0 + n_ctas * BLOCK_ROWS, first_row,
                                         rows_per_rank, num_tokens, cols, col_ok, mc_in, IN_DTYPE,
                                         HIDDEN, BLOCK_H, BLOCK_ROWS, IN_VEC, WORLD_SIZE,
                                         USE_MULTIMEM)

            # 2. bias, residual, rounding to the residual dtype
            if HAS_BIAS:
                acc = acc + bias[None, :]
            if HAS_RESIDUAL:
                if RESIDUAL_IN_SHARDED:
                    r_off = local.to(tl.int64)[:, None] * stride_res_row + cols[None, :]
                else:
                    r_off = rows[:, None] * stride_res_row + cols[None, :]
                acc = acc + tl.load(RESIDUAL + r_off, mask=mask, other=0.0).to(tl.float32)
            res = acc.to(RES_DTYPE)
            if RESIDUAL_OUT_SHARDED:
                ro_off = local.to(tl.int64)[:, None] * stride_res_out_row + cols[None, :]
                tl.store(RESIDUAL_OUT + ro_off, tl.where(mask, res, tl.zeros_like(res)),
                         mask=in_shard[:, None] & col_ok[None, :])
            elif USE_MULTIMEM:
                _mm_store_bcast(mc_res, rows, row_ok, res, RES_DTYPE, HIDDEN, BLOCK_H,
                                BLOCK_ROWS, RES_VEC)
            else:
                _p2p_store_bcast(PTR_TABLE, 2, elem_off, res, mask, RES_DTYPE, WORLD_SIZE)

            # 3. RMSNorm in fp32 registers
            r = res.to(tl.float32)
            var = tl.sum(r * r, axis=1) / HIDDEN
            y = r * tl.rsqrt(var + eps)[:, None]
            if HAS_MID:
                y = y.to(MID_DTYPE).to(tl.float32)
            if HAS_WEIGHT:
                y = y * w[None, :]
            normed = y.to(OUT_DTYPE)

            # 4. all-gather of the normed rows
            if USE_MULTIMEM:
                _mm_store_bcast(mc_out, rows, row_ok, normed, OUT_DTYPE, HIDDEN, BLOCK_H,
                                BLOCK_ROWS, OUT_VEC)
            else:
                _p2p_store_bcast(PTR_TABLE, 1, elem_off, normed, mask, OUT_DTYPE, WORLD_SIZE)
            i0 += n_ctas * BLOCK_ROWS

        # Exit barrier: every peer CTA finished reading our input and writing our outputs.
        _block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT,
                       FENCE_ASM)

    # ---- the push kernel (p2p): remote stores only --------------------------------------

    @triton.jit
    def _rows_of(j0, BLOCK_ROWS: tl.constexpr, owner, rows_per_rank, num_tokens):
        """Shard-local indices ``j`` and global rows of ``owner``'s shard, with validity."""
        j = j0 + tl.arange(0, BLOCK_ROWS)
        rows = (owner * rows_per_rank + j).to(tl.int64)
        ok = (j < rows_per_rank) & (rows < num_tokens)
        return j.to(tl.int64), rows, ok

    @triton.jit(do_not_specialize=["num_tokens", "rows_per_rank", "slot_rows", "rank", "pad_offset"])
    def _symm_push_allreduce_rmsnorm_kernel(
        PTR_TABLE,  # *i64: in[N], out[N], res[N], pad[N] addresses (regions used as [N, slot_rows, H])
        X,  # this rank's partial sums [T, H], any (non-symmetric) memory
        RESIDUAL,  # [T, H] or this rank's shard [S, H]
        BIAS,
        WEIGHT,
        NORMED,  # [T, H] output, regular memory
        RESIDUAL_OUT,  # [T, H] or this rank's shard [S, H], regular memory
        STATUS,
        num_tokens,
        rows_per_rank,  # S
        slot_rows,  # rows per source-rank slot in the symmetric regions (capacity / N)
        rank,
        pad_offset,
        stride_x_row,
        stride_res_row,
        stride_out_row,
        stride_res_out_row,
        eps,
        weight_offset,
        WORLD_SIZE: tl.constexpr,
        HIDDEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
        RES_DTYPE: tl.constexpr,
        MID_DTYPE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_MID: tl.constexpr,
        RESIDUAL_IN_SHARDED: tl.constexpr,
        RESIDUAL_OUT_SHARDED: tl.constexpr,
        SPIN_LIMIT: tl.constexpr,
        FENCE_ASM: tl.constexpr,
        COPY_ENGINE: tl.constexpr = False,  # phase 2 only: peers' rows move by copy engine
    ):
        """Reduce-scatter and all-gather by *pushing*: every cross-rank access is a store.

        CTA ``b`` handles shard-local rows ``j`` of its grid-stride set in every phase and for
        every owner, so the CTA-pairwise barriers order exactly the rows each pair exchanges.
        """
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_ROWS
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < HIDDEN
        # Symmetric regions are 16-byte aligned: say so, or every access is scalar.
        in_base = tl.multiple_of(tl.load(PTR_TABLE + rank).to(tl.pointer_type(IN_DTYPE)), 16)
        out_base = tl.multiple_of(tl.load(PTR_TABLE + WORLD_SIZE + rank).to(tl.pointer_type(OUT_DTYPE)), 16)
        res_base = tl.multiple_of(tl.load(PTR_TABLE + 2 * WORLD_SIZE + rank).to(tl.pointer_type(RES_DTYPE)), 16)

        # Entry: every peer finished its previous launch on this channel (it read its slots).
        if not COPY_ENGINE:
            _block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)

        # 1. scatter: our partial of owner p's rows -> slot [rank] of p's input region.
        for p in tl.static_range(WORLD_SIZE * (1 - COPY_ENGINE)):  # no peers touched in CE mode
            if p != rank:
                peer_in = tl.load(PTR_TABLE + p).to(tl.pointer_type(IN_DTYPE))
                peer_in = tl.multiple_of(peer_in, 16)
                j0 = pid * BLOCK_ROWS
                while j0 < rows_per_rank:
                    j, rows, ok = _rows_of(j0, BLOCK_ROWS, p, rows_per_rank, num_tokens)
                    m = ok[:, None] & col_ok[None, :]
                    v = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m)
                    tl.store(peer_in + (rank * slot_rows + j)[:, None] * HIDDEN + cols[None, :], v, mask=m)
                    j0 += step
        if not COPY_ENGINE:
            _block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)

        # 2. reduce our rows locally, add, norm; keep our rows, push them to every peer.
        if HAS_BIAS:
            bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32) + weight_offset
        j0 = pid * BLOCK_ROWS
        while j0 < rows_per_rank:
            j, rows, ok = _rows_of(j0, BLOCK_ROWS, rank, rows_per_rank, num_tokens)
            m = ok[:, None] & col_ok[None, :]
            acc = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
            for p in tl.static_range(WORLD_SIZE):
                if p != rank:
                    acc += tl.load(in_base + (p * slot_rows + j)[:, None] * HIDDEN + cols[None, :],
                                   mask=m, other=0.0).to(tl.float32)
            if HAS_BIAS:
                acc = acc + bias[None, :]
            if HAS_RESIDUAL:
                if RESIDUAL_IN_SHARDED:
                    r_off = j[:, None] * stride_res_row + cols[None, :]
                else:
                    r_off = rows[:, None] * stride_res_row + cols[None, :]
                acc = acc + tl.load(RESIDUAL + r_off, mask=m, other=0.0).to(tl.float32)
            res = acc.to(RES_DTYPE)
            if RESIDUAL_OUT_SHARDED:
                sm = (j < rows_per_rank)[:, None] & col_ok[None, :]
                tl.store(RESIDUAL_OUT + j[:, None] * stride_res_out_row + cols[None, :],
                         tl.where(m, res, tl.zeros_like(res)), mask=sm)
            else:
                tl.store(RESIDUAL_OUT + rows[:, None] * stride_res_out_row + cols[None, :], res, mask=m)
                if COPY_ENGINE:  # our own slot; the peers copy it from there
                    tl.store(res_base + (rank * slot_rows + j)[:, None] * HIDDEN + cols[None, :], res, mask=m)
                else:
                    for p in tl.static_range(WORLD_SIZE):
                        if p != rank:
                            peer_res = tl.multiple_of(
                                tl.load(PTR_TABLE + 2 * WORLD_SIZE + p).to(tl.pointer_type(RES_DTYPE)), 16)
                            tl.store(peer_res + (rank * slot_rows + j)[:, None] * HIDDEN + cols[None, :], res,
                                     mask=m)
            r = res.to(tl.float32)
            var = tl.sum(r * r, axis=1) / HIDDEN
            y = r * tl.rsqrt(var + eps)[:, None]
            if HAS_MID:
                y = y.to(MID_DTYPE).to(tl.float32)
            if HAS_WEIGHT:
                y = y * w[None, :]
            normed = y.to(OUT_DTYPE)
            tl.store(NORMED + rows[:, None] * stride_out_row + cols[None, :], normed, mask=m)
            if COPY_ENGINE:
                tl.store(out_base + (rank * slot_rows + j)[:, None] * HIDDEN + cols[None, :], normed, mask=m)
            for p in tl.static_range(WORLD_SIZE * (1 - COPY_ENGINE)):
                if p != rank:
                    peer_out = tl.multiple_of(
                        tl.load(PTR_TABLE + WORLD_SIZE + p).to(tl.pointer_type(OUT_DTYPE)), 16)
                    tl.store(peer_out + (rank * slot_rows + j)[:, None] * HIDDEN + cols[None, :], normed, mask=m)
            j0 += step
        if not COPY_ENGINE:
            _block_barrier(PTR_TABLE, STATUS, rank, pad_offset, WORLD_SIZE, SPIN_LIMIT, FENCE_ASM)

        # 3. gather: the peers pushed their rows into our slots; copy them to the outputs.
        for p in tl.static_range(WORLD_SIZE * (1 - COPY_ENGINE)):  # no peers touched in CE mode
            if p != rank:
                j0 = pid * BLOCK_ROWS
                while j0 < rows_per_rank:
                    j, rows, ok = _rows_of(j0, BLOCK_ROWS, p, rows_per_rank, num_tokens)
                    m = ok[:, None] & col_ok[None, :]
                    slot = (p * slot_rows + j)[:, None] * HIDDEN + cols[None, :]
                    tl.store(NORMED + rows[:, None] * stride_out_row + cols[None, :],
                             tl.load(out_base + slot, mask=m), mask=m)
                    if not RESIDUAL_OUT_SHARDED:
                        tl.store(RESIDUAL_OUT + rows[:, None] * stride_res_out_row + cols[None, :],
                                 tl.load(res_base + slot, mask=m), mask=m)
                    j0 += step


else:  # pragma: no cover
    _symm_allreduce_rmsnorm_kernel = _symm_push_allreduce_rmsnorm_kernel = None


@dataclass(frozen=True)
class _LaunchMeta:
    block_h: int
    block_rows: int
    num_warps: int
    grid: int


@functools.lru_cache(maxsize=4096)
def _launch_meta(hidden: int, rows_per_rank: int, num_ctas: int,
                 num_warps: Optional[int] = None) -> _LaunchMeta:
    """Tile shape and grid.  Depends only on (H, S, num_ctas): identical on all ranks.

    Aim for ~32 fp32 accumulator registers per thread: 16 warps for rows >= 2048
    elements, up to 8 rows per CTA iteration for short rows (more loads in flight per
    thread, which matters with so few CTAs), but never more rows per iteration than the
    shard gives each CTA (so small T still spreads over all CTAs)."""
    block_h = _next_pow2(hidden)
    if num_warps is None:
        num_warps = 16 if block_h >= 2048 else max(4, block_h // 128)
    threads = 32 * num_warps
    r_max = max(1, min(8, 32 * threads // block_h))
    r_need = _prev_pow2(max(1, math.ceil(rows_per_rank / max(1, num_ctas))))
    block_rows = max(1, min(r_max, r_need))
    grid = max(1, min(num_ctas, math.ceil(max(1, rows_per_rank) / block_rows)))
    return _LaunchMeta(block_h, block_rows, num_warps, grid)


@functools.lru_cache(maxsize=1024)
def _kernel_constexprs_cached(**kw) -> tuple:
    return tuple(_kernel_constexprs(**kw).items())


def _kernel_constexprs(*, world_size, hidden, block_h, block_rows, in_dtype, out_dtype,
                       res_dtype, mid_dtype, has_bias, has_residual, has_weight,
                       residual_in_sharded, residual_out_sharded, use_multimem,
                       spin_limit, interpreting=False) -> dict:
    return dict(
        WORLD_SIZE=int(world_size),
        HIDDEN=int(hidden),
        BLOCK_H=int(block_h),
        BLOCK_ROWS=int(block_rows),
        IN_DTYPE=_tl_dtype(in_dtype),
        OUT_DTYPE=_tl_dtype(out_dtype),
        RES_DTYPE=_tl_dtype(res_dtype),
        MID_DTYPE=_tl_dtype(mid_dtype if mid_dtype is not None else torch.float32),
        IN_VEC=vector_width(in_dtype),
        OUT_VEC=vector_width(out_dtype),
        RES_VEC=vector_width(res_dtype),
        HAS_BIAS=bool(has_bias),
        HAS_RESIDUAL=bool(has_residual),
        HAS_WEIGHT=bool(has_weight),
        HAS_MID=mid_dtype is not None,
        RESIDUAL_IN_SHARDED=bool(residual_in_sharded),
        RESIDUAL_OUT_SHARDED=bool(residual_out_sharded),
        USE_MULTIMEM=bool(use_multimem),
        SPIN_LIMIT=int(spin_limit),
        # Triton's CPU interpreter cannot run inline PTX (tests simulate ranks with it).
        FENCE_ASM=not interpreting,
    )


# --------------------------------------------------------------------------------------
# Symmetric workspace
# --------------------------------------------------------------------------------------


class SymmCapacityError(RuntimeError):
    """The workspace is too small and cannot grow now (CUDA graph capture)."""


@dataclass(eq=False)
class SymmWorkspace:
    """Symmetric buffers of one (group, dtypes, hidden, channel), capacity in rows.

    One ``symm_mem.empty`` uint8 allocation, one ``rendezvous``; three row-major regions
    ``inp`` [cap, H] (x dtype), ``out`` [cap, H] (out dtype), ``res`` [cap, H] (residual
    dtype; used only when the residual output is all-gathered).  ``ptr_table`` holds, for
    every rank, the peer-mapped addresses of the three regions and of its signal pad,
    followed by the multicast addresses (0 when there is no multicast object)."""

    group_name: str
    device: torch.device
    in_dtype: torch.dtype
    out_dtype: torch.dtype
    res_dtype: torch.dtype
    hidden: int
    channel: int
    capacity: int
    rank: int
    world_size: int
    buffer: torch.Tensor
    handle: Any
    inp: torch.Tensor
    out: torch.Tensor
    res: torch.Tensor
    ptr_table: torch.Tensor
    status: torch.Tensor
    multicast_ptr: int
    pad_offset: int
    used_in_capture: bool = False
    #: per rank, (inp, out, res) views mapped into this process (copy-engine variant)
    peer_views: Optional[list] = None

    def check_status(self) -> int:
        """Number of barrier timeouts recorded so far (synchronises the device)."""
        return int(self.status.item())


_WORKSPACES: dict[tuple, SymmWorkspace] = {}
# Workspaces replaced by a larger one while a captured CUDA graph may still use them.
_RETIRED: list[SymmWorkspace] = []
_PROBES: dict[tuple, Any] = {}


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def _ensure_group_enabled(group_name: str) -> None:
    """Older PyTorch needs ``enable_symm_mem_for_group``; newer deprecates it (no-op)."""
    symm_mem = _symm_mem()
    try:
        enabled = symm_mem.is_symm_mem_enabled_for_group(group_name)
    except Exception:
        enabled = False
    if not enabled and hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


def _signal_pad_bytes(handle) -> int:
    size = getattr(handle, "signal_pad_size", None)
    if not size:
        try:
            size = _symm_mem().get_signal_pad_size()
        except Exception:
            size = 0
    return int(size)


def pad_offset_for(channel: int, world_size: int) -> int:
    """First uint32 signal slot of ``channel`` (each channel: _MAX_CTAS * N slots, after
    the 32 * N slots PyTorch's own kernels may use).  Channel 0 needs
    (32 + 32) * N * 4 bytes of pad: 2048 bytes (the old default) for N = 8; the newer
    9216-byte default holds channels 0..7 for N <= 8."""
    return (_TORCH_RESERVED_BLOCKS + int(channel) * _MAX_CTAS) * int(world_size)


def _ws_key(group_name, in_dtype, out_dtype, res_dtype, hidden, channel, device):
    return (str(group_name), in_dtype, out_dtype, res_dtype, int(hidden), int(channel),
            int(device.index if device.index is not None else torch.cuda.current_device()))


def _round_capacity(padded_rows: int, world_size: int) -> int:
    q = _CAPACITY_ROUND_ROWS * world_size
    return max(q, math.ceil(padded_rows / q) * q)


def _allocate_workspace(group_name, device, in_dtype, out_dtype, res_dtype, hidden, channel,
                        capacity) -> SymmWorkspace:
    """Collective: every rank of ``group_name`` must call it with the same arguments."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    symm_mem = _symm_mem()
    _ensure_group_enabled(group_name)

    def _rbytes(dt):
        n = capacity * hidden * torch.empty((), dtype=dt).element_size()
        return math.ceil(n / _REGION_ALIGN) * _REGION_ALIGN

    off_in, off_out = 0, _rbytes(in_dtype)
    off_res = off_out + _rbytes(out_dtype)
    total = off_res + _rbytes(res_dtype)
    # Normal (non-inference) tensors: copy_ into them must work inside and outside
    # torch.inference_mode().
    with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(device):
        buf = symm_mem.empty(total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group_name)
        world_size = int(handle.world_size)
        rank = int(handle.rank)
        if world_size > MAX_WORLD_SIZE:
            raise RuntimeError(f"world size {world_size} > {MAX_WORLD_SIZE} not supported")

        # buffer_ptrs point at the allocation's data start; the tensor may sit at an
        # offset inside it (PyTorch's symmetric MemPool).  Compute it from our own
        # mapping (version independent) and cross-check with handle.offset if present.
        bptrs = [int(p) for p in handle.buffer_ptrs]
        base_off = buf.data_ptr() - bptrs[rank]
        h_off = getattr(handle, "offset", None)
        if base_off < 0 or base_off % 16:
            raise RuntimeError(f"unexpected symmetric tensor offset {base_off}")
        if h_off is not None and int(h_off) != base_off:
            logger.warning("symm handle offset %s != computed %s; using computed",
                           h_off, base_off)
        offs: Optional[list] = None
        try:  # The offset must be the same on every rank (symmetric allocation).
            pg = c10d._resolve_process_group(group_name)
            offs = [None] * world_size
            dist.all_gather_object(offs, base_off, group=pg)
        except Exception as e:  # pragma: no cover - best effort check
            logger.warning("could not cross-check symmetric buffer offsets: %s", e)
            offs = None
        if offs is not None and len(set(offs)) != 1:
            raise RuntimeError(f"symmetric buffer offsets differ across ranks: {offs}")

        # multicast_ptr is the multicast address of the rendezvous'd tensor itself
        # (PyTorch adds the handle's offset), i.e. of ``buf``'s first byte.
        mc = int(getattr(handle, "multicast_ptr", 0) or 0)
        mc_base = mc
        pads = [int(p) for p in handle.signal_pad_ptrs]
        table = []
        for region in (off_in, off_out, off_res):
            table += [b + base_off + region for b in bptrs]
        table += pads
        table += [mc_base + off_in if mc else 0, mc_base + off_out if mc else 0,
                  mc_base + off_res if mc else 0]
        ptr_table = torch.tensor(table, dtype=torch.int64, device=device)
        status = torch.zeros(1, dtype=torch.int32, device=device)

        pad_off = pad_offset_for(channel, world_size)
        need = (pad_off + _MAX_CTAS * world_size) * 4
        have = _signal_pad_bytes(handle)
        if have and need > have:
            raise RuntimeError(
                f"signal pad too small for channel {channel}: need {need} bytes, have "
                f"{have}; call torch.distributed._symmetric_memory.set_signal_pad_size("
                f"{need}) before any symmetric allocation, or use a lower channel")

        def _view(off, dt):
            n = capacity * hidden * torch.empty((), dtype=dt).element_size()
            return buf[off:off + n].view(dt).view(capacity, hidden)

        ws = SymmWorkspace(
            group_name=str(group_name), device=device, in_dtype=in_dtype, out_dtype=out_dtype,
            res_dtype=res_dtype, hidden=hidden, channel=channel, capacity=capacity, rank=rank,
            world_size=world_size, buffer=buf, handle=handle, inp=_view(off_in, in_dtype),
            out=_view(off_out, out_dtype), res=_view(off_res, res_dtype), ptr_table=ptr_table,
            status=status, multicast_ptr=mc_base, pad_offset=pad_off)
    logger.info("symm workspace group=%s rank=%d/%d H=%d dtypes=%s/%s/%s channel=%d "
                "capacity=%d rows (%.1f MiB) multicast=%s", group_name, rank, world_size,
                hidden, in_dtype, out_dtype, res_dtype, channel, capacity, total / 2**20,
                bool(mc))
    return ws


def get_workspace(group_name: str, dtype: torch.dtype, hidden: int, num_tokens: int, *,
                  out_dtype: Optional[torch.dtype] = None,
                  residual_dtype: Optional[torch.dtype] = None, channel: int = 0,
                  device: Optional[torch.device] = None) -> Optional[SymmWorkspace]:
    """The cached workspace with room for ``num_tokens`` rows (padded to S*N).

    Allocating or growing is collective (rendezvous): all ranks must call this with the
    same arguments, which they do when they run the same model step.  Never grows while
    the current stream is capturing a CUDA graph: returns None instead (callers fall
    back; call :func:`reserve` before capture)."""
    out_dtype = out_dtype or dtype
    residual_dtype = residual_dtype or dtype
    device = torch.device(device) if device is not None else torch.device(
        "cuda", torch.cuda.current_device())
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = _ws_key(group_name, dtype, out_dtype, residual_dtype, hidden, channel, device)
    ws = _WORKSPACES.get(key)
    capturing = torch.cuda.is_current_stream_capturing()
    if ws is not None:
        s = math.ceil(num_tokens / ws.world_size)
        if s * ws.world_size <= ws.capacity:
            if capturing:
                ws.used_in_capture = True
            return ws
    if capturing:
        logger.warning("symm workspace for %s (H=%d, %d tokens, channel %d) missing or too "
                       "small during CUDA graph capture; call reserve() before capturing",
                       group_name, hidden, num_tokens, channel)
        return None
    world_size = ws.world_size if ws is not None else _group_size(group_name)
    capacity = _round_capacity(math.ceil(max(1, num_tokens) / world_size) * world_size,
                               world_size)
    if ws is not None:
        if ws.used_in_capture:
            # A captured graph still points at the old buffers: keep them alive.
            _RETIRED.append(ws)
    from .outside_pool import run_outside_graph_pool

    # Growing at run time can happen inside cudagraph trees' warm-up (a symbolic T above the
    # compile-time reservation); allocated there, the workspace's tensors fail the pool check.
    new = run_outside_graph_pool(lambda: _allocate_workspace(
        group_name, device, dtype, out_dtype, residual_dtype, hidden, channel, capacity), device)
    _WORKSPACES[key] = new
    return new


def _group_size(group_name: str) -> int:
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(group_name).size()


def reserve(group_name: str, dtype: torch.dtype, hidden: int, max_tokens: int, *,
            out_dtype: Optional[torch.dtype] = None,
            residual_dtype: Optional[torch.dtype] = None, channel: int = 0,
            device: Optional[torch.device] = None) -> SymmWorkspace:
    """Pre-allocate (collectively) a workspace for up to ``max_tokens`` rows; call it
    before CUDA graph capture."""
    if torch.cuda.is_current_stream_capturing():
        raise SymmCapacityError("reserve() must be called outside CUDA graph capture")
    ws = get_workspace(group_name, dtype, hidden, max_tokens, out_dtype=out_dtype,
                       residual_dtype=residual_dtype, channel=channel, device=device)
    assert ws is not None
    return ws


def input_buffer(group_name: str, dtype: torch.dtype, num_tokens: int, hidden: int, *,
                 out_dtype: Optional[torch.dtype] = None,
                 residual_dtype: Optional[torch.dtype] = None, channel: int = 0,
                 device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """[T, H] view of this rank's symmetric input buffer (zero-copy producer path).

    A producer (e.g. the row-parallel GEMM) may write its partial sums here; passing
    this view as ``x`` to :func:`fused_allreduce_rmsnorm_symm` (same dtypes/channel)
    skips the staging copy.  Write it on the stream that launches the fused op, and
    only after the previous fused launch on that channel was enqueued.  Returns None
    during CUDA graph capture when no large-enough workspace exists."""
    ws = get_workspace(group_name, dtype, hidden, num_tokens, out_dtype=out_dtype,
                       residual_dtype=residual_dtype, channel=channel, device=device)
    return None if ws is None else ws.inp[:num_tokens]


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


def _launch(ptr_table: torch.Tensor, status: torch.Tensor, *, rank: int, world_size: int,
            pad_offset: int, num_tokens: int, hidden: int, in_dtype: torch.dtype,
            out_dtype: torch.dtype, residual_dtype: torch.dtype,
            mid_dtype: Optional[torch.dtype], residual: Optional[torch.Tensor],
            bias: Optional[torch.Tensor], weight: Optional[torch.Tensor],
            residual_out: Optional[torch.Tensor], residual_in_sharded: bool, eps: float,
            weight_offset: float, num_ctas: int, num_warps: Optional[int],
            use_multimem: bool) -> _LaunchMeta:
    """Launch the kernel on prepared buffers (``ptr_table`` layout: see SymmWorkspace).

    ``residual_out`` given = sharded residual output [S, H].  Shared by the public
    launcher and the CPU interpreter simulation in the tests."""
    S = math.ceil(num_tokens / world_size)
    dummy = ptr_table  # any valid tensor for absent pointer arguments (never read)
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    bias = bias.contiguous() if bias is not None else None
    weight = weight.contiguous() if weight is not None else None
    meta = _launch_meta(hidden, S, num_ctas, num_warps)
    consts = _kernel_constexprs_cached(
        world_size=world_size, hidden=hidden, block_h=meta.block_h, block_rows=meta.block_rows,
        in_dtype=in_dtype, out_dtype=out_dtype, res_dtype=residual_dtype, mid_dtype=mid_dtype,
        has_bias=bias is not None, has_residual=residual is not None,
        has_weight=weight is not None, residual_in_sharded=residual_in_sharded,
        residual_out_sharded=residual_out is not None, use_multimem=use_multimem,
        spin_limit=_spin_limit(), interpreting=_interpreting())
    _symm_allreduce_rmsnorm_kernel[(meta.grid,)](
        ptr_table,
        residual if residual is not None else dummy,
        bias if bias is not None else dummy,
        weight if weight is not None else dummy,
        residual_out if residual_out is not None else dummy,
        status,
        num_tokens, S, rank, pad_offset,
        residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0,
        float(eps), float(weight_offset),
        num_warps=meta.num_warps, num_stages=1, **dict(consts))
    return meta


def _launch_push(ws: "SymmWorkspace", x, residual, bias, weight, normed, residual_out, *,
                 num_tokens: int, mid_dtype, residual_in_sharded: bool, residual_out_sharded: bool,
                 eps: float, weight_offset: float, num_ctas: int, num_warps: Optional[int],
                 copy_engine: bool = False) -> _LaunchMeta:
    """Launch the push kernel: x, residual and the outputs are ordinary tensors."""
    N, H = ws.world_size, ws.hidden
    S = math.ceil(num_tokens / N)
    dummy = ws.ptr_table
    bias = bias.contiguous() if bias is not None else None
    weight = weight.contiguous() if weight is not None else None
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    meta = _launch_meta(H, S, num_ctas, num_warps)
    _symm_push_allreduce_rmsnorm_kernel[(meta.grid,)](
        ws.ptr_table, x,
        residual if residual is not None else dummy,
        bias if bias is not None else dummy,
        weight if weight is not None else dummy,
        normed, residual_out, ws.status,
        num_tokens, S, ws.capacity // N, ws.rank, ws.pad_offset,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        normed.stride(0), residual_out.stride(0), float(eps), float(weight_offset),
        WORLD_SIZE=N, HIDDEN=H, BLOCK_H=meta.block_h, BLOCK_ROWS=meta.block_rows,
        IN_DTYPE=_tl_dtype(x.dtype), OUT_DTYPE=_tl_dtype(normed.dtype),
        RES_DTYPE=_tl_dtype(residual_out.dtype),
        MID_DTYPE=_tl_dtype(mid_dtype if mid_dtype is not None else torch.float32),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_MID=mid_dtype is not None, RESIDUAL_IN_SHARDED=residual_in_sharded,
        RESIDUAL_OUT_SHARDED=residual_out_sharded, SPIN_LIMIT=_spin_limit(),
        FENCE_ASM=not _interpreting(), COPY_ENGINE=copy_engine, num_warps=meta.num_warps, num_stages=1)
    return meta


def _peer_regions(ws: "SymmWorkspace") -> list:
    """Per rank, ``(inp, out, res)`` views of that rank's regions, mapped here (cached)."""
    if ws.peer_views is not None:
        return ws.peer_views
    N, H = ws.world_size, ws.hidden
    table = ws.ptr_table.tolist()
    views = []
    for p in range(N):
        base = ws.handle.get_buffer(p, [ws.buffer.numel() + (ws.buffer.data_ptr() - int(ws.handle.buffer_ptrs[ws.rank]))],
                                    torch.uint8, 0)
        regions = []
        for k, dt in enumerate((ws.in_dtype, ws.out_dtype, ws.res_dtype)):
            off = table[k * N + p] - base.data_ptr()
            nbytes = ws.capacity * H * torch.empty((), dtype=dt).element_size()
            regions.append(base[off:off + nbytes].view(dt).view(ws.capacity, H))
        views.append(tuple(regions))
    ws.peer_views = views
    return views


def _copy_engine_allreduce_rmsnorm(ws: "SymmWorkspace", x, residual, bias, weight, normed, residual_out, *,
                                   num_tokens: int, residual_out_sharded: bool, **norm_kw) -> None:
    """Barrier, copy-engine scatter of peer rows, local add+norm kernel, barrier, copy-engine gather.

    Every cross-rank byte moves by ``cudaMemcpyAsync`` between peer-mapped buffers (copy
    engines, no SMs); only the add+norm of this rank's rows runs on SMs, on local memory.
    The first barrier also guarantees that every peer finished the previous call (its
    gather read our slots), so the slots can be overwritten.
    """
    N, r = ws.world_size, ws.rank
    S = math.ceil(num_tokens / N)
    slot = ws.capacity // N
    views = _peer_regions(ws)
    ws.handle.barrier(channel=0)
    for p in range(N):
        rows = min(S, max(0, num_tokens - p * S))
        if p != r and rows:
            views[p][0][r * slot:r * slot + rows].copy_(x[p * S:p * S + rows])
    ws.handle.barrier(channel=0)
    _launch_push(ws, x, residual, bias, weight, normed, residual_out, num_tokens=num_tokens,
                 residual_out_sharded=residual_out_sharded, copy_engine=True, **norm_kw)
    ws.handle.barrier(channel=0)
    for p in range(N):
        rows = min(S, max(0, num_tokens - p * S))
        if p != r and rows:
            normed[p * S:p * S + rows].copy_(views[p][1][p * slot:p * slot + rows])
            if not residual_out_sharded:
                residual_out[p * S:p * S + rows].copy_(views[p][2][p * slot:p * slot + rows])


def fused_allreduce_rmsnorm_symm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    group_name: str,
    residual_dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
    mid_dtype: Optional[torch.dtype] = None,
    weight_offset: float = 0.0,
    residual_in_sharded: bool = False,
    residual_out_sharded: bool = False,
    num_ctas: int = _DEFAULT_NUM_CTAS,
    variant: str = "p2p",
    channel: int = 0,
    num_warps: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x`` over ``group_name``, add bias/residual, RMSNorm; see module doc.

    Returns ``(normed [T, H] out_dtype, residual_out)`` where ``residual_out`` is this
    rank's shard [S, H] (rows >= T zero) if ``residual_out_sharded`` else [T, H].
    Collective: every rank must call it with the same shapes, flags, ``num_ctas`` and
    ``channel``.  Raises :class:`SymmCapacityError` if the workspace is too small during
    CUDA graph capture (call :func:`reserve` first)."""
    if not _HAS_TRITON:
        raise RuntimeError("triton is not available")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    if x.dim() != 2 or not (x.is_cuda or _interpreting()):
        raise ValueError("x must be a 2-D CUDA tensor [T, H]")
    T, H = x.shape
    in_dtype = x.dtype
    residual_dtype = residual_dtype or (residual.dtype if residual is not None else in_dtype)
    out_dtype = out_dtype or in_dtype
    why = check_hidden(H, [in_dtype, out_dtype, residual_dtype])
    if why:
        raise ValueError(why)
    if mid_dtype is not None and mid_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"mid_dtype {mid_dtype} not supported")
    if not (1 <= num_ctas <= _MAX_CTAS):
        raise ValueError(f"num_ctas must be in [1, {_MAX_CTAS}], got {num_ctas}")

    ws = get_workspace(group_name, in_dtype, H, max(T, 1), out_dtype=out_dtype,
                       residual_dtype=residual_dtype, channel=channel, device=x.device)
    if ws is None:
        raise SymmCapacityError(
            f"no symmetric workspace with room for {T} tokens (H={H}, channel={channel}) "
            "while capturing a CUDA graph; call reserve() before capture")
    if variant == "multimem" and not ws.multicast_ptr:
        # Hard safety rule: never issue multimem instructions without a multicast object.
        raise RuntimeError("multimem variant requested but the symmetric-memory handle has "
                           "no multicast_ptr; use variant='p2p'")
    N, rank = ws.world_size, ws.rank
    S = math.ceil(T / N)
    if residual_out_sharded:
        residual_out = torch.empty((S, H), dtype=residual_dtype, device=x.device)
    if T == 0:
        normed = torch.empty((0, H), dtype=out_dtype, device=x.device)
        if not residual_out_sharded:
            residual_out = torch.empty((0, H), dtype=residual_dtype, device=x.device)
        return normed, residual_out

    if residual is not None:
        exp = (S, H) if residual_in_sharded else (T, H)
        if tuple(residual.shape) != exp:
            raise ValueError(f"residual must have shape {exp}, got {tuple(residual.shape)}")
    for name, t in (("bias", bias), ("weight", weight)):
        if t is not None and (t.dim() != 1 or t.shape[0] != H):
            raise ValueError(f"{name} must have shape [{H}]")

    if variant in ("p2p", "p2p_ce"):
        # Push: x is read where it is and the outputs are written where they will live.
        # Peers push into our input region, so x must not live there.
        inp_lo = ws.inp.data_ptr()
        if inp_lo <= x.data_ptr() < inp_lo + ws.inp.numel() * ws.inp.element_size():
            x = x.clone()
        normed = torch.empty((T, H), dtype=out_dtype, device=x.device)
        if not residual_out_sharded:
            residual_out = torch.empty((T, H), dtype=residual_dtype, device=x.device)
        x = x if x.stride(-1) == 1 and x.is_contiguous() else x.contiguous()
        norm_kw = dict(mid_dtype=mid_dtype, residual_in_sharded=residual_in_sharded, eps=eps,
                       weight_offset=weight_offset, num_ctas=num_ctas, num_warps=num_warps)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            if variant == "p2p_ce":
                _copy_engine_allreduce_rmsnorm(ws, x, residual, bias, weight, normed, residual_out,
                                               num_tokens=T, residual_out_sharded=residual_out_sharded,
                                               **norm_kw)
            else:
                _launch_push(ws, x, residual, bias, weight, normed, residual_out, num_tokens=T,
                             residual_out_sharded=residual_out_sharded, **norm_kw)
        return normed, residual_out

    # Pull (p2p_pull, multimem): stage x into the symmetric input buffer unless it already is it.
    if not (x.data_ptr() == ws.inp.data_ptr() and x.stride() == (H, 1)):
        ws.inp[:T].copy_(x)

    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _launch(ws.ptr_table, ws.status, rank=rank, world_size=N,
                pad_offset=ws.pad_offset, num_tokens=T, hidden=H, in_dtype=in_dtype,
                out_dtype=out_dtype, residual_dtype=residual_dtype, mid_dtype=mid_dtype,
                residual=residual, bias=bias,
                weight=weight, residual_out=residual_out if residual_out_sharded else None,
                residual_in_sharded=residual_in_sharded, eps=eps,
                weight_offset=weight_offset, num_ctas=num_ctas, num_warps=num_warps,
                use_multimem=variant == "multimem")

    # Copies, not views: the next launch on this channel overwrites the buffers.
    normed = ws.out[:T].clone()
    if not residual_out_sharded:
        residual_out = ws.res[:T].clone()
    return normed, residual_out


# --------------------------------------------------------------------------------------
# Selection
# --------------------------------------------------------------------------------------


def _probe_handle(group_name: str, device: torch.device):
    """A small cached symmetric buffer's handle (collective on first use)."""
    key = (str(group_name), device.index)
    if key not in _PROBES:
        symm_mem = _symm_mem()
        _ensure_group_enabled(group_name)
        with torch.inference_mode(False), torch.cuda.device(device):
            t = symm_mem.empty(4096, dtype=torch.uint8, device=device)
            _PROBES[key] = (t, symm_mem.rendezvous(t, group_name))
    return _PROBES[key][1]


def select_symm_variant(group_name: str, device, dtype: torch.dtype, hidden: int, *,
                        handle: Any = None) -> tuple[Optional[str], str]:
    """``(variant or None, reason)``.

    ``multimem`` only if the handle has a non-zero ``multicast_ptr`` (PyTorch created a
    multicast object, i.e. NVLink SHARP is enabled for this group); else ``p2p`` when
    symmetric memory works for the group (rendezvous succeeded: every peer is mapped);
    else None.  Without ``handle`` this rendezvous-es a small probe buffer, which is
    collective: call it on every rank of the group (e.g. at model init)."""
    if not _HAS_TRITON:
        return None, "triton is not available"
    if dtype not in SUPPORTED_DTYPES:
        return None, f"dtype {dtype} not supported (bf16, fp16, fp32 only)"
    why = check_hidden(int(hidden), [dtype])
    if why:
        return None, why
    if handle is None:
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None, "torch.distributed is not initialized"
            dev = torch.device(device)
            if dev.type != "cuda":
                return None, f"device {dev} is not CUDA"
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            handle = _probe_handle(group_name, dev)
        except Exception as e:
            return None, f"symmetric memory unavailable for group {group_name}: {e}"
    world_size = int(getattr(handle, "world_size", 0) or 0)
    if world_size < 1:
        return None, "symmetric-memory handle reports no ranks"
    if world_size > MAX_WORLD_SIZE:
        return None, f"world size {world_size} > {MAX_WORLD_SIZE}"
    bptrs = getattr(handle, "buffer_ptrs", None)
    if bptrs is not None and (len(bptrs) != world_size or not all(int(p) for p in bptrs)):
        return None, "peer buffers are not all mapped (no P2P access)"
    mc = int(getattr(handle, "multicast_ptr", 0) or 0)
    if mc != 0:
        return "multimem", f"multicast_ptr=0x{mc:x}: NVLink multicast available"
    return "p2p", "no multicast object (multicast_ptr=0); peer-to-peer loads/stores"


# --------------------------------------------------------------------------------------
# Offline compilation (no GPU needed)
# --------------------------------------------------------------------------------------


def compile_variant_ptx(variant: str, dtype: torch.dtype, hidden: int,
                        num_warps: Optional[int] = None, *, world_size: int = 2,
                        out_dtype: Optional[torch.dtype] = None,
                        residual_dtype: Optional[torch.dtype] = None,
                        mid_dtype: Optional[torch.dtype] = None, has_bias: bool = True,
                        has_residual: bool = True, has_weight: bool = True,
                        residual_in_sharded: bool = False,
                        residual_out_sharded: bool = False, block_rows: Optional[int] = None,
                        spin_limit: int = 0, arch: int = 90, return_all: bool = False):
    """Compile the kernel for ``cuda:sm_<arch>`` without a GPU and return its PTX.

    Uses Triton's ``ASTSource`` + ``triton.compile(target=GPUTarget("cuda", arch, 32))``;
    Triton's bundled ptxas also assembles the cubin, so a successful return means the
    inline PTX (multimem) is accepted by ptxas for that architecture.  With
    ``return_all`` the whole ``asm`` dict (ttir, ttgir, llir, ptx, cubin) is returned."""
    if not _HAS_TRITON:
        raise RuntimeError("triton is not available")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out_dtype = out_dtype or dtype
    residual_dtype = residual_dtype or dtype
    why = check_hidden(hidden, [dtype, out_dtype, residual_dtype])
    if why:
        raise ValueError(why)
    meta = _launch_meta(hidden, 1 << 20, _DEFAULT_NUM_CTAS, num_warps)
    if block_rows is not None:
        meta = _LaunchMeta(meta.block_h, int(block_rows), meta.num_warps, meta.grid)
    consts = _kernel_constexprs(
        world_size=world_size, hidden=hidden, block_h=meta.block_h, block_rows=meta.block_rows,
        in_dtype=dtype, out_dtype=out_dtype, res_dtype=residual_dtype, mid_dtype=mid_dtype,
        has_bias=has_bias, has_residual=has_residual, has_weight=has_weight,
        residual_in_sharded=residual_in_sharded, residual_out_sharded=residual_out_sharded,
        use_multimem=variant == "multimem", spin_limit=spin_limit)
    common_sig = {
        "PTR_TABLE": "*i64",
        "RESIDUAL": _sig_dtype(residual_dtype),
        "BIAS": _sig_dtype(dtype),
        "WEIGHT": _sig_dtype(dtype),
        "RESIDUAL_OUT": _sig_dtype(residual_dtype),
        "STATUS": "*i32",
        "num_tokens": "i32",
        "rows_per_rank": "i32",
        "rank": "i32",
        "pad_offset": "i32",
        "stride_res_row": "i32",
        "stride_res_out_row": "i32",
        "eps": "fp32",
        "weight_offset": "fp32",
    }
    if variant in ("p2p", "p2p_ce"):
        fn = _symm_push_allreduce_rmsnorm_kernel
        consts = dict(consts, COPY_ENGINE=variant == "p2p_ce")
        runtime_sig = dict(common_sig, X=_sig_dtype(dtype), NORMED=_sig_dtype(out_dtype),
                           slot_rows="i32", stride_x_row="i32", stride_out_row="i32")
        aligned = ["PTR_TABLE", "X", "RESIDUAL", "BIAS", "WEIGHT", "NORMED", "RESIDUAL_OUT",
                   "STATUS", "stride_x_row", "stride_res_row", "stride_out_row", "stride_res_out_row"]
    else:
        fn = _symm_allreduce_rmsnorm_kernel
        runtime_sig = common_sig
        aligned = ["PTR_TABLE", "RESIDUAL", "BIAS", "WEIGHT", "RESIDUAL_OUT", "STATUS",
                   "stride_res_row", "stride_res_out_row"]
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    signature = {name: (runtime_sig[name] if name in runtime_sig else "constexpr")
                 for name in fn.arg_names}
    # What the JIT would specialise at launch: 16-byte aligned pointers and strides.
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": meta.num_warps, "num_stages": 1})
    return dict(compiled.asm) if return_all else compiled.asm["ptx"]


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------


def allreduce_rmsnorm_rows_ref(
    xs: list,
    residual: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    residual_dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
    mid_dtype: Optional[torch.dtype] = None,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process float64 reference: ``xs`` are the per-rank partial sums [T, H];
    ``residual`` is the full (unsharded) [T, H].  Returns ``(normed [T, H] out_dtype,
    residual_out [T, H] residual_dtype)`` — the all-gathered results every rank sees."""
    if not xs:
        raise ValueError("xs must hold one tensor per rank")
    in_dtype = xs[0].dtype
    residual_dtype = residual_dtype or (residual.dtype if residual is not None else in_dtype)
    out_dtype = out_dtype or in_dtype
    acc = xs[0].to(torch.float64)
    for x in xs[1:]:
        acc = acc + x.to(torch.float64)
    if bias is not None:
        acc = acc + bias.to(torch.float64)
    if residual is not None:
        acc = acc + residual.to(torch.float64)
    res = acc.to(residual_dtype)
    r = res.to(torch.float64)
    y = r * torch.rsqrt((r * r).mean(dim=-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).to(torch.float64)
    if weight is not None:
        y = y * (weight.to(torch.float64) + weight_offset)
    return y.to(out_dtype), res


__all__ = [
    "SUPPORTED_DTYPES",
    "SymmCapacityError",
    "SymmWorkspace",
    "VARIANTS",
    "allreduce_rmsnorm_rows_ref",
    "compile_variant_ptx",
    "fused_allreduce_rmsnorm_symm",
    "get_workspace",
    "input_buffer",
    "pad_offset_for",
    "reserve",
    "select_symm_variant",
    "vector_width",
]
