"""The ``reference`` implementation of ``weave::allreduce_add_rmsnorm`` and its float64 oracle.

:func:`reference_impl` is reduce-scatter over token rows -> add -> RMSNorm on this rank's rows ->
all-gather, with functional collectives (gloo on CPU, NCCL on GPU). It runs wherever a process
group does, takes every argument of the op (a scale, an eps tensor, a LayerNorm), and is what
every other implementation falls back to. With ``batch_invariant`` the reduce-scatter is an
all-to-all and the partial sums are added in rank order in fp32
(:func:`weave_compile.rows.ordered_sum_rows`); the claim holds on CPU ranks (tested), not on GPUs:
there the norm's mean (and the fp8 quant's amax) are torch's CUDA reductions, whose thread layout
per row follows the number of rows (``ATen/native/cuda/Reduce.cuh``: the threads a row gets shrink
as rows are added), so a row may round differently in another batch; ``nccl`` is the GPU's
invariant path (:data:`INVARIANT_WHY`).

:func:`allreduce_add_rmsnorm_ref` is the one float64 oracle of the op's contract (see
``ops/allreduce_rmsnorm.py``), computed in one process from every rank's partial
sum. Every test of the op, of its implementations and of the passes compares against it.
"""

from __future__ import annotations

from typing import Optional

import torch

from weave_compile.quant import gathered_outputs
from weave_compile.rows import (all_gather_rows, group_size_rank, norm_rows, ordered_sum_rows, pad_rows,
                                reduce_scatter_rows, rows_per_rank)

from .registry import Implementation
from .spec import FusedSpec, Rows


def reference_impl(rows: Rows, spec: FusedSpec) -> tuple[torch.Tensor, ...]:
    """Reduce-scatter -> add -> RMSNorm (or LayerNorm) (-> fp8) on this rank's rows -> all-gather;
    outputs as rows."""
    world_size, rank = group_size_rank(spec.group_name)
    x = rows.x
    total, hidden = x.shape
    per_rank = rows_per_rank(total, world_size)
    padded = per_rank * world_size

    if spec.batch_invariant:
        acc = ordered_sum_rows(pad_rows(x, padded), spec.group_name, world_size)
    else:
        acc = reduce_scatter_rows(pad_rows(x, padded), spec.group_name, world_size).float()
    if rows.scale is not None:
        acc = acc * rows.scale.float()
    if rows.bias is not None:
        acc = acc + rows.bias.float()
    if rows.residual is not None:
        if spec.residual_in_sharded:
            res_rows = rows.residual
        else:
            res_rows = pad_rows(rows.residual, padded)[rank * per_rank:(rank + 1) * per_rank]
        acc = acc + res_rows.float()
    res_shard = acc.to(spec.residual_dtype)
    normed_shard = norm_rows(res_shard, rows.weight, rows.eps(spec), spec.out_dtype, spec.mid_dtype, spec.weight_offset,
                             spec.norm, rows.norm_bias)
    if spec.quant is not None:  # the normed rows move as fp8 codes and row scales
        return gathered_outputs(normed_shard, res_shard, spec.quant, rows.quant_scale, spec.residual_out_sharded,
                                spec.group_name, world_size, total)

    if spec.residual_out_sharded:
        return all_gather_rows(normed_shard, spec.group_name, world_size)[:total], res_shard
    if spec.out_dtype == spec.residual_dtype:
        # One gather for both outputs: half the collective launches of two gathers.
        both = all_gather_rows(torch.cat([normed_shard, res_shard], dim=-1), spec.group_name, world_size)[:total]
        # Clones: the two outputs must not share storage (custom-op aliasing rule).
        return both[:, :hidden].clone(), both[:, hidden:].clone()
    return (all_gather_rows(normed_shard, spec.group_name, world_size)[:total],
            all_gather_rows(res_shard, spec.group_name, world_size)[:total])


#: Why ``reference`` is not batch-invariant on GPUs (explain() and the errors say it).
INVARIANT_WHY = ("on a GPU its norm is torch's CUDA reductions, whose layout per row follows the row count; "
                 "nccl reduces a row alike at every token count")

IMPLEMENTATION = Implementation(
    "reference", "reduce-scatter, add + RMSNorm or LayerNorm on this rank's rows, all-gather (functional collectives)",
    lambda site: None, reference_impl, takes_scale=True, takes_eps_tensor=True, takes_layernorm=True, fallback=True,
    batch_invariant=True, batch_invariant_on=("cpu",), batch_invariant_why=INVARIANT_WHY, takes_quant=True)


# ----------------------------------------------------------------------------- float64 oracle


def allreduce_add_rmsnorm_ref(
    partials: list[torch.Tensor],
    residual: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    scale: Optional[torch.Tensor] = None,
    residual_dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
    mid_dtype: Optional[torch.dtype] = None,
    norm: str = "rmsnorm",
    norm_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's contract in float64, from every rank's partial sum (``partials``, each ``[..., H]``).

    ``residual`` is the full (unsharded) residual. Returns ``(normed, residual_out)`` as every
    rank sees them after the gather: ``normed`` in ``out_dtype`` (default: the partials' dtype),
    ``residual_out`` in ``residual_dtype`` (default: the residual's dtype, else the partials').
    Everything is computed in float64 and rounded only where the contract rounds. ``norm``:
    ``"rmsnorm"`` or ``"layernorm"`` (the centred row's mean square as the variance);
    ``norm_bias`` is added after the weight.
    """
    if not partials:
        raise ValueError("allreduce_add_rmsnorm_ref: partials must hold one tensor per rank")
    in_dtype = partials[0].dtype
    residual_dtype = residual_dtype or (residual.dtype if residual is not None else in_dtype)
    out_dtype = out_dtype or in_dtype
    acc = torch.stack([p.to(torch.float64) for p in partials]).sum(0)
    if scale is not None:
        acc = acc * scale.to(torch.float64)
    if bias is not None:
        acc = acc + bias.to(torch.float64)
    if residual is not None:
        acc = acc + residual.to(torch.float64)
    res = acc.to(residual_dtype)
    r = res.to(torch.float64)
    if norm == "layernorm":
        r = r - r.mean(dim=-1, keepdim=True)
    elif norm != "rmsnorm":
        raise ValueError(f"allreduce_add_rmsnorm_ref: norm must be 'rmsnorm' or 'layernorm', got {norm!r}")
    y = r * torch.rsqrt((r * r).mean(dim=-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).to(torch.float64)
    if weight is not None:
        y = y * (weight.to(torch.float64) + weight_offset)
    if norm_bias is not None:
        y = y + norm_bias.to(torch.float64)
    return y.to(out_dtype), res
