"""``nccl``: NCCL reduce-scatter, the shared few-CTA add+norm kernel, NCCL all-gather.

The baseline the overlap designs are measured against: the collectives are NCCL's (on its own
stream, ordered after the current one, with NCCL's own few SMs) and the local work is the shared
add+norm kernel of :mod:`weave_compile.kernels.shared.addnorm` instead of the reference's chain
of torch ops. Same contract as every implementation, ``scale`` included. Under the split
schedule the start op runs it on the comm stream, as it runs every implementation.

The fallback on GPUs (``gpu_fallback``): where the design chosen for a CUDA site cannot run, at
compile time or at run time, this runs instead of ``reference``, whose eager chain inside a
compiled graph measured well slower than plain Inductor (docs/performance.md section 8).
Whether a site gets it or stays as written is :mod:`weave_compile.kernels.auto`'s decision.

With ``batch_invariant`` the reduce-scatter is an all-to-all (the same bytes) and the partial sums
are added in rank order in fp32, then rounded once to x's dtype (one more elementwise pass over
the rows); the rest of a row is computed alike for every row (on CPU ranks checked bitwise:
``tests/kernels/test_batch_invariant.py``; on a GPU, the add+norm kernel at the launch shape each
T selects, on fake groups of 3 and 4 ranks: ``tests/benchmarks/test_bench_batch_invariant_gpu.py``).

Functional collectives carry it, so it also runs on gloo (CPU tests; the add+norm then uses its
torch path) and is capturable in a CUDA graph where NCCL is.

LayerNorm (``takes_layernorm``): the add+norm kernel's LayerNorm variant computes it on GPUs (the
centred row's mean square as the variance, the norm bias after the weight; the RMSNorm kernel is
compiled as before), its torch path on CPU ranks; a LayerNorm site is taken wherever an RMSNorm
one is.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from weave_compile.quant import gather_quantized
from weave_compile.rows import (all_gather_rows, group_size_rank, ordered_sum_rows, pad_rows, reduce_scatter_rows,
                                rows_of_rank)

from .registry import Implementation, Site
from .shared import addnorm
from .spec import FusedSpec, Rows


def fused_allreduce_rmsnorm_nccl(rows: Rows, spec: FusedSpec) -> tuple[torch.Tensor, ...]:
    """``(normed [T, H], residual_out [T, H] or this rank's [S, H] shard)`` (with an fp8 epilogue:
    the fp8 rows first and the row scales third, quantized by the add+norm kernel); collective."""
    world_size, rank = group_size_rank(spec.group_name)
    x, residual = rows.x, rows.residual
    T, H = x.shape
    S = math.ceil(T / world_size)
    n_mine = rows_of_rank(T, S, rank)
    if spec.batch_invariant:  # rank order in fp32, rounded once to x's dtype: the add+norm reads it as it is
        acc_in = ordered_sum_rows(pad_rows(x, S * world_size), spec.group_name, world_size).to(x.dtype)
    else:
        acc_in = reduce_scatter_rows(pad_rows(x, S * world_size), spec.group_name, world_size)  # [S, H], x dtype
    if residual is not None and not spec.residual_in_sharded:
        residual = residual[rank * S:rank * S + n_mine]
    quant = spec.quant
    normed_shard = torch.empty((S, H), dtype=spec.out_dtype if quant is None else quant.dtype, device=x.device)
    res_shard = torch.empty((S, H), dtype=spec.residual_dtype, device=x.device)
    row_scales = None
    if quant is not None:  # fp8 codes and their row scales out of the kernel (empty scales: a static one)
        row_scales = torch.empty((S, 1) if quant.kind == "row" else (0,), dtype=torch.float32, device=x.device)
    if S > n_mine:  # padding rows are gathered (then cut): keep them finite
        normed_shard[n_mine:].view(torch.uint8 if quant is not None else normed_shard.dtype).zero_()
        if row_scales is not None and row_scales.numel():
            row_scales[n_mine:].fill_(1.0)
    addnorm.add_rmsnorm_rows(acc_in, None, residual, rows.bias, rows.weight,
                             None if rows.scale is None else rows.scale.reshape(1), normed_shard, res_shard,
                             n_valid=n_mine, eps=rows.eps(spec), mid_dtype=spec.mid_dtype,
                             weight_offset=spec.weight_offset, num_ctas=addnorm.ctas_for(spec),
                             norm=spec.norm, norm_bias=rows.norm_bias, quant=quant,
                             quant_scale=None if rows.quant_scale is None else rows.quant_scale.reshape(1),
                             row_scales=row_scales, out_dtype=spec.out_dtype)
    if quant is not None:  # gathered as fp8 codes and row scales
        return gather_quantized(normed_shard, row_scales, res_shard, spec.residual_out_sharded, spec.group_name,
                                world_size, T)
    normed = all_gather_rows(normed_shard, spec.group_name, world_size)[:T]
    if spec.residual_out_sharded:
        return normed, res_shard
    return normed, all_gather_rows(res_shard, spec.group_name, world_size)[:T]


def _check(site: Site) -> Optional[str]:
    return addnorm.unavailable_reason(site.device, (site.dtype, site.residual_dtype, site.out_dtype), site.hidden)


IMPLEMENTATION = Implementation(
    "nccl", "NCCL reduce-scatter, the few-CTA add+norm kernel, NCCL all-gather (the overlap baseline)",
    _check, fused_allreduce_rmsnorm_nccl, takes_scale=True, takes_eps_tensor=True, takes_layernorm=True,
    gpu_fallback=True, batch_invariant=True, takes_quant=True)
