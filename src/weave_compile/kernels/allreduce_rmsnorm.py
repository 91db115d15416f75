"""The fused ``weave::allreduce_add_rmsnorm`` op: its contract, reference implementation and oracle.

TokenWeave's first pillar. A tensor-parallel layer ends with ``all_reduce(x) (+ bias) + residual ->
RMSNorm``. Done as reduce-scatter over token rows -> add -> RMSNorm on this rank's rows ->
all-gather, the norm runs on 1/N of the tokens and the all-reduce's two halves bracket it.

Contract, per row (rows are the flattened leading dims of ``x``; ``x`` is this rank's partial sum)::

    acc    = sum_over_ranks(x_row).float() (* scale) (+ bias.float()) (+ residual_row.float())
    res    = acc.to(residual_dtype)                                 # -> residual_out
    r      = res.float()
    y      = r * rsqrt(mean(r * r) + eps)
    y      = y.to(mid_dtype).float()          if mid_dtype is not None   # HF Llama casts back first
    y      = y * (weight.float() + weight_offset)  if weight is not None  # offset 1.0: Gemma (1 + w)
    normed = y.to(out_dtype)

Rows are split into ``S = ceil(T / N)`` rows per rank (padded with zero rows); rank ``r`` owns
rows ``[r*S, (r+1)*S)``. A *sharded* residual is that ``[S, H]`` slice: with
``residual_in_sharded`` the op reads it instead of the full residual, with ``residual_out_sharded``
it returns only its slice (no gather), which lets consecutive fused sites keep the residual
stream sharded as TokenWeave does.

Implementations (``kernel`` argument, chosen at compile time by :func:`select_kernel`):
``reference`` (functional collectives: gloo on CPU, NCCL on GPU; the numerical oracle and the
fallback) and the symmetric-memory Triton kernels ``p2p`` / ``multimem`` in
``symm_mem_allreduce_rmsnorm.py``. ``allreduce_add_rmsnorm_ref`` is the float64 single-process
oracle used by tests.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)

KERNELS = ("reference", "p2p", "multimem")


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


def _num_rows(x: torch.Tensor):
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
    return rows


# ----------------------------------------------------------------------------- reference


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
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """RMSNorm of already-reduced rows, following the contract's cast order."""
    r = res.to(compute_dtype)
    y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).to(compute_dtype)
    if weight is not None:
        y = y * (weight.to(compute_dtype) + weight_offset)
    return y.to(out_dtype)


