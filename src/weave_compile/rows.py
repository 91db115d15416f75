"""Token rows across a process group: who owns which rows, and the collectives that move them.

The fused op's contract (:mod:`weave_compile.ops.allreduce_rmsnorm`) splits the ``T`` token rows
(the flattened leading dims of ``x``) into ``S = ceil(T / N)`` rows per rank, padded with zero
rows; rank ``r`` owns rows ``[r*S, (r+1)*S)``. These helpers are that bookkeeping, the
reduce-scatter / all-gather of rows with functional collectives (gloo on CPU, NCCL on GPU) and
the RMSNorm or LayerNorm of already-reduced rows in torch ops. The op layer and every implementation in
:mod:`weave_compile.kernels` use them; this module imports neither.
"""

from __future__ import annotations

from typing import Optional

import torch


def group_size_rank(group_name: str) -> tuple[int, int]:
    """``(world size, this rank)`` of the process group registered as ``group_name`` now.

    Resolved on every call, never cached by name: names restart at "0" once the groups are
    destroyed, so a process that creates its groups again (another world size, another rank)
    would read the old group's values and compute wrong rows without an error."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    return pg.size(), pg.rank()


def group_size(group_name: str) -> int:
    return group_size_rank(group_name)[0]


def rows_per_rank(num_rows, world_size: int):
    """Rows each rank owns: ``ceil(T / N)``; works on SymInts."""
    return (num_rows + world_size - 1) // world_size


def num_rows(x: torch.Tensor):
    """The flattened leading dims of ``x`` (its token rows); works on SymInts."""
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    return rows


def rows_of_rank(num_tokens: int, per_rank: int, rank: int) -> int:
    """How many of rank ``rank``'s ``per_rank`` rows are real (the rest pad ``T`` to ``S * N``)."""
    return max(0, min(per_rank, num_tokens - rank * per_rank))


def pad_rows(rows: torch.Tensor, padded: int) -> torch.Tensor:
    """``rows`` [T, H] with zero rows appended up to ``padded`` rows (contiguous)."""
    if rows.shape[0] == padded:
        return rows.contiguous()
    return torch.nn.functional.pad(rows, (0, 0, 0, padded - rows.shape[0]))


def reduce_scatter_rows(rows: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """This rank's ``[S, H]`` slice of the sum over ranks of ``rows`` [S * N, H]."""
    out = torch.ops._c10d_functional.reduce_scatter_tensor(rows, "sum", world_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def ordered_sum_rows(rows: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """This rank's ``[S, H]`` slice of the sum over ranks of ``rows`` [S * N, H], added in rank
    order (0, 1, ..., N-1) in float32: an all-to-all brings every rank's partial rows of this
    rank's slice (the bytes of a reduce-scatter), then the same additions run for every row, so a
    row's sum does not depend on the token count, the other rows or the rank that owns it (a
    reduce-scatter's order may: NCCL's and gloo's algorithms change with the message and the
    owner)."""
    S = rows.shape[0] // world_size
    split = [S] * world_size
    out = torch.ops._c10d_functional.all_to_all_single(rows.contiguous(), split, split, group_name)
    parts = torch.ops._c10d_functional.wait_tensor(out).view(world_size, S, *rows.shape[1:])
    acc = parts[0].float()
    for j in range(1, world_size):
        acc = acc + parts[j].float()
    return acc


def all_gather_rows(rows: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Every rank's ``rows`` [S, H], stacked in rank order: [S * N, H]."""
    out = torch.ops._c10d_functional.all_gather_into_tensor(rows.contiguous(), world_size, group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


#: The norms the fused op computes (its ``norm`` argument): RMSNorm, and LayerNorm (the row's mean
#: subtracted, the variance taken of the centred row).
NORMS = ("rmsnorm", "layernorm")


def norm_rows(
    res: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps,
    out_dtype: torch.dtype,
    mid_dtype: Optional[torch.dtype],
    weight_offset: float,
    norm: str = "rmsnorm",
    norm_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """RMSNorm (or LayerNorm: ``norm="layernorm"``) of already-reduced rows in float32, following
    the contract's cast order; ``norm_bias`` is added after the weight.

    ``eps`` is a number or a 0-d tensor. The LayerNorm's variance is the mean of the centred row's
    squares (two passes over the row), not E[x^2] - mean^2, which cancels where the mean is large
    against the spread."""
    r = res.float()
    if norm == "layernorm":
        r = r - r.mean(-1, keepdim=True)
    elif norm != "rmsnorm":
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).float()
    if weight is not None:
        y = y * (weight.float() + weight_offset)
    if norm_bias is not None:
        y = y + norm_bias.float()
    return y.to(out_dtype)
