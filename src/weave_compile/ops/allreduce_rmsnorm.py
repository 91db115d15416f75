"""The fused ``weave::allreduce_add_rmsnorm`` op, its async form and ``weave::comm_wait``.

TokenWeave's first pillar. A tensor-parallel layer ends with ``all_reduce(x) (+ bias) + residual ->
RMSNorm``. Done as reduce-scatter over token rows -> add -> RMSNorm on this rank's rows ->
all-gather, the norm runs on 1/N of the tokens and the all-reduce's two halves bracket it.

Contract, per row (rows are the flattened leading dims of ``x``; ``x`` is this rank's partial sum)::

    acc    = sum_over_ranks(x_row).float() (* scale) (+ bias.float()) (+ residual_row.float())
    res    = acc.to(residual_dtype)                                 # -> residual_out
    r      = res.float()
    r      = r - mean(r)                      if norm == "layernorm"     # else "rmsnorm": as it is
    y      = r * rsqrt(mean(r * r) + eps)                                # LayerNorm: the centred row's variance
    y      = y.to(mid_dtype).float()          if mid_dtype is not None   # HF Llama casts back first
    y      = y * (weight.float() + weight_offset)  if weight is not None  # offset 1.0: Gemma (1 + w)
    y      = y + norm_bias.float()            if norm_bias is not None   # a LayerNorm's bias, after the weight
    normed = y.to(out_dtype)
    normed, scales = quantize(normed)         if quant                   # the fp8 epilogue: weave_compile.quant

With ``quant`` ("row" or "static") the first output is the fp8 rows (``quant_dtype``) and the
third the per-row scales (``[..., 1]`` fp32; empty for "static" and without ``quant``); the
all-gather then moves fp8 codes and one fp32 scale per row. The three outputs are always
``(normed, residual_out, scales)``.

Rows are split into ``S = ceil(T / N)`` rows per rank (padded with zero rows); rank ``r`` owns
rows ``[r*S, (r+1)*S)``. A *sharded* residual is that ``[S, H]`` slice: with
``residual_in_sharded`` the op reads it instead of the full residual, with ``residual_out_sharded``
it returns only its slice (no gather), which lets consecutive fused sites keep the residual
stream sharded as TokenWeave does.

The arguments are defined once, by :func:`_arguments`; both ops get that schema
(:data:`SCHEMA`), and :data:`ARG_NAMES` names them for the passes, which build and rewrite the
ops by name (``weave_compile.passes.graph_utils.call_named`` / ``named_args`` / ``replace_args``).

Implementations (the ``kernel`` argument, chosen at compile time by
:func:`weave_compile.kernels.auto.choose`): the entries of :mod:`weave_compile.kernels.registry`.
The op builds their :class:`~weave_compile.kernels.spec.FusedSpec` and
:class:`~weave_compile.kernels.spec.Rows` once, here, and runs the chosen one; where it cannot
run now (tensors on a device it does not run on, or a workspace that cannot grow inside CUDA-graph
capture) :func:`weave_compile.kernels.auto.runtime_fallback` runs instead, logged once: on CUDA
tensors compiled work (``nccl``), never the eager ``reference`` chain, which runs on a GPU only
where a site forced it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Optional

import torch

from weave_compile import kernels
from weave_compile.kernels import FusedSpec, Rows, auto
from weave_compile.quant import QuantSpec
from weave_compile.rows import group_size, num_rows, rows_per_rank

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
    norm: str = "rmsnorm",
    norm_bias: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
    quant: str = "",
    quant_dtype: Optional[torch.dtype] = None,
    quant_max: float = 0.0,
    quant_floor: float = 0.0,
    quant_reciprocal: bool = False,
    quant_clamp: bool = True,
    quant_scale: Optional[torch.Tensor] = None,
    quant_scale_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one definition of the fused op's arguments (never called).

    ``scale`` (a 0-d tensor, e.g. Gemma's embedding scale) multiplies the reduced sum. Like
    bias, residual and weight it must be the same on every rank (each row is computed on one
    rank).
    ``kernel`` names a registered implementation (:func:`weave_compile.kernels.names`);
    ``comm_ctas`` the thread blocks the communication may use. ``scale`` goes only to
    implementations that take one (the pass chooses accordingly); ``eps_tensor`` (a 0-d tensor),
    when given, replaces ``eps``: under ``torch.compile(dynamic=True)`` Dynamo turns a model's
    Python-float eps into a graph input. Implementations that do not read it from a tensor get it
    as a float, read on the host, so the pass gives them only a CPU one (no device sync).
    ``out_slot`` >= 0 lets an implementation that takes it (``takes_out_slot``) leave ``normed`` in
    that slot of the group's symmetric output ring instead of copying the peers' rows out: the
    result is then a view of memory the next call on that slot overwrites (on every rank), which
    is only correct where :mod:`weave_compile.passes.output_in_place` proved every reader runs
    before that call. -1 (and every other implementation): a fresh tensor.
    ``norm``: ``"rmsnorm"`` or ``"layernorm"``; ``norm_bias`` (a LayerNorm's bias, added after the
    weight; ``bias`` is the one added to the reduced sum before the norm). Both go only to
    implementations that take a LayerNorm (``takes_layernorm``; the pass chooses accordingly).
    ``batch_invariant``: add the ranks' partial sums in rank order (0, 1, ..., N-1) in fp32, so a
    row's outputs do not depend on the token count, the other rows or the rank that owns it; only
    implementations that claim it (``Implementation.batch_invariant``) are given it.
    ``quant`` ("" none, "row", "static") and the ``quant_*`` arguments: the fp8 epilogue
    (:class:`weave_compile.quant.QuantSpec`; ``quant_scale`` the static scale, one element); only
    implementations that take it (``takes_quant``) are given it; ``quant_scale_dtype`` (None:
    float32) is the dtype a row scale's quotient is rounded to before it becomes fp32.
    """
    raise NotImplementedError


