"""Row add + RMSNorm on local memory with many bytes in flight: the SM phase of ``ce`` and ``nccl``.

What: for ``n_valid`` rows, ``acc = x (+ sum of the reduce-scatter slots) (* scale) (+ bias)
(+ residual)``, ``res = acc.to(res dtype)`` (stored), ``normed = RMSNorm(res)`` (or LayerNorm,
with its bias after the weight: the kernel's ``IS_LAYERNORM`` / ``HAS_NORM_BIAS`` variant)
following the cast order of the fused op's contract (``ops/allreduce_rmsnorm.py``). Rows
``n_valid .. n_res_rows`` of the residual output are written as zeros (a sharded residual's
padding rows).

Why a kernel of its own: once copy engines (or NCCL) move the bytes between GPUs, the only SM work
left is this local streaming pass, and it should need few CTAs so the other token half's GEMMs keep
their SMs. Per-CTA bandwidth is set by bytes in flight, not by the hardware (four rows in flight
per CTA move over twice what one does; docs/performance.md section 1, "What one SM moves"): each
CTA works on ``BLOCK_ROWS`` rows at a time and the next rows' loads are issued before this row
block's math: one warp per row with column chunks loaded ahead (``CHUNK`` > 0, the shared
:func:`weave_compile.kernels.shared.rownorm.rowwise_group`), the next block prefetched into
registers (``PREFETCH``), or a ``tl.range(num_stages=NUM_STAGES)`` software pipeline. The launch
shape is :func:`launch_config`; ``benchmarks/bench_comm_ce.py`` measured it.

Off GPU (CPU tensors without the Triton interpreter) :func:`add_rmsnorm_rows` runs the same math
with torch ops, which is what the copy-engine CPU simulation uses.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import fp8_rows
from .common import (HAS_TRITON, MAX_HIDDEN, SUPPORTED_DTYPES, interpreting, next_pow2, prefetch_fits, tl, tl_dtype,
                     triton)
from .shapes import ROWWISE_CHUNK, ROWWISE_WARPS, rowwise_fits

log = logging.getLogger(__name__)

#: Chunks the add+norm kernel's one-warp-per-row loop loads ahead: the most measured, which still
#: fits the registers with a bias, a scale and a mid dtype (docs/performance.md, "Launch shapes").
ADDNORM_ROWWISE_DEPTH = 8

if HAS_TRITON:
    from .fp8_rows import quant_tile
    from .rownorm import (add_norm, load_norm_bias, norm_params, norm_tile, rowwise_first_loads, rowwise_group,
                          store_residual_shard)

@dataclass(frozen=True)
class LaunchConfig:
    block_rows: int
    num_stages: int
    num_warps: int
    # the next row block's loads go to registers before this block's math (num_stages unused)
    prefetch: bool = False
    # > 0: one warp per row (rownorm.rowwise_group; block_rows = num_warps rows per block) in
    # chunks of this many columns, loaded `depth` chunks ahead (num_stages, prefetch unused)
    chunk: int = 0
    depth: int = 1


def launch_config(hidden: int, block_rows: Optional[int] = None, num_stages: Optional[int] = None,
                  num_warps: Optional[int] = None, prefetch: Optional[bool] = None, *, slots: int = 1,
                  elem_bytes: int = 2, res_bytes: Optional[int] = None,
                  rows_per_cta: Optional[int] = None, quant: bool = False) -> LaunchConfig:
    """Rows per iteration, loop kind, pipeline depth and warps for ``hidden`` (``slots``
    received partials, ``elem_bytes`` the widest input, ``res_bytes`` the residual output's
    element size (default ``elem_bytes``), ``rows_per_cta`` the rows each CTA gets if known); any
    shape argument given overrides.

    Default where :func:`weave_compile.kernels.shared.shapes.rowwise_fits` (one received
    partial, 16-bit inputs, 2048 <= H <= 4096, a 16-bit residual) and every CTA gets at least 8
    rows: one warp per row (8 warps, 8-row blocks, 256-column chunks loaded
    :data:`ADDNORM_ROWWISE_DEPTH` ahead; :func:`weave_compile.kernels.shared.rownorm.rowwise_group`).
    Elsewhere the register-prefetched loop on an 8K-element tile (2 rows at H=4096, 1 at 8192)
    with 16 warps, where two tiles of its inputs fit the registers
    (:func:`weave_compile.kernels.shared.common.prefetch_fits`); elsewhere the pipelined loop on
    a 16K-element tile, 3 stages, 16 warps up to H=4096 and 8 above. Each is the fastest shape
    measured where it runs (docs/performance.md, "Launch shapes"); a pipelined shape that does not
    fit in shared memory is retried with fewer stages (launcher).

    ``quant`` (an fp8 epilogue) never gets the one-warp-per-row loop (:func:`add_rmsnorm_rows`).

    LayerNorm takes the same shapes (measured for RMSNorm only): its second pass is over the row
    already held in registers, the tile or the one-warp-per-row loop's kept chunks, and compiled
    for sm_90 at H = 2048..8192 the default shapes do not spill (ptxas, bf16, with and without a
    bias, scale and mid dtype; 128 registers or fewer at 16 warps for the prefetched tile, 255 or
    fewer for the one-warp-per-row loop up to H=4096).
    """
    block_h = next_pow2(hidden)
    if ((block_rows, num_stages, num_warps, prefetch) == (None,) * 4
            and not quant and rowwise_fits(hidden, slots, elem_bytes, res_bytes or elem_bytes)
            and (rows_per_cta is None or rows_per_cta >= ROWWISE_WARPS)):
        return LaunchConfig(ROWWISE_WARPS, 1, ROWWISE_WARPS, False, ROWWISE_CHUNK, ADDNORM_ROWWISE_DEPTH)
    pf_rows = block_rows or max(1, min(8, 8192 // block_h))
    pf_warps = num_warps or max(1, min(16, pf_rows * block_h // 128))  # >= 4 elements per thread
    if prefetch is None:
        e = pf_rows * block_h // (32 * pf_warps)
        prefetch = e >= 1 and prefetch_fits(2 + next_pow2(max(1, slots)), e, elem_bytes, pf_warps)
    if prefetch:
        block_rows, num_warps = pf_rows, pf_warps
        num_stages = num_stages or 1
    if block_rows is None:
        block_rows = max(1, min(8, 16384 // block_h))
    if num_stages is None:
        num_stages = 3
    if num_warps is None:
        num_warps = 16 if block_h <= 4096 else 8
    return LaunchConfig(int(block_rows), int(num_stages), int(num_warps), bool(prefetch))


def ctas_for(spec) -> Optional[int]:
    """The add+norm's ``num_ctas`` for an op with :class:`~weave_compile.kernels.spec.FusedSpec`
    ``spec``: its ``comm_ctas`` where it runs beside other work, else None: nothing runs beside
    it, the grid is sized for the whole device (:func:`plan`)."""
    return spec.comm_ctas if spec.beside_compute else None


def plan(hidden: int, n_res_rows: int, num_ctas: Optional[int], *, slots: int = 1, elem_bytes: int = 2,
         res_bytes: Optional[int] = None, quant: bool = False, rank_order: bool = False,
         config: Optional[LaunchConfig] = None, sms: int = 0) -> tuple[LaunchConfig, int]:
    """The launch shape and the grid of :func:`add_rmsnorm_rows` for ``n_res_rows`` rows.

    ``num_ctas`` an int: at most that many CTAs, each looping over row blocks, the shape
    :func:`launch_config` picks for the rows each gets. None (nothing runs beside it): the shape
    picked as for one CTA per ``ROWWISE_WARPS`` rows (the one-warp-per-row loop where it fits, a
    CTA per row block of it), on at least one CTA per SM (``sms``, the device's) while there are
    row blocks for them. A CTA's row blocks run one after another, each waiting on its rows' sums
    (and the fp8 epilogue's amax), so 8 rows a CTA on a smaller block is latency-bound on few
    rows; past a CTA per SM the loop's prefetch of the next block beats more waves (one H100, the
    fp8 epilogue at H=4096: 128 rows 12.0 us on 16 CTAs, 4.6 us on this grid's 64; 512 rows 12.1
    us on 64, 7.4 us on 132; 2048 rows 27.1 us on 256, 36.1 us on a CTA per tile's 1024;
    ``docs/performance.md``, "fp8 epilogue")."""
    ctas = max(1, -(-n_res_rows // ROWWISE_WARPS)) if num_ctas is None else max(1, int(num_ctas))
    if config is None and rank_order:  # one shape for every row count (add_rmsnorm_rows)
        config = launch_config(hidden, prefetch=False)
    cfg = config or launch_config(hidden, slots=slots, elem_bytes=elem_bytes, res_bytes=res_bytes,
                                  rows_per_cta=-(-n_res_rows // ctas), quant=quant)
    blocks = max(1, -(-n_res_rows // cfg.block_rows))
    if num_ctas is None:
        ctas = max(ctas, sms)
    return cfg, min(ctas, blocks)


@functools.lru_cache(maxsize=None)
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The SMs of CUDA ``device`` (0 elsewhere: the interpreter's grid is not a device's)."""
    if device.type != "cuda":
        return 0
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


def check_hidden(hidden: int) -> Optional[str]:
    """Why ``hidden`` cannot run in the kernel, or None."""
    if hidden < 1 or hidden > MAX_HIDDEN:
        return f"hidden size {hidden} outside [1, {MAX_HIDDEN}] (a row lives in registers)"
    return None


def unavailable_reason(device: torch.device, dtypes, hidden: int) -> Optional[str]:
    """Why the add+norm kernel cannot run for rows of ``hidden`` elements of ``dtypes`` on
    ``device`` at compile time (None if it can): the designs built on it need CUDA and triton."""
    if device.type != "cuda":
        return f"{device.type} tensors: the add+norm kernel needs CUDA"
    if not HAS_TRITON:
        return "triton is not installed (the add+norm kernel is a Triton kernel)"
    bad = [d for d in dtypes if d not in SUPPORTED_DTYPES]
    if bad:
        return f"dtypes {bad} not supported"
    return check_hidden(hidden)


if HAS_TRITON:

    @triton.jit
    def _store_normed(NORMED, QSCALES, rows, cols, m, n_valid, stride_normed_row, normed, qstatic,
                      QUANT: tl.constexpr, Q_INV_MAX: tl.constexpr, Q_FLOOR: tl.constexpr,
                      Q_RECIP: tl.constexpr, Q_SAT: tl.constexpr, Q_SDTYPE: tl.constexpr, Q_MBITS: tl.constexpr,
                      Q_BIAS: tl.constexpr, INTERPRET: tl.constexpr, Q_VEC: tl.constexpr = 0):
        """Store a block's normed rows where ``m``: as they are, or (``QUANT`` 1: per row, 2: static)
        as fp8 codes through ``NORMED``'s bytes, with a row's scale at ``QSCALES[row]``
        (:func:`weave_compile.kernels.shared.fp8_rows.quant_tile`); ``Q_VEC`` > 0: the codes' row
        starts are that many bytes aligned (the launcher checked), stored that many a thread."""
        ptr = NORMED + rows[:, None] * stride_normed_row + cols[None, :]
        if QUANT == 0:
            tl.store(ptr, normed, mask=m)
        else:
            code, sc = quant_tile(normed, qstatic, Q_INV_MAX, Q_FLOOR, QUANT == 1, Q_RECIP, Q_SAT, Q_SDTYPE,
                                  Q_MBITS, Q_BIAS, INTERPRET)
            # The codes' store vectorized as the normed rows' store is without the epilogue (16 bytes
            # of them a thread): one byte each, aligned rows would get 16 elements a thread, which
            # Triton's layout choice spreads back to the whole tile, so the row's sum of squares
            # would be reduced in another order than the kernel without the epilogue reduces it (its
            # normed rows then differ in the last bit now and then, and with them a code).
            if Q_VEC > 0:
                ptr = tl.multiple_of(ptr, [1, Q_VEC])
            tl.store(ptr, code.to(tl.uint8), mask=m)
            if QUANT == 1:
                tl.store(QSCALES + rows, sc, mask=rows < n_valid)

    @triton.jit
    def _row_block(X, RECV, RES_IN, NORMED, RES_OUT, blk, n_valid, n_res_rows, stride_x_row, stride_recv_slot,
                   stride_res_in_row, stride_normed_row, stride_res_out_row, eps, w, b, s, cols, cmask,
                   NUM_SLOTS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                   RES_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr,
                   HAS_MID: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, nb=None,
                   IS_LAYERNORM: tl.constexpr = False, HAS_NORM_BIAS: tl.constexpr = False,
                   QSCALES=None, qstatic=0.0, QUANT: tl.constexpr = 0,
                   Q_INV_MAX: tl.constexpr = 1.0, Q_FLOOR: tl.constexpr = 0.0,
                   Q_RECIP: tl.constexpr = False, Q_SAT: tl.constexpr = 1.0, Q_SDTYPE: tl.constexpr = None,
                   Q_MBITS: tl.constexpr = 3, Q_BIAS: tl.constexpr = 7, INTERPRET: tl.constexpr = False,
                   OWN: tl.constexpr = -1, Q_VEC: tl.constexpr = 0):
        rows = (blk * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        m = (rows < n_valid)[:, None] & cmask[None, :]
        own = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if OWN < 0:  # x, then the slots in slot order
            acc = own
            for k in tl.static_range(NUM_SLOTS):
                acc += tl.load(RECV + k * stride_recv_slot + rows[:, None] * HIDDEN + cols[None, :], mask=m,
                               other=0.0).to(tl.float32)
        else:  # rank order: x is rank OWN's partial, slot k holds rank k (k < OWN) or k + 1
            acc = tl.zeros_like(own)
            for p in tl.static_range(NUM_SLOTS + 1):
                if p == OWN:
                    term = own
                else:  # rank p's slot: p below OWN, p - 1 above (a constexpr: the loop is unrolled)
                    term = tl.load(RECV + (p - (p > OWN)) * stride_recv_slot + rows[:, None] * HIDDEN
                                   + cols[None, :], mask=m, other=0.0).to(tl.float32)
                if p == 0:
                    acc = term
                else:
                    acc += term
        if HAS_SCALE:
            acc = acc * s
        # The one add+norm body of every kernel (rownorm.py); our rows are shard-local (j == rows).
        res, normed = add_norm(acc, rows, rows, m, cols, RES_IN, stride_res_in_row, b, w, eps, HIDDEN, RES_DTYPE,
                               OUT_DTYPE, MID_DTYPE, HAS_BIAS, HAS_RESIDUAL, HAS_WEIGHT, HAS_MID, True, nb,
                               IS_LAYERNORM, HAS_NORM_BIAS)
        # rows past n_valid loaded every input as 0: zero already unless a bias or scale moves them
        store_residual_shard(RES_OUT, rows, res, m, cmask, cols, n_res_rows, stride_res_out_row,
                             HAS_BIAS or HAS_SCALE)
        _store_normed(NORMED, QSCALES, rows, cols, m, n_valid, stride_normed_row, normed, qstatic, QUANT,
                      Q_INV_MAX, Q_FLOOR, Q_RECIP, Q_SAT, Q_SDTYPE, Q_MBITS, Q_BIAS, INTERPRET, Q_VEC=Q_VEC)

    @triton.jit
    def _block_loads(X, RECV, RES_IN, blk, n_valid, stride_x_row, stride_recv_slot, stride_res_in_row,
                     cols, cmask, NUM_SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, HIDDEN: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """Row block ``blk``'s inputs as loaded: x [R, BLOCK_H], the slots as one
        [SLOTS_P2, R, BLOCK_H] tile (padding masked), the residual (a placeholder without one)."""
        rows = (blk * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        m = (rows < n_valid)[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=m, other=0.0)
        k = tl.arange(0, SLOTS_P2)
        recv = tl.load(RECV + k[:, None, None] * stride_recv_slot + rows[None, :, None] * HIDDEN
                       + cols[None, None, :], mask=(k < NUM_SLOTS)[:, None, None] & m[None, :, :], other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(RES_IN + rows[:, None] * stride_res_in_row + cols[None, :], mask=m, other=0.0)
        else:
            res = tl.zeros((1,), dtype=tl.float32)
        return x, recv, res

    @triton.jit
    def _rowwise_inputs(X, RECV, RES_IN, blk, n_valid, stride_x_row, stride_recv_slot, stride_res_in_row,
                        NUM_SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, HIDDEN: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr):
        """Row pointers and masks of row block ``blk``'s inputs for
        :func:`weave_compile.kernels.shared.rownorm.rowwise_group`: x [R, 1], the slots [SLOTS_P2, R, 1]
        (padding masked), the residual [R, 1]."""
        rows = (blk * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        ok = rows < n_valid
        k = tl.arange(0, SLOTS_P2)
        PR = RECV + (k[:, None] * stride_recv_slot + rows[None, :] * HIDDEN)[:, :, None]
        pm = ((k < NUM_SLOTS)[:, None] & ok[None, :])[:, :, None]
        return (X + (rows * stride_x_row)[:, None], PR, RES_IN + (rows * stride_res_in_row)[:, None],
                ok[:, None], pm)

    @triton.jit
    def _block_finish(x, recv, res_in, NORMED, RES_OUT, blk, n_valid, n_res_rows, stride_normed_row,
                      stride_res_out_row, eps, w, b, s, cols, cmask, BLOCK_ROWS: tl.constexpr,
                      HIDDEN: tl.constexpr, RES_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
                      MID_DTYPE: tl.constexpr, HAS_MID: tl.constexpr, HAS_SCALE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      nb=None, IS_LAYERNORM: tl.constexpr = False, HAS_NORM_BIAS: tl.constexpr = False,
                      QSCALES=None, qstatic=0.0, QUANT: tl.constexpr = 0,
                      Q_INV_MAX: tl.constexpr = 1.0, Q_FLOOR: tl.constexpr = 0.0,
                      Q_RECIP: tl.constexpr = False, Q_SAT: tl.constexpr = 1.0, Q_SDTYPE: tl.constexpr = None,
                      Q_MBITS: tl.constexpr = 3, Q_BIAS: tl.constexpr = 7, INTERPRET: tl.constexpr = False,
                      Q_VEC: tl.constexpr = 0):
        """The math and stores of a row block whose inputs :func:`_block_loads` loaded."""
        rows = (blk * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        m = (rows < n_valid)[:, None] & cmask[None, :]
        acc = x.to(tl.float32) + tl.sum(recv.to(tl.float32), axis=0)
        if HAS_SCALE:
            acc = acc * s
        res, normed = norm_tile(acc, res_in, b, w, eps, HIDDEN, RES_DTYPE, OUT_DTYPE, MID_DTYPE, HAS_BIAS,
                                HAS_RESIDUAL, HAS_WEIGHT, HAS_MID, nb, IS_LAYERNORM, HAS_NORM_BIAS)
        # rows past n_valid loaded every input as 0: zero already unless a bias or scale moves them
        store_residual_shard(RES_OUT, rows, res, m, cmask, cols, n_res_rows, stride_res_out_row,
                             HAS_BIAS or HAS_SCALE)
        _store_normed(NORMED, QSCALES, rows, cols, m, n_valid, stride_normed_row, normed, qstatic, QUANT,
                      Q_INV_MAX, Q_FLOOR, Q_RECIP, Q_SAT, Q_SDTYPE, Q_MBITS, Q_BIAS, INTERPRET, Q_VEC=Q_VEC)

    # The row counts are not specialized (a count of 1, or one divisible by 16, would otherwise be
    # a binary of its own): a new token count must never compile or load a kernel at run time
    # (ce loads every variant a site can launch at compile time; kernels/ce/program.py).
    @triton.jit(do_not_specialize=["n_valid", "n_res_rows"])
    def _add_rmsnorm_rows_kernel(
        X, RECV, RES_IN, BIAS, WEIGHT, SCALE, ABORT, NORMED, RES_OUT,
        n_valid, n_res_rows, stride_x_row, stride_recv_slot, stride_res_in_row, stride_normed_row,
        stride_res_out_row, eps, weight_offset,
        NUM_SLOTS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        NUM_STAGES: tl.constexpr, RES_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr,
        HAS_MID: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr, INTERPRET: tl.constexpr, PREFETCH: tl.constexpr = False,
        SLOTS_P2: tl.constexpr = 1, CHUNK: tl.constexpr = 0, DEPTH: tl.constexpr = 1,
        HAS_ABORT: tl.constexpr = False, EPS_PTR: tl.constexpr = False,
        NORM_BIAS=None, IS_LAYERNORM: tl.constexpr = False, HAS_NORM_BIAS: tl.constexpr = False,
        QSCALES=None, QSTATIC=None, QUANT: tl.constexpr = 0,
        Q_INV_MAX: tl.constexpr = 1.0, Q_FLOOR: tl.constexpr = 0.0, Q_RECIP: tl.constexpr = False,
        Q_SAT: tl.constexpr = 1.0, Q_SDTYPE: tl.constexpr = None, Q_MBITS: tl.constexpr = 3,
        Q_BIAS: tl.constexpr = 7, OWN: tl.constexpr = -1, Q_VEC: tl.constexpr = 0,
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < HIDDEN
        if EPS_PTR:  # eps a 0-d device tensor (a graph input under dynamic shapes), read once per CTA
            eps = tl.load(eps).to(tl.float32)
        # Loop invariants, loaded once per CTA (the one-warp-per-row loop re-reads them per chunk).
        nb = None  # NORM_BIAS: None (a constexpr, no kernel argument) unless HAS_NORM_BIAS
        if CHUNK == 0:
            b, w = norm_params(BIAS, WEIGHT, cols, cmask, weight_offset, HAS_BIAS, HAS_WEIGHT)
            if HAS_NORM_BIAS:
                nb = load_norm_bias(NORM_BIAS, cols, cmask)
        s = 1.0
        if HAS_SCALE:
            s = tl.load(SCALE).to(tl.float32)
        if HAS_ABORT:
            # A watchdog that released this call's waits set the word (kernels/ce/watchdog.py): the
            # scale becomes NaN and so does every output; else it stays (x * 1.0 is exact).
            nan = tl.full((1,), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
            s = tl.sum(tl.where(tl.load(ABORT + tl.arange(0, 1)) != 0, nan, s), axis=0)
        qstatic = 0.0
        if QUANT == 2:  # the static fp8 scale, read once per CTA
            qstatic = tl.load(QSTATIC).to(tl.float32)
        num_blocks = (n_res_rows + BLOCK_ROWS - 1) // BLOCK_ROWS
        if CHUNK > 0:
            # One warp per row (rownorm.rowwise_group): row blocks of BLOCK_ROWS rows in chunks
            # of CHUNK columns, loaded DEPTH chunks ahead.
            c = tl.arange(0, CHUNK)
            XR, PR, RR, m, pm = _rowwise_inputs(X, RECV, RES_IN, pid, n_valid, stride_x_row,
                                                stride_recv_slot, stride_res_in_row, NUM_SLOTS,
                                                SLOTS_P2, HIDDEN, BLOCK_ROWS)
            pre = rowwise_first_loads(XR, PR, RR, m, pm, c, HIDDEN, CHUNK, DEPTH, HAS_RESIDUAL)
            blk = pid
            while blk < num_blocks:  # a while loop: the interpreter runs it too
                XR, PR, RR, m, pm = _rowwise_inputs(X, RECV, RES_IN, blk, n_valid, stride_x_row,
                                                    stride_recv_slot, stride_res_in_row, NUM_SLOTS,
                                                    SLOTS_P2, HIDDEN, BLOCK_ROWS)
                NXR, NPR, NRR, nm, npm = _rowwise_inputs(X, RECV, RES_IN, blk + nprog, n_valid,
                                                         stride_x_row, stride_recv_slot,
                                                         stride_res_in_row, NUM_SLOTS, SLOTS_P2,
                                                         HIDDEN, BLOCK_ROWS)
                rows = (blk * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
                pre = rowwise_group(
                    pre, XR, PR, RR, m, pm, NXR, NPR, NRR, nm, npm,
                    RES_OUT + (rows * stride_res_out_row)[:, None], (rows < n_res_rows)[:, None],
                    RES_OUT, m, NORMED + (rows * stride_normed_row)[:, None], NORMED, m, BIAS,
                    WEIGHT, s, eps, weight_offset, c, BLOCK_ROWS, HIDDEN, CHUNK, DEPTH, RES_DTYPE,
                    OUT_DTYPE, MID_DTYPE, HAS_SCALE or HAS_ABORT, HAS_BIAS, HAS_RESIDUAL, HAS_WEIGHT, HAS_MID,
                    HAS_BIAS or HAS_SCALE or HAS_ABORT, False, False, NORM_BIAS, IS_LAYERNORM, HAS_NORM_BIAS)
                blk += nprog
        elif PREFETCH:
            # Registers double-buffered: block blk + nprog's loads are issued before block blk's
            # math and stores (no shared-memory staging, no per-stage wait and barrier).
            nx, nrecv, nres = _block_loads(X, RECV, RES_IN, pid, n_valid, stride_x_row, stride_recv_slot,
                                           stride_res_in_row, cols, cmask, NUM_SLOTS, SLOTS_P2, HIDDEN,
                                           BLOCK_ROWS, HAS_RESIDUAL)
            blk = pid
            while blk < num_blocks:  # a while loop: the interpreter runs it too
                cx = nx
                crecv = nrecv
                cres = nres
                nx, nrecv, nres = _block_loads(X, RECV, RES_IN, blk + nprog, n_valid, stride_x_row,
                                               stride_recv_slot, stride_res_in_row, cols, cmask, NUM_SLOTS,
                                               SLOTS_P2, HIDDEN, BLOCK_ROWS, HAS_RESIDUAL)
                _block_finish(cx, crecv, cres, NORMED, RES_OUT, blk, n_valid, n_res_rows, stride_normed_row,
                              stride_res_out_row, eps, w, b, s, cols, cmask, BLOCK_ROWS, HIDDEN, RES_DTYPE,
                              OUT_DTYPE, MID_DTYPE, HAS_MID, HAS_SCALE or HAS_ABORT, HAS_BIAS, HAS_RESIDUAL,
                              HAS_WEIGHT, nb, IS_LAYERNORM, HAS_NORM_BIAS, QSCALES, qstatic, QUANT,
                              Q_INV_MAX, Q_FLOOR, Q_RECIP, Q_SAT, Q_SDTYPE, Q_MBITS, Q_BIAS, INTERPRET, Q_VEC=Q_VEC)
                blk += nprog
        elif INTERPRET:
            # Triton 3.6's interpreter cannot take runtime bounds in tl.range (numpy >= 2): same body.
            blk = pid
            while blk < num_blocks:
                _row_block(X, RECV, RES_IN, NORMED, RES_OUT, blk, n_valid, n_res_rows, stride_x_row,
                           stride_recv_slot, stride_res_in_row, stride_normed_row, stride_res_out_row, eps, w, b,
                           s, cols, cmask, NUM_SLOTS, HIDDEN, BLOCK_ROWS, RES_DTYPE, OUT_DTYPE, MID_DTYPE,
                           HAS_MID, HAS_SCALE or HAS_ABORT, HAS_BIAS, HAS_RESIDUAL, HAS_WEIGHT, nb, IS_LAYERNORM,
                           HAS_NORM_BIAS, QSCALES, qstatic, QUANT, Q_INV_MAX, Q_FLOOR, Q_RECIP,
                           Q_SAT, Q_SDTYPE, Q_MBITS, Q_BIAS, INTERPRET, OWN, Q_VEC)
                blk += nprog
        else:
            # Pipelined: the loads of the next row blocks are issued before this block's reduction.
            for blk in tl.range(pid, num_blocks, nprog, num_stages=NUM_STAGES):
                _row_block(X, RECV, RES_IN, NORMED, RES_OUT, blk, n_valid, n_res_rows, stride_x_row,
                           stride_recv_slot, stride_res_in_row, stride_normed_row, stride_res_out_row, eps, w, b,
                           s, cols, cmask, NUM_SLOTS, HIDDEN, BLOCK_ROWS, RES_DTYPE, OUT_DTYPE, MID_DTYPE,
                           HAS_MID, HAS_SCALE or HAS_ABORT, HAS_BIAS, HAS_RESIDUAL, HAS_WEIGHT, nb, IS_LAYERNORM,
                           HAS_NORM_BIAS, QSCALES, qstatic, QUANT, Q_INV_MAX, Q_FLOOR, Q_RECIP,
                           Q_SAT, Q_SDTYPE, Q_MBITS, Q_BIAS, INTERPRET, OWN, Q_VEC)

else:  # pragma: no cover
    _add_rmsnorm_rows_kernel = None


def use_triton(device: torch.device) -> bool:
    """The Triton kernel runs on CUDA tensors, and on CPU ones under ``TRITON_INTERPRET=1``."""
    return HAS_TRITON and (device.type == "cuda" or interpreting())


def add_rmsnorm_rows(
    x: torch.Tensor,
    recv: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    normed: torch.Tensor,
    res_out: torch.Tensor,
    *,
    n_valid: int,
    eps: Union[float, torch.Tensor],
    mid_dtype: Optional[torch.dtype],
    weight_offset: float,
    num_ctas: Optional[int],
    config: Optional[LaunchConfig] = None,
    force_torch: bool = False,
    preload: bool = False,
    abort: Optional[torch.Tensor] = None,
    norm: str = "rmsnorm",
    norm_bias: Optional[torch.Tensor] = None,
    quant=None,
    quant_scale: Optional[torch.Tensor] = None,
    row_scales: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    rank_order: Optional[int] = None,
):
    """Write ``normed[:n_valid]`` and ``res_out[:len(res_out)]`` (zeros past ``n_valid``).

    ``x`` [>= n_valid, H] (row stride free, unit column stride); ``recv`` [slots, >= n_valid, H]
    contiguous rows, or None; ``residual`` [>= n_valid, H] or None; ``scale`` a 1-element tensor;
    ``eps`` a number or a 0-d tensor on ``x``'s device (read there: no host sync);
    ``abort`` an int32 word or None: where it is not 0 every output is NaN (the ``ce`` watchdog's
    poison). Rows of ``normed`` past ``n_valid`` are not touched. ``num_ctas``: the grid's bound,
    or None: sized for the whole device, at least a CTA per SM while row blocks last
    (:func:`plan`). ``preload``: compile and load the kernel this call would launch (its module and
    function handles), launch nothing, and return it (see :mod:`weave_compile.kernels.ce.copy_engine`,
    "Deadlock freedom"). ``norm``:
    ``"rmsnorm"`` or ``"layernorm"`` (the centred row's mean square as the variance); ``norm_bias``
    [H] is added after the weight. Both run in the Triton kernel (its ``IS_LAYERNORM`` /
    ``HAS_NORM_BIAS`` variant, every loop kind) as RMSNorm does.
    ``quant``: a :class:`weave_compile.quant.QuantSpec` (the fp8 epilogue): the normed rows, rounded
    to ``out_dtype`` (required then), are written to ``normed`` (``quant.dtype``) as fp8 codes, and
    with a per-row scale each row's scale to ``row_scales`` ([>= n_valid, 1] fp32, contiguous);
    a static one is read from ``quant_scale``. In the kernel (:mod:`.fp8_rows`, bit-exact to
    :func:`weave_compile.quant.quantize_rows`) on the row tile: a quantizing launch never takes the
    one-warp-per-row loop, whose row is in chunks when each is stored (its amax is not known yet).
    ``rank_order``: the partials are added in rank order in fp32, ``x`` being rank
    ``rank_order``'s and slot ``k`` rank ``k`` (``k < rank_order``) or ``k + 1`` (the ``ce``
    layout, :func:`weave_compile.kernels.ce.workspace.slot_of`); the launch shape is then the
    pipelined row tile whatever the row count (the one-warp-per-row loop, picked from 8 rows per
    CTA on, sums a row's squares in another order, and the prefetched tile sums its slots as a
    tree): a row's outputs do not depend on the call's other rows.
    """
    if norm not in ("rmsnorm", "layernorm"):
        raise ValueError(f"add_rmsnorm_rows: norm must be 'rmsnorm' or 'layernorm', got {norm!r}")
    hidden = x.shape[-1]
    n_res_rows = res_out.shape[0]
    if quant is not None:
        _check_quant(quant, quant_scale, row_scales, normed, out_dtype, n_valid)
    if rank_order is not None:
        slots = 0 if recv is None else recv.shape[0]
        if not 0 <= rank_order <= slots:
            raise ValueError(f"add_rmsnorm_rows: rank_order {rank_order} outside 0..{slots} (x and {slots} slots)")
        if config is not None and (config.chunk or config.prefetch):
            raise ValueError("add_rmsnorm_rows: rank_order runs on the pipelined row tile only, got " + str(config))
    if n_res_rows == 0:
        return None
    if force_torch or not use_triton(x.device):
        if preload:  # nothing to load: the torch path has no kernel of ours
            return None
        _add_rmsnorm_rows_torch(x, recv, residual, bias, weight, scale, normed, res_out, n_valid=n_valid,
                                eps=eps, mid_dtype=mid_dtype, weight_offset=weight_offset, abort=abort,
                                norm=norm, norm_bias=norm_bias, quant=quant, quant_scale=quant_scale,
                                row_scales=row_scales, out_dtype=out_dtype, rank_order=rank_order)
        return None
    slots = 0 if recv is None else recv.shape[0]
    cfg, grid = plan(hidden, n_res_rows, num_ctas, slots=slots,
                     elem_bytes=max(t.element_size() for t in (x, residual, recv) if t is not None),
                     res_bytes=res_out.element_size(), quant=quant is not None, rank_order=rank_order is not None,
                     config=config, sms=sm_count(x.device) if num_ctas is None else 0)
    if quant is not None and cfg.chunk:
        raise ValueError("add_rmsnorm_rows: the fp8 epilogue runs on the row tile, not the one-warp-per-row loop")
    if recv is not None and (recv.stride(-1) != 1 or recv.stride(-2) != hidden):
        raise ValueError("add_rmsnorm_rows: recv slots must hold contiguous rows")
    for name, t in (("x", x), ("residual", residual), ("normed", normed), ("res_out", res_out)):
        if t is not None and t.stride(-1) != 1 and t.numel() and t.shape[-1] > 1:  # an empty one is never read
            raise ValueError(f"add_rmsnorm_rows: {name} needs unit column stride")
    if norm_bias is not None and (norm_bias.numel() != hidden or not norm_bias.is_contiguous()):
        raise ValueError(f"add_rmsnorm_rows: norm_bias must be a contiguous row of H={hidden} elements")
    key = (hidden, slots, cfg, x.dtype, res_out.dtype, normed.dtype)
    # The LayerNorm variant: keywords and a shape memo of its own; RMSNorm's launch as it was.
    ln = {} if norm == "rmsnorm" and norm_bias is None else dict(norm=norm, norm_bias=norm_bias)
    if ln:
        key = key + (norm, norm_bias is not None)
    if quant is not None:  # the epilogue: its own keywords, and the normed rows' dtype before it
        ln.update(quant=quant, quant_scale=quant_scale, row_scales=row_scales, out_dtype=out_dtype)
        key = key + (quant, out_dtype)
    if rank_order is not None:
        ln["rank_order"] = rank_order
        key = key + ("rank order", rank_order)
    cfg = _SHRUNK.get(key, cfg)
    tensors = (x, recv, residual, bias, weight, scale, abort, normed, res_out)
    while True:
        try:
            return _launch(tensors, n_valid, n_res_rows, eps, mid_dtype, weight_offset, grid, cfg, slots,
                           preload=preload, **ln)
        except triton.runtime.errors.OutOfResources as e:
            if cfg.num_stages <= 1 or cfg.prefetch:
                raise
            smaller = LaunchConfig(cfg.block_rows, cfg.num_stages - 1, cfg.num_warps)
            log.info("add+norm shape %s does not fit (%s); retrying with %s", cfg, e, smaller)
            cfg = _SHRUNK[key] = smaller


_SHRUNK: dict = {}  # launch shapes that did not fit -> the shape that did


def kernel_args(tensors, n_valid, n_res_rows, eps, mid_dtype, weight_offset, cfg, slots, *, norm="rmsnorm",
                norm_bias=None, quant=None, quant_scale=None, row_scales=None,
                out_dtype=None, rank_order=None) -> tuple[tuple, dict]:
    """The add+norm kernel's ``(args, constexpr and launch keywords)`` for ``tensors`` = ``(x, recv,
    residual, bias, weight, scale, abort, normed, res_out)`` (absent ones None). RMSNorm without a
    norm bias passes none of the LayerNorm keywords, and a launch without ``quant`` none of the fp8
    epilogue's: their kernels and cache keys are as they were. With ``quant`` the kernel stores
    ``normed``'s bytes and rounds the normed rows to ``out_dtype`` first."""
    x, recv, residual, bias, weight, scale, abort, normed, res_out = tensors
    hidden = x.shape[-1]
    dummy = x
    args = (x, recv if recv is not None else dummy, residual if residual is not None else dummy,
            bias if bias is not None else dummy, weight if weight is not None else dummy,
            scale if scale is not None else dummy, abort if abort is not None else dummy, normed, res_out,
            int(n_valid), int(n_res_rows), x.stride(0), recv.stride(0) if recv is not None else 0,
            residual.stride(0) if residual is not None else 0, normed.stride(0), res_out.stride(0),
            eps if isinstance(eps, torch.Tensor) else float(eps), float(weight_offset))
    kwargs = dict(
        NUM_SLOTS=slots, HIDDEN=hidden, BLOCK_H=next_pow2(hidden), BLOCK_ROWS=cfg.block_rows,
        NUM_STAGES=cfg.num_stages, RES_DTYPE=tl_dtype(res_out.dtype),
        OUT_DTYPE=tl_dtype(normed.dtype if quant is None else out_dtype),
        MID_DTYPE=tl_dtype(mid_dtype if mid_dtype is not None else torch.float32),
        HAS_MID=mid_dtype is not None, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, INTERPRET=interpreting(),
        PREFETCH=bool(cfg.prefetch), SLOTS_P2=next_pow2(max(1, slots)), CHUNK=int(cfg.chunk),
        DEPTH=int(cfg.depth), HAS_ABORT=abort is not None, EPS_PTR=isinstance(eps, torch.Tensor),
        num_warps=cfg.num_warps, num_stages=1)
    if norm != "rmsnorm":
        kwargs["IS_LAYERNORM"] = True
    if norm_bias is not None:
        kwargs.update(NORM_BIAS=norm_bias, HAS_NORM_BIAS=True)
    if quant is not None:
        args = args[:7] + (normed.view(torch.uint8),) + args[8:]
        kwargs.update(QSCALES=row_scales if row_scales is not None else dummy,
                      QSTATIC=quant_scale if quant_scale is not None else dummy,
                      Q_VEC=fp8_rows.code_vector(normed, out_dtype),
                      **fp8_rows.quant_constexprs(quant, out_dtype))
    if rank_order is not None:
        kwargs["OWN"] = int(rank_order)
    return args, kwargs


def _launch(tensors, n_valid, n_res_rows, eps, mid_dtype, weight_offset, grid, cfg, slots, preload=False,
            **variant):
    args, kwargs = kernel_args(tensors, n_valid, n_res_rows, eps, mid_dtype, weight_offset, cfg, slots, **variant)
    if not preload:
        _add_rmsnorm_rows_kernel[(grid,)](*args, **kwargs)
        return None
    compiled = _add_rmsnorm_rows_kernel.warmup(*args, grid=(grid,), **kwargs)
    if hasattr(compiled, "result"):  # compiled asynchronously
        compiled = compiled.result()
    if hasattr(compiled, "_init_handles"):
        compiled._init_handles()  # cuModuleLoadData + cuModuleGetFunction now, not at the launch
    return compiled


def _check_quant(quant, quant_scale, row_scales, normed, out_dtype, n_valid) -> None:
    """The fp8 epilogue's arguments, named where they do not fit (:func:`add_rmsnorm_rows`)."""
    if out_dtype is None:
        raise ValueError("add_rmsnorm_rows: an fp8 epilogue needs out_dtype (the normed rows' dtype before it)")
    if normed.dtype != quant.dtype:
        raise ValueError(f"add_rmsnorm_rows: normed must be {quant.dtype} with this epilogue, got {normed.dtype}")
    if quant.kind == "row":
        if row_scales is None or row_scales.dtype != torch.float32 or row_scales.shape[0] < n_valid \
                or row_scales.stride(0) != 1:
            raise ValueError("add_rmsnorm_rows: a per-row fp8 epilogue needs row_scales, [>= n_valid, 1] fp32 "
                             "with unit row stride")
    elif quant_scale is None or quant_scale.numel() != 1:
        raise ValueError("add_rmsnorm_rows: a static fp8 epilogue needs its one-element quant_scale")


def _add_rmsnorm_rows_torch(x, recv, residual, bias, weight, scale, normed, res_out, *, n_valid, eps,
                            mid_dtype, weight_offset, abort=None, norm="rmsnorm", norm_bias=None, quant=None,
                            quant_scale=None, row_scales=None, out_dtype=None, rank_order=None) -> None:
    """The kernel's math with torch ops (CPU simulation path)."""
    from weave_compile.rows import norm_rows

    acc = x[:n_valid].float()
    if recv is not None and rank_order is not None:  # rank order, x at its rank's place
        terms = [recv[k, :n_valid].float() for k in range(recv.shape[0])]
        terms.insert(rank_order, acc)
        acc = terms[0]
        for t in terms[1:]:
            acc = acc + t
    elif recv is not None:
        acc = acc + recv[:, :n_valid].float().sum(0)
    if scale is not None:
        acc = acc * scale.float().reshape(())
    if abort is not None:  # NaN everywhere once a watchdog set the word (no host sync: a select)
        acc = acc * torch.where(abort.reshape(()) != 0, float("nan"), 1.0)
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None:
        acc = acc + residual[:n_valid].float()
    res = acc.to(res_out.dtype)
    res_out[:n_valid].copy_(res)
    res_out[n_valid:].zero_()
    if quant is None:
        normed[:n_valid].copy_(norm_rows(res, weight, eps, normed.dtype, mid_dtype, weight_offset, norm, norm_bias))
        return
    from weave_compile.quant import quantize_rows

    q, scales = quantize_rows(norm_rows(res, weight, eps, out_dtype, mid_dtype, weight_offset, norm, norm_bias),
                              quant, quant_scale)
    normed[:n_valid].copy_(q)
    if quant.kind == "row":
        row_scales[:n_valid].copy_(scales)
