"""The ``tokenweave`` torch.compile backend.

``torch.compile(model, backend="tokenweave", options={...})`` reaches :func:`tokenweave_backend`
through the ``torch_dynamo_backends`` entry point. It hands the Dynamo graph to Inductor with the
tokenweave passes installed as Inductor's post-grad custom pass, so Inductor still compiles all
compute. Without an initialized process group it is exactly the default Inductor backend.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import tempfile
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch._dynamo.exc import ShortenTraceback

from weave_compile import agreement, backward_hooks
from weave_compile import report as report_mod
from weave_compile.config import TokenWeaveConfig
from weave_compile.kernels.auto import BatchInvariantError
from weave_compile.passes.pass_manager import WeavePassManager

log = logging.getLogger(__name__)


def tokenweave_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                       options: Optional[dict[str, Any]] = None, mode: Optional[str] = None):
    """``torch.compile`` hands us ``options=`` or ``mode=`` (Inductor's modes: "reduce-overhead"
    turns on CUDA graphs, "max-autotune" autotuning), never both: with options, the mode is the
    ``mode`` option."""
    config = _config(options)
    mode = mode or config.mode
    inductor_patches: dict[str, Any] = {}
    if mode != "default":
        from torch._inductor import list_mode_options

        inductor_patches = dict(list_mode_options(mode))
    # Registers weave::allreduce_add_rmsnorm before any graph can contain it.
    import weave_compile.ops  # noqa: F401

    if not (dist.is_available() and dist.is_initialized()):
        _no_collectives_without_a_group(gm)
        report_mod.new_graph(config.compiler, note="no process group initialized: passes not run")
        log.info("tokenweave: no process group; compiling with plain %s", config.compiler)
        return _compile(gm, example_inputs, config, None, inductor_patches)
    passes = WeavePassManager(config, config.compiler)
    passes.prepare(gm, example_inputs)
    as_written = _as_written(gm, example_inputs, config, inductor_patches)
    strict = agreement.first_compile_of_frame()
    with agreement.compiling():
        try:
            compiled = _compile(gm, example_inputs, config, passes, inductor_patches)
        except Exception as e:
            _raise_callers_batch_invariant(e)
            raise
    passes.after_compile()
    reports = passes.graph_reports
    brk = graph_break(gm)
    if brk is not None:
        report_mod.mark_graph_break(reports, brk)
    return agreement.check_at_first_call(
        compiled, passes.comm_plans, written=passes.written_plans, timeout_s=config.agreement_timeout_s,
        as_written=as_written, on_degraded=lambda reason: report_mod.mark_as_written(reports, reason),
        what=f"graph {reports[0].graph_id}" if reports else "the graph", strict=strict)


# Dynamo resolves backend="tokenweave" (importing this module) before it traces: from here on, the
# module backward hooks a forward under no_grad cannot fire are traced as what they are, no-ops.
backward_hooks.install(tokenweave_backend)


def graph_break(gm) -> Optional[str]:
    """Why Dynamo ended ``gm`` at a graph break, with where in the user's code; None if the graph
    reached the end of its frame. Dynamo records it on the graph it hands a backend
    (``compile_subgraph_reason``, what ``torch._dynamo.explain`` reads); "" if it gave no reason."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    lines = [line.strip() for line in str(getattr(reason, "reason", "") or "").splitlines() if line.strip()]
    why = lines[0] if lines else ""
    if why.startswith("generic_jump"):  # Dynamo's name for the jump it could not trace
        why = "data-dependent branching (an if on a tensor's value)"
    hint = next((line for line in lines[1:] if line.startswith("Hint:")), "")  # the first: the others repeat it
    stack = getattr(reason, "user_stack", None) or []
    where = f" ({os.path.basename(stack[-1].filename)}:{stack[-1].lineno} in {stack[-1].name})" if stack else ""
    return (why + where + (" " + hint if hint else "")) if why else ""


def _as_written(gm, example_inputs, config: TokenWeaveConfig, inductor_patches: dict[str, Any]):
    """Compiles the Dynamo graph without the passes when first called: what runs when the ranks of a
    group disagree. Inside the original compile's tracing context (as Dynamo recompiles a graph for
    a shape specialization at run time), so fake inputs and symbolic shapes are the first compile's;
    compile_fx only normalizes ``gm`` in place, so it still holds the collectives as written."""
    import contextlib

    context = torch._guards.TracingContext.try_get()
    inputs = list(example_inputs)

    def compile_now():
        with agreement.compiling(), (torch._guards.tracing(context) if context is not None
                                     else contextlib.nullcontext()):
            return _compile(gm, inputs, config, None, inductor_patches)

    return compile_now


