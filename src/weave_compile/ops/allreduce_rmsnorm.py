"""The fused ``weave::allreduce_add_rmsnorm`` op, its async form and ``weave::comm_wait``.

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

The arguments are defined once, by :func:`_arguments`; both ops get that schema
(:data:`SCHEMA`), and :data:`ARG_NAMES` names them for the passes, which build and rewrite the
ops by name (``weave_compile.passes.graph_utils.call_named`` / ``named_args`` / ``replace_args``).

Implementations (``kernel`` argument, chosen at compile time by
:func:`weave_compile.ops.selection.select_kernel`): ``reference``
(:func:`weave_compile.ops.reference.reference_impl`; functional collectives, the fallback) and
the symmetric-memory Triton kernels ``p2p`` / ``multimem`` of :mod:`weave_compile.kernels`.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Optional

import torch

from .reference import group_size, num_rows, reference_impl, rows_per_rank
from .selection import KERNELS, NO_SCALE_KERNELS, SYMM_KERNELS, symm_kernels

log = logging.getLogger(__name__)


def _arguments(
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
    out_slot: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one definition of the fused op's arguments (never called).

    ``scale`` (a 0-d tensor, e.g. Gemma's embedding scale) multiplies the reduced sum. Like
    bias, residual and weight it must be the same on every rank (each row is computed on one
    rank). The symmetric-memory kernels do not take it: the pass selects ``reference`` there.
    ``kernel`` is one of :data:`KERNELS`; ``comm_ctas`` the thread blocks the kernels may use.
    ``eps_tensor`` (a 0-d tensor), when given, replaces ``eps``: under ``torch.compile(dynamic=True)``
    Dynamo turns a model's Python-float eps into a graph input. The symmetric-memory kernels read
    it on the host, so the pass gives them only a CPU one (no device sync).
    ``out_slot`` >= 0 lets the ``p2p`` kernel leave ``normed`` in that slot of the group's
    symmetric output ring instead of copying the peers' rows out: the result is then a view of
    memory the next call on that slot overwrites (on every rank), which is only correct where
    :mod:`weave_compile.passes.output_in_place` proved every reader runs before that call. -1 (and
    every other kernel): a fresh tensor.
    """
    raise NotImplementedError


_SIGNATURE = inspect.signature(_arguments)
#: ``(Tensor x, Tensor? residual, ...) -> (Tensor, Tensor)``: both ops' schema.
SCHEMA = torch.library.infer_schema(_arguments, mutates_args=())
#: The arguments in schema order.
ARG_NAMES = tuple(_SIGNATURE.parameters)


def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name, defaults filled in."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _fused(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(normed, residual_out)`` of ``all_reduce(x) (*scale) (+bias) (+residual) -> RMSNorm``; see module doc."""
    a = bind(args, kwargs)
    kernel = a.pop("kernel")
    comm_ctas = a.pop("comm_ctas")
    out_slot = a.pop("out_slot")
    if kernel != "reference":
        # Only the reference takes a tensor eps; the kernels get a CPU 0-d one (the pass sees to
        # it), read on the host with no device sync.
        eps_tensor = a.pop("eps_tensor")
        if eps_tensor is not None:
            a["eps"] = float(eps_tensor)
    if kernel not in KERNELS:
        raise ValueError(f"weave::allreduce_add_rmsnorm: unknown kernel {kernel!r}; valid: {KERNELS}")
    if a["scale"] is not None and kernel in NO_SCALE_KERNELS:
        raise ValueError("weave::allreduce_add_rmsnorm: the symmetric-memory kernels take no scale")
    if kernel in SYMM_KERNELS and a["x"].is_cuda:
        out = _symm(kernel, comm_ctas, out_slot=out_slot, **a)
        if out is not None:
            return out
    elif kernel == "oneshot" and a["x"].is_cuda:
        out = _oneshot(comm_ctas, **a)
        if out is not None:
            return out
    elif kernel in ("ce", "nccl") and (a["x"].is_cuda or kernel == "nccl"):
        from weave_compile.kernels import comm_kernels

        out = comm_kernels.dispatch(kernel, comm_ctas=comm_ctas, **a)
        if out is not None:
            return out
    return reference_impl(**a)


