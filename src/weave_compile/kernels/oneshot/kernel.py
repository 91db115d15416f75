"""The one-shot kernel: barrier-free fused all-reduce + bias/residual add + RMSNorm (or LayerNorm), small T.

What
----
``kernel="oneshot"`` implementation of ``weave::allreduce_add_rmsnorm`` (contract: the module
docstring of ``allreduce_rmsnorm.py``). Every rank pushes its whole partial sum (all ``T`` rows)
into its own slot of every peer's symmetric buffer, waits on its *own* memory until every peer's
rows have arrived, and then reduces all rows in fp32 (fixed rank order 0..N-1, so every rank
computes bit-identical rows), adds bias/residual, normalizes and writes both outputs locally. No
second exchange, no barrier. With a sharded residual input each rank also pushes its residual
rows (the ones it owns) so that every rank can finish every row; with a sharded residual output
it returns only its own ``[S, H]`` rows (rows past ``T`` zero), like the other kernels.
LayerNorm (``norm="layernorm"``, a norm bias after the weight) is the shared row body's variant
(``IS_LAYERNORM``, ``HAS_NORM_BIAS`` with the ``NORM_BIAS`` row: the row's mean subtracted after the
residual's rounding, the centred row's mean square as the variance, both passes over the tile in
registers); the launcher passes none of these for RMSNorm without a norm bias, so that kernel
compiles as it did.
Batch invariance (the op's ``batch_invariant``): the sum is in rank order in fp32 on every rank
for every row, so no owner shows in a row's bits; the launcher pins the one launch choice that
moved with T, the rows per tile (:func:`invariant_meta`: one-row tiles), so a row's sum of squares
is reduced alike at every T and CTA count.

Why
---
In decode (a few to a few hundred tokens) the two-shot push kernel's three block barriers,
each a cross-GPU round trip, are most of its time (a fixed cost whatever H; docs/performance.md,
"`oneshot`, `nccl`, `reference`, `multimem`").
One-shot replaces them with a single one-way trip. At two ranks it moves the same NVLink bytes
as reduce-scatter + all-gather (``T*H*b`` each way); it pays with ``N`` times the local
reduce/norm work, which is why ``auto`` may take it only below a crossover
(:data:`weave_compile.kernels.oneshot.ONESHOT_MAX_BYTES`).
This is the "Lamport" scheme of TensorRT-LLM / FlashInfer, written here for this contract.

Protocol
--------
Data are their own flags. The *sentinel* is the negative-zero bit pattern of the dtype
(``0x8000`` for bf16/fp16, ``0x80000000`` for fp32). A real ``-0.0`` in the data is sent as
``+0.0`` (the same value), so a stored element equals the sentinel only if it was not written.

Each rank's symmetric buffer holds 3 *slots*; slot ``s`` has one ``[capacity, H]`` region per
source rank (input dtype) and one ``[capacity, H]`` residual region (residual input dtype, row
``i`` written by its owner). A local, non-symmetric ``state`` tensor (int32) holds the call
counter ``k``, a CTA ticket, and per slot the rows written into it (x2, +1 if residual rows
were pushed). Call ``k`` on every rank:

1. reads ``k`` from ``state`` (device memory: a CUDA graph replays the kernel, not the value);
2. **push**: for each of its rows, stores the (sign-fixed) row into region ``rank`` of slot
   ``k % 3`` of every peer (and, with a sharded residual, its own residual rows into the peers'
   residual region);
3. **clear**: re-poisons, in its *own* buffer, the rows of slot ``(k + 2) % 3`` (the slot call
   ``k - 1`` used, next written at call ``k + 2``) with the sentinel;
4. **wait + reduce**: loads the rows it needs from its own slot ``k % 3`` with volatile loads
   until no element equals the sentinel, sums them with its own ``x`` in rank order, adds,
   normalizes, stores the outputs;
5. the last CTA (ticket) advances ``k`` and resets the ticket; CTA 0 records the rows used.

Why it is race-free
-------------------
* A read never sees a stale value from an earlier use of the slot: slot ``k % 3`` was last
  written at call ``k - 3`` and cleared by this rank at call ``k - 2``, before this kernel
  started (stream order), and volatile loads read the memory, not a cached line.
* A clear never erases data a peer has written for a later call. Rank ``r`` clears slot
  ``(k - 1) % 3`` during call ``k``; a peer ``p`` writes that slot again only in call ``k + 2``,
  which it starts after finishing call ``k + 1``, which needs ``r``'s pushes of call ``k + 1``,
  which ``r`` issues after its call ``k`` (and its clear) completed. With two slots the clear
  of call ``k`` would race with the peer's writes of call ``k + 1``: hence three.
* A clear never erases data that has not arrived yet: call ``k - 1`` on ``r`` finished only
  after it saw every element pushed to ``r`` for that call.
* Each element is checked individually, so a 16-byte vector seen half-written is re-read;
  2- and 4-byte aligned stores are not torn.
* The counter is the same on every rank at every call because every rank issues the same
  sequence of calls on the same workspace (what a TP model does); the CTA that advances it
  takes the last ticket, i.e. after every CTA of this launch has read it.

Why it is replay-safe
---------------------
All protocol state (counter, ticket, rows per slot, the buffers' poison) lives in device memory
and is advanced by the kernel itself; a captured CUDA graph replays the launch and the kernel
finds the current slot. No host-side value is baked into the graph except the token count,
which a captured graph fixes anyway. Buffers are allocated, poisoned and rendezvoused outside
capture (:func:`.workspace.reserve`, called by the fuse pass at compile time); during capture a
too-small workspace raises ``SymmCapacityError`` and the fused op falls back to ``reference`` (logged).

Liveness: every CTA pushes before it waits, and CTA ``b`` of every rank handles the same rows,
so it waits only on CTA ``b`` of the peers; the grid (<= ``comm_ctas``) must be co-resident
with the peers' (true for small grids). ``WEAVE_SYMM_SPIN_LIMIT`` bounds the spins (a timeout
is counted in ``state[5]`` and the results are garbage). Peer memory is reached only through
PyTorch symmetric memory's ``buffer_ptrs``: no multicast, no multimem.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..shared.common import HAS_TRITON, spin_limit, tl, tl_dtype, triton
from ..shared.probe import check_hidden
from ..shared.shapes import LaunchMeta, launch_meta, layernorm_constexprs, warps_and_rows
from ..shared.symm_call import kernel_eps
from ..spec import FusedSpec, Rows
from .workspace import SENTINEL, OneShotWorkspace, SymmCapacityError, get_workspace

# ----------------------------------------------------------------------------- kernel

if HAS_TRITON:
    from ..shared.rownorm import add_norm, load_norm_bias, norm_params  # the shared add + norm body (jit functions)

    @triton.jit
    def _unsentinel(v, BITS: tl.constexpr, SENT: tl.constexpr):
        """-0.0 -> +0.0: the same value, but never the "not yet written" pattern."""
        return tl.where(v.to(BITS, bitcast=True) == SENT, tl.zeros_like(v), v)

    @triton.jit
    def _wait_load(ptrs, mask, BITS: tl.constexpr, SENT: tl.constexpr, SPIN_LIMIT: tl.constexpr):
        """Volatile loads of ``ptrs`` (own memory) until no element under ``mask`` is the
        sentinel; returns ``(values, 1 if the spin limit tripped else 0)``."""
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
        pending = tl.sum((mask & (v.to(BITS, bitcast=True) == SENT)).to(tl.int32))
        spins = 0
        if SPIN_LIMIT > 0:
            while (pending > 0) & (spins < SPIN_LIMIT):
                v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
                pending = tl.sum((mask & (v.to(BITS, bitcast=True) == SENT)).to(tl.int32))
                spins += 1
        else:
            while pending > 0:
                v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
                pending = tl.sum((mask & (v.to(BITS, bitcast=True) == SENT)).to(tl.int32))
        return v, (pending > 0).to(tl.int32)

    @triton.jit(do_not_specialize=["num_tokens", "rows_per_rank", "rank", "slot_bytes", "src_bytes",
                                   "res_off"])
    def _oneshot_allreduce_rmsnorm_kernel(
        PTR_TABLE,  # *i64 [N]: every rank's workspace base, mapped into this process
        STATE,  # *i32 [8], this rank's protocol state (see module doc)
        X,  # this rank's partial sums [T, H]
        RESIDUAL,  # [T, H], or this rank's shard [S, H]
        BIAS,
        WEIGHT,
        NORMED,  # [T, H] out
        RESIDUAL_OUT,  # [T, H], or this rank's shard [S, H] (rows >= T zero)
        num_tokens,
        rows_per_rank,  # S = ceil(T / N)
        rank,
        slot_bytes,  # bytes per slot
        src_bytes,  # bytes per source-rank region: capacity * H * itemsize(in)
        res_off,  # byte offset of the residual region inside a slot
        stride_x_row,
        stride_res_row,
        stride_out_row,
        stride_res_out_row,
        eps,  # a float, or a 0-d tensor on the device (EPS_PTR)
        weight_offset,
        WORLD_SIZE: tl.constexpr,
        HIDDEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        IN_DTYPE: tl.constexpr,
        IN_BITS: tl.constexpr,
        IN_SENT: tl.constexpr,
        RIN_DTYPE: tl.constexpr,  # the residual input's dtype (pushed when sharded)
        RIN_BITS: tl.constexpr,
        RIN_SENT: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
        RES_DTYPE: tl.constexpr,
        MID_DTYPE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_MID: tl.constexpr,
        RESIDUAL_IN_SHARDED: tl.constexpr,
        RESIDUAL_OUT_SHARDED: tl.constexpr,
        PUSH_RES: tl.constexpr,  # HAS_RESIDUAL and RESIDUAL_IN_SHARDED: peers need our residual rows
        SPIN_LIMIT: tl.constexpr,
        EPS_PTR: tl.constexpr = False,
        NORM_BIAS=None,  # [H]: a LayerNorm's bias, added after the weight (HAS_NORM_BIAS only)
        IS_LAYERNORM: tl.constexpr = False,
        HAS_NORM_BIAS: tl.constexpr = False,
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_ROWS
        padded = rows_per_rank * WORLD_SIZE
        cols = tl.arange(0, BLOCK_H)
        col_ok = cols < HIDDEN
        own_lo = rank * rows_per_rank

        # 1. which slot: the counter lives in device memory (CUDA-graph replay reads it anew).
        k = tl.load(STATE, volatile=True)
        slot = k % 3
        clear_slot = (k + 2) % 3
        prev_rows = tl.load(STATE + 2 + clear_slot, volatile=True)
        ticket = tl.atomic_add(STATE + 1, 1, sem="acq_rel", scope="gpu")  # after the read of k

        # 2. push our rows (and our residual rows) into slot `slot` of every peer.
        i0 = pid * BLOCK_ROWS
        while i0 < num_tokens:
            rows = (i0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
            m = (rows < num_tokens)[:, None] & col_ok[None, :]
            elem = rows[:, None] * HIDDEN + cols[None, :]
            v = _unsentinel(tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m),
                            IN_BITS, IN_SENT)
            if PUSH_RES:
                own = (rows >= own_lo) & (rows < own_lo + rows_per_rank) & (rows < num_tokens)
                mr = own[:, None] & col_ok[None, :]
                rv = _unsentinel(tl.load(RESIDUAL + (rows - own_lo)[:, None] * stride_res_row + cols[None, :],
                                         mask=mr), RIN_BITS, RIN_SENT)
            for p in tl.static_range(WORLD_SIZE):
                if p != rank:
                    base = tl.load(PTR_TABLE + p) + slot * slot_bytes
                    dst = tl.multiple_of((base + rank * src_bytes).to(tl.pointer_type(IN_DTYPE)), 16)
                    tl.store(dst + elem, v, mask=m)
                    if PUSH_RES:
                        rdst = tl.multiple_of((base + res_off).to(tl.pointer_type(RIN_DTYPE)), 16)
                        tl.store(rdst + elem, rv, mask=mr)
            i0 += step

        # 3. re-poison, in our own buffer, the rows call k-1 received (slot (k+2) % 3).
        own_base = tl.load(PTR_TABLE + rank)
        prev_t = prev_rows // 2
        i0 = pid * BLOCK_ROWS
        while i0 < prev_t:
            rows = (i0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
            m = (rows < prev_t)[:, None] & col_ok[None, :]
            elem = rows[:, None] * HIDDEN + cols[None, :]
            base = own_base + clear_slot * slot_bytes
            poison = tl.full((BLOCK_ROWS, BLOCK_H), IN_SENT, IN_BITS).to(IN_DTYPE, bitcast=True)
            for p in tl.static_range(WORLD_SIZE):
                if p != rank:
                    tl.store((base + p * src_bytes).to(tl.pointer_type(IN_DTYPE)) + elem, poison, mask=m)
            if prev_rows % 2 == 1:  # that call pushed residual rows too
                rpoison = tl.full((BLOCK_ROWS, BLOCK_H), RIN_SENT, RIN_BITS).to(RIN_DTYPE, bitcast=True)
                tl.store((base + res_off).to(tl.pointer_type(RIN_DTYPE)) + elem, rpoison, mask=m)
            i0 += step

        # 4. wait for every peer's rows in our own slot, reduce in rank order, add, norm.
        if EPS_PTR:  # eps a 0-d device tensor (a graph input under dynamic shapes)
            eps = tl.load(eps).to(tl.float32)
        bias, w = norm_params(BIAS, WEIGHT, cols, col_ok, weight_offset, HAS_BIAS, HAS_WEIGHT)
        nb = None  # NORM_BIAS: None (a constexpr, no kernel argument) unless HAS_NORM_BIAS
        if HAS_NORM_BIAS:
            nb = load_norm_bias(NORM_BIAS, cols, col_ok)
        timeouts = tl.zeros((), dtype=tl.int32)
        slot_base = own_base + slot * slot_bytes
        i0 = pid * BLOCK_ROWS
        while i0 < padded:
            rows = (i0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
            row_ok = rows < num_tokens
            m = row_ok[:, None] & col_ok[None, :]
            elem = rows[:, None] * HIDDEN + cols[None, :]
            acc = tl.zeros((BLOCK_ROWS, BLOCK_H), dtype=tl.float32)
            for p in tl.static_range(WORLD_SIZE):
                if p == rank:
                    acc += tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m,
                                   other=0.0).to(tl.float32)
                else:
                    src = tl.multiple_of((slot_base + p * src_bytes).to(tl.pointer_type(IN_DTYPE)), 16)
                    v, t = _wait_load(src + elem, m, IN_BITS, IN_SENT, SPIN_LIMIT)
                    acc += v.to(tl.float32)
                    timeouts += t
            own = (rows >= own_lo) & (rows < own_lo + rows_per_rank)
            if PUSH_RES:
                # Our rows' residual is local, the others' came with the peers' pushes; added
                # after the bias, as the shared body does.
                not_own = (rows < own_lo) | (rows >= own_lo + rows_per_rank)
                mo = (own & row_ok)[:, None] & col_ok[None, :]
                r_own = tl.load(RESIDUAL + (rows - own_lo)[:, None] * stride_res_row + cols[None, :],
                                mask=mo, other=0.0).to(tl.float32)
                mp = (not_own & row_ok)[:, None] & col_ok[None, :]
                rsrc = tl.multiple_of((slot_base + res_off).to(tl.pointer_type(RIN_DTYPE)), 16)
                r_peer, t = _wait_load(rsrc + elem, mp, RIN_BITS, RIN_SENT, SPIN_LIMIT)
                timeouts += t
                if HAS_BIAS:
                    acc = acc + bias[None, :]
                acc = acc + tl.where(own[:, None], r_own, r_peer.to(tl.float32))
                res, normed = add_norm(acc, rows, rows, m, cols, RESIDUAL, stride_res_row, bias, w, eps,
                                       HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, False, False, HAS_WEIGHT,
                                       HAS_MID, False, nb, IS_LAYERNORM, HAS_NORM_BIAS)
            else:
                res, normed = add_norm(acc, rows, rows, m, cols, RESIDUAL, stride_res_row, bias, w, eps,
                                       HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, HAS_BIAS, HAS_RESIDUAL,
                                       HAS_WEIGHT, HAS_MID, False, nb, IS_LAYERNORM, HAS_NORM_BIAS)
            if RESIDUAL_OUT_SHARDED:
                ms = own[:, None] & col_ok[None, :]
                tl.store(RESIDUAL_OUT + (rows - own_lo)[:, None] * stride_res_out_row + cols[None, :],
                         tl.where(m, res, tl.zeros_like(res)), mask=ms)
            else:
                tl.store(RESIDUAL_OUT + rows[:, None] * stride_res_out_row + cols[None, :], res, mask=m)
            tl.store(NORMED + rows[:, None] * stride_out_row + cols[None, :], normed, mask=m)
            i0 += step
        if timeouts > 0:
            tl.atomic_add(STATE + 5, timeouts)

        # 5. bookkeeping for the next calls (nobody reads these entries during this call).
        if pid == 0:
            tl.store(STATE + 2 + slot, num_tokens * 2 + (1 if PUSH_RES else 0))
        if ticket == tl.num_programs(0) - 1:  # every CTA has read k
            tl.store(STATE + 1, 0)
            tl.store(STATE, k + 1)

else:  # pragma: no cover
    _oneshot_allreduce_rmsnorm_kernel = None


# ----------------------------------------------------------------------------- launcher


def launch(ws: OneShotWorkspace, rows: Rows, spec: FusedSpec, normed: torch.Tensor,
           residual_out: torch.Tensor) -> None:
    """Enqueue the kernel on the current stream for prepared rows (tests call it directly with
    emulated workspaces). The grid depends on (T, N, H, comm_ctas) only: the same on every rank.
    ``spec.norm`` picks RMSNorm or LayerNorm, ``rows.norm_bias`` (a LayerNorm's bias, [H]) is added
    after the weight; RMSNorm without a norm bias launches the kernel without the LayerNorm keywords
    (:func:`weave_compile.kernels.shared.shapes.layernorm_constexprs`). ``spec.batch_invariant``:
    :func:`invariant_meta`'s shape (the kernel is the same: its sum is in rank order already)."""
    x, residual, bias, weight = rows.x, rows.residual, rows.bias, rows.weight
    residual_in_sharded, residual_out_sharded = spec.residual_in_sharded, spec.residual_out_sharded
    mid_dtype = spec.mid_dtype
    T, H = x.shape
    N = ws.world_size
    S = -(-T // N)
    if T == 0:
        return
    if -(-T // N) * N > ws.capacity:
        raise SymmCapacityError(f"oneshot workspace holds {ws.capacity} rows, {T} tokens need {S * N}")
    rin_dtype = residual.dtype if residual is not None else x.dtype
    if residual is not None and residual_in_sharded and rin_dtype != ws.res_dtype:
        raise ValueError(f"workspace residual dtype {ws.res_dtype} != residual {rin_dtype}")
    norm_bias = rows.norm_bias
    if norm_bias is not None:
        if norm_bias.numel() != H:
            raise ValueError(f"norm_bias must have {H} elements, got shape {tuple(norm_bias.shape)}")
        norm_bias = norm_bias.reshape(H).contiguous()
    if spec.batch_invariant:  # one-row tiles whatever T (invariant_meta)
        meta = invariant_meta(H, S * N, spec.comm_ctas)
    else:
        meta = launch_meta(H, S * N, spec.comm_ctas)
    dummy = ws.state
    eps = kernel_eps(rows, spec)
    _oneshot_allreduce_rmsnorm_kernel[(meta.grid,)](
        ws.ptr_table, ws.state, x,
        residual if residual is not None else dummy,
        bias if bias is not None else dummy,
        weight if weight is not None else dummy,
        normed, residual_out,
        T, S, ws.rank, ws.layout.slot_bytes, ws.layout.src_bytes, ws.layout.res_off,
        x.stride(0), residual.stride(0) if residual is not None else 0, normed.stride(0), residual_out.stride(0),
        eps, float(spec.weight_offset),
        WORLD_SIZE=N, HIDDEN=H, BLOCK_H=meta.block_h, BLOCK_ROWS=meta.block_rows,
        IN_DTYPE=tl_dtype(x.dtype), IN_BITS=_tl_int(x.dtype), IN_SENT=SENTINEL[x.dtype],
        RIN_DTYPE=tl_dtype(ws.res_dtype), RIN_BITS=_tl_int(ws.res_dtype), RIN_SENT=SENTINEL[ws.res_dtype],
        OUT_DTYPE=tl_dtype(normed.dtype), RES_DTYPE=tl_dtype(residual_out.dtype),
        MID_DTYPE=tl_dtype(mid_dtype if mid_dtype is not None else torch.float32),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_MID=mid_dtype is not None, RESIDUAL_IN_SHARDED=residual_in_sharded,
        RESIDUAL_OUT_SHARDED=residual_out_sharded,
        PUSH_RES=residual is not None and residual_in_sharded, SPIN_LIMIT=spin_limit(),
        EPS_PTR=isinstance(eps, torch.Tensor), num_warps=meta.num_warps, num_stages=1,
        **layernorm_constexprs(spec.norm, norm_bias))


def invariant_meta(hidden: int, rows: int, comm_ctas: int) -> LaunchMeta:
    """The launch shape with ``batch_invariant``: one-row tiles, the warps from H alone, whatever the
    token count and the CTA count.

    The kernel already adds every row's partials in rank order 0..N-1 in fp32 (each rank computes
    every row alike: no owner's order); what T moved is the tile's row count
    (:func:`weave_compile.kernels.shared.shapes.launch_meta`: up to 8 rows where the shard gives a
    CTA that many), which sets the [rows, BLOCK_H] layout a row's sum of squares is reduced over on
    the GPU. One row per tile gives every row the same reduction; only the grid varies, which
    touches no row's arithmetic."""
    return LaunchMeta(*warps_and_rows(hidden, rows, comm_ctas, 1, None))


def _tl_int(dtype: torch.dtype):
    return tl.int16 if dtype.itemsize == 2 else tl.int32


def oneshot_allreduce_rmsnorm(rows: Rows, spec: FusedSpec, workspace: Optional[OneShotWorkspace] = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's contract on rows [T, H]; fresh outputs. Raises ``SymmCapacityError``
    during capture when no large-enough workspace was reserved."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not available")
    x, residual = rows.x, rows.residual
    T, H = x.shape
    why = check_hidden(H, [x.dtype, spec.residual_dtype, spec.out_dtype]
                       + ([residual.dtype] if residual is not None else []))
    if why:
        raise ValueError(why)
    rin_dtype = residual.dtype if residual is not None else x.dtype
    ws = workspace or get_workspace(spec.group_name, x.dtype, rin_dtype, H, max(T, 1), x.device)
    if ws is None:
        raise SymmCapacityError(f"no oneshot workspace with room for {T} tokens (H={H}) while capturing a "
                                "CUDA graph; it is reserved at compile time for the graph's token count")
    S = -(-T // ws.world_size)
    normed = torch.empty((T, H), dtype=spec.out_dtype, device=x.device)
    residual_out = torch.empty((S, H) if spec.residual_out_sharded else (T, H), dtype=spec.residual_dtype,
                               device=x.device)
    if T == 0:
        return normed, residual_out
    rows = Rows(x.contiguous(), None if residual is None else residual.contiguous(),
                None if rows.bias is None else rows.bias.contiguous(),
                None if rows.weight is None else rows.weight.contiguous(), eps_tensor=rows.eps_tensor,
                norm_bias=rows.norm_bias)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        launch(ws, rows, spec, normed, residual_out)
    return normed, residual_out


# ----------------------------------------------------------------------------- traffic


def message_bytes(num_tokens: int, hidden: int, dtype: torch.dtype) -> int:
    return int(num_tokens) * int(hidden) * dtype.itemsize


def traffic_model(num_tokens: int, hidden: int, dtype: torch.dtype, world_size: int) -> dict[str, int]:
    """Bytes per rank of one call: NVLink out/in, and local HBM traffic."""
    b = message_bytes(num_tokens, hidden, dtype)
    return dict(nvlink_out=(world_size - 1) * b, nvlink_in=(world_size - 1) * b,
                # read x twice, read N-1 slots, clear N-1 slots, write normed + residual
                hbm=2 * b + 2 * (world_size - 1) * b + 2 * b)
