"""The collective-based implementation of ``weave::allreduce_add_rmsnorm`` and its float64 oracle.

:func:`reference_impl` is the op's ``reference`` kernel: reduce-scatter over token rows -> add ->
RMSNorm on this rank's rows -> all-gather, with functional collectives (gloo on CPU, NCCL on
GPU). It is the fallback wherever the symmetric-memory kernels cannot run.

:func:`allreduce_add_rmsnorm_ref` is the one float64 oracle of the op's contract (see
:mod:`weave_compile.ops.allreduce_rmsnorm`), computed in one process from every rank's partial
sum. Every test of the op, of its kernels and of the passes compares against it.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch


# ----------------------------------------------------------------------------- group helpers


@functools.lru_cache(maxsize=None)
def _group_size_rank(group_name: str) -> tuple[int, int]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    return pg.size(), pg.rank()


def group_size(group_name: str) -> int:
    return _group_size_rank(group_name)[0]


def rows_per_rank(num_rows, world_size: int):
    """Rows each rank owns: ``ceil(T / N)``; works on SymInts."""
    return (num_rows + world_size - 1) // world_size


def num_rows(x: torch.Tensor):
    """The flattened leading dims of ``x`` (its token rows); works on SymInts."""
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    return rows


# ----------------------------------------------------------------------------- collective reference


def _reduce_scatter_rows(rows: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    out = torch.ops._c10d_functional.reduce_scatter_tensor(rows, "sum", world_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _all_gather_rows(rows: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    out = torch.ops._c10d_functional.all_gather_into_tensor(rows.contiguous(), world_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def _pad_rows(rows: torch.Tensor, padded: int) -> torch.Tensor:
    if rows.shape[0] == padded:
        return rows.contiguous()
    return torch.nn.functional.pad(rows, (0, 0, 0, padded - rows.shape[0]))


def norm_rows(
    res: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    out_dtype: torch.dtype,
    mid_dtype: Optional[torch.dtype],
    weight_offset: float,
) -> torch.Tensor:
    """RMSNorm of already-reduced rows in float32, following the contract's cast order."""
    r = res.float()
    y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).float()
    if weight is not None:
        y = y * (weight.float() + weight_offset)
    return y.to(out_dtype)


def reference_impl(x, residual, bias, weight, eps, group_name, residual_dtype, out_dtype, mid_dtype, weight_offset,
                   residual_in_sharded, residual_out_sharded, scale=None,
                   eps_tensor=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce-scatter -> add -> RMSNorm on this rank's rows -> all-gather, with functional collectives.

    The op's arguments less ``kernel`` and ``comm_ctas`` (types and meaning:
    ``weave_compile.ops.allreduce_rmsnorm._arguments``, their one definition).
    """
    world_size, rank = _group_size_rank(group_name)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    total = rows.shape[0]
    per_rank = rows_per_rank(total, world_size)
    padded = per_rank * world_size

    acc = _reduce_scatter_rows(_pad_rows(rows, padded), group_name, world_size).float()
    if scale is not None:
        acc = acc * scale.float()
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None:
        if residual_in_sharded:
            res_rows = residual
        else:
            res_rows = _pad_rows(residual.reshape(-1, hidden), padded)[rank * per_rank : (rank + 1) * per_rank]
        acc = acc + res_rows.float()
    res_shard = acc.to(residual_dtype)
    normed_shard = norm_rows(res_shard, weight, eps if eps_tensor is None else eps_tensor, out_dtype, mid_dtype,
                             weight_offset)

    if residual_out_sharded:
        normed = _all_gather_rows(normed_shard, group_name, world_size)[:total]
        return normed.reshape(x.shape), res_shard
    if out_dtype == residual_dtype:
        # One gather for both outputs: half the collective launches of two gathers.
        both = _all_gather_rows(torch.cat([normed_shard, res_shard], dim=-1), group_name, world_size)
        both = both[:total]
        # Clones: the two outputs must not share storage (custom-op aliasing rule).
        normed, residual_out = both[:, :hidden].clone(), both[:, hidden:].clone()
    else:
        normed = _all_gather_rows(normed_shard, group_name, world_size)[:total]
        residual_out = _all_gather_rows(res_shard, group_name, world_size)[:total]
    return normed.reshape(x.shape), residual_out.reshape(x.shape)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's contract in float64, from every rank's partial sum (``partials``, each ``[..., H]``).

    ``residual`` is the full (unsharded) residual. Returns ``(normed, residual_out)`` as every
    rank sees them after the gather: ``normed`` in ``out_dtype`` (default: the partials' dtype),
    ``residual_out`` in ``residual_dtype`` (default: the residual's dtype, else the partials').
    Everything is computed in float64 and rounded only where the contract rounds.
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
    y = r * torch.rsqrt((r * r).mean(dim=-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).to(torch.float64)
    if weight is not None:
        y = y * (weight.to(torch.float64) + weight_offset)
    return y.to(out_dtype), res
