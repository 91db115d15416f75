"""Every rank of a process group must run the same collectives: check it once per compiled graph.

The passes rewrite collectives: a fused site replaces an all_reduce by a reduce-scatter and
all-gathers, a sharded residual skips a gather. Their decisions depend on the whole graph (is the
norm in this graph, who reads the residual), so ranks that compile *different* graphs (a graph
break on one rank only, from a rank-conditional ``print`` or ``.item()``; inputs of other shapes)
can run collectives of different sizes against each other: gloo aborts with "Received data size
doesn't match expected size", NCCL hangs or corrupts memory. Plain Inductor is immune (it keeps
each all_reduce as written), which is why the check belongs to this backend.

What is compared: per compiled graph and per group (identified by its global ranks in group-rank
order), the ordered list of the graph's communication ops after the passes, each with its
arguments (shapes, dtypes, flags, kernel; the group as ranks). :func:`plan` builds it while
compiling; :func:`check_at_first_call` wraps the compiled graph so that its first call, before
any collective runs and outside any CUDA-graph capture (a host-side store exchange, no device
work), publishes the digest on the default process group's store and waits until every peer of
the group has published the same digest.

Why keyed by content and not by a per-graph sequence number: ranks may compile different
*numbers* of graphs and still run the same collectives (a rank-local guard failure recompiles an
identical graph on one rank only); matching by content accepts that at once, where sequence
numbers would wait for a graph the peer never compiles. A mismatch is detected without waiting
out the timeout when it is a deadlock: a peer waiting for a digest this rank never published
while this rank waits for one the peer never published (neither can progress). A rank that finds
a mismatch marks the group failed, for good: its peers stop too, now or at their next check (a
retry over the same ranks fails at once). Otherwise the wait is bounded by the store's timeout
(the process group's), and the error says which ranks never arrived.
"""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx

log = logging.getLogger(__name__)

Ranks = tuple[int, ...]
_PREFIX = "weave_agreement/"
_MAX_SHOWN = 8  # ops shown per rank in an error message

REMEDY = ("Make every rank compile the same graphs: keep rank-conditional code (a print or .item() on "
          "one rank, a statistic stored on the module by one rank) out of the compiled region, or run it "
          "on every rank behind torch.compiler.disable so every rank breaks the graph at the same place; "
          "give every rank of a group inputs of the same shapes. Or compile with "
          "options={'fuse': False}: the collectives then stay as written, like plain Inductor.")


class RankDisagreement(RuntimeError):
    """Ranks of one process group compiled graphs whose communication differs."""


def group_ranks(group_name: str) -> Ranks:
    """Global ranks of the process group named ``group_name``, in group-rank order."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    return tuple(dist.get_global_rank(pg, i) for i in range(pg.size()))


# ----------------------------------------------------------------------------- what a graph does


def plan(graph: fx.Graph) -> dict[Ranks, list[str]]:
    """Per group, the graph's communication ops in order, one line each (ops taking a ``group_name``)."""
    out: dict[Ranks, list[str]] = {}
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


def merge(plans: list[dict[Ranks, list[str]]]) -> dict[Ranks, list[str]]:
    """One Dynamo graph's plans (forward, and backward if already compiled), concatenated per group."""
    out: dict[Ranks, list[str]] = {}
    for p in plans:
        for ranks, ops in p.items():
            out.setdefault(ranks, []).extend(ops)
    return out


def digest(ops: list[str]) -> str:
    return hashlib.sha256("\n".join(ops).encode()).hexdigest()[:32]


# ----------------------------------------------------------------------------- the exchange


def agree(store, ranks: Ranks, me: int, ops: list[str], timeout_s: float, what: str = "a graph") -> None:
    """Publish ``ops``' digest for group ``ranks`` and wait until every peer has published the same one.

    Raises :class:`RankDisagreement` on a detected mismatch, on a peer that reported one, or when
    peers have not published the digest within ``timeout_s``.
    """
    exchange = _Exchange(store, ranks, me, ops, what)
    exchange.publish()
    exchange.wait(time.monotonic() + timeout_s, timeout_s)


