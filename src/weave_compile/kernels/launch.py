"""Launch shapes, launchers and the public entry point of the symmetric-memory kernels.

:func:`fused_allreduce_rmsnorm_symm` is what the fused op calls: checks, the cached workspace,
then :func:`allreduce_rmsnorm_on`, which runs one rank's launch on a given workspace (the
emulated ranks of ``weave_compile.testing.emulated_ranks`` call it with workspaces built from
ordinary allocations).  Every launch shape is a function of ``(H, S, comm_ctas, N, dtypes)``
only, hence identical on every rank, which the CTA-pairwise barriers require.

Outputs: the push kernel (``p2p``) writes ``x``'s all-reduced, normed rows straight into
fresh output tensors.  The pull kernel (``multimem``; ``p2p_pull`` for measurement) reads a
staged copy of ``x`` from the symmetric input buffer and the outputs are copied out of the
symmetric buffers (a later launch overwrites them, so views would change under the caller).
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .common import (DEFAULT_COMM_CTAS, HAS_TRITON, MAX_CTAS, SUPPORTED_DTYPES, extent, interpreting,
                     needs_int64, next_pow2, prefetch_fits, prev_pow2, spin_limit, tl_dtype,
                     vector_width)
from .pull import pull_allreduce_rmsnorm_kernel
from .push import push_allreduce_rmsnorm_kernel
from .select import SYMM_KERNELS, check_hidden
from .workspace import SymmCapacityError, SymmWorkspace, get_workspace, ring_output

#: Kernels that read a staged copy of x (``p2p_pull`` is a measurement hook, see testing.ptx).
PULL_KERNELS = ("multimem", "p2p_pull")
#: Shared memory the push kernel's software pipeline may use for staged loads (H100/H200
#: allow 227 KB per CTA; leave room for the reduction scratch and the compiler's slack).
_SMEM_BUDGET = 160 * 1024
_MAX_NORM_STAGES = 3
_COPY_IN_FLIGHT = 64 * 1024  # bytes each CTA of a copy phase loads before it stores


@dataclass(frozen=True)
class LaunchMeta:
    block_h: int
    block_rows: int
    num_warps: int
    grid: int
    # push kernel only: tiles per iteration and tl.range stages of the scatter / gather
    # loops and of the add+norm loop
    copy_unroll: int = 1
    copy_stages: int = 1
    norm_unroll: int = 1
    norm_stages: int = 1
    # push kernel: the add+norm loop loads the next tile into registers before this tile's math
    # (True), or runs the tl.range pipeline of norm_stages stages (False)
    norm_prefetch: bool = False
    # push kernel: > 0 = the add+norm loop runs one warp per row (rownorm.rowwise_group) over
    # groups of block_rows x norm_unroll rows, in chunks of norm_chunk columns loaded
    # norm_depth chunks ahead of their math (norm_prefetch and norm_stages then unused)
    norm_chunk: int = 0
    norm_depth: int = 1


def _warps_and_rows(hidden: int, rows_per_rank: int, comm_ctas: int, r_max: int,
                    num_warps: Optional[int]) -> tuple:
    block_h = next_pow2(hidden)
    if num_warps is None:
        num_warps = 16 if block_h >= 2048 else max(4, block_h // 128)
    r_need = prev_pow2(max(1, math.ceil(rows_per_rank / max(1, comm_ctas))))
    block_rows = max(1, min(r_max, r_need))
    grid = max(1, min(comm_ctas, math.ceil(max(1, rows_per_rank) / block_rows)))
    return block_h, block_rows, num_warps, grid


@functools.lru_cache(maxsize=4096)
def launch_meta(hidden: int, rows_per_rank: int, comm_ctas: int,
                num_warps: Optional[int] = None) -> LaunchMeta:
    """The pull kernel's tile shape and grid (and the push kernel's before the pipeline).

    Aim for ~32 fp32 accumulator registers per thread: 16 warps for rows >= 2048
    elements, up to 8 rows per CTA iteration for short rows, but never more rows per
    iteration than the shard gives each CTA (so small T still spreads over all CTAs)."""
    block_h = next_pow2(hidden)
    threads = 32 * (num_warps or (16 if block_h >= 2048 else max(4, block_h // 128)))
    r_max = max(1, min(8, 32 * threads // block_h))
    return LaunchMeta(*_warps_and_rows(hidden, rows_per_rank, comm_ctas, r_max, num_warps))


#: The one-warp-per-row add+norm (rownorm.rowwise_group): warps (= rows per group), columns per
#: chunk (8 16-bit elements per lane) and, in the push kernel, chunks loaded ahead (one H200,
#: NOTES.md, session 7: 4 / 6 / 8 ahead moved 78.3 / 81.6 / 85.7 GB/s per CTA; 8 spills one
#: register with a full residual pushed to the peers, a bias and the ring, 7 fits everywhere).
ROWWISE_WARPS, ROWWISE_CHUNK, ROWWISE_DEPTH = 8, 256, 7


def rowwise_fits(hidden: int, partials: int, in_bytes: int, res_bytes: int) -> bool:
    """Whether the one-warp-per-row add+norm runs for this shape: one partial to add (2 ranks;
    with more, the [partials, rows, chunk] tile's layout costs shared memory and barriers, and
    spills), 16-bit inputs, a row's rounded residual kept in 64 registers per lane (H x residual
    bytes <= 8 KB: H <= 4096 in 16 bits), and H >= 2048 (the shapes measured)."""
    return partials == 1 and in_bytes <= 2 and 2048 <= hidden and hidden * res_bytes <= 8192


def _prefetch_shape(hidden: int, rows_per_rank: int, comm_ctas: int, world_size: int,
                    in_bytes: int, res_bytes: int) -> Optional[tuple]:
    """``(block_rows, num_warps)`` of the register-prefetched add+norm loop, or None where no
    shape keeps two tiles of its inputs in registers.

    Each thread holds ``E`` elements of every input (x, the padded peer tile, the residual) of
    the current tile and of the next one.  Measured on one H200 with 2 bf16 ranks, emulated
    (benchmarks/NOTES.md, session 5): E = 16 (16 warps; 2 rows at H=4096, 1 at 8192) is the
    fastest whole op at 8 and 32 CTAs (E = 32 with 8 warps won a standalone add+norm probe but
    lost in the kernel), and shapes beyond the register file spill (10-20x slower).  So: the
    largest E <= 16 whose registers fit (:func:`weave_compile.kernels.common.prefetch_fits`),
    then the biggest tile, then the fewest warps.  With the output left in the ring the same
    cap: session 5 measured E = 32 (8 warps) faster there, but with today's loop 16 warps win
    at every measured point (one H200, session 7, ``results/comm_per_cta_depth.csv``: whole op
    405 vs 427 us at H=4096, 780 vs 818 at 8192, 8 CTAs; 154 vs 159 and 297 vs 307 at 32).  Only
    2-rank bf16 shapes are measured; for the others the model only keeps the shape inside the
    register file.  (At 2 ranks and 2048 <= H <= 4096 the one-warp-per-row loop runs instead,
    :func:`rowwise_fits`.)
    """
    cap = 16
    block_h = next_pow2(hidden)
    inputs = 1 + next_pow2(max(1, world_size - 1)) + 1
    best = None
    for rows in (1, 2, 4, 8):
        if rows * block_h > 8192 or rows > max(1, prev_pow2(math.ceil(rows_per_rank / max(1, comm_ctas)))):
            continue
        for warps in (1, 2, 4, 8, 16, 32):
            e = rows * block_h // (32 * warps)
            if 1 <= e <= cap and prefetch_fits(inputs, e, max(in_bytes, res_bytes), warps):
                key = (e, rows, -warps)  # most per thread, then the biggest tile, then fewest warps
                if best is None or key > best[0]:
                    best = (key, rows, warps)
    return None if best is None else best[1:]


@functools.lru_cache(maxsize=4096)
def push_meta(hidden: int, rows_per_rank: int, comm_ctas: int, world_size: int,
              in_bytes: int, res_bytes: int, num_warps: Optional[int] = None) -> LaunchMeta:
    """The push kernel's tile shape, grid, unrolling and add+norm loop.

    Copy phases: as many tiles per iteration as make ~64 KB in flight per CTA, held in
    registers (no shared memory staging: a 2-row x 4-stage ``tl.range`` copy measured slower
    than 4 unpipelined rows, benchmarks/NOTES.md).  Add+norm, where :func:`rowwise_fits` (2
    ranks, 16-bit inputs, 2048 <= H <= 4096, at least 8 shard rows per CTA): one warp per row, no CTA barrier
    (:func:`weave_compile.kernels.rownorm.rowwise_group`; 8 warps, groups of 8 rows made of
    ``norm_unroll`` copy tiles, so each CTA keeps the rows the barriers pair; measured on one
    H200 at H=4096, 8 CTAs: 85.7 GB/s per CTA against 77.7 for the register-prefetched tile, the
    whole op 477 vs 502 us; benchmarks/NOTES.md, session 7).  Elsewhere the next tile's inputs
    are loaded into registers while this one is reduced and stored (``norm_prefetch``, shape
    from :func:`_prefetch_shape`: 16 warps, 1-row tiles at H=8192 for 2 bf16 ranks; the whole op
    31% faster than the pipelined loop at 8 CTAs, session 6); where no such shape fits the
    registers (many ranks with wide dtypes), or ``num_warps`` is forced, the
    :func:`push_pipelined_meta` shape.  Never more tiles per iteration than the shard gives a
    CTA.  The shape does not depend on where the normed output goes (copied out or left in the
    ring): every rank compiles the same graph, and one shape won both (session 7)."""

    if (num_warps is None and rowwise_fits(hidden, world_size - 1, in_bytes, res_bytes)
            and math.ceil(rows_per_rank / max(1, comm_ctas)) >= ROWWISE_WARPS):
        # (a CTA with fewer rows than warps would leave warps idle, each busy one walking its
        # whole row: decode-sized shards keep the prefetched tile)
        block_h, block_rows, warps, grid = _warps_and_rows(hidden, rows_per_rank, comm_ctas,
                                                           max(1, min(8, 8192 // next_pow2(hidden))),
                                                           ROWWISE_WARPS)
        return LaunchMeta(block_h, block_rows, warps, grid, norm_unroll=ROWWISE_WARPS // block_rows,
                          norm_chunk=ROWWISE_CHUNK, norm_depth=ROWWISE_DEPTH,
                          copy_unroll=_copy_unroll(block_h, block_rows, grid, rows_per_rank, in_bytes,
                                                   res_bytes))
    shape = None if num_warps is not None else _prefetch_shape(
        hidden, rows_per_rank, comm_ctas, world_size, in_bytes, res_bytes)
    if shape is None:
        return push_pipelined_meta(hidden, rows_per_rank, comm_ctas, world_size, in_bytes, res_bytes,
                                   num_warps)
    block_rows, warps = shape
    block_h, block_rows, warps, grid = _warps_and_rows(hidden, rows_per_rank, comm_ctas, block_rows,
                                                       warps)
    return LaunchMeta(block_h, block_rows, warps, grid, norm_prefetch=True,
                      copy_unroll=_copy_unroll(block_h, block_rows, grid, rows_per_rank, in_bytes, res_bytes))


def _copy_unroll(block_h: int, block_rows: int, grid: int, rows_per_rank: int, in_bytes: int,
                 res_bytes: int) -> int:
    """Tiles per copy iteration: ~64 KB in flight per CTA, never more than the shard gives it."""
    tiles_per_cta = max(1, math.ceil(rows_per_rank / (grid * block_rows)))
    return max(1, min(8, prev_pow2(_COPY_IN_FLIGHT // (block_rows * block_h * max(in_bytes, res_bytes))),
                      prev_pow2(tiles_per_cta)))


@functools.lru_cache(maxsize=4096)
def push_pipelined_meta(hidden: int, rows_per_rank: int, comm_ctas: int, world_size: int,
                        in_bytes: int, res_bytes: int, num_warps: Optional[int] = None) -> LaunchMeta:
    """The push kernel's launch shape before the add+norm prefetch (kept for the benchmarks):
    16 warps, the add+norm loop a ``tl.range`` pipeline of as many stages (<= 3) as the
    shared-memory budget allows for the loads one iteration stages (x, N-1 partials, the
    residual)."""
    block_h, block_rows, num_warps, grid = _warps_and_rows(
        hidden, rows_per_rank, comm_ctas, max(1, min(8, 8192 // next_pow2(hidden))), num_warps)
    norm_stage_bytes = block_rows * block_h * (world_size * in_bytes + res_bytes)
    norm_stages = max(1, min(_MAX_NORM_STAGES, _SMEM_BUDGET // norm_stage_bytes))
    return LaunchMeta(block_h, block_rows, num_warps, grid, norm_stages=norm_stages,
                      copy_unroll=_copy_unroll(block_h, block_rows, grid, rows_per_rank, in_bytes, res_bytes))


def push_v1_meta(hidden: int, rows_per_rank: int, comm_ctas: int,
                 num_warps: Optional[int] = None) -> LaunchMeta:
    """The push kernel's first launch shape (kept for comparison in the benchmarks): the pull
    kernel's rows per iteration, no software pipelining."""
    return launch_meta(hidden, rows_per_rank, comm_ctas, num_warps)


