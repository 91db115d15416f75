"""How the ranks of a process group decide together, on a store, how a compiled graph runs.

:mod:`weave_compile.agreement` says what is compared and why; this module is the exchange. Each
group (keyed by its global ranks) has one *mode* on the store, moved only by compare-and-set, so
every rank reads the same one, and every move is final:

- open (nothing decided yet) -> ``fused``: every peer compiled the same rewritten communication
  for the graph, and confirmed it (its other groups agreed too). The graph runs rewritten.
- open -> ``degraded``: two ranks each wait for communication the other never compiled, or a
  peer does not arrive within the timeout (it runs that code eagerly, or skipped it). Every graph
  of the group then runs with its collectives as written, on every rank, without waiting.
- ``fused`` -> ``degraded``: after fused graphs ran, every rank of the group waits at the first
  call of a graph for communication that some rank will not reach (the ranks compiled different
  graphs for the same point of their programs: a second model in which one rank alone stores a
  statistic). The graphs that ran fused keep running fused; these graphs, and every graph compiled
  later whose communication did not run fused, run with their collectives as written.
- open or ``fused`` -> ``failed``: the collectives differ even as written (neither rank's list is
  a prefix of the other's: inputs of other shapes per rank, which fail under plain Inductor too),
  or, once the group ran fused graphs, a peer that does not arrive. Every rank of the group
  raises :class:`RankDisagreement`, now or at its next check.

Why this is safe: a graph runs fused only once every peer confirmed the same rewritten
communication. ``degraded`` is entered from open, where no rank ever ran a fused graph of the
group, so each rank's whole stream of the group's collectives is the one written (plain
Inductor's, which match one-to-one in execution order however the graphs are cut); or from
``fused`` only while every rank of the group is held at a check (none inside a collective, none
able to go on without the others), so the graphs being decided are at the same point of every
rank's program and all of them run as written, and from then on a graph's communication decides:
one that ran fused runs fused (a rank-local recompile of an agreed graph), the others as written.
What cannot degrade is a divergence while a peer does not check: it runs an agreed graph (maybe
inside a fused collective now), and falling back alone would pair an all_reduce with its
reduce-scatter. So is a rank-local recompile whose communication ran both fused and as written
(it cannot tell which of its peers' graphs it pairs with).

Checks at the first compile of a frame (``strict``) also count their visits per communication
(``visit/<digest>/<rank>``): once fused graphs ran, such a check waits until every peer reached
the same communication as often, not only once. A second model whose graph on one rank
communicates exactly as an agreed graph of the first model must not run fused while its peer
reaches a different graph for the same point. A recompile of a known frame (a guard that failed
on one rank only) is not strict: its communication, if it ran fused, runs fused at once.

Store keys, under ``weave_agreement/<ranks>/``: ``mode``; ``ops/<digest>`` and
``written/<digest>`` (the communication after and before the passes, to name a difference);
``has/<digest>/<rank>`` (compiled it); ``ready/<digest>/<rank>`` (compiled it and every other
group of the graph agreed); ``wait/<rank>`` (``<digest>@<visit>#<check>``: what the rank waits on
now, the visit for a strict check, its check number; "" when not waiting); ``checks/<rank>`` (the
rank's checks so far); ``visit/<digest>/<rank>`` (strict checks of it so far); ``held/<rank>/<check>``
(a peer found every rank held, this check included: it runs as written, the value says why);
``ran/<digest>`` (it ran fused); ``deg/<digest>`` (it ran fused and was also run as written).
``weave_agreement/compiling/<rank>`` is "1" while the rank compiles: a peer waiting for it does
not time out meanwhile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Optional

import torch.distributed as dist

Ranks = tuple[int, ...]
PREFIX = "weave_agreement/"
FUSED, DEGRADED, FAILED = "fused", "degraded", "failed"
_MAX_SHOWN = 8  # ops shown per rank in an error message

REMEDY = ("Make every rank compile the same graphs: keep rank-conditional code (a print or .item() on "
          "one rank, a statistic stored on the module by one rank) out of the compiled region, or run it "
          "on every rank behind torch.compiler.disable so every rank breaks the graph at the same place; "
          "give every rank of a group inputs of the same shapes. Or compile with "
          "options={'fuse': False}: the collectives then stay as written, like plain Inductor.")


class RankDisagreement(RuntimeError):
    """Ranks of one process group compiled communication that cannot run together safely."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """How a graph runs: rewritten, or with its collectives as written and why (for ``explain()``)."""

    fused: bool
    reason: str = ""
    #: the degraded groups, each with the reason it degraded (for one warning per group)
    groups: tuple[tuple[Ranks, str], ...] = ()


def digest(ops: list[str]) -> str:
    return hashlib.sha256("\n".join(ops).encode()).hexdigest()[:32]


def agree(store, me: int, plans: dict[Ranks, tuple[list[str], list[str]]], timeout_s: float,
          what: str = "a graph", cap_s: Optional[float] = None, strict: bool = False) -> Decision:
    """Decide with the peers of every group in ``plans`` how this rank's graph runs.

    ``plans[ranks] = (ops, written)``: the graph's communication over that group after and
    before the passes. Waits ``timeout_s`` for missing peers, restarted while they compile, at
    most ``cap_s`` (default ``timeout_s``) in all. ``strict``: the graph is its frame's first
    compile (module doc). Raises :class:`RankDisagreement` where the graph can run neither
    rewritten nor as written.
    """
    groups = [_Group(store, ranks, me, ops, written, what, strict) for ranks, (ops, written) in sorted(plans.items())]
    start = time.monotonic()
    try:
        # Publish for every group before waiting on any: a graph over two groups (a 2-D mesh) never
        # waits on one group while a peer waits for this rank's digest on the other.
        for g in groups:
            g.publish()
        outcome = _wait_all(groups, "has", start, timeout_s, cap_s or timeout_s)
        if outcome is None:  # every peer of every group compiled the same: confirm, then wait for theirs
            for g in groups:
                g.store.set(f"ready/{g.digest}/{me}", "1")
            outcome = _wait_all(groups, "ready", start, timeout_s, cap_s or timeout_s)
        return _decide(groups, outcome, what)
    finally:
        for g in groups:
            g.store.set(f"wait/{me}", "")


@dataclasses.dataclass(frozen=True)
class _Outcome:
    kind: str  # DEGRADED (the group already is) | "disagree" | "absent" | "unsafe"
    detail: str  # why, in a few words (``explain()``, the warning); the whole message if "unsafe"
    sides: str = ""  # what each rank compiled, for an error message
    from_fused: bool = False  # "disagree" with every rank held at a check after fused graphs ran


def _wait_all(groups: list[_Group], stage: str, start: float, timeout_s: float, cap_s: float) -> Optional[_Outcome]:
    """None once every peer of every group published ``stage`` for the digest; else why not."""
    deadline, pause = start + timeout_s, 0.005
    while True:
        pending = []
        for g in groups:
            outcome, missing = g.poll(stage)
            if outcome is not None:
                return outcome
            if missing:
                pending.append((g, missing))
        if not pending:
            return None
        now = time.monotonic()
        if any(_is_compiling(g.root, p) for g, missing in pending for p in missing):
            deadline = max(deadline, now + timeout_s)
        if now > min(deadline, start + cap_s):
            g, missing = pending[0]
            return g.absent(missing, stage, timeout_s)
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


class _Group:
    """One group's side of one graph's check."""

    def __init__(self, store, ranks: Ranks, me: int, ops: list[str], written: list[str], what: str,
                 strict: bool = False):
        self.root = store
        self.store = _group_store(store, ranks)
        self.ranks, self.me, self.what = ranks, me, what
        self.peers = [r for r in ranks if r != me]
        self.ops, self.written = ops, written
        self.digest, self.summary = digest(ops), _summary(ops)
        self.strict = strict
        self.visit: Optional[int] = None  # this check's visit of the digest (strict checks)
        self.seq = 0  # this rank's check number on the group (names this check in held/)

    def mode(self) -> tuple[str, str]:
        """(state, detail): state "" (open), ``fused``, ``degraded`` or ``failed``."""
        if not self.store.check(["mode"]):
            return "", ""
        state, _, detail = self.store.get("mode").decode().partition("\n")
        return state, detail

    def settle(self, target: str, detail: str, from_fused: bool = False) -> tuple[str, str]:
        """Move the mode from open to ``target`` (to ``failed`` also from ``fused``, to ``degraded``
        from ``fused`` where ``from_fused``); the mode it then has."""
        value = f"{target}\n{detail}"
        now = self.store.compare_set("mode", "", value).decode()
        if now.partition("\n")[0] == FUSED and (target == FAILED or (target == DEGRADED and from_fused)):
            self.store.compare_set("mode", now, value)
        return self.mode()

    def publish(self) -> None:
        if self.mode()[0] == FAILED:
            raise self.failed_error()
        # The op lists first: a peer that sees has/ may read them to name the first difference.
        self.store.set(f"ops/{self.digest}", "\n".join(self.ops))
        self.store.set(f"written/{self.digest}", "\n".join(self.written))
        self.store.set(f"has/{self.digest}/{self.me}", f"{self.what}: {self.summary}")
        if self.strict:
            self.visit = int(self.store.add(f"visit/{self.digest}/{self.me}", 1))
        self.seq = int(self.store.add(f"checks/{self.me}", 1))
        self.store.set(f"wait/{self.me}", f"{self.digest}@{self.visit or ''}#{self.seq}")

    def ran(self, d: Optional[str] = None) -> bool:
        """The communication ``d`` (default: this graph's) ran fused on this group."""
        return self.store.check([f"ran/{d or self.digest}"])

    def mark(self, fused: bool) -> None:
        """Record how this graph's communication runs (``ran/``; ``deg/`` where it ran both ways)."""
        if fused:
            self.store.set(f"ran/{self.digest}", "1")
        elif self.ran():
            self.store.set(f"deg/{self.digest}", "1")

    def poll(self, stage: str) -> tuple[Optional[_Outcome], list[int]]:
        """(an outcome that ends the wait, or None; the peers that have not published ``stage`` yet)."""
        state, detail = self.mode()
        if state == FAILED:
            raise self.failed_error()
        if state == DEGRADED and not self.ran():
            return _Outcome(DEGRADED, detail), []
        missing = [p for p in self.peers if not self.store.check([f"{stage}/{self.digest}/{p}"])]
        if state == "":
            differing = [(p, theirs) for p in missing if (theirs := self._deadlocked_with(p))]
            return (self._disagreement(differing) if differing else None), missing
        # Fused graphs ran on this group: a strict check waits for every peer's same visit, and the
        # group degrades only while every rank is held at a check (module doc).
        held = f"held/{self.me}/{self.seq}"
        if self.store.check([held]):  # a peer found every rank held, this check included
            return _Outcome("disagree", self.store.get(held).decode(), from_fused=True), missing
        if not self.strict and self.store.check([f"deg/{self.digest}"]):
            return _Outcome("unsafe", self._ambiguous()), missing
        if stage == "has" and self.visit is not None:
            missing += [p for p in self.peers if p not in missing and self._visits(self.digest, p) < self.visit]
        checks = self._all_held() if missing else None
        if checks:
            differing = [(p, d) for p in self.peers if (d := self._waiting(p)[0]) and d != self.digest]
            if differing:
                outcome = self._disagreement(differing, from_fused=True)
                if outcome.kind != "unsafe":
                    # Every held rank leaves with this decision, also once this one has left its check.
                    for r, seq in checks:
                        self.store.set(f"held/{r}/{seq}", outcome.detail)
                return outcome, missing
        return None, missing

    def _waiting(self, p: int) -> tuple[str, Optional[int], int]:
        """(the digest ``p`` waits on, "" when none; its visit for a strict check; its check number)."""
        if p == self.me:
            return self.digest, self.visit, self.seq
        value = self.store.get(f"wait/{p}").decode() if self.store.check([f"wait/{p}"]) else ""
        value, _, seq = value.partition("#")
        d, _, k = value.partition("@")
        return d, int(k) if k else None, int(seq) if seq else 0

    def _visits(self, d: str, p: int) -> int:
        key = f"visit/{d}/{p}"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def _all_held(self) -> Optional[list[tuple[int, int]]]:
        """``[(rank, its check number)]`` if every rank of the group waits at a check that cannot
        pass (its communication lacks some rank's compile or visit, and every rank is waiting: none
        will publish without a decision), else None."""
        checks = []
        for r in self.ranks:
            d, k, seq = self._waiting(r)
            if not d:
                return None
            done = all(self.store.check([f"has/{d}/{q}"]) for q in self.ranks)
            if done and (k is None or all(self._visits(d, q) >= k for q in self.ranks)):
                return None
            checks.append((r, seq))
        return checks

    def _ambiguous(self) -> str:
        return (f"tokenweave: rank {self.me} recompiled {self.what} (a guard failed on this rank), whose "
                f"communication over process group {list(self.ranks)} ran fused in one graph and as written in "
                f"another after the ranks disagreed, so it cannot tell which of its peers' graphs it pairs "
                f"with. Stopped before {self.what} ran any collective. Rank {self.me} has {self.summary}. "
                + REMEDY)

    def confirmed(self) -> bool:
        """Every peer compiled this communication and every other group of its graph agreed."""
        return all(self.store.check([f"ready/{self.digest}/{p}"]) for p in self.peers)

    def _deadlocked_with(self, p: int) -> str:
        """The digest ``p`` waits for if neither can progress: ``p`` waits for communication this rank
        never compiled, this rank for one ``p`` never compiled, and neither publishes while waiting."""
        theirs = self._waiting(p)[0]
        if theirs and theirs != self.digest and not self.store.check([f"has/{theirs}/{self.me}"]):
            return theirs
        return ""

    def _disagreement(self, differing: list[tuple[int, str]], from_fused: bool = False) -> _Outcome:
        peers = [(q, self._get(f"has/{d}/{q}") or f"digest {d}", self._lines(f"ops/{d}"), self._lines(f"written/{d}"))
                 for q, d in differing]
        counts = ", ".join([f"rank {self.me} {self.what}: {len(self.ops)}"]
                           + [f"rank {q} {summary.partition(':')[0]}: {len(ops)}" for q, summary, ops, _ in peers])
        sides = "; ".join([f"Rank {self.me} has {self.summary}"] + [f"rank {q} has {s}" for q, s, _, _ in peers])
        for q, _, _, written in peers:
            n = min(len(written), len(self.written))
            if written[:n] != self.written[:n]:  # neither is a prefix of the other
                return _Outcome("unsafe", (
                    f"tokenweave: ranks of process group {list(self.ranks)} compiled different graphs whose "
                    f"collectives differ even as written, so they cannot run together (plain Inductor would "
                    f"fail there too: gloo aborts, NCCL hangs). Stopped before {self.what} ran any collective. "
                    f"As written, {first_difference(self.me, self.written, q, written)}. {sides}. " + REMEDY))
        p, _, theirs, _ = peers[0]
        after = ("; the group had run fused graphs: those keep running fused, these and the graphs compiled "
                 "from now on run their collectives as written unless they communicate as one that ran fused"
                 if from_fused else "")
        return _Outcome("disagree", f"its ranks compiled different graphs ({counts} communication op(s)); "
                                    f"{first_difference(self.me, self.ops, p, theirs)}{after}", sides, from_fused)

    def absent(self, missing: list[int], stage: str, timeout_s: float) -> _Outcome:
        what = ("did not reach a graph with the same communication as" if stage == "has" else
                "reached the same communication, but another of their process groups did not agree on")
        return _Outcome("absent", (
            f"rank(s) {missing} {what} {self.what} on rank {self.me} within {timeout_s:g} s (option "
            f"agreement_timeout_s): they run that code eagerly, skipped it, or compiled something else"),
            f"Rank {self.me} has {self.summary}")

    def _get(self, key: str) -> str:
        return self.store.get(key).decode() if self.store.check([key]) else ""

    def _lines(self, key: str) -> list[str]:
        text = self._get(key)
        return text.split("\n") if text else []

    def failed_error(self) -> RankDisagreement:
        return RankDisagreement(
            f"tokenweave: the ranks of process group {list(self.ranks)} cannot run their compiled graphs "
            f"together (decided earlier on this group); rank {self.me} stops before {self.what} runs a "
            f"collective. Rank {self.me} has {self.summary}. The first report: {self.mode()[1]}")


def _decide(groups: list[_Group], outcome: Optional[_Outcome], what: str) -> Decision:
    """Every group of the graph to one final mode, or :class:`RankDisagreement`."""
    target = FUSED if outcome is None else FAILED if outcome.kind == "unsafe" else DEGRADED
    from_fused = outcome is not None and outcome.from_fused
    modes = [g.settle(target, outcome.detail if outcome else "", from_fused) for g in groups]
    states = [state for state, _ in modes]
    # A group that degraded after fused graphs ran still runs fused what ran fused (module doc).
    effective = [FUSED if s == DEGRADED and target == FUSED and g.ran() else s for g, s in zip(groups, states)]
    # Fused also where this rank gave up waiting just as the last peer confirmed and another rank
    # settled the group fused: every peer confirmed this very communication.
    if all(s == FUSED for s in effective) and (target == FUSED or all(g.confirmed() for g in groups)):
        for g in groups:
            g.mark(fused=True)
        return Decision(fused=True)
    # A peer that does not arrive may be running a graph that ran fused: not safe to fall back alone.
    absent_after_fused = target == DEGRADED and outcome.kind == "absent" and any(
        s == FUSED or g.ran() for g, s in zip(groups, states))
    if target != FAILED and all(s == DEGRADED for s in states) and not absent_after_fused:
        for g in groups:
            g.mark(fused=False)
        reasons = tuple((g.ranks, d) for g, (_, d) in zip(groups, modes))
        return Decision(fused=False, reason="; ".join(f"process group {list(r)}: {d}" for r, d in reasons),
                        groups=reasons)
    # Neither way is safe: the ranks' graphs differ even as written (falling back would meet the
    # mismatch in the collective), a peer may be inside a fused collective of the group now (it ran
    # agreed graphs before), or a graph over several groups found them settled differently (a third
    # rank decided one of them meanwhile). Every group of the graph that is not degraded stops.
    earlier = next((g for g, s in zip(groups, states) if s == FAILED and target != FAILED), None)
    if target == FAILED:
        message = outcome.detail
    elif target == DEGRADED and (FUSED in states or absent_after_fused):
        ran = groups[states.index(FUSED)] if FUSED in states else next(g for g in groups if g.ran())
        message = (f"tokenweave: process group {list(ran.ranks)}: {outcome.detail}. "
                   f"The group already ran fused collectives, so its ranks cannot fall back to the "
                   f"collectives as written together (a peer may be inside a fused collective now). Stopped "
                   f"before {what} ran any collective. {outcome.sides}. " + REMEDY)
    else:
        message = (f"tokenweave: {what} communicates over process groups that settled differently "
                   f"({', '.join(f'{list(g.ranks)}: {s}' for g, s in zip(groups, states))}); it can run "
                   f"neither rewritten nor as written. Stopped before it ran any collective. " + REMEDY)
    for g, s in zip(groups, states):
        if s != DEGRADED:
            g.settle(FAILED, f"rank {g.me}: {message}")
    raise earlier.failed_error() if earlier is not None else RankDisagreement(message)


# ----------------------------------------------------------------------------- messages


def first_difference(me: int, mine: list[str], p: int, theirs: list[str]) -> str:
    """Where two ranks' op lists part, in words."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"the first difference is op {i + 1}, {_op_difference(me, a, p, b)}"
    n = min(len(mine), len(theirs))
    longer, extra = (me, mine) if len(mine) > n else (p, theirs)
    if len(extra) == n:
        return "the same ops"
    return f"the first {n} op(s) are the same; rank {longer} has {len(extra) - n} more, the first `{extra[n]}`"


def _op_difference(me: int, a: str, p: int, b: str) -> str:
    """``name: rank me k=v; rank p k=w`` for the arguments that differ (both ops whole if the names do)."""
    (name_a, args_a), (name_b, args_b) = _split_op(a), _split_op(b)
    if name_a != name_b:
        return f"rank {me} `{a}`, rank {p} `{b}`"
    keys = [k for k in {**args_a, **args_b} if args_a.get(k) != args_b.get(k)]
    return (f"{name_a}: rank {me} " + ", ".join(f"{k}={args_a.get(k, '-')}" for k in keys)
            + f"; rank {p} " + ", ".join(f"{k}={args_b.get(k, '-')}" for k in keys))


def _split_op(op: str) -> tuple[str, dict[str, str]]:
    """``ns::name(k=v, k2=[a, b])`` -> ``("ns::name", {"k": "v", "k2": "[a, b]"})``."""
    name, _, rest = op.partition("(")
    rest = rest[:-1] if rest.endswith(")") else rest
    args, depth, start = {}, 0, 0
    for i, ch in enumerate(rest + ","):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            key, _, value = rest[start:i].strip().partition("=")
            args[key] = value
            start = i + 1
    return name, args


def _summary(ops: list[str]) -> str:
    shown = "; ".join(ops[:_MAX_SHOWN]) + (f"; ... ({len(ops) - _MAX_SHOWN} more)" if len(ops) > _MAX_SHOWN else "")
    return f"{len(ops)} communication op(s): {shown}"


# ----------------------------------------------------------------------------- compiling marker


def set_compiling(store, rank: int, on: bool) -> None:
    store.set(f"{PREFIX}compiling/{rank}", "1" if on else "")


def _is_compiling(store, rank: int) -> bool:
    key = f"{PREFIX}compiling/{rank}"
    return store.check([key]) and store.get(key) == b"1"


def _group_store(store, ranks: Ranks):
    """The keys of group ``ranks``'s checks."""
    return dist.PrefixStore(PREFIX + "-".join(map(str, ranks)) + "/", store)


def waiting_at(store, ranks: Ranks, rank: int) -> str:
    """What ``rank`` waits on at a first-call check of group ``ranks`` ("" when it does not)."""
    group = _group_store(store, ranks)
    key = f"wait/{rank}"
    return group.get(key).decode() if group.check([key]) else ""


def as_written_detail(store, ranks: Ranks) -> str:
    """Why group ``ranks`` runs as written (its mode is degraded or failed), or ""."""
    group = _group_store(store, ranks)
    if not group.check(["mode"]):
        return ""
    state, _, detail = group.get("mode").decode().partition("\n")
    return (detail or state) if state in (DEGRADED, FAILED) else ""
