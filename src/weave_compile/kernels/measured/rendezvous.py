"""Every rank of the group at the same measurement before any timing collective: a meeting on the store.

Ranks can compile different graphs, or different numbers of graphs (rank-dependent code, a
recompile on one rank, a rank served from Inductor's FX graph cache, which runs no pass): a rank
that starts a timing collective its peers never start hangs until the process group's timeout.
So before anything collective, each rank *posts* what it is about to measure (a digest of the
graph's signatures and candidates, and the answer its disk cache holds for it, if any) and waits
until every rank of the group posted the same. The meeting's outcome is one store key, set once
by compare-and-set, so every rank reads the same: ``go`` (every rank posted; measure, or take a
posted answer) or ``no:<why>`` (a peer measures something else, or did not come within the
timeout: every rank keeps the shipped rules, with the reason). A rank that times out still reads
``go`` where a peer completed the meeting first, and then takes part.

Keys, under ``weave_measure/<ranks>/``: ``wait/<rank>`` (``<digest>#<visit>`` while the rank
waits at a meeting, else ""); ``<digest>#<visit>/post/<rank>`` (its post, JSON);
``<digest>#<visit>/state``; ``<digest>#<visit>/x/<tag>/<rank>`` (what :meth:`Meeting.exchange`
shares after ``go``). ``visit`` counts the rank's meetings for the digest (a second graph with
the same signatures meets again, unless the group settled it earlier in this run).

While a missing peer is compiling (the first-call agreement's ``compiling`` mark,
:mod:`weave_compile.consensus`) the wait restarts, capped by the process group's store timeout.
A missing peer that waits at the first call of a graph (that agreement's ``wait`` mark, seen
unchanged for :data:`SETTLE_S`) compiled past this point without posting: it will not come, and
its agreement waits for this rank's first call, so the meeting ends at once instead of at the
timeout. (A rank leaves its first-call agreement microseconds after it ends; a compile takes
seconds: the settling time tells a stale mark from a real wait.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Optional

log = logging.getLogger(__name__)

PREFIX = "weave_measure/"
GO = "go"
SETTLE_S = 1.0
_visits: dict[tuple, int] = {}


@dataclasses.dataclass
class Meeting:
    """One meeting's outcome on this rank: ``ok`` (go) with every rank's post, else why not."""

    ok: bool
    posts: list[dict]
    reason: str = ""
    store: Any = None
    root: str = ""
    me: int = 0  # this rank's position in the group
    size: int = 1

    def exchange(self, tag: str, payload: Any) -> list[Any]:
        """Every rank's ``payload`` for ``tag`` (JSON), in group order; waits for them (the store's
        timeout bounds it: after ``go`` every rank is here). Without a store: this rank's alone."""
        if self.store is None:
            return [payload]
        keys = [f"{self.root}/x/{tag}/{r}" for r in range(self.size)]
        self.store.set(keys[self.me], json.dumps(payload))
        self.store.wait(keys)
        return [json.loads(v) for v in self.store.multi_get(keys)] if hasattr(self.store, "multi_get") \
            else [json.loads(self.store.get(k)) for k in keys]


def alone(post: dict) -> Meeting:
    """A meeting of one (no peers, or the fake process group: no one else will post)."""
    return Meeting(True, [post])