def norm_constexprs(*, world_size, hidden, block_h, block_rows, in_dtype, out_dtype, res_dtype,
                    mid_dtype, has_bias, has_residual, has_weight, residual_in_sharded,
                    residual_out_sharded, spin=0, interp=False) -> dict:
    """The constexprs both kernels take (the pull kernel adds the vector widths and
    USE_MULTIMEM, the push kernel its pipeline depths)."""
    return dict(
        WORLD_SIZE=int(world_size), HIDDEN=int(hidden), BLOCK_H=int(block_h),
        BLOCK_ROWS=int(block_rows), IN_DTYPE=tl_dtype(in_dtype), OUT_DTYPE=tl_dtype(out_dtype),
        RES_DTYPE=tl_dtype(res_dtype),
        MID_DTYPE=tl_dtype(mid_dtype if mid_dtype is not None else torch.float32),
        HAS_BIAS=bool(has_bias), HAS_RESIDUAL=bool(has_residual), HAS_WEIGHT=bool(has_weight),
        HAS_MID=mid_dtype is not None, RESIDUAL_IN_SHARDED=bool(residual_in_sharded),
        RESIDUAL_OUT_SHARDED=bool(residual_out_sharded), SPIN_LIMIT=int(spin),
        # Triton's CPU interpreter cannot run inline PTX (tests simulate ranks with it).
        FENCE_ASM=not interp,
    )