_SIGNATURE = inspect.signature(_arguments)
#: ``(Tensor x, Tensor? residual, ...) -> (Tensor, Tensor, Tensor)``: both ops' schema.
SCHEMA = torch.library.infer_schema(_arguments, mutates_args=())
#: The arguments in schema order.
ARG_NAMES = tuple(_SIGNATURE.parameters)


def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name, defaults filled in."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _fused(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(normed, residual_out, scales)`` of ``all_reduce(x) (*scale) (+bias) (+residual) -> RMSNorm``
    (or LayerNorm) (-> fp8); see module doc."""
    return _call(bind(args, kwargs), beside_compute=False)


def _call(a: dict[str, Any], beside_compute: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op on its arguments by name; ``beside_compute``: it runs beside other work (the start op)."""
    # A name, or a table by token count (the measured choice): ValueError naming the valid ones.
    impl = auto.implementation_for(a["kernel"], num_rows(a["x"]))
    not_invariant = a["batch_invariant"] and kernels.registry.invariant_on(impl, a["x"].device)
    if not_invariant:
        raise ValueError(f"weave::allreduce_add_rmsnorm: kernel {impl.name!r}: {not_invariant}; batch-invariant on "
                         f"{a['x'].device.type}: {kernels.registry.invariant_takers(a['x'].device)}")
    if a["scale"] is not None and not impl.takes_scale:
        raise ValueError(f"weave::allreduce_add_rmsnorm: kernel {impl.name!r} is one of those that take no scale "
                         f"({[e.name for e in kernels.implementations() if not e.takes_scale]})")
    if (a["norm"] != "rmsnorm" or a["norm_bias"] is not None) and not impl.takes_layernorm:
        raise ValueError(f"weave::allreduce_add_rmsnorm: kernel {impl.name!r} computes RMSNorm only (no norm="
                         f"{a['norm']!r}, no norm_bias); a LayerNorm is taken by "
                         f"{[e.name for e in kernels.implementations() if e.takes_layernorm]}")
    quant = QuantSpec.of(a["quant"], a["quant_dtype"], a["quant_max"], a["quant_floor"], a["quant_reciprocal"],
                         a["quant_clamp"], a["quant_scale_dtype"])
    if quant is not None and not impl.takes_quant:
        raise ValueError(f"weave::allreduce_add_rmsnorm: kernel {impl.name!r} has no fp8 epilogue (quant="
                         f"{a['quant']!r}); it is taken by {[e.name for e in kernels.implementations() if e.takes_quant]}")
    if quant is not None and (quant.kind == "static") != (a["quant_scale"] is not None):
        raise ValueError("weave::allreduce_add_rmsnorm: quant_scale is given with quant='static' and only then, "
                         f"got quant={a['quant']!r} and quant_scale={'a tensor' if a['quant_scale'] is not None else None}")
    eps, eps_tensor = a["eps"], a["eps_tensor"]
    if eps_tensor is not None and not impl.takes_eps_tensor:
        # A host tensor (the pass passes the graph's own input): no device sync.
        if eps_tensor.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"weave::allreduce_add_rmsnorm: kernel {impl.name!r} reads eps on the host, and eps "
                               "is a CUDA tensor inside CUDA-graph capture, where reading it is not allowed; "
                               "pass eps as a number or a CPU tensor")
        eps, eps_tensor = float(eps_tensor), None
    spec = FusedSpec(residual_dtype=a["residual_dtype"], out_dtype=a["out_dtype"], eps=eps,
                     group_name=a["group_name"], mid_dtype=a["mid_dtype"], weight_offset=a["weight_offset"],
                     residual_in_sharded=a["residual_in_sharded"], residual_out_sharded=a["residual_out_sharded"],
                     comm_ctas=a["comm_ctas"], out_slot=a["out_slot"], beside_compute=beside_compute,
                     norm=a["norm"], batch_invariant=a["batch_invariant"], quant=quant)
    rows = Rows.of(a["x"], a["residual"], a["bias"], a["weight"], a["scale"], eps_tensor, a["norm_bias"],
                   a["quant_scale"])
    normed, residual_out, *scales = _run(impl, rows, spec)
    return rows.restore(normed, residual_out, spec.residual_out_sharded, *scales)


