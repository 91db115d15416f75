"""Barrier-free one-shot fused all-reduce + bias/residual add + RMSNorm for small token counts.

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

Why
---
In decode (a few to a few hundred tokens) the two-shot push kernel's three block barriers,
each a cross-GPU round trip, are most of its time (2x H200: ~19 us at T=128 whatever H, NOTES.md).
One-shot replaces them with a single one-way trip. At two ranks it moves the same NVLink bytes
as reduce-scatter + all-gather (``T*H*b`` each way); it pays with ``N`` times the local
reduce/norm work, which is why it is only chosen below a crossover (``ONESHOT_MAX_BYTES``).
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
capture (:func:`reserve`, called by the fuse pass at compile time); during capture a too-small
workspace raises :class:`SymmCapacityError` and the fused op falls back to ``reference`` (logged).

Liveness: every CTA pushes before it waits, and CTA ``b`` of every rank handles the same rows,
so it waits only on CTA ``b`` of the peers; the grid (<= ``comm_ctas``) must be co-resident
with the peers' (true for small grids). ``WEAVE_SYMM_SPIN_LIMIT`` bounds the spins (a timeout
is counted in ``state[5]`` and the results are garbage). Peer memory is reached only through
PyTorch symmetric memory's ``buffer_ptrs``: no multicast, no multimem.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .common import HAS_TRITON, spin_limit, tl, tl_dtype, triton
from .launch import launch_meta
from .select import check_hidden
from .workspace import SymmCapacityError

log = logging.getLogger(__name__)

#: Provisional crossover (a model over 2x H200 data: benchmarks/NOTES.md, issue 15): the one-shot kernel
#: fits a static token count whose message ``T * H * itemsize`` is at most this.
ONESHOT_MAX_BYTES = 4 << 20
#: Whether ``kernel="auto"`` may pick it where it fits. False until the 2-GPU run (issue 16) has
#: measured the crossover and checked the protocol across real GPUs: so far it ran correctly on
#: ranks emulated on one H200 only, and ``auto`` picks no design that was never measured.
AUTO_PICKS_ONESHOT = False
NUM_SLOTS = 3
_REGION_ALIGN = 256
_STATE_WORDS = 8  # [0] call counter, [1] CTA ticket, [2:5] rows per slot, [5] spin timeouts
_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
#: The negative-zero bit pattern, as the signed integer of the dtype's width.
SENTINEL = {torch.bfloat16: -(1 << 15), torch.float16: -(1 << 15), torch.float32: -(1 << 31)}


def sentinel_tensor(dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor of ``dtype`` holding the sentinel bit pattern (-0.0)."""
    return torch.tensor([SENTINEL[dtype]], dtype=_INT_OF[dtype]).view(dtype)


# ----------------------------------------------------------------------------- kernel

if HAS_TRITON:
    from .rownorm import add_norm, norm_params  # the shared add + RMSNorm body (jit functions)

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
        eps,
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
        bias, w = norm_params(BIAS, WEIGHT, cols, col_ok, weight_offset, HAS_BIAS, HAS_WEIGHT)
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
                                       HAS_MID, False)
            else:
                res, normed = add_norm(acc, rows, rows, m, cols, RESIDUAL, stride_res_row, bias, w, eps,
                                       HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, HAS_BIAS, HAS_RESIDUAL,
                                       HAS_WEIGHT, HAS_MID, False)
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


# ----------------------------------------------------------------------------- workspace


@dataclass(frozen=True)
class Layout:
    """Byte layout of one rank's buffer: ``NUM_SLOTS`` x (N source regions + 1 residual region)."""

    capacity: int
    src_bytes: int
    res_off: int
    slot_bytes: int

    @property
    def total(self) -> int:
        return NUM_SLOTS * self.slot_bytes