def meet(store, ranks: tuple[int, ...], me: int, digest: str, post: dict, timeout_s: float,
         cap_s: Optional[float] = None, compiling=None, first_call=None) -> Meeting:
    """Post ``post`` for ``digest`` and wait for every rank of ``ranks`` (module doc). ``me``: this
    rank's global rank. ``compiling(rank)``: whether a rank is compiling now (the wait restarts, up
    to ``cap_s`` in all: by default the store's timeout). ``first_call(rank)``: what the rank waits
    on at a graph's first call ("" when it does not)."""
    group_key = ",".join(map(str, ranks))
    _visits[(group_key, digest)] = visit = _visits.get((group_key, digest), 0) + 1
    base = f"{PREFIX}{group_key}"
    session = f"{digest}#{visit}"
    root = f"{base}/{session}"
    pos = ranks.index(me)
    post_keys = [f"{root}/post/{r}" for r in range(len(ranks))]
    store.set(post_keys[pos], json.dumps(post))
    store.set(f"{base}/wait/{pos}", session)
    if cap_s is None:  # the store's own timeout (the process group's) caps a wait that compiling peers extend
        limit = getattr(store, "timeout", None)
        cap_s = limit.total_seconds() if hasattr(limit, "total_seconds") else timeout_s
    cap_s = max(timeout_s, cap_s)
    start = time.monotonic()
    deadline, pause = start + timeout_s, 0.005
    seen: dict[int, tuple[str, float]] = {}  # a peer's first-call wait and when this rank first saw it
    try:
        while True:
            state = _get(store, f"{root}/state")
            if state:
                break
            missing = [r for r in range(len(ranks)) if r != pos and not store.check([post_keys[r]])]
            if not missing:
                state = _decide(store, root, GO)
                break
            # A peer blocked at an undecided meeting of other sites will not post ours before this one
            # ends, nor this rank post theirs: neither can end. (A peer still at a decided meeting
            # is about to leave it.)
            elsewhere = [r for r in missing if _waits_elsewhere(store, base, r, session)]
            if elsewhere:
                why = "no:the ranks compiled different graphs here: rank {} measures other sites than rank {}"
                state = _decide(store, root, why.format(ranks[elsewhere[0]], me))
                for r in elsewhere:  # and the peer's meeting cannot end either: say so there
                    _decide(store, f"{base}/{_get(store, f'{base}/wait/{r}')}", why.format(me, ranks[r]))
                break
            now = time.monotonic()
            at_first_call = [r for r in missing if first_call is not None and _settled_wait(seen, r, first_call(ranks[r]), now)]
            if at_first_call:
                why = "no:the ranks compiled different graphs here: rank {} runs a graph whose sites rank {} does not measure"
                state = _decide(store, root, why.format(ranks[at_first_call[0]], me))
                break
            if compiling is not None and any(compiling(ranks[r]) for r in missing):
                deadline = max(deadline, now + timeout_s)
            if now > min(deadline, start + cap_s):
                state = _decide(store, root, f"no:rank {ranks[missing[0]]} did not reach the same sites within "
                                             f"{timeout_s:g} s (agreement_timeout_s)")
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
    finally:
        store.set(f"{base}/wait/{pos}", "")
    if state != GO:
        return Meeting(False, [], state[3:] if state.startswith("no:") else state)
    posts = [json.loads(_get(store, k)) for k in post_keys]
    return Meeting(True, posts, store=store, root=root, me=pos, size=len(ranks))


def post_only(store, ranks: tuple[int, ...], me: int, digest: str, post: dict) -> None:
    """Post for ``digest`` without waiting: a rank whose graph is already fixed (served from
    Inductor's FX graph cache) tells the peers that measure what it runs."""
    group_key = ",".join(map(str, ranks))
    _visits[(group_key, digest)] = visit = _visits.get((group_key, digest), 0) + 1
    store.set(f"{PREFIX}{group_key}/{digest}#{visit}/post/{ranks.index(me)}", json.dumps(post))


def _settled_wait(seen: dict, r: int, value: str, now: float) -> bool:
    """Whether the peer waits on ``value`` and has since this rank first saw it :data:`SETTLE_S` ago."""
    if not value:
        seen.pop(r, None)
        return False
    if seen.get(r, ("", 0.0))[0] != value:
        seen[r] = (value, now)
    return now - seen[r][1] >= SETTLE_S


def _waits_elsewhere(store, base: str, rank_pos: int, session: str) -> bool:
    other = _get(store, f"{base}/wait/{rank_pos}")
    return other not in ("", session) and not _get(store, f"{base}/{other}/state")


def _get(store, key: str) -> str:
    return store.get(key).decode() if store.check([key]) else ""


def _decide(store, root: str, want: str) -> str:
    """The meeting's state: ``want`` if this rank sets it first, else what a peer set."""
    got = store.compare_set(f"{root}/state", "", want)
    return got.decode() if isinstance(got, bytes) else str(got)


def reset() -> None:
    """Forget the visit counts (tests that start a new group in the same process)."""
    _visits.clear()