class _Exchange:
    """One group's side of one graph's check: publish, then wait for the peers."""

    def __init__(self, store, ranks: Ranks, me: int, ops: list[str], what: str):
        self.store = dist.PrefixStore(_PREFIX + "-".join(map(str, ranks)) + "/", store)
        self.ranks, self.me, self.what = ranks, me, what
        self.digest, self.summary = digest(ops), _summary(ops)

    def publish(self) -> None:
        self._raise_if_poisoned()
        self.store.set(f"has/{self.digest}/{self.me}", self.summary)
        self.store.set(f"wait/{self.me}", self.digest)

    def wait(self, deadline: float, timeout_s: float) -> None:
        store, me, mine = self.store, self.me, self.digest
        peers = [r for r in self.ranks if r != me]
        pause = 0.005
        try:
            while True:
                missing = [p for p in peers if not store.check([f"has/{mine}/{p}"])]
                if not missing:
                    store.set(f"wait/{me}", "")
                    return
                self._raise_if_poisoned()
                for p in missing:
                    self._raise_if_deadlocked(p)
                if time.monotonic() > deadline:
                    raise RankDisagreement(
                        f"tokenweave: rank(s) {missing} of process group {list(self.ranks)} did not compile "
                        f"a graph with the same communication as {self.what} on rank {me} within "
                        f"{timeout_s:.0f} s (the process group's timeout): they are still compiling, or "
                        f"the ranks compiled different graphs. Rank {me} has {self.summary}. " + REMEDY)
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
        except RankDisagreement as e:
            # Final for the group: its peers (waiting now or checking later) stop too. A peer's
            # state from an earlier check can then never be mistaken for its current one.
            if not store.check(["failed"]):
                store.set("failed", f"rank {me}: {e}")
            raise

    def _raise_if_poisoned(self) -> None:
        if self.store.check(["failed"]):
            first = self.store.get("failed").decode()
            raise RankDisagreement(
                f"tokenweave: the ranks of process group {list(self.ranks)} compiled different graphs "
                f"(found by {first.split(':')[0]}); rank {self.me} stops before {self.what} runs a "
                f"collective. Rank {self.me} has {self.summary}. The first report: {first}")

    def _raise_if_deadlocked(self, p: int) -> None:
        store, me, mine = self.store, self.me, self.digest
        theirs = store.get(f"wait/{p}").decode() if store.check([f"wait/{p}"]) else ""
        if theirs and theirs != mine and not store.check([f"has/{theirs}/{me}"]):
            # A deadlock, not a delay: p waits for a graph this rank never compiled, this rank for
            # one p never compiled, and neither publishes anything while it waits.
            peer_summary = store.get(f"has/{theirs}/{p}").decode()
            raise RankDisagreement(
                f"tokenweave: ranks of process group {list(self.ranks)} compiled different graphs, so the "
                f"fused collectives would not match (gloo: a size mismatch, NCCL: a hang or corrupted "
                f"memory). Stopped before {self.what} ran any collective. Rank {me} has {self.summary}. "
                f"Rank {p} has {peer_summary}. " + REMEDY)


def _summary(ops: list[str]) -> str:
    shown = "; ".join(ops[:_MAX_SHOWN]) + (f"; ... ({len(ops) - _MAX_SHOWN} more)" if len(ops) > _MAX_SHOWN else "")
    return f"{len(ops)} communication op(s): {shown}"


# ----------------------------------------------------------------------------- the hook


def check_at_first_call(compiled: Callable, plans: list[dict[Ranks, list[str]]], graph_id: Optional[int] = None):
    """``compiled``, checked against the peers on its first call (nothing to check: ``compiled`` itself)."""
    merged = {ranks: ops for ranks, ops in merge(plans).items() if len(ranks) > 1}
    if not merged:
        return compiled
    if dist.get_backend() == "fake":  # one real rank measuring single-rank costs: no peer will answer
        log.info("tokenweave: fake process group: the ranks' agreement check is skipped")
        return compiled
    what = f"graph {graph_id}" if graph_id is not None else "the graph"
    state: dict[str, Any] = {"done": False, "error": None}

    def checked(*args, **kwargs):
        if not state["done"]:
            if state["error"] is not None:
                raise state["error"]
            try:
                _verify(merged, what)
            except RankDisagreement as e:
                state["error"] = e
                raise
            state["done"] = True
        return compiled(*args, **kwargs)

    if getattr(compiled, "_boxed_call", False):
        checked._boxed_call = True  # type: ignore[attr-defined]
    return checked


def _verify(merged: dict[Ranks, list[str]], what: str) -> None:
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    timeout = store.timeout
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    me = dist.get_rank()
    start = time.monotonic()
    exchanges = [_Exchange(store, ranks, me, merged[ranks], what) for ranks in sorted(merged)]
    # Publish for every group before waiting on any: a graph over two groups (a 2-D mesh) never
    # waits on one group while a peer waits for this rank's digest on the other.
    for ex in exchanges:
        ex.publish()
    for ex in exchanges:
        ex.wait(start + timeout_s, timeout_s)
    log.info("tokenweave: ranks agree on %s's communication over %d group(s) (%.3f s)",
             what, len(merged), time.monotonic() - start)


# ----------------------------------------------------------------------------- FX graph cache


def store_plans(directory: Callable[[], str], key: str, plans: list[dict[Ranks, list[str]]]) -> None:
    """Keep the plans beside the explain report: a graph Inductor serves from its cache skips the passes."""
    import json
    import os
    import tempfile

    try:
        d = directory()
        fd, tmp = tempfile.mkstemp(dir=d)
        with os.fdopen(fd, "w") as f:
            json.dump([[[list(r), ops] for r, ops in p.items()] for p in plans], f)
        os.replace(tmp, os.path.join(d, key + ".comm.json"))
    except OSError as e:
        log.warning("tokenweave: could not record the graph's communication for the FX graph cache: %s", e)


def load_plans(directory: Callable[[], str], key: str) -> list[dict[Ranks, list[str]]]:
    import json
    import os

    try:
        with open(os.path.join(directory(), key + ".comm.json")) as f:
            return [{tuple(r): ops for r, ops in p} for p in json.load(f)]
    except (OSError, ValueError):
        log.warning("tokenweave: a graph served from Inductor's FX graph cache has no recorded "
                    "communication: the ranks' first-call agreement check is skipped for it")
        return []
