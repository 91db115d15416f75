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

Timings read real rows: :func:`written_collectives` (on from :func:`init`) makes the fake group's
reduce-scatter and all-gather write every row of their outputs. Left to the fake group they write
none, so the GEMMs after them read whatever the allocator handed out, often zeros, and a GEMM runs
faster on zeros than on real values (one H100, bf16 [T x 4096] @ [4096 x 14336]: 0.85x the time at
T=4096, 0.94x at 1024; freshly allocated memory 0.83-0.93x): a comparison with a variant that reads
real rows (plain Inductor's all_reduce, which the fake group leaves as its input) was biased by up
to that much. Written, each collective gives rank 0's view of the fake all_reduce: the reduce-
scatter this rank's rows of its input (the sum is this rank's partial, as above), the all-gather
this rank's rows in every rank's place. The cost is a copy of what the real collective writes into
this GPU's memory (S or N x S rows), timed with the variant (the gather copies words, so its
element count goes with the bytes: :func:`as_words`); plain Inductor's all_reduce copies its input
the same way (Inductor clones it before the in-place collective).

Benchmarks only: it swaps a registry entry of the package for the ``with`` block, and registers
CPU and CUDA kernels for torch's functional collectives while written collectives are on.
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
#: What :func:`init` keeps entered for the life of the process.
_PROCESS = contextlib.ExitStack()


def init(world_size: int = 2, device: int = 0, written: bool = True) -> torch.device:
    """Rank 0 of a fake process group of ``world_size`` on CUDA device ``device`` (one process),
    its collectives written (:func:`written_collectives`) for the rest of the process unless
    ``written`` is False."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("the fake process group runs in ONE process on one GPU; do not use torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    if written:
        _PROCESS.enter_context(written_collectives())
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
        return torch.device("cuda", device)
    return torch.device("cpu")


def each_world(worlds):
    """``(world size, device, group name)`` of a fake group of each size in ``worlds`` in turn (this
    process rank 0 of each; the written collectives entered with the first, for the process), each
    group destroyed once its iteration is done."""
    for i, world in enumerate(worlds):
        dev = init(world, written=i == 0)
        try:
            yield world, dev, dist.group.WORLD.group_name
        finally:
            dist.destroy_process_group()


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
                             num_ctas=addnorm.ctas_for(spec), norm=spec.norm, norm_bias=rows.norm_bias)
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


# ----------------------------------------------------------------------------- written collectives


def _this_rank(group_name) -> int:
    """This process's rank in ``group_name`` (a name or a ProcessGroup), which must be a fake group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name) if isinstance(group_name, str) else group_name
    if dist.get_backend(group) != "fake":
        raise RuntimeError(f"fake_group.written_collectives: group {group_name!r} is {dist.get_backend(group)!r}, "
                           "not a fake process group; leave the block to run real collectives")
    return dist.get_rank(group)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as the widest integer elements (8, 4 or 2 bytes) its rows divide into, or ``t``.

    The written all-gather copies its input broadcast N times, a strided copy whose time follows
    its element count: one H100 copied 4 MB of one-byte fp8 codes no faster than 8 MB of bf16 rows
    (8.4 us at H=4096, T=1024, 8 ranks; ``benchmarks/fp8_kernels.py``), where the collective it
    stands for moves bytes. As words the element count goes with the bytes."""
    if t.dim() == 0 or not t.is_contiguous():
        return t
    for dt in (torch.int64, torch.int32, torch.int16):
        size = dt.itemsize
        if t.element_size() < size and (t.shape[-1] * t.element_size()) % size == 0 \
                and (t.storage_offset() * t.element_size()) % size == 0:
            return t.view(dt)
    return t


def _gather_into(inp: torch.Tensor, group_size: int, group_name, out: torch.Tensor) -> torch.Tensor:
    _this_rank(group_name)
    words, out_words = as_words(inp), as_words(out)
    if words.dtype != out_words.dtype:
        words, out_words = inp, out
    out_words.view(group_size, *words.shape).copy_(words.unsqueeze(0).expand(group_size, *words.shape))
    return out


def _scatter_into(inp: torch.Tensor, group_size: int, group_name, out: torch.Tensor) -> torch.Tensor:
    rows = inp.shape[0] // group_size
    rank = _this_rank(group_name)
    out.copy_(inp[rank * rows:(rank + 1) * rows])
    return out


def _all_gather(inp, group_size, group_name):
    return _gather_into(inp, group_size, group_name, inp.new_empty((group_size * inp.shape[0], *inp.shape[1:])))


def _all_gather_out(inp, group_size, group_name, *, out):
    return _gather_into(inp, group_size, group_name, out)


def _reduce_scatter(inp, reduce_op, group_size, group_name):
    out = inp.new_empty((inp.shape[0] // group_size, *inp.shape[1:]))
    return _scatter_into(inp, group_size, group_name, out)


def _reduce_scatter_out(inp, reduce_op, group_size, group_name, *, out):
    return _scatter_into(inp, group_size, group_name, out)


def _all_to_all_single(inp, output_split_sizes, input_split_sizes, group_name):
    """Every peer's block of this rank's slice is this rank's own block (``batch_invariant``'s
    all-to-all: the rank-order sum then adds N copies of this rank's partial rows)."""
    rank = _this_rank(group_name)
    starts = [sum(input_split_sizes[:j]) for j in range(len(input_split_sizes))]
    mine = inp[starts[rank]:starts[rank] + input_split_sizes[rank]]
    return torch.cat([mine[:n] for n in output_split_sizes]) if output_split_sizes else inp.new_empty((0,))


#: torch's functional collectives (``_c10d_functional``, what compiled graphs and the fused op's
#: ``nccl`` and ``reference`` call) that the fake group leaves unwritten, and what writes them here.
WRITTEN = {"all_gather_into_tensor": _all_gather, "all_gather_into_tensor_out": _all_gather_out,
           "reduce_scatter_tensor": _reduce_scatter, "reduce_scatter_tensor_out": _reduce_scatter_out,
           "all_to_all_single": _all_to_all_single}


@contextlib.contextmanager
def written_collectives() -> Iterator[None]:
    """While inside, the fake group's reduce-scatter and all-gather write every row of their outputs
    (module doc): kernels of their own on the CPU and CUDA dispatch keys, ahead of torch's
    device-generic one, removed at the end. Only fake groups: another group's collective raises."""
    lib = torch.library.Library("_c10d_functional", "IMPL")
    try:
        for name, fn in WRITTEN.items():
            for key in ("CPU", "CUDA"):
                lib.impl(name, fn, key)
        yield
    finally:
        lib._destroy()
