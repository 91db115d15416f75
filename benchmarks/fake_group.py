"""One GPU as rank 0 of a tensor-parallel group: PyTorch's fake process group, and the fused op's
collectives as that group gives them to plain Inductor.

:func:`init` starts ``dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)``:
this process builds and runs rank 0's shard of a TP model, and every collective returns at once
without moving data. What it returns differs by collective: an all_reduce (in place, or the
functional one, which reduces a copy in place) leaves its input as it is, so plain Inductor's
graph sees ``all_reduce(x) == x``; a reduce-scatter or an all-gather leaves its output as the
allocator handed it out, so the fused op's output rows (and whatever is computed from them) are
undefined. Timings do not care; token equality between two compiled models does.

:func:`identity_collectives` makes the comparison sound. While inside, the GPU fallback ``nccl``
computes what the site as written computes under the fake group's all_reduce: the reduced sum is
this rank's partial sum unchanged, and every row is normalized here by the shared add+norm
kernel, the residual kept in the layout the graph asks for (its shard is rank 0's rows). Both
compiled models then see the same, deterministic collective results, so equal tokens prove that
the rewritten graph (fused sites, residual sharding, the op's dispatch, CUDA graphs, the static
cache) computes the function the written graph computes; they say nothing of communication across
ranks (the CPU gloo tests and the 2-GPU runs do). A residual already sharded into the site holds
only rank 0's rows, so beyond ``ceil(T / N)`` tokens the other rows are not here: the mode raises
there (batch-1 decode, T = 1, is inside it; so is any site whose residual is not sharded).

Benchmarks only: it swaps a registry entry of the package for the ``with`` block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Iterator

import torch
import torch.distributed as dist

from weave_compile.kernels import registry
from weave_compile.kernels.shared import addnorm
from weave_compile.kernels.spec import FusedSpec, Rows
from weave_compile.rows import group_size_rank

GPU_FALLBACK = "nccl"


def init(world_size: int = 2, device: int = 0) -> torch.device:
    """Rank 0 of a fake process group of ``world_size`` on CUDA device ``device`` (one process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("the fake process group runs in ONE process on one GPU; do not use torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
        return torch.device("cuda", device)
    return torch.device("cpu")


class OutsideIdentityMode(RuntimeError):
    """The site needs rows that are not on rank 0 (a sharded residual with more than ``ceil(T/N)`` rows)."""


def identity_run(rows: Rows, spec: FusedSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The site as written under the fake group's all_reduce (module doc), on every row."""
    world, rank = group_size_rank(spec.group_name)
    x, residual = rows.x, rows.residual
    T, H = x.shape
    S = math.ceil(T / world)
    if rank != 0:
        raise OutsideIdentityMode(f"identity collectives run as rank 0 of a fake group, not rank {rank}")
    if residual is not None and spec.residual_in_sharded:
        if T > S:
            raise OutsideIdentityMode(f"a sharded residual holds rank 0's {S} of {T} rows only: compare at "
                                      f"T <= ceil(T / {world}) (batch-1 decode) or without a sharded residual")
        residual = residual[:T]
    normed = torch.empty((T, H), dtype=spec.out_dtype, device=x.device)
    res = torch.empty((T, H), dtype=spec.residual_dtype, device=x.device)
    addnorm.add_rmsnorm_rows(x, None, residual, rows.bias, rows.weight,
                             None if rows.scale is None else rows.scale.reshape(1), normed, res, n_valid=T,
                             eps=rows.eps(spec), mid_dtype=spec.mid_dtype, weight_offset=spec.weight_offset,
                             num_ctas=addnorm.ctas_for(spec, T))
    if not spec.residual_out_sharded:
        return normed, res
    shard = res.new_zeros((S, H))
    shard[:min(S, T)] = res[:min(S, T)]
    return normed, shard


@contextlib.contextmanager
def identity_collectives() -> Iterator[None]:
    """The GPU fallback computes with the fake group's all_reduce semantics while inside (module doc).
    Compile and run the compared model inside: CUDA graphs record what runs at capture."""
    original = registry.replace(dataclasses.replace(registry.get(GPU_FALLBACK), run=identity_run))
    try:
        yield
    finally:
        registry.replace(original)
