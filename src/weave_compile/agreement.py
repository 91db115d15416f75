"""Every rank of a process group must run the same collectives: decided once per compiled graph.

The passes rewrite collectives: a fused site replaces an all_reduce by a reduce-scatter and
all-gathers, a sharded residual skips a gather. Their decisions depend on the whole graph (is the
norm in this graph, who else reads the residual), so ranks that compile *different* graphs (a
graph break on one rank only, from a rank-conditional ``print`` or ``.item()``; a statistic one
rank stores on the module) would run collectives of different sizes against each other: gloo
aborts with "Received data size doesn't match expected size", NCCL hangs or corrupts memory.
Plain Inductor runs such programs correctly: it keeps each collective as written, and the ranks'
collectives as written match one-to-one in execution order however the graphs are cut.

What is compared: per compiled graph and per group (its global ranks in group-rank order), the
ordered list of the graph's communication ops after the passes, each with its arguments (shapes,
dtypes, flags, kernel; the group as ranks), and the same list before them (as written).
:func:`check_at_first_call` wraps the compiled graph so that its first call, before any
collective runs and outside any CUDA-graph capture (a host-side exchange on the default process
group's store, no device work), decides with the peers (:mod:`weave_compile.consensus`) whether
it runs rewritten, or, where the ranks disagree, every graph of the group runs with its
collectives as written: the same Dynamo graph compiled without the passes, on demand, with one
warning per group and the reason in ``explain()``. After the group ran fused graphs it degrades
the same way where every rank is held at such a first call (a second model whose graph differs on
one rank): the graphs that ran fused keep running fused (:mod:`weave_compile.consensus` says why
that is safe). Where neither is safe it raises :class:`RankDisagreement`.

The whole group degrades, not only the differing sites: keeping a site fused needs every rank to
fuse the same sites in the same execution order, which ranks whose graphs are cut differently
cannot establish without numbering collectives across graphs and recompiling with a negotiated
site set (and a site's fused form depends on its neighbours: residual sharding, split halves).

Why by content, not a per-graph sequence number: ranks may compile different *numbers* of graphs
and still run the same collectives (a rank-local guard failure recompiles an identical graph on
one rank only): the peer's digest is already there, the check passes at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from weave_compile import consensus
from weave_compile.consensus import REMEDY, Decision, RankDisagreement, Ranks, digest

__all__ = ["REMEDY", "Decision", "RankDisagreement", "check_at_first_call", "compiling", "digest",
           "first_compile_of_frame", "merge", "plan"]

log = logging.getLogger(__name__)

Plan = dict[Ranks, list[str]]


def group_ranks(group_name: str) -> Ranks:
    """Global ranks of the process group named ``group_name``, in group-rank order."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    return tuple(dist.get_global_rank(pg, i) for i in range(pg.size()))


# ----------------------------------------------------------------------------- what a graph does


def plan(graph: fx.Graph) -> Plan:
    """Per group, the graph's communication ops in order, one line each (ops taking a ``group_name``)."""
    out: Plan = {}
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not any(a.name == "group_name" for a in schema.arguments):
            continue
        bound = dict(zip((a.name for a in schema.arguments), node.args))
        bound.update(node.kwargs)
        ranks = group_ranks(bound["group_name"])
        parts = [f"{name}={_describe(v)}" for name, v in bound.items() if name != "group_name" and v is not None]
        out.setdefault(ranks, []).append(f"{schema.name}({', '.join(parts)})")
    return out


def _describe(v: Any) -> str:
    if isinstance(v, fx.Node):
        t = v.meta.get("val")
        if isinstance(t, torch.Tensor):
            return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
        return "?"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_describe(x) for x in v) + "]"
    return repr(v)


def merge(plans: Sequence[Plan]) -> Plan:
    """One Dynamo graph's plans (forward, and backward if already compiled), concatenated per group."""
    out: Plan = {}
    for p in plans:
        for ranks, ops in p.items():
            out.setdefault(ranks, []).extend(ops)
    return out


# ----------------------------------------------------------------------------- compiling marker

_compiling_lock = threading.Lock()
_compiling_depth = 0


@contextlib.contextmanager
def compiling():
    """Tells the peers this rank is compiling, so that their wait for it does not time out meanwhile."""
    global _compiling_depth
    store = _default_store()
    with _compiling_lock:
        _compiling_depth += 1
        if store is not None and _compiling_depth == 1:
            consensus.set_compiling(store, dist.get_rank(), True)
    try:
        yield
    finally:
        with _compiling_lock:
            _compiling_depth -= 1
            if store is not None and _compiling_depth == 0:
                consensus.set_compiling(store, dist.get_rank(), False)


def _default_store():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def measuring_store():
    """The store the ranks meet on before a measured choice (:mod:`weave_compile.kernels.measured`);
    None where no peer will answer (no process group, or the fake one)."""
    return _default_store()


def is_compiling(rank: int) -> bool:
    """Whether ``rank`` is compiling now (its peers' waits restart meanwhile)."""
    store = _default_store()
    return store is not None and consensus._is_compiling(store, rank)