def _align(n: int) -> int:
    return -(-n // _REGION_ALIGN) * _REGION_ALIGN


def layout(capacity: int, world_size: int, hidden: int, in_dtype: torch.dtype, res_dtype: torch.dtype) -> Layout:
    src = _align(capacity * hidden * in_dtype.itemsize)
    res_off = world_size * src
    return Layout(capacity, src, res_off, res_off + _align(capacity * hidden * res_dtype.itemsize))


@dataclass(eq=False)
class OneShotWorkspace:
    """One rank's view of a one-shot workspace: every rank's buffer address and its own state."""

    rank: int
    world_size: int
    hidden: int
    in_dtype: torch.dtype
    res_dtype: torch.dtype  # the residual *input*'s dtype (pushed when it is sharded)
    layout: Layout
    ptr_table: torch.Tensor  # int64 [N]
    state: torch.Tensor  # int32 [8]
    buffer: torch.Tensor  # this rank's buffer (kept alive)
    handle: Any = None

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    def timeouts(self) -> int:
        """Spin-limit trips so far (synchronizes the device)."""
        return int(self.state[5].item())


def poison_(buffer: torch.Tensor, lay: Layout, world_size: int, hidden: int, in_dtype: torch.dtype,
            res_dtype: torch.dtype) -> None:
    """Fill every data region of a uint8 buffer with the sentinel ("not yet written")."""
    for s in range(NUM_SLOTS):
        base = s * lay.slot_bytes
        xs = buffer[base:base + world_size * lay.src_bytes].view(in_dtype)
        xs.copy_(sentinel_tensor(in_dtype).to(buffer.device).expand_as(xs))
        n = lay.capacity * hidden * res_dtype.itemsize
        rs = buffer[base + lay.res_off:base + lay.res_off + n].view(res_dtype)
        rs.copy_(sentinel_tensor(res_dtype).to(buffer.device).expand_as(rs))


def workspace_from_buffers(buffers: list[torch.Tensor], rank: int, *, hidden: int, in_dtype: torch.dtype,
                           res_dtype: torch.dtype, capacity: int, poison: bool = True) -> OneShotWorkspace:
    """A workspace over ordinary uint8 buffers, one per rank (emulated ranks in tests).

    ``buffers[p]`` must be at least :func:`layout`'s ``total`` bytes; rank ``rank`` poisons its own
    one (the caller must make every rank's poisoning complete before any rank's first call)."""
    n = len(buffers)
    lay = layout(capacity, n, hidden, in_dtype, res_dtype)
    own = buffers[rank]
    if own.numel() < lay.total:
        raise ValueError(f"buffer of {own.numel()} bytes < {lay.total} needed")
    if poison:
        poison_(own, lay, n, hidden, in_dtype, res_dtype)
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=own.device)
    state = torch.zeros(_STATE_WORDS, dtype=torch.int32, device=own.device)
    return OneShotWorkspace(rank, n, hidden, in_dtype, res_dtype, lay, table, state, own)


_WORKSPACES: dict[tuple, OneShotWorkspace] = {}
#: Replaced workspaces, kept alive for the process (see get_workspace); with growth of at least
#: 1.5x what is kept stays below about twice the final capacity.
_RETIRED: list[OneShotWorkspace] = []