def pull_constexprs(use_multimem: bool, **kw) -> dict:
    c = norm_constexprs(**kw)
    return dict(c, IN_VEC=vector_width(kw["in_dtype"]), OUT_VEC=vector_width(kw["out_dtype"]),
                RES_VEC=vector_width(kw["res_dtype"]), USE_MULTIMEM=bool(use_multimem))


def push_constexprs(meta: LaunchMeta, **kw) -> dict:
    return dict(norm_constexprs(block_h=meta.block_h, block_rows=meta.block_rows, **kw),
                COPY_UNROLL=meta.copy_unroll, COPY_STAGES=meta.copy_stages,
                NORM_UNROLL=meta.norm_unroll, NORM_STAGES=meta.norm_stages,
                NORM_PREFETCH=bool(meta.norm_prefetch),
                NORM_CHUNK=int(meta.norm_chunk), NORM_DEPTH=int(meta.norm_depth),
                PEERS_P2=next_pow2(max(1, int(kw["world_size"]) - 1)))


def _norm_inputs(residual, bias, weight):
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    return (residual, bias.contiguous() if bias is not None else None,
            weight.contiguous() if weight is not None else None)


def launch_pull(ws: SymmWorkspace, *, num_tokens: int, mid_dtype, residual, bias, weight,
                residual_out: Optional[torch.Tensor], residual_in_sharded: bool, eps: float,
                weight_offset: float, comm_ctas: int, num_warps: Optional[int],
                use_multimem: bool) -> LaunchMeta:
    """Launch the pull kernel on ``ws`` (x already staged in ``ws.inp``); ``residual_out``
    given = sharded residual output [S, H]."""
    N, H = ws.world_size, ws.hidden
    S = math.ceil(num_tokens / N)
    dummy = ws.ptr_table  # any valid tensor for absent pointer arguments (never read)
    residual, bias, weight = _norm_inputs(residual, bias, weight)
    meta = launch_meta(H, S, comm_ctas, num_warps)
    consts = pull_constexprs(
        use_multimem, world_size=N, hidden=H, block_h=meta.block_h, block_rows=meta.block_rows,
        in_dtype=ws.in_dtype, out_dtype=ws.out_dtype, res_dtype=ws.res_dtype, mid_dtype=mid_dtype,
        has_bias=bias is not None, has_residual=residual is not None,
        has_weight=weight is not None, residual_in_sharded=residual_in_sharded,
        residual_out_sharded=residual_out is not None, spin=spin_limit(), interp=interpreting())
    pull_allreduce_rmsnorm_kernel[(meta.grid,)](
        ws.ptr_table, residual if residual is not None else dummy,
        bias if bias is not None else dummy, weight if weight is not None else dummy,
        residual_out if residual_out is not None else dummy, ws.status,
        num_tokens, S, ws.rank, ws.pad_offset,
        residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0,
        float(eps), float(weight_offset), num_warps=meta.num_warps, num_stages=1, **consts)
    return meta