def reference_impl(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    eps: float,
    group_name: str,
    residual_dtype: torch.dtype,
    out_dtype: torch.dtype,
    mid_dtype: Optional[torch.dtype],
    weight_offset: float,
    residual_in_sharded: bool,
    residual_out_sharded: bool,
    scale: Optional[torch.Tensor] = None,
    eps_tensor: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce-scatter -> add -> RMSNorm on this rank's rows -> all-gather, with functional collectives."""
    world_size, rank = _group_size_rank(group_name)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    num_rows = rows.shape[0]
    per_rank = rows_per_rank(num_rows, world_size)
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
        normed = _all_gather_rows(normed_shard, group_name, world_size)[:num_rows]
        return normed.reshape(x.shape), res_shard
    if out_dtype == residual_dtype:
        # One gather for both outputs: half the collective launches of two gathers.
        both = _all_gather_rows(torch.cat([normed_shard, res_shard], dim=-1), group_name, world_size)
        both = both[:num_rows]
        # Clones: the two outputs must not share storage (custom-op aliasing rule).
        normed, residual_out = both[:, :hidden].clone(), both[:, hidden:].clone()
    else:
        normed = _all_gather_rows(normed_shard, group_name, world_size)[:num_rows]
        residual_out = _all_gather_rows(res_shard, group_name, world_size)[:num_rows]
    return normed.reshape(x.shape), residual_out.reshape(x.shape)


# ----------------------------------------------------------------------------- selection


def select_kernel(
    requested: str, device: torch.device, dtypes: tuple[torch.dtype, ...], hidden: int, group_name: str
) -> tuple[str, str]:
    """Pick the implementation at compile time; returns ``(kernel, reason)`` for the explain report.

    ``dtypes`` are the input's, the residual's and the output's. On CUDA this rendezvous-es a
    probe buffer on first use (collective): every rank compiles the same graphs, so every rank
    gets here together.
    """
    if requested == "reference":
        return "reference", "requested"
    if device.type != "cuda":
        return "reference", f"{device.type} tensors: only the collective-based reference runs there"
    try:
        from . import symm_mem_allreduce_rmsnorm as symm
    except Exception as e:  # triton or symmetric memory unavailable
        return "reference", f"symmetric-memory kernels unavailable ({type(e).__name__}: {e})"
    variant, reason = symm.select_symm_variant(group_name, device, dtypes[0], hidden)
    why = symm.check_hidden(hidden, dtypes[1:])  # the residual's and output's dtypes too
    if variant is not None and why:
        variant, reason = None, why
    if variant is None:
        return "reference", reason
    if requested == "auto":
        return variant, f"auto: {reason}"
    if requested == variant:
        return variant, "requested"
    if requested == "p2p" and variant == "multimem":
        return "p2p", "requested (multimem also available)"
    return "reference", f"requested {requested!r} unavailable: {reason}"


# ----------------------------------------------------------------------------- registered op


@torch.library.custom_op("weave::allreduce_add_rmsnorm", mutates_args=())
def allreduce_add_rmsnorm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    eps: float,
    group_name: str,
    residual_dtype: torch.dtype,
    out_dtype: torch.dtype,
    mid_dtype: Optional[torch.dtype],
    weight_offset: float,
    residual_in_sharded: bool,
    residual_out_sharded: bool,
    kernel: str,
    comm_ctas: int,
    scale: Optional[torch.Tensor] = None,
    eps_tensor: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of ``all_reduce(x) (*scale) (+bias) (+residual) -> RMSNorm``; see module doc.

    ``scale`` (a 0-d tensor, e.g. Gemma's embedding scale) multiplies the reduced sum. Like
    bias, residual and weight it must be the same on every rank (each row is computed on one
    rank). The symmetric-memory kernels do not take it: the pass selects ``reference`` there.

    ``eps_tensor`` (a 0-d tensor), when given, replaces ``eps``: under ``torch.compile(dynamic=True)``
    Dynamo turns the model's Python-float eps into a graph input. The symmetric-memory kernels
    read it on the host, so the pass passes them only a CPU one (no device sync).
    """
    args = (x, residual, bias, weight, eps, group_name, residual_dtype, out_dtype, mid_dtype,
            weight_offset, residual_in_sharded, residual_out_sharded, scale, eps_tensor)
    if eps_tensor is not None and kernel in ("p2p", "multimem"):
        eps = float(eps_tensor)
    if scale is not None and kernel in ("p2p", "multimem"):
        raise ValueError("weave::allreduce_add_rmsnorm: the symmetric-memory kernels take no scale")
    if kernel in ("p2p", "multimem") and x.is_cuda:
        from . import symm_mem_allreduce_rmsnorm as symm

        hidden = x.shape[-1]
        try:
            normed, residual_out = symm.fused_allreduce_rmsnorm_symm(
                x.reshape(-1, hidden),
                None if residual is None else (residual if residual_in_sharded else residual.reshape(-1, hidden)),
                None if bias is None else bias.reshape(hidden),
                None if weight is None else weight.reshape(hidden),
                eps=eps, group_name=group_name, residual_dtype=residual_dtype, out_dtype=out_dtype,
                mid_dtype=mid_dtype, weight_offset=weight_offset, residual_in_sharded=residual_in_sharded,
                residual_out_sharded=residual_out_sharded, num_ctas=comm_ctas, variant=kernel,
            )
        except symm.SymmCapacityError as e:
            # The workspace cannot grow inside CUDA-graph capture: the collective path can.
            _log_fallback_once(kernel, str(e))
        else:
            normed = normed.reshape(x.shape)
            return normed, (residual_out if residual_out_sharded else residual_out.reshape(x.shape))
    elif kernel not in KERNELS:
        raise ValueError(f"weave::allreduce_add_rmsnorm: unknown kernel {kernel!r}; valid: {KERNELS}")
    return reference_impl(*args)


@functools.lru_cache(maxsize=64)
def _log_fallback_once(kernel: str, reason: str) -> None:
    log.warning("weave::allreduce_add_rmsnorm: %s kernel fell back to reference: %s", kernel, reason)


@allreduce_add_rmsnorm.register_fake
def _(x, residual, bias, weight, eps, group_name, residual_dtype, out_dtype, mid_dtype,
      weight_offset, residual_in_sharded, residual_out_sharded, kernel, comm_ctas, scale=None, eps_tensor=None):
    normed = x.new_empty(x.shape, dtype=out_dtype)
    if residual_out_sharded:
        per_rank = rows_per_rank(_num_rows(x), group_size(group_name))
        return normed, x.new_empty((per_rank, x.shape[-1]), dtype=residual_dtype)
    return normed, x.new_empty(x.shape, dtype=residual_dtype)


# ----------------------------------------------------------------------------- float64 oracle


def allreduce_add_rmsnorm_ref(
    partials: list[torch.Tensor],
    residual: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process float64 reference of the contract from every rank's partial sum."""
    acc = torch.stack([p.double() for p in partials]).sum(0)
    if scale is not None:
        acc = acc * scale.double()
    if bias is not None:
        acc = acc + bias.double()
    if residual is not None:
        acc = acc + residual.double()
    y = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.double() + weight_offset)
    return y, acc


# ----------------------------------------------------------------------------- async form


_lib = torch.library.Library("weave", "FRAGMENT")
# The same schema as weave::allreduce_add_rmsnorm. Its kernels run one at a time on the comm
# stream, so both halves share the workspace's channel 0.
_lib.define(str(allreduce_add_rmsnorm._opoverload._schema)
            .replace("weave::allreduce_add_rmsnorm(", "allreduce_add_rmsnorm_start(", 1))


@torch.library.impl("weave::allreduce_add_rmsnorm_start", "CompositeExplicitAutograd", lib=_lib)
def allreduce_add_rmsnorm_start(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``weave::allreduce_add_rmsnorm`` launched on the communication stream (the split schedule's form).

    Same arguments and results, but on CUDA the work is enqueued on
    :func:`weave_compile.streams.comm_stream` after everything already enqueued on the current
    stream, and the results are valid on the current stream only after the matching
    ``weave::comm_wait``. The graph passes ``x`` and ``residual`` to that wait as well, so their
    memory is not reused while the communication stream may still read it. On CPU it runs
    synchronously (gloo is blocking) and the wait is a no-op.
    """
    x = args[0]
    if not x.is_cuda:
        return allreduce_add_rmsnorm(*args)
    from weave_compile import streams

    current = torch.cuda.current_stream(x.device)
    with torch.cuda.stream(streams.fork(x.device)):
        normed, residual_out = allreduce_add_rmsnorm(*args)
    streams.mark_done(normed)
    # Allocated on the comm stream, freed by code on the current one: tell the allocator.
    normed.record_stream(current)
    residual_out.record_stream(current)
    return normed, residual_out


@torch.library.register_fake("weave::allreduce_add_rmsnorm_start", lib=_lib)
def _(*args):
    return torch.ops.weave.allreduce_add_rmsnorm.default(*args)


@torch.library.custom_op("weave::comm_wait", mutates_args=("normed", "residual_out"))
def comm_wait(normed: torch.Tensor, residual_out: torch.Tensor, keep_alive: list[torch.Tensor]) -> None:
    """Make the current stream wait for the start op that produced ``normed`` (only for it).

    Declared as writing ``normed`` and ``residual_out`` so that the compiler orders every reader
    of the results after it; ``keep_alive`` (the start's inputs) holds their memory until here.
    """
    if normed.is_cuda:
        from weave_compile import streams

        streams.join(normed)


@comm_wait.register_fake
def _(normed, residual_out, keep_alive):
    return None
