"""The ``nccl`` implementation of the fused op: NCCL reduce-scatter, one add+norm kernel, NCCL all-gather.

The baseline issue 11 measures the overlap designs against: the collectives are NCCL's (on its own
stream, ordered after the current one, with NCCL's own few SMs) and the local work is the shared
few-CTA add+norm kernel of ``kernels/addnorm.py`` instead of the reference's chain of torch ops.
Same contract as every fused-op kernel (``ops/allreduce_rmsnorm.py``), ``scale`` included. Under
the split schedule the start op runs it on the comm stream, as it runs every kernel.

Functional collectives carry it, so it also runs on gloo (CPU tests; the add+norm then uses its torch
path) and is capturable in a CUDA graph where NCCL is.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import addnorm
from weave_compile.ops.reference import _all_gather_rows, _group_size_rank, _pad_rows, _reduce_scatter_rows


def fused_allreduce_rmsnorm_nccl(
    x: torch.Tensor, residual: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    weight: Optional[torch.Tensor], *, eps: float, group_name: str, residual_dtype: torch.dtype,
    out_dtype: torch.dtype, mid_dtype: Optional[torch.dtype], weight_offset: float,
    residual_in_sharded: bool, residual_out_sharded: bool, num_ctas: int, scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed [T, H], residual_out [T, H] or this rank's [S, H] shard)`` for x [T, H]; collective."""
    world_size, rank = _group_size_rank(group_name)
    T, H = x.shape
    S = math.ceil(T / world_size)
    n_mine = max(0, min(S, T - rank * S))
    acc_in = _reduce_scatter_rows(_pad_rows(x, S * world_size), group_name, world_size)  # [S, H], x dtype
    if residual is not None and not residual_in_sharded:
        residual = residual[rank * S:rank * S + n_mine]
    normed_shard = torch.empty((S, H), dtype=out_dtype, device=x.device)
    res_shard = torch.empty((S, H), dtype=residual_dtype, device=x.device)
    if S > n_mine:  # padding rows are gathered (then cut): keep them finite
        normed_shard[n_mine:].zero_()
    addnorm.add_rmsnorm_rows(acc_in, None, residual, bias, weight, None if scale is None else scale.reshape(1),
                             normed_shard, res_shard, n_valid=n_mine, eps=eps, mid_dtype=mid_dtype,
                             weight_offset=weight_offset, num_ctas=num_ctas)
    normed = _all_gather_rows(normed_shard, group_name, world_size)[:T]
    if residual_out_sharded:
        return normed, res_shard
    return normed, _all_gather_rows(res_shard, group_name, world_size)[:T]