def launch_push(ws: SymmWorkspace, x, residual, bias, weight, normed, residual_out, *,
                num_tokens: int, mid_dtype, residual_in_sharded: bool, residual_out_sharded: bool,
                eps: float, weight_offset: float, comm_ctas: int, num_warps: Optional[int],
                meta: Optional[LaunchMeta] = None, phases: int = 7, sync: bool = True,
                compile_only: bool = False, out_slot: int = -1) -> LaunchMeta:
    """Launch the push kernel: x, residual and the outputs are ordinary tensors.

    With ``out_slot >= 0``, ``normed`` must be :func:`.workspace.ring_output` of that slot: the
    kernel leaves the normed rows there (peers push into the same slot) and copies none.

    ``meta`` overrides the launch shape (benchmarks: :func:`push_v1_meta`); ``phases`` and
    ``sync`` are the kernel's measurement / simulation hooks (see :mod:`.push`);
    ``compile_only`` compiles without launching (emulated ranks compile every rank's launch
    before enqueueing any, so no rank spins while the host compiles a peer's)."""
    N, H = ws.world_size, ws.hidden
    S = math.ceil(num_tokens / N)
    dummy = ws.ptr_table
    residual, bias, weight = _norm_inputs(residual, bias, weight)
    if out_slot >= 0:
        ring = ring_output(ws, out_slot, num_tokens)
        if normed.data_ptr() != ring.data_ptr() or normed.stride(0) != H:
            raise ValueError(f"out_slot={out_slot}: normed must be the workspace's ring slot view")
    if meta is None:
        meta = push_meta(H, S, comm_ctas, N, x.dtype.itemsize, residual_out.dtype.itemsize, num_warps)
    consts = push_constexprs(
        meta, world_size=N, hidden=H, in_dtype=x.dtype, out_dtype=normed.dtype,
        res_dtype=residual_out.dtype, mid_dtype=mid_dtype, has_bias=bias is not None,
        has_residual=residual is not None, has_weight=weight is not None,
        residual_in_sharded=residual_in_sharded, residual_out_sharded=residual_out_sharded,
        spin=spin_limit(), interp=interpreting())
    args = (ws.ptr_table, x, residual if residual is not None else dummy,
            bias if bias is not None else dummy, weight if weight is not None else dummy,
            normed, residual_out, ws.status,
            num_tokens, S, ws.capacity // N, ws.rank, ws.pad_offset,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            normed.stride(0), residual_out.stride(0), float(eps), float(weight_offset),
            max(out_slot, 0) * ws.capacity)
    # Every region offset is below capacity x H rows' worth, the ring's below the end of the slot
    # this launch writes (slot 0 is the output region itself).
    region_rows = ws.capacity * (max(out_slot, 0) + 1)
    idx64 = needs_int64(region_rows * H, *(extent(t) for t in (x, residual, normed, residual_out)
                                           if t is not None))
    kwargs = dict(OUT_IN_REGION=out_slot >= 0, PHASES=int(phases), SYNC=bool(sync), IDX64=idx64,
                  num_warps=meta.num_warps, num_stages=1, **consts)
    if compile_only:  # compile (or find) the binary this launch would run, launch nothing
        push_allreduce_rmsnorm_kernel.warmup(*args, grid=(meta.grid,), **kwargs)
    else:
        push_allreduce_rmsnorm_kernel[(meta.grid,)](*args, **kwargs)
    return meta


