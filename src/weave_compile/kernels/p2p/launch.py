"""The push kernel's launch shapes and launcher, and a direct call for tests and benchmarks.

:func:`push_on` is one rank's launch on a workspace (the real one, or an emulated one from
``weave_compile.testing.emulated_ranks``): ``x`` is read where it is and the outputs are written
where they will live, fresh tensors, or with ``spec.out_slot >= 0`` a view of that slot of the
workspace's output ring. :func:`allreduce_rmsnorm` is the whole call on the group's cached
workspace, the arguments given as keywords.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Optional

import torch

from ..shared.common import extent, interpreting, needs_int64, next_pow2, prefetch_fits, prev_pow2, spin_limit
from ..shared.fp8_rows import code_vector, quant_constexprs
from ..shared.shapes import (ROWWISE_CHUNK, ROWWISE_WARPS, LaunchMeta, layernorm_constexprs, norm_constexprs,
                             rowwise_fits, warps_and_rows)
from ..shared.symm_call import contiguous_inputs, kernel_eps, run_on_workspace
from ..shared.workspace import SymmWorkspace, ring_output
from ..spec import FusedSpec, Rows
from .push import push_allreduce_rmsnorm_kernel

#: Shared memory the pipelined add+norm loop may use for staged loads (H100/H200 allow 227 KB
#: per CTA; leave room for the reduction scratch and the compiler's slack).
_SMEM_BUDGET = 160 * 1024
_MAX_NORM_STAGES = 3
_COPY_IN_FLIGHT = 64 * 1024  # bytes each CTA of a copy phase loads before it stores
#: Chunks the push kernel's one-warp-per-row add+norm loads ahead: the most that fits the
#: registers with every flag combination (a full residual pushed to the peers, a bias, the ring);
#: one more spills (docs/performance.md, "Launch shapes").
PUSH_ROWWISE_DEPTH = 7


def _prefetch_shape(hidden: int, rows_per_rank: int, comm_ctas: int, world_size: int,
                    in_bytes: int, res_bytes: int) -> Optional[tuple]:
    """``(block_rows, num_warps)`` of the register-prefetched add+norm loop, or None where no
    shape keeps two tiles of its inputs in registers.

    Each thread holds ``E`` elements of every input (x, the padded peer tile, the residual) of
    the current tile and of the next one. The rule: the largest ``E <= 16`` whose registers fit
    (:func:`weave_compile.kernels.shared.common.prefetch_fits`), then the biggest tile, then the
    fewest warps, with the output copied out or left in the ring alike: ``E = 16`` was the fastest
    whole op where measured (2 bf16 ranks; docs/performance.md, "Launch shapes"), and a shape
    beyond the register file spills. For other ranks and dtypes the rule only keeps the shape in
    the register file. (At 2 ranks and 2048 <= H <= 4096 the one-warp-per-row loop runs instead,
    :func:`weave_compile.kernels.shared.shapes.rowwise_fits`.)
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
              in_bytes: int, res_bytes: int, num_warps: Optional[int] = None,
              batch_invariant: bool = False, quant: bool = False) -> LaunchMeta:
    """The push kernel's tile shape, grid, unrolling and add+norm loop.

    Copy phases: as many tiles per iteration as make ~64 KB in flight per CTA, held in
    registers (no shared-memory staging, which measured slower).  Add+norm, where
    :func:`rowwise_fits` (2 ranks, 16-bit inputs, 2048 <= H <= 4096) and every CTA gets at least
    8 shard rows: one warp per row, no CTA barrier
    (:func:`weave_compile.kernels.shared.rownorm.rowwise_group`; 8 warps, groups of 8 rows made
    of ``norm_unroll`` copy tiles, so each CTA keeps the rows the barriers pair). Elsewhere the
    next tile's inputs are loaded into registers while this one is reduced and stored
    (``norm_prefetch``, shape from :func:`_prefetch_shape`); where no such shape fits the
    registers (many ranks with wide dtypes), or ``num_warps`` is forced, the
    :func:`pipelined_meta` shape. Each loop is the one that was fastest where both could run
    (docs/performance.md, "Launch shapes"). Never more tiles per iteration than the shard gives a
    CTA. The shape does not depend on where the normed output goes (copied out or left in the
    ring): every rank compiles the same graph, and one shape won both. Nor on the norm: a LayerNorm
    takes RMSNorm's shapes (measured for RMSNorm only), which it fits without spilling (its second
    pass is over the row already in registers; ptxas, sm_90, tests/testing/test_ptx.py).

    ``batch_invariant``: :func:`invariant_meta` (one add+norm shape for every T and CTA count).
    ``quant`` (an fp8 epilogue) never gets the one-warp-per-row loop: the epilogue needs a row's
    amax over the whole row, which the tile loops hold and that loop's chunks do not."""
    if batch_invariant:
        return invariant_meta(hidden, rows_per_rank, comm_ctas, world_size, in_bytes, res_bytes, num_warps)
    if (num_warps is None and not quant and rowwise_fits(hidden, world_size - 1, in_bytes, res_bytes)
            and math.ceil(rows_per_rank / max(1, comm_ctas)) >= ROWWISE_WARPS):
        # (a CTA with fewer rows than warps would leave warps idle, each busy one walking its
        # whole row: decode-sized shards keep the prefetched tile)
        block_h, block_rows, warps, grid = warps_and_rows(hidden, rows_per_rank, comm_ctas,
                                                          max(1, min(8, 8192 // next_pow2(hidden))),
                                                          ROWWISE_WARPS)
        return LaunchMeta(block_h, block_rows, warps, grid, norm_unroll=ROWWISE_WARPS // block_rows,
                          norm_chunk=ROWWISE_CHUNK, norm_depth=PUSH_ROWWISE_DEPTH,
                          copy_unroll=_copy_unroll(block_h, block_rows, grid, rows_per_rank, in_bytes,
                                                   res_bytes))
    shape = None if num_warps is not None else _prefetch_shape(
        hidden, rows_per_rank, comm_ctas, world_size, in_bytes, res_bytes)
    if shape is None:
        return pipelined_meta(hidden, rows_per_rank, comm_ctas, world_size, in_bytes, res_bytes, num_warps)
    block_rows, warps = shape
    block_h, block_rows, warps, grid = warps_and_rows(hidden, rows_per_rank, comm_ctas, block_rows, warps)
    return LaunchMeta(block_h, block_rows, warps, grid, norm_prefetch=True,
                      copy_unroll=_copy_unroll(block_h, block_rows, grid, rows_per_rank, in_bytes, res_bytes))


def _copy_unroll(block_h: int, block_rows: int, grid: int, rows_per_rank: int, in_bytes: int,
                 res_bytes: int) -> int:
    """Tiles per copy iteration: ~64 KB in flight per CTA, never more than the shard gives it."""
    tiles_per_cta = max(1, math.ceil(rows_per_rank / (grid * block_rows)))
    return max(1, min(8, prev_pow2(_COPY_IN_FLIGHT // (block_rows * block_h * max(in_bytes, res_bytes))),
                      prev_pow2(tiles_per_cta)))


@functools.lru_cache(maxsize=4096)
def pipelined_meta(hidden: int, rows_per_rank: int, comm_ctas: int, world_size: int,
                   in_bytes: int, res_bytes: int, num_warps: Optional[int] = None,
                   max_rows: Optional[int] = None) -> LaunchMeta:
    """The push kernel's shape where no register-prefetched tile fits (or the warps are forced):
    16 warps, the add+norm loop a ``tl.range`` pipeline of as many stages (<= 3) as the
    shared-memory budget allows for the loads one iteration stages (x, N-1 partials, the
    residual); tiles of at most ``max_rows`` rows (default: an 8K-element tile, up to 8 rows)."""
    block_h, block_rows, num_warps, grid = warps_and_rows(
        hidden, rows_per_rank, comm_ctas, max_rows or max(1, min(8, 8192 // next_pow2(hidden))), num_warps)
    norm_stage_bytes = block_rows * block_h * (world_size * in_bytes + res_bytes)
    norm_stages = max(1, min(_MAX_NORM_STAGES, _SMEM_BUDGET // norm_stage_bytes))
    return LaunchMeta(block_h, block_rows, num_warps, grid, norm_stages=norm_stages,
                      copy_unroll=_copy_unroll(block_h, block_rows, grid, rows_per_rank, in_bytes, res_bytes))


def invariant_meta(hidden: int, rows_per_rank: int, comm_ctas: int, world_size: int,
                   in_bytes: int, res_bytes: int, num_warps: Optional[int] = None) -> LaunchMeta:
    """The push kernel's shape with ``batch_invariant``: the ``tl.range`` pipelined add+norm loop
    on one-row tiles, whatever T and the CTA count.

    A row's arithmetic must not depend on the call: the one-warp-per-row loop (picked from 8
    rows per CTA on) adds a row's squares in chunk order, the prefetched tile adds the peers'
    partials as a tree over a slot axis (``tl.sum``), and the tile's row count (from the rows per
    CTA) sets the [rows, BLOCK_H] layout a row's sum of squares is reduced over. One row per tile
    and the warps from H alone (:func:`weave_compile.kernels.shared.shapes.warps_and_rows`) give
    every row the same reduction; the kernel adds the partials in rank order (``RANK_ORDER``).
    Only the grid, the pipeline depth and the copy phases' unrolling vary, none of which touch a
    row's arithmetic. The cost: the add+norm moves one row per CTA iteration where the other
    shapes move up to 8 (not measured yet)."""
    return pipelined_meta(hidden, rows_per_rank, comm_ctas, world_size, in_bytes, res_bytes, num_warps, 1)


def check_invariant_meta(meta: LaunchMeta) -> None:
    """Refuse a launch shape ``batch_invariant`` cannot keep (:func:`invariant_meta`): a loop
    other than the pipelined one, or more than one row per add+norm tile."""
    if meta.norm_prefetch or meta.norm_chunk or meta.block_rows * meta.norm_unroll != 1:
        raise ValueError("p2p: batch_invariant runs the pipelined add+norm loop on one-row tiles "
                         f"(invariant_meta), got {meta}")


def push_constexprs(meta: LaunchMeta, **kw) -> dict:
    return dict(norm_constexprs(block_h=meta.block_h, block_rows=meta.block_rows, **kw),
                COPY_UNROLL=meta.copy_unroll, COPY_STAGES=meta.copy_stages,
                NORM_UNROLL=meta.norm_unroll, NORM_STAGES=meta.norm_stages,
                NORM_PREFETCH=bool(meta.norm_prefetch),
                NORM_CHUNK=int(meta.norm_chunk), NORM_DEPTH=int(meta.norm_depth),
                PEERS_P2=next_pow2(max(1, int(kw["world_size"]) - 1)))


def launch_push(ws: SymmWorkspace, rows: Rows, spec: FusedSpec, normed: torch.Tensor,
                residual_out: torch.Tensor, *, num_warps: Optional[int] = None,
                meta: Optional[LaunchMeta] = None, phases: int = 7, sync: bool = True,
                compile_only: bool = False, scales: Optional[torch.Tensor] = None) -> LaunchMeta:
    """Launch the push kernel: x, residual and the outputs are ordinary tensors.

    With ``spec.out_slot >= 0``, ``normed`` must be :func:`.workspace.ring_output` of that slot:
    the kernel leaves the normed rows there (peers push into the same slot) and copies none.
    ``spec.norm`` picks RMSNorm or LayerNorm, ``rows.norm_bias`` (a LayerNorm's bias, [H]) is added
    after the weight (:func:`weave_compile.kernels.shared.shapes.layernorm_constexprs`).

    ``spec.batch_invariant``: the partials of a row are added in rank order in fp32
    (``RANK_ORDER``) on :func:`invariant_meta`'s shape (a ``meta`` given must be such a shape).

    ``spec.quant`` (the fp8 epilogue, :class:`weave_compile.quant.QuantSpec`): ``normed`` is the fp8
    rows [T, H] and, per row, ``scales`` [T, 1] fp32 their scales (a static one is
    ``rows.quant_scale``); each rank quantizes its own rows (:mod:`.push`) and pushes codes and
    scales, H + 4 bytes a row instead of the normed rows' 2H, into the peers' output regions, codes
    first, scales after them (the workspace is the one without the epilogue). Not with
    ``spec.out_slot`` >= 0 (the ring holds normed rows of the output dtype).

    ``meta`` overrides the launch shape; ``phases`` and ``sync`` are the kernel's measurement /
    simulation hooks (see :mod:`.push`); ``compile_only`` compiles without launching (emulated
    ranks compile every rank's launch before enqueueing any, so no rank spins while the host
    compiles a peer's)."""
    x = rows.x
    num_tokens = x.shape[0]
    out_slot = spec.out_slot
    N, H = ws.world_size, ws.hidden
    S = math.ceil(num_tokens / N)
    dummy = ws.ptr_table
    residual, bias, weight = contiguous_inputs(rows)
    norm_bias = rows.norm_bias
    if norm_bias is not None:
        if norm_bias.numel() != H:
            raise ValueError(f"norm_bias must have {H} elements, got shape {tuple(norm_bias.shape)}")
        norm_bias = norm_bias.reshape(H).contiguous()
    quant = spec.quant
    if quant is not None:
        _check_quant(ws, spec, rows, normed, scales)
    if out_slot >= 0:
        ring = ring_output(ws, out_slot, num_tokens)
        if normed.data_ptr() != ring.data_ptr() or normed.stride(0) != H:
            raise ValueError(f"out_slot={out_slot}: normed must be the workspace's ring slot view")
    if meta is None:
        meta = push_meta(H, S, spec.comm_ctas, N, x.dtype.itemsize, residual_out.dtype.itemsize, num_warps,
                         spec.batch_invariant, quant is not None)
    elif spec.batch_invariant:
        check_invariant_meta(meta)
    if quant is not None and meta.norm_chunk:
        raise ValueError(f"p2p: the fp8 epilogue runs in the tile loops, not one warp per row: {meta}")
    consts = push_constexprs(
        meta, world_size=N, hidden=H, in_dtype=x.dtype, out_dtype=normed.dtype if quant is None else ws.out_dtype,
        res_dtype=residual_out.dtype, mid_dtype=spec.mid_dtype, has_bias=bias is not None,
        has_residual=residual is not None, has_weight=weight is not None,
        residual_in_sharded=spec.residual_in_sharded, residual_out_sharded=spec.residual_out_sharded,
        spin=spin_limit(), interp=interpreting())
    eps = kernel_eps(rows, spec)
    args = (ws.ptr_table, x, residual if residual is not None else dummy,
            bias if bias is not None else dummy, weight if weight is not None else dummy,
            normed if quant is None else normed.view(torch.uint8), residual_out, ws.status,
            num_tokens, S, ws.capacity // N, ws.rank, ws.pad_offset,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            normed.stride(0), residual_out.stride(0), eps, float(spec.weight_offset),
            max(out_slot, 0) * ws.capacity)
    # Every region offset is below capacity x H rows' worth, the ring's below the end of the slot
    # this launch writes (slot 0 is the output region itself).
    region_rows = ws.capacity * (max(out_slot, 0) + 1)
    idx64 = needs_int64(region_rows * H, *(extent(t) for t in (x, residual, normed, residual_out)
                                           if t is not None))
    kwargs = dict(OUT_IN_REGION=out_slot >= 0, PHASES=int(phases), SYNC=bool(sync), IDX64=idx64,
                  EPS_PTR=isinstance(eps, torch.Tensor),
                  num_warps=meta.num_warps, num_stages=1, **consts)
    kwargs.update(layernorm_constexprs(spec.norm, norm_bias))
    if spec.batch_invariant:  # the partials in rank order (RMSNorm without it compiles as it did)
        kwargs["RANK_ORDER"] = True
    if quant is not None:  # the epilogue's keywords (a launch without it passes none: its kernel as it was)
        kwargs.update(QSCALES=scales if quant.kind == "row" else None,
                      QSTATIC=rows.quant_scale.reshape(1) if quant.kind == "static" else None,
                      INTERPRET=interpreting(), Q_VEC=code_vector(normed, ws.out_dtype),
                      **quant_constexprs(quant, ws.out_dtype))
    if compile_only:  # compile (or find) the binary this launch would run, launch nothing
        push_allreduce_rmsnorm_kernel.warmup(*args, grid=(meta.grid,), **kwargs)
    else:
        push_allreduce_rmsnorm_kernel[(meta.grid,)](*args, **kwargs)
    return meta


def quant_region_bytes(ws: SymmWorkspace) -> int:
    """Bytes of an output region the fp8 epilogue uses: the [N, capacity / N, H] codes, 16-byte
    aligned, then a row scale (fp32) per row (:mod:`.push`)."""
    return -(-ws.capacity * ws.hidden // 16) * 16 + 4 * ws.capacity


def _check_quant(ws: SymmWorkspace, spec: FusedSpec, rows: Rows, normed: torch.Tensor,
                 scales: Optional[torch.Tensor]) -> None:
    """The fp8 epilogue's arguments of :func:`launch_push`, named where they do not fit."""
    quant, T, H = spec.quant, rows.x.shape[0], ws.hidden
    if spec.out_slot >= 0:
        raise ValueError("p2p: the fp8 epilogue returns fresh fp8 rows; out_slot must be -1")
    if ws.out_dtype != spec.out_dtype:
        raise ValueError(f"p2p: the workspace's output dtype {ws.out_dtype} is not the normed rows' "
                         f"{spec.out_dtype} (the dtype they are rounded to before the epilogue)")
    if quant_region_bytes(ws) > ws.capacity * H * ws.out_dtype.itemsize:
        raise ValueError(f"p2p: an output region of {ws.capacity} rows x {H} {ws.out_dtype} cannot hold "
                         f"the codes and row scales ({quant_region_bytes(ws)} bytes)")
    if normed.dtype != quant.dtype or normed.shape != (T, H) or not normed.is_contiguous():
        raise ValueError(f"p2p: the fp8 epilogue's normed must be contiguous {quant.dtype} [{T}, {H}], got "
                         f"{normed.dtype} {tuple(normed.shape)}")
    if quant.kind == "row" and (scales is None or scales.shape != (T, 1) or scales.dtype != torch.float32
                                or not scales.is_contiguous()):
        raise ValueError(f"p2p: a per-row epilogue needs scales, contiguous float32 [{T}, 1]")
    if quant.kind == "static" and (rows.quant_scale is None or rows.quant_scale.numel() != 1):
        raise ValueError("p2p: a static epilogue needs rows.quant_scale (one element)")


def push_on(ws: SymmWorkspace, rows: Rows, spec: FusedSpec, **launch_kw) -> tuple[torch.Tensor, ...]:
    """One rank's push launch on workspace ``ws`` (``rows.x`` [T, H], T >= 1, checked):
    ``(normed, residual_out)``, with ``spec.quant`` ``(fp8 rows, residual_out, row scales [T, 1]
    (empty for a static scale))``; ``launch_kw`` goes to :func:`launch_push`."""
    x = rows.x
    T, H = x.shape
    dev = x.device
    # Peers push into our input region, so x must not live there.
    inp_lo = ws.inp.data_ptr()
    if inp_lo <= x.data_ptr() < inp_lo + ws.inp.numel() * ws.inp.element_size():
        x = x.clone()
    x = x if x.is_contiguous() else x.contiguous()
    if x is not rows.x:
        rows = dataclasses.replace(rows, x=x)
    out_slot = spec.out_slot
    if out_slot >= 0 and _overlaps_ring_slot(ws, out_slot, x, rows.residual, rows.bias, rows.weight,
                                           rows.norm_bias):
        # The pass proves no input is the slot's previous output. Falling back on this rank
        # alone would break the protocol (peers push to the ring slot by global row), so fail.
        raise RuntimeError(f"weave: an input of the fused op lives in output ring slot {out_slot}, "
                           "which this call overwrites (a bug of the output_in_place pass; "
                           "run without output_in_place and report it)")
    quant = spec.quant
    normed = ring_output(ws, out_slot, T) if out_slot >= 0 else torch.empty(
        (T, H), dtype=ws.out_dtype if quant is None else quant.dtype, device=dev)
    residual_out = torch.empty((math.ceil(T / ws.world_size) if spec.residual_out_sharded else T, H),
                               dtype=ws.res_dtype, device=dev)
    scales = None
    if quant is not None:
        scales = torch.empty((T, 1) if quant.kind == "row" else (0,), dtype=torch.float32, device=dev)
    with torch.cuda.device(dev) if x.is_cuda else contextlib.nullcontext():
        launch_push(ws, rows, spec, normed, residual_out, scales=scales, **launch_kw)
    return (normed, residual_out) if quant is None else (normed, residual_out, scales)


def _overlaps_ring_slot(ws: SymmWorkspace, slot: int, *tensors) -> bool:
    """True if any of ``tensors`` has memory in ring slot ``slot`` of ``ws``'s output region."""
    ring = ws.out_ring[slot]
    lo, hi = ring.data_ptr(), ring.data_ptr() + ring.numel() * ring.element_size()
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        t_lo = t.data_ptr()
        t_hi = t_lo + extent(t) * t.element_size()
        if t_lo < hi and lo < t_hi:
            return True
    return False


def allreduce_rmsnorm(x: torch.Tensor, residual: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                      weight: Optional[torch.Tensor] = None, *, channel: int = 0, num_warps: Optional[int] = None,
                      eps_tensor: Optional[torch.Tensor] = None, norm_bias: Optional[torch.Tensor] = None,
                      **spec_kw) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x`` [T, H] over ``spec_kw["group_name"]``, add bias/residual, RMSNorm (or
    LayerNorm: ``norm="layernorm"``), with the push kernel: ``(normed [T, H], residual_out [T, H]
    or this rank's [S, H] shard)``.

    ``spec_kw`` are :class:`~weave_compile.kernels.spec.FusedSpec`'s fields (dtypes default to the
    inputs'); ``eps_tensor`` (0-d, on ``x``'s device) replaces ``eps`` and is read there;
    ``norm_bias`` [H] is added after the weight.
    Collective; see :func:`weave_compile.kernels.shared.symm_call.run_on_workspace`."""
    spec = FusedSpec.for_rows(x, residual, **spec_kw)
    rows = Rows(x, residual, bias, weight, eps_tensor=eps_tensor, norm_bias=norm_bias)
    return run_on_workspace(rows, spec, push_on, ring=spec.out_slot >= 0, channel=channel, num_warps=num_warps)
