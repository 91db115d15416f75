"""Launch shapes the barrier kernels share: tile, warps and grid of a row loop, and the
one-warp-per-row add+norm's limits.

Every shape is a function of ``(H, S, comm_ctas, N, dtypes)`` only, hence identical on every
rank, which the CTA-pairwise barriers (:mod:`.sync`) require. The load-based kernels
(``multimem``, the one-shot kernel) use :func:`launch_meta` as is; the push kernel (``p2p``)
builds on :func:`warps_and_rows` with its own unrolling and add+norm loop.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .common import next_pow2, prev_pow2, tl_dtype


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
    # norm_depth chunks ahead (norm_prefetch and norm_stages then unused)
    norm_chunk: int = 0
    norm_depth: int = 1


def warps_and_rows(hidden: int, rows_per_rank: int, comm_ctas: int, r_max: int,
                   num_warps: Optional[int]) -> tuple:
    """``(block_h, block_rows, num_warps, grid)``: a row tile of at most ``r_max`` rows, never more
    rows per iteration than the shard gives each CTA (small T still spreads over every CTA)."""
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
    """The load-based kernels' tile shape and grid.

    Aim for ~32 fp32 accumulator registers per thread: 16 warps for rows >= 2048
    elements, up to 8 rows per CTA iteration for short rows, but never more rows per
    iteration than the shard gives each CTA (so small T still spreads over all CTAs)."""
    block_h = next_pow2(hidden)
    threads = 32 * (num_warps or (16 if block_h >= 2048 else max(4, block_h // 128)))
    r_max = max(1, min(8, 32 * threads // block_h))
    return LaunchMeta(*warps_and_rows(hidden, rows_per_rank, comm_ctas, r_max, num_warps))


#: The one-warp-per-row add+norm (rownorm.rowwise_group): warps (= rows per group) and columns
#: per chunk (8 16-bit elements per lane).
ROWWISE_WARPS, ROWWISE_CHUNK = 8, 256


def rowwise_fits(hidden: int, partials: int, in_bytes: int, res_bytes: int) -> bool:
    """Whether the one-warp-per-row add+norm runs for this shape: one partial to add (2 ranks;
    with more, the [partials, rows, chunk] tile's layout costs shared memory and barriers, and
    spills), 16-bit inputs, a row's rounded residual kept in 64 registers per lane (H x residual
    bytes <= 8 KB: H <= 4096 in 16 bits), and H >= 2048 (the shapes measured)."""
    return partials == 1 and in_bytes <= 2 and 2048 <= hidden and hidden * res_bytes <= 8192


def norm_constexprs(*, world_size, hidden, block_h, block_rows, in_dtype, out_dtype, res_dtype,
                    mid_dtype, has_bias, has_residual, has_weight, residual_in_sharded,
                    residual_out_sharded, spin=0, interp=False) -> dict:
    """The constexprs the push and pull kernels both take (the pull kernel adds the vector
    widths and USE_MULTIMEM, the push kernel its pipeline depths)."""
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


def layernorm_constexprs(norm: str, norm_bias) -> dict:
    """The LayerNorm keywords of the kernels built on the shared row bodies (the push, pull and one-shot
    kernels): ``IS_LAYERNORM`` for ``norm="layernorm"``, the ``NORM_BIAS`` row and ``HAS_NORM_BIAS``
    where there is one. RMSNorm without a norm bias gets none of them: its launch binds the kernel's
    defaults (flags off, no ``NORM_BIAS`` argument) and compiles to the code it did before the variant
    existed (sm_90 PTX compared)."""
    if norm not in ("rmsnorm", "layernorm"):
        raise ValueError(f"norm must be 'rmsnorm' or 'layernorm', got {norm!r}")
    kw = {}
    if norm == "layernorm":
        kw["IS_LAYERNORM"] = True
    if norm_bias is not None:
        kw.update(NORM_BIAS=norm_bias, HAS_NORM_BIAS=True)
    return kw