def allreduce_rmsnorm_on(ws: SymmWorkspace, x: torch.Tensor, residual=None, bias=None,
                         weight=None, *, kernel: str, eps: float = 1e-6,
                         mid_dtype: Optional[torch.dtype] = None, weight_offset: float = 0.0,
                         residual_in_sharded: bool = False, residual_out_sharded: bool = False,
                         comm_ctas: int = DEFAULT_COMM_CTAS, num_warps: Optional[int] = None,
                         out_slot: int = -1, **push_hooks) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's launch of ``kernel`` on workspace ``ws`` (``x`` [T, H], T >= 1, checked).

    ``out_slot >= 0`` (``p2p`` only; the other kernels return fresh outputs): the normed output
    is a view of that ring slot of the workspace's output region, valid until the next launch
    that uses the slot (:mod:`weave_compile.passes.output_in_place` proves who reads it when).
    ``push_hooks`` (``meta``, ``phases``, ``sync``) go to :func:`launch_push`."""
    T, H = x.shape
    N = ws.world_size
    S = math.ceil(T / N)
    dev = x.device
    norm_kw = dict(mid_dtype=mid_dtype, residual_in_sharded=residual_in_sharded, eps=eps,
                   weight_offset=weight_offset, comm_ctas=comm_ctas, num_warps=num_warps)
    res_shard = torch.empty((S, H), dtype=ws.res_dtype, device=dev) if residual_out_sharded else None
    ctx = torch.cuda.device(dev) if x.is_cuda else contextlib.nullcontext()
    if kernel == "p2p":
        # Push: x is read where it is and the outputs are written where they will live.
        # Peers push into our input region, so x must not live there.
        inp_lo = ws.inp.data_ptr()
        if inp_lo <= x.data_ptr() < inp_lo + ws.inp.numel() * ws.inp.element_size():
            x = x.clone()
        x = x if x.is_contiguous() else x.contiguous()
        if out_slot >= 0 and _overlaps_ring_slot(ws, out_slot, x, residual, bias, weight):
            # The pass proves no input is the slot's previous output. Falling back on this rank
            # alone would break the protocol (peers push to the ring slot by global row), so fail.
            raise RuntimeError(f"weave: an input of the fused op lives in output ring slot {out_slot}, "
                               "which this call overwrites (a bug of the output_in_place pass; "
                               "run without output_in_place and report it)")
        normed = ring_output(ws, out_slot, T) if out_slot >= 0 else torch.empty(
            (T, H), dtype=ws.out_dtype, device=dev)
        residual_out = res_shard if residual_out_sharded else torch.empty(
            (T, H), dtype=ws.res_dtype, device=dev)
        with ctx:
            launch_push(ws, x, residual, bias, weight, normed, residual_out, num_tokens=T,
                        residual_out_sharded=residual_out_sharded, out_slot=out_slot, **norm_kw,
                        **push_hooks)
        return normed, residual_out
    if kernel not in PULL_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {SYMM_KERNELS}")
    # Pull: stage x into the symmetric input buffer unless it already is it.
    if not (x.data_ptr() == ws.inp.data_ptr() and x.stride() == (H, 1)):
        ws.inp[:T].copy_(x)
    with ctx:
        launch_pull(ws, num_tokens=T, residual=residual, bias=bias, weight=weight,
                    residual_out=res_shard, use_multimem=kernel == "multimem", **norm_kw)
    # Copies, not views: the next launch on this channel overwrites the buffers.
    return ws.out[:T].clone(), res_shard if residual_out_sharded else ws.res[:T].clone()


def _overlaps_ring_slot(ws: SymmWorkspace, slot: int, *tensors) -> bool:
    """True if any of ``tensors`` has memory in ring slot ``slot`` of ``ws``'s output region."""
    ring = ws.out_ring[slot]
    lo, hi = ring.data_ptr(), ring.data_ptr() + ring.numel() * ring.element_size()
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        t_lo = t.data_ptr()
        t_hi = t_lo + (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))) * t.element_size()
        if t_lo < hi and lo < t_hi:
            return True
    return False