def _allocate(group_name: str, device: torch.device, hidden: int, in_dtype: torch.dtype, res_dtype: torch.dtype,
              capacity: int) -> OneShotWorkspace:
    """Collective: symmetric allocation, poison, rendezvous, then a barrier so that no peer can
    push before this rank's poison has landed."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    import torch.distributed.distributed_c10d as c10d

    from .workspace import _ensure_group_enabled

    _ensure_group_enabled(group_name)
    pg = c10d._resolve_process_group(group_name)
    n = pg.size()
    lay = layout(capacity, n, hidden, in_dtype, res_dtype)
    with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(device):
        buf = symm_mem.empty(lay.total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group_name)
        rank = int(handle.rank)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        offset = buf.data_ptr() - ptrs[rank]  # the tensor may sit inside the allocation
        if offset < 0 or offset % 16:
            raise RuntimeError(f"unexpected symmetric tensor offset {offset}")
        poison_(buf, lay, n, hidden, in_dtype, res_dtype)
        table = torch.tensor([p + offset for p in ptrs], dtype=torch.int64, device=device)
        state = torch.zeros(_STATE_WORDS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
    dist.barrier(group=pg)
    log.info("oneshot workspace group=%s rank=%d/%d H=%d %s/%s capacity=%d rows (%.1f MiB)",
             group_name, rank, n, hidden, in_dtype, res_dtype, capacity, lay.total / 2**20)
    return OneShotWorkspace(rank, n, hidden, in_dtype, res_dtype, lay, table, state, buf, handle)


def get_workspace(group_name: str, in_dtype: torch.dtype, res_dtype: torch.dtype, hidden: int,
                  num_tokens: int, device: torch.device) -> Optional[OneShotWorkspace]:
    """The cached workspace with room for ``num_tokens`` (padded to S*N) rows; grows outside
    capture (collective), returns None during capture when it is missing or too small."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(group_name), in_dtype, res_dtype, int(hidden), device.index)
    ws = _WORKSPACES.get(key)
    capturing = torch.cuda.is_current_stream_capturing()
    if ws is not None:
        padded = -(-num_tokens // ws.world_size) * ws.world_size
        if padded <= ws.capacity:
            return ws
    if capturing:
        return None
    from weave_compile.ops.reference import group_size

    n = group_size(group_name)
    capacity = -(-max(1, num_tokens) // (64 * n)) * 64 * n
    if ws is not None:
        # Geometric growth (few replaced workspaces), and the replaced one kept alive: a captured
        # graph may point at it, and (growth is host-side, not a device barrier) a launch on it
        # may still be running here or on a peer, which writes into our old slots.
        capacity = max(capacity, -(-math.ceil(ws.capacity * 1.5) // (64 * n)) * 64 * n)
        _RETIRED.append(ws)
    from .outside_pool import run_outside_graph_pool

    # A run-time growth may happen inside cudagraph trees' warm-up: keep it out of the graph pool.
    _WORKSPACES[key] = run_outside_graph_pool(
        lambda: _allocate(group_name, device, hidden, in_dtype, res_dtype, capacity), device)
    return _WORKSPACES[key]


def reserve_rows(hidden: int, dtype: torch.dtype, num_tokens: int) -> int:
    """Rows to reserve at compile time: this graph's, and at least every T ``auto`` would send here."""
    return max(num_tokens, min(4096, ONESHOT_MAX_BYTES // (hidden * dtype.itemsize)))


def reserve(group_name: str, in_dtype: torch.dtype, res_dtype: torch.dtype, hidden: int, max_tokens: int,
            device: torch.device) -> OneShotWorkspace:
    """Allocate (collectively) before CUDA-graph capture."""
    if torch.cuda.is_current_stream_capturing():
        raise SymmCapacityError("oneshot reserve() must be called outside CUDA graph capture")
    ws = get_workspace(group_name, in_dtype, res_dtype, hidden, max_tokens, device)
    assert ws is not None
    return ws


# ----------------------------------------------------------------------------- launcher


def launch(ws: OneShotWorkspace, x: torch.Tensor, residual: Optional[torch.Tensor], bias: Optional[torch.Tensor],
           weight: Optional[torch.Tensor], normed: torch.Tensor, residual_out: torch.Tensor, *, eps: float,
           mid_dtype: Optional[torch.dtype], weight_offset: float, residual_in_sharded: bool,
           residual_out_sharded: bool, num_ctas: int) -> None:
    """Enqueue the kernel on the current stream for prepared 2-D tensors (tests call it directly
    with emulated workspaces). The grid depends on (T, N, H, num_ctas) only: the same on every rank."""
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
    meta = launch_meta(H, S * N, num_ctas)
    dummy = ws.state
    _oneshot_allreduce_rmsnorm_kernel[(meta.grid,)](
        ws.ptr_table, ws.state, x,
        residual if residual is not None else dummy,
        bias if bias is not None else dummy,
        weight if weight is not None else dummy,
        normed, residual_out,
        T, S, ws.rank, ws.layout.slot_bytes, ws.layout.src_bytes, ws.layout.res_off,
        x.stride(0), residual.stride(0) if residual is not None else 0, normed.stride(0), residual_out.stride(0),
        float(eps), float(weight_offset),
        WORLD_SIZE=N, HIDDEN=H, BLOCK_H=meta.block_h, BLOCK_ROWS=meta.block_rows,
        IN_DTYPE=tl_dtype(x.dtype), IN_BITS=_tl_int(x.dtype), IN_SENT=SENTINEL[x.dtype],
        RIN_DTYPE=tl_dtype(ws.res_dtype), RIN_BITS=_tl_int(ws.res_dtype), RIN_SENT=SENTINEL[ws.res_dtype],
        OUT_DTYPE=tl_dtype(normed.dtype), RES_DTYPE=tl_dtype(residual_out.dtype),
        MID_DTYPE=tl_dtype(mid_dtype if mid_dtype is not None else torch.float32),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_MID=mid_dtype is not None, RESIDUAL_IN_SHARDED=residual_in_sharded,
        RESIDUAL_OUT_SHARDED=residual_out_sharded,
        PUSH_RES=residual is not None and residual_in_sharded, SPIN_LIMIT=spin_limit(),
        num_warps=meta.num_warps, num_stages=1)


def _tl_int(dtype: torch.dtype):
    return tl.int16 if dtype.itemsize == 2 else tl.int32


def oneshot_allreduce_rmsnorm(
    x: torch.Tensor, residual: Optional[torch.Tensor], bias: Optional[torch.Tensor], weight: Optional[torch.Tensor],
    *, eps: float, group_name: str, residual_dtype: torch.dtype, out_dtype: torch.dtype,
    mid_dtype: Optional[torch.dtype], weight_offset: float, residual_in_sharded: bool, residual_out_sharded: bool,
    num_ctas: int, workspace: Optional[OneShotWorkspace] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's contract on 2-D ``x`` [T, H]; fresh outputs. Raises
    :class:`SymmCapacityError` during capture when no large-enough workspace was reserved."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not available")
    T, H = x.shape
    why = check_hidden(H, [x.dtype, residual_dtype, out_dtype] + ([residual.dtype] if residual is not None else []))
    if why:
        raise ValueError(why)
    rin_dtype = residual.dtype if residual is not None else x.dtype
    ws = workspace or get_workspace(group_name, x.dtype, rin_dtype, H, max(T, 1), x.device)
    if ws is None:
        raise SymmCapacityError(f"no oneshot workspace with room for {T} tokens (H={H}) while capturing a "
                                "CUDA graph; it is reserved at compile time for the graph's token count")
    S = -(-T // ws.world_size)
    x = x.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    normed = torch.empty((T, H), dtype=out_dtype, device=x.device)
    residual_out = torch.empty((S, H) if residual_out_sharded else (T, H), dtype=residual_dtype, device=x.device)
    if T == 0:
        return normed, residual_out
    with torch.cuda.device(x.device) if x.is_cuda else _nullcontext():
        launch(ws, x, residual, None if bias is None else bias.contiguous(),
               None if weight is None else weight.contiguous(), normed, residual_out, eps=eps, mid_dtype=mid_dtype,
               weight_offset=weight_offset, residual_in_sharded=residual_in_sharded,
               residual_out_sharded=residual_out_sharded, num_ctas=num_ctas)
    return normed, residual_out


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- selection


def message_bytes(num_tokens: int, hidden: int, dtype: torch.dtype) -> int:
    return int(num_tokens) * int(hidden) * dtype.itemsize


def traffic_model(num_tokens: int, hidden: int, dtype: torch.dtype, world_size: int) -> dict[str, int]:
    """Bytes per rank of one call (see NOTES.md): NVLink out/in, and local HBM traffic."""
    b = message_bytes(num_tokens, hidden, dtype)
    return dict(nvlink_out=(world_size - 1) * b, nvlink_in=(world_size - 1) * b,
                # read x twice, read N-1 slots, clear N-1 slots, write normed + residual
                hbm=2 * b + 2 * (world_size - 1) * b + 2 * b)


@functools.lru_cache(maxsize=None)
def _warn_symbolic() -> None:
    log.info("oneshot: symbolic token count; auto keeps the two-shot kernel (one-shot needs a static T)")


def choose(requested: str, num_tokens: Optional[int], hidden: int, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``requested`` ("auto" or "oneshot") should use the one-shot kernel, and why."""
    if requested == "oneshot":
        return True, "requested"
    if num_tokens is None:
        _warn_symbolic()
        return False, "symbolic token count (one-shot needs a static T below the crossover)"
    nbytes = message_bytes(num_tokens, hidden, dtype)
    if nbytes <= ONESHOT_MAX_BYTES:
        return True, (f"T*H*b = {nbytes} B <= {ONESHOT_MAX_BYTES} B (provisional one-shot crossover, "
                      "benchmarks/NOTES.md)")
    return False, f"T*H*b = {nbytes} B > {ONESHOT_MAX_BYTES} B one-shot crossover"