def _symm(kernel: str, comm_ctas: int, *, x, residual, bias, weight, residual_in_sharded,
          residual_out_sharded, scale, **rest) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The symmetric-memory kernel, or None where it cannot run now (the reference runs instead)."""
    symm = symm_kernels()
    hidden = x.shape[-1]
    try:
        normed, residual_out = symm.fused_allreduce_rmsnorm_symm(
            x.reshape(-1, hidden),
            None if residual is None else (residual if residual_in_sharded else residual.reshape(-1, hidden)),
            None if bias is None else bias.reshape(hidden),
            None if weight is None else weight.reshape(hidden),
            residual_in_sharded=residual_in_sharded, residual_out_sharded=residual_out_sharded,
            comm_ctas=comm_ctas, kernel=kernel, **rest,
        )
    except symm.SymmCapacityError as e:
        # The workspace cannot grow inside CUDA-graph capture: the collective path can.
        _log_fallback_once(kernel, str(e))
        return None
    return normed.reshape(x.shape), (residual_out if residual_out_sharded else residual_out.reshape(x.shape))


def _oneshot(comm_ctas: int, *, x, residual, bias, weight, scale, **rest) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The barrier-free one-shot kernel, or None where its buffers cannot grow now (reference runs)."""
    from weave_compile.kernels import SymmCapacityError, oneshot

    hidden = x.shape[-1]
    try:
        normed, residual_out = oneshot.oneshot_allreduce_rmsnorm(
            x.reshape(-1, hidden), None if residual is None else residual.reshape(-1, hidden),
            None if bias is None else bias.reshape(hidden), None if weight is None else weight.reshape(hidden),
            num_ctas=comm_ctas, **rest)
    except SymmCapacityError as e:
        _log_fallback_once("oneshot", str(e))
        return None
    return normed.reshape(x.shape), (residual_out if rest["residual_out_sharded"] else residual_out.reshape(x.shape))


@functools.lru_cache(maxsize=64)
def _log_fallback_once(kernel: str, reason: str) -> None:
    log.warning("weave::allreduce_add_rmsnorm: %s kernel fell back to reference: %s", kernel, reason)


def _fake(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    a = bind(args, kwargs)
    x = a["x"]
    normed = x.new_empty(x.shape, dtype=a["out_dtype"])
    if a["residual_out_sharded"]:
        per_rank = rows_per_rank(num_rows(x), group_size(a["group_name"]))
        return normed, x.new_empty((per_rank, x.shape[-1]), dtype=a["residual_dtype"])
    return normed, x.new_empty(x.shape, dtype=a["residual_dtype"])


allreduce_add_rmsnorm = torch.library.custom_op("weave::allreduce_add_rmsnorm", _fused, mutates_args=(),
                                                schema=SCHEMA)
allreduce_add_rmsnorm.register_fake(_fake)


# ----------------------------------------------------------------------------- async form


def _start(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``weave::allreduce_add_rmsnorm`` launched on the communication stream (the split schedule's form).

    Same arguments and results, but on CUDA the work is enqueued on
    :func:`weave_compile.streams.comm_stream` after everything already enqueued on the current
    stream, and the results are valid on the current stream only after the matching
    ``weave::comm_wait``. The graph passes ``x`` and ``residual`` to that wait as well, so their
    memory is not reused while the communication stream may still read it. On CPU it runs
    synchronously (gloo is blocking) and the wait is a no-op. Its kernels run one at a time on
    the comm stream, so both halves share the workspace's channel 0.
    """
    x = bind(args, kwargs)["x"]
    if not x.is_cuda:
        return _fused(*args, **kwargs)
    from weave_compile import streams

    current = torch.cuda.current_stream(x.device)
    with torch.cuda.stream(streams.fork(x.device)):
        normed, residual_out = _fused(*args, **kwargs)
    streams.mark_done(normed)
    # Allocated on the comm stream, freed by code on the current one: tell the allocator.
    normed.record_stream(current)
    residual_out.record_stream(current)
    return normed, residual_out


allreduce_add_rmsnorm_start = torch.library.custom_op("weave::allreduce_add_rmsnorm_start", _start,
                                                      mutates_args=(), schema=SCHEMA)
allreduce_add_rmsnorm_start.register_fake(_fake)


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


FUSED_OP = torch.ops.weave.allreduce_add_rmsnorm.default
START_OP = torch.ops.weave.allreduce_add_rmsnorm_start.default
WAIT_OP = torch.ops.weave.comm_wait.default