class _CallersError(ShortenTraceback):
    """The caller's mistake found while compiling (a bad option given to ``torch.compile`` as a
    dict, a collective without a process group), raised past Dynamo as the caller's error.

    Dynamo wraps whatever a backend raises in ``BackendCompilerFailed``, a ``RuntimeError`` that
    reads as a compiler bug, except a ``ShortenTraceback``: that one it re-raises as it is, its
    traceback cut to ``first_useful_frame`` (Inductor surfaces ``TritonMissing`` this way). A bad
    option reaches the caller as the ``ValueError``/``TypeError`` that ``Options(...)`` raises,
    with the same message.
    """

    def __init__(self, message: str, frame) -> None:
        super().__init__(message, first_useful_frame=frame)
        self.message = message

    def __str__(self) -> str:
        # Dynamo appends "Set TORCHDYNAMO_VERBOSE=1 ... especially if you're reporting a bug to
        # PyTorch" to the args of what it lets through: for the caller's own mistake, it misleads.
        return self.message


class OptionValueError(_CallersError, ValueError):
    pass


class OptionTypeError(_CallersError, TypeError):
    pass


class MissingProcessGroupError(_CallersError, RuntimeError):
    """The graph calls a collective, and torch.distributed has no process group to run it on."""


class BatchInvariantCompileError(_CallersError, BatchInvariantError):
    """``batch_invariant=True`` and a site that cannot be kept invariant (the message names it)."""