def check_call(x, residual, bias, weight, *, residual_dtype, out_dtype, mid_dtype,
               residual_in_sharded: bool, comm_ctas: int, world_size: Optional[int]):
    """Raise ValueError naming the problem; returns ``(residual_dtype, out_dtype)``."""
    if x.dim() != 2 or not (x.is_cuda or interpreting()):
        raise ValueError("x must be a 2-D CUDA tensor [T, H]")
    T, H = x.shape
    residual_dtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    out_dtype = out_dtype or x.dtype
    why = check_hidden(H, [x.dtype, out_dtype, residual_dtype])
    if why:
        raise ValueError(why)
    if mid_dtype is not None and mid_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"mid_dtype {mid_dtype} not supported")
    if not (1 <= comm_ctas <= MAX_CTAS):
        raise ValueError(f"comm_ctas must be in [1, {MAX_CTAS}], got {comm_ctas}")
    if residual is not None and world_size is not None and T > 0:
        exp = (math.ceil(T / world_size), H) if residual_in_sharded else (T, H)
        if tuple(residual.shape) != exp:
            raise ValueError(f"residual must have shape {exp}, got {tuple(residual.shape)}")
    for name, t in (("bias", bias), ("weight", weight)):
        if t is not None and (t.dim() != 1 or t.shape[0] != H):
            raise ValueError(f"{name} must have shape [{H}]")
    return residual_dtype, out_dtype


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
    comm_ctas: int = DEFAULT_COMM_CTAS,
    kernel: str = "p2p",
    channel: int = 0,
    num_warps: Optional[int] = None,
    out_slot: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x`` over ``group_name``, add bias/residual, RMSNorm.

    ``kernel``: one of :data:`SYMM_KERNELS` (``p2p``: :mod:`.push`; ``multimem``:
    :mod:`.pull`, only with a multicast object).  Returns ``(normed [T, H] out_dtype,
    residual_out)`` where ``residual_out`` is this rank's shard [S, H] (rows >= T zero) if
    ``residual_out_sharded`` else [T, H].  ``out_slot >= 0`` (``p2p``): ``normed`` is a view
    of that slot of the workspace's output ring (no copy of the peers' rows), overwritten by
    the next launch on the slot; -1: a fresh tensor.  Collective: every rank must call it with the same
    shapes, flags, ``comm_ctas`` and ``channel``; two launches that may run concurrently
    need different channels.  Raises :class:`SymmCapacityError` if the workspace is too
    small during CUDA graph capture (call :func:`reserve` first)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not available")
    if kernel not in SYMM_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {SYMM_KERNELS}")
    return _fused(x, residual, bias, weight, eps=eps, group_name=group_name,
                  residual_dtype=residual_dtype, out_dtype=out_dtype, mid_dtype=mid_dtype,
                  weight_offset=weight_offset, residual_in_sharded=residual_in_sharded,
                  residual_out_sharded=residual_out_sharded, comm_ctas=comm_ctas, kernel=kernel,
                  channel=channel, num_warps=num_warps, out_slot=out_slot)