def waiting_at_first_call(ranks: Ranks, rank: int) -> str:
    """What ``rank`` waits on at a graph's first call on group ``ranks`` ("" when it does not wait
    there): a peer waiting there compiled past a measurement meeting it did not attend."""
    store = _default_store()
    return "" if store is None else consensus.waiting_at(store, ranks, rank)


def runs_as_written(ranks: Ranks) -> str:
    """Why group ``ranks`` runs its collectives as written from now on ("" while it does not)."""
    store = _default_store()
    return "" if store is None else consensus.as_written_detail(store, ranks)


def backend() -> str:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else ""


# ----------------------------------------------------------------------------- the hook

_warned: set[Ranks] = set()


def check_at_first_call(compiled: Callable, plans: Sequence[Plan], *, timeout_s: float,
                        as_written: Optional[Callable[[], Callable]] = None,
                        written: Sequence[Plan] = (), on_degraded: Callable[[str], None] = lambda reason: None,
                        what: str = "the graph", strict: bool = False) -> Callable:
    """``compiled``, decided with the peers on its first call (nothing to check: ``compiled`` itself).

    ``as_written()`` compiles the same Dynamo graph without the passes; it runs instead of
    ``compiled`` when the group degrades (then ``on_degraded(reason)`` is called once).
    ``written``: the plans before the passes, to tell a degradable disagreement from one that
    would fail as written too. ``strict``: the graph is its frame's first compile, not a
    recompile (:func:`first_compile_of_frame`; :mod:`weave_compile.consensus` says what changes).
    """
    merged = {ranks: ops for ranks, ops in merge(plans).items() if len(ranks) > 1}
    if not merged:
        return compiled
    if dist.get_backend() == "fake":  # one real rank measuring single-rank costs: no peer will answer
        log.info("tokenweave: fake process group: the ranks' agreement check is skipped")
        return compiled
    before = merge(written)
    boxed = getattr(compiled, "_boxed_call", False)
    state: dict[str, Any] = {"fn": None, "error": None, "as_written": as_written}

    def first_call() -> Callable:
        if state["error"] is not None:
            raise state["error"]
        try:
            # Unknown as-written lists (a cache entry without them) are empty: a prefix of any, so degradable.
            decision = _verify(merged, {r: before.get(r, []) for r in merged}, what, timeout_s, strict)
            fn = compiled if decision.fused else _degrade(decision, state["as_written"], boxed, what)
        except Exception as e:  # final for this graph: every later call raises the same
            state["error"] = e
            raise
        finally:
            state["as_written"] = None  # the Dynamo graph and its example inputs are no longer needed
        if not decision.fused:
            on_degraded(decision.reason)
        state["fn"] = fn
        return fn

    def checked(*args, **kwargs):
        fn = state["fn"] or first_call()
        return fn(*args, **kwargs)

    if boxed:
        checked._boxed_call = True  # type: ignore[attr-defined]
    return checked


def _degrade(decision: Decision, as_written: Optional[Callable[[], Callable]], boxed: bool, what: str) -> Callable:
    for ranks, reason in decision.groups:
        if ranks not in _warned:
            _warned.add(ranks)
            log.warning("tokenweave: process group %s runs its collectives as written from now on, like "
                        "plain Inductor (no fused all_reduce+RMSNorm): %s. See weave_compile.explain().",
                        list(ranks), reason)
    if as_written is None:
        raise RankDisagreement(f"tokenweave: {what} must run with its collectives as written ({decision.reason}) "
                               f"but was compiled without a way to recompile it. " + REMEDY)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RankDisagreement(f"tokenweave: {what} must be recompiled with its collectives as written "
                               f"({decision.reason}), which cannot happen during CUDA-graph capture: run "
                               f"it once before capturing.")
    fn = as_written()
    if getattr(fn, "_boxed_call", False) == boxed:
        return fn
    if boxed:  # called with one list of arguments; ``fn`` takes them spread
        return lambda args: fn(*args)
    return lambda *args: fn(list(args))


def first_compile_of_frame() -> bool:
    """True unless Dynamo is recompiling a frame it compiled before (a guard failed): the compile
    id's second number counts the frame's compiles."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    return compile_id is None or not getattr(compile_id, "frame_compile_id", 0)


def _verify(merged: Plan, written: Plan, what: str, timeout_s: float, strict: bool = False) -> Decision:
    store = _default_store()
    timeout = store.timeout
    # The store's own timeout (the process group's) caps a wait that peers keep extending by compiling.
    cap_s = max(timeout_s, timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout))
    start = time.monotonic()
    decision = consensus.agree(store, dist.get_rank(), {r: (merged[r], written[r]) for r in merged},
                               timeout_s, what, cap_s, strict)
    log.info("tokenweave: %s, %d group(s): %s (decided in %.3f s)", what, len(merged),
             "fused" if decision.fused else "as written", time.monotonic() - start)
    return decision