def _run(impl: kernels.Implementation, rows: Rows, spec: FusedSpec) -> tuple:
    """``impl``'s outputs (``(normed, residual_out)``, with the scales third where ``spec.quant``), or
    the run-time fallback's where it cannot run now."""
    if impl.fallback:  # reference: the CPU path, or forced; it runs wherever a process group does
        return impl.run(rows, spec)
    why = f"it does not run on these tensors ({rows.x.device})"
    try:
        out = impl.run(rows, spec)
    except tuple(e for e in (impl.capacity_error,) if e is not None) as e:
        # Its buffers cannot grow inside CUDA-graph capture: the fallback's collectives can.
        out, why = None, str(e)
    if out is not None:
        return out
    fallback = auto.runtime_fallback(rows.x.device)
    if fallback is impl:
        raise RuntimeError(f"weave::allreduce_add_rmsnorm: kernel {impl.name!r}, the fallback on {rows.x.device}, "
                           f"cannot run: {why}")
    _log_fallback_once(impl.name, fallback.name, why)
    return fallback.run(rows, spec)


@functools.lru_cache(maxsize=64)
def _log_fallback_once(kernel: str, fallback: str, reason: str) -> None:
    log.warning("weave::allreduce_add_rmsnorm: %s kernel fell back to %s: %s", kernel, fallback, reason)


def _fake(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = bind(args, kwargs)
    x = a["x"]
    normed = x.new_empty(x.shape, dtype=a["quant_dtype"] if a["quant"] else a["out_dtype"])
    if a["quant"] == "row":
        scales = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
    else:
        scales = x.new_empty((0,), dtype=torch.float32)
    if a["residual_out_sharded"]:
        per_rank = rows_per_rank(num_rows(x), group_size(a["group_name"]))
        return normed, x.new_empty((per_rank, x.shape[-1]), dtype=a["residual_dtype"]), scales
    return normed, x.new_empty(x.shape, dtype=a["residual_dtype"]), scales


allreduce_add_rmsnorm = torch.library.custom_op("weave::allreduce_add_rmsnorm", _fused, mutates_args=(),
                                                schema=SCHEMA)
allreduce_add_rmsnorm.register_fake(_fake)


# ----------------------------------------------------------------------------- async form


def _start(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weave::allreduce_add_rmsnorm`` launched on the communication stream (the split schedule's form).

    Same arguments and results, but on CUDA the work is enqueued on
    :func:`weave_compile.ops.streams.comm_stream` after everything already enqueued on the current
    stream, and the results are valid on the current stream only after the matching
    ``weave::comm_wait``. The graph passes ``x`` and ``residual`` to that wait as well, so their
    memory is not reused while the communication stream may still read it. On CPU it runs
    synchronously (gloo is blocking) and the wait is a no-op. Its kernels run one at a time on
    the comm stream, so both halves share the workspace's channel 0.
    """
    a = bind(args, kwargs)
    x = a["x"]
    if not x.is_cuda:
        return _call(a, beside_compute=True)
    from weave_compile.ops import streams

    current = torch.cuda.current_stream(x.device)
    with torch.cuda.stream(streams.fork(x.device)):
        outs = _call(a, beside_compute=True)
    streams.mark_done(outs[0])
    # Allocated on the comm stream, freed by code on the current one: tell the allocator.
    for t in outs:
        t.record_stream(current)
    return outs


allreduce_add_rmsnorm_start = torch.library.custom_op("weave::allreduce_add_rmsnorm_start", _start,
                                                      mutates_args=(), schema=SCHEMA)
allreduce_add_rmsnorm_start.register_fake(_fake)


@torch.library.custom_op("weave::comm_wait", mutates_args=("normed", "residual_out", "scales"))
def comm_wait(normed: torch.Tensor, residual_out: torch.Tensor, keep_alive: list[torch.Tensor],
              scales: Optional[torch.Tensor]) -> None:
    """Make the current stream wait for the start op that produced ``normed`` (only for it).

    Declared as writing ``normed``, ``residual_out`` and ``scales`` (an fp8 epilogue's; None
    without one) so that the compiler orders every reader of the results after it; ``keep_alive``
    (the start's inputs) holds their memory until here. ``scales`` has no default: a traced call
    drops arguments equal to their default, and torch 2.11 reads each mutated argument by its
    position (an omitted one raised IndexError).
    """
    if normed.is_cuda:
        from weave_compile.ops import streams

        streams.join(normed)


@comm_wait.register_fake
def _(normed, residual_out, keep_alive, scales):
    return None


FUSED_OP = torch.ops.weave.allreduce_add_rmsnorm.default
START_OP = torch.ops.weave.allreduce_add_rmsnorm_start.default
WAIT_OP = torch.ops.weave.comm_wait.default
#: The fused op in both forms (the split's halves run the start form).
FUSED_OPS = (FUSED_OP, START_OP)