def _fused(x, residual, bias, weight, *, group_name, residual_dtype, out_dtype, mid_dtype,
           residual_in_sharded, residual_out_sharded, comm_ctas, kernel, channel, out_slot=-1, **kw):
    """:func:`fused_allreduce_rmsnorm_symm` for any kernel (``p2p_pull`` included)."""
    residual_dtype, out_dtype = check_call(
        x, residual, bias, weight, residual_dtype=residual_dtype, out_dtype=out_dtype,
        mid_dtype=mid_dtype, residual_in_sharded=residual_in_sharded, comm_ctas=comm_ctas,
        world_size=None)
    T, H = x.shape
    ws = get_workspace(group_name, x.dtype, H, max(T, 1), out_dtype=out_dtype,
                       residual_dtype=residual_dtype, channel=channel, device=x.device,
                       ring=out_slot >= 0 and kernel == "p2p")
    if ws is None:
        raise SymmCapacityError(
            f"no symmetric workspace with room for {T} tokens (H={H}, channel={channel}) "
            "while capturing a CUDA graph; call reserve() before capture")
    if kernel == "multimem" and not ws.multicast_ptr:
        # Hard safety rule: never issue multimem instructions without a multicast object.
        raise RuntimeError("multimem kernel requested but the symmetric-memory handle has "
                           "no multicast_ptr; use kernel='p2p'")
    N = ws.world_size
    S = math.ceil(T / N)
    if T == 0:
        res_shape = (S, H) if residual_out_sharded else (0, H)
        return (torch.empty((0, H), dtype=out_dtype, device=x.device),
                torch.empty(res_shape, dtype=residual_dtype, device=x.device))
    check_call(x, residual, bias, weight, residual_dtype=residual_dtype, out_dtype=out_dtype,
               mid_dtype=mid_dtype, residual_in_sharded=residual_in_sharded,
               comm_ctas=comm_ctas, world_size=N)
    return allreduce_rmsnorm_on(ws, x, residual, bias, weight, kernel=kernel,
                                mid_dtype=mid_dtype, residual_in_sharded=residual_in_sharded,
                                residual_out_sharded=residual_out_sharded, comm_ctas=comm_ctas,
                                out_slot=out_slot, **kw)