def _raise_callers_batch_invariant(e: BaseException) -> None:
    """Raise the :class:`BatchInvariantError` behind ``e`` (the compiler wraps what a pass raises)
    as the caller's error; return where there is none."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, BatchInvariantError):
            raise BatchInvariantCompileError(str(e), inspect.currentframe()) from None
        e = e.__cause__ or e.__context__ or next((a for a in getattr(e, "args", ()) if isinstance(a, BaseException)),
                                                 None)


def _no_collectives_without_a_group(gm) -> None:
    """:class:`MissingProcessGroupError` where ``gm`` calls a collective while no process group is
    initialized: Inductor would fail on it with "Could not resolve the process group registered
    under the name ...", and the eager graph at its first call. (Where the model passes no group at
    all, ``funcol.all_reduce(x, "sum", dist.group.WORLD)`` before ``init_process_group``, torch
    raises "Unsupported group type: <class 'NoneType'>" in the model's own call, before any graph
    reaches a backend.)"""
    calls = {}  # op name -> its nodes
    for n in gm.graph.nodes:
        name = (getattr(n.target, "_qualified_op_name", None) or getattr(n.target, "_name", "")) \
            if n.op == "call_function" else ""
        namespace, _, op = str(name).partition("::")
        if namespace in ("_c10d_functional", "c10d") and op != "wait_tensor":
            calls.setdefault(op.split(".")[0], []).append(n)
    if not calls:
        return
    ops = sorted(calls)
    groups = sorted({a for ns in calls.values() for n in ns for a in n.args
                     if isinstance(a, str) and a not in ("sum", "avg", "max", "min", "product")})
    raise MissingProcessGroupError(
        f"tokenweave: the model calls {', '.join(ops)} (process group {', '.join(map(repr, groups)) or 'unnamed'}), "
        f"but no process group is initialized: call torch.distributed.init_process_group() on every rank before "
        f"the compiled model's first call (under torchrun: init_process_group(\"nccl\"))",
        inspect.currentframe())


def _config(options) -> TokenWeaveConfig:
    """``options`` (None, a dict or an ``Options``) as an ``Options``; see :class:`_CallersError`."""
    try:
        return TokenWeaveConfig.from_options(options)
    except (ValueError, TypeError) as e:
        kind = OptionValueError if isinstance(e, ValueError) else OptionTypeError
        raise kind(str(e), inspect.currentframe()) from None


def _compile(gm, example_inputs, config: TokenWeaveConfig, passes: Optional[WeavePassManager],
             inductor_patches: dict[str, Any]):
    """``gm`` compiled by the configured compiler, with ``passes`` (None: none, plain Inductor)."""
    if config.compiler == "aot_eager":
        return _aot_eager(gm, example_inputs, passes)
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    if passes is None:
        return compile_fx(gm, example_inputs, config_patches=inductor_patches or None)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    key = _report_key(gm, example_inputs, passes)
    compiled = compile_fx(gm, example_inputs,
                          config_patches={**inductor_patches, "post_grad_custom_post_pass": passes})
    if passes.graph_reports:
        _store_reports(key, passes.graph_reports, passes.comm_plans, passes.written_plans, passes.measured_digests)
    elif counters["inductor"]["fxgraph_cache_hit"] > hits:
        # The passes did not run: show what they did when this graph was compiled.
        stored, passes.comm_plans, passes.written_plans, measured_choices = _load_reports(key)
        _post_served(measured_choices)
        for payload in stored or []:
            passes.graph_reports.append(report_mod.graph_from_json(
                "inductor", "served from Inductor's FX graph cache (sites as first compiled)",
                payload))
        if not stored:
            passes.graph_reports.append(report_mod.new_graph("inductor", note=(
                "served from Inductor's FX graph cache: the passes ran when it was first compiled and "
                "no site list was recorded; set TORCHINDUCTOR_FX_GRAPH_CACHE=0 to see it")))
    return compiled


def _report_key(gm, example_inputs, passes: WeavePassManager) -> str:
    """The Dynamo graph, its inputs' metadata, the passes and the machine: what the report depends on."""
    import hashlib

    metas = [(tuple(str(d) for d in t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor)
             else repr(t) for t in example_inputs]
    machine = (dist.get_world_size() if dist.is_initialized() else 1,
               torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    text = f"{gm.code}\n{metas}\n{passes.uuid()}\n{machine}"
    return hashlib.sha256(text.encode()).hexdigest()


def _reports_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layouts
        from torch._inductor.runtime.runtime_utils import cache_dir
    path = os.path.join(cache_dir(), "tokenweave_reports")
    os.makedirs(path, exist_ok=True)
    return path


def _post_served(choices) -> None:
    """A graph served from the FX graph cache runs the measured choice it was compiled with: peers
    that measure the same sites now take that answer (``kernels/measured``) instead of waiting."""
    from weave_compile.kernels import measured

    for ranks, digest, answer in choices:
        measured.served(agreement.measuring_store(), tuple(ranks), digest, answer)


def _store_reports(key: str, graphs, plans, written, measured_choices=()) -> None:
    """Keep the site reports, the communication plans and the measured choices beside Inductor's
    cache: a graph it serves from there skips the passes."""
    plans_json = {name: [[[list(r), ops] for r, ops in p.items()] for p in ps]
                  for name, ps in (("fused", plans), ("written", written))}
    plans_json["measured"] = [[list(r), d, a] for r, d, a in measured_choices]
    for suffix, text in ((".json", report_mod.dumps(graphs)), (".comm.json", json.dumps(plans_json))):
        try:
            fd, tmp = tempfile.mkstemp(dir=_reports_dir())
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(_reports_dir(), key + suffix))
        except OSError as e:  # a record we cannot keep must not fail the compile
            log.warning("tokenweave: could not record the graph's explain report for the FX graph cache: %s", e)


def _load_reports(key: str):
    """(site reports or None, fused plans, as-written plans, measured choices) recorded by
    :func:`_store_reports`."""
    def read(suffix):
        try:
            with open(os.path.join(_reports_dir(), key + suffix)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    reports, plans = read(".json"), read(".comm.json")
    try:
        fused, written = ([{tuple(r): ops for r, ops in p} for p in plans[name]] for name in ("fused", "written"))
    except (TypeError, KeyError, ValueError):
        log.warning("tokenweave: a graph served from Inductor's FX graph cache has no recorded "
                    "communication: the ranks' first-call agreement check is skipped for it")
        fused, written = [], []
    measured_choices = (plans or {}).get("measured", []) if isinstance(plans, dict) else []
    return reports, fused, written, measured_choices


def _aot_eager(gm, example_inputs, passes: Optional[WeavePassManager]):
    """AOT-autograd with Inductor's decompositions, our passes, then the ATen graph run as is."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def fw_compiler(fw_gm: torch.fx.GraphModule, fw_inputs):
        if passes is not None:
            passes(fw_gm.graph)
            fw_gm.recompile()
        return make_boxed_func(fw_gm)

    backend = aot_autograd(fw_compiler=fw_compiler, decompositions=select_decomp_table(),
                           keep_inference_input_mutations=True)
    return backend(gm, example_inputs)
