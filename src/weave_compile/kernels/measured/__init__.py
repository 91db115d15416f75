"""The measured choice: each graph's sites get the design that is fastest on the machine it runs on.

``kernel="auto"`` with ``autotune=True`` (the default) asks :func:`choose` once per graph and
group, at compile time, with the graph's sites as :class:`~.signature.Signature` s (what shapes
each op call's time, the residual's layout included). The answer comes from the first of:

1. **this run**: the group settled the same sites earlier in this process (no store traffic: every
   rank of the group holds the same answer);
2. **a meeting** on the store (:mod:`.rendezvous`): every rank posts the sites and the answer its
   disk cache (:mod:`.cache`) or its FX-graph-cache-served graph holds. No rank starts anything
   collective before every rank posted the same; a peer that measures other sites, or does not come
   within ``agreement_timeout_s``, makes the whole group keep the shipped rules
   (:func:`weave_compile.kernels.auto.choose`), with the reason. Where any rank posted an answer,
   every rank takes the same one (a served graph's first, else the lowest rank's cache);
3. **a measurement**: the candidates' capability checks (collective probes), their workspaces, the
   float64 oracle check of each design (:func:`.timing.check`; a wrong design never competes), then
   every candidate timed at every token bucket (:mod:`.timing`), the ranks' statistics exchanged on
   the store and settled into one answer (:mod:`.choice`), written to the disk cache.

The answer is applied by the fuse pass: every site as written, or each site its fastest design
(per token bucket: a table the op dispatches by, :mod:`.dispatch`). Being the op's ``kernel``
argument, the choice stays in the graph's communication plan: ranks whose answers differed
anyway would still be caught by the first-call agreement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from typing import Callable, Optional

import torch

from .. import registry
from ..registry import Site
from . import cache, choice, dispatch, rendezvous, timing
from .choice import MIN_GAIN
from .signature import Signature, bucket_of
from .timing import AS_WRITTEN, Stat

__all__ = ["AS_WRITTEN", "MIN_GAIN", "Request", "Outcome", "Signature", "bucket_of", "choose", "dispatch",
           "forget", "set_timer"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Request:
    """One graph's sites over one group, as the pass layer hands them over."""

    group_name: str
    ranks: tuple[int, ...]
    #: per site (the collective node's name), the signatures of its op calls (two for a split layer)
    sites: dict[str, list[Signature]]
    #: per site, what the capability checks and the reservations take
    where: dict[str, Site]
    #: the options that shape the op or its timing (part of every cache key)
    options: dict
    compiler: str = "inductor"
    mode: str = "default"
    timeout_s: float = 60.0
    #: the store the ranks meet on (None: a group of one process, e.g. the fake process group)
    store: object = None
    #: whether a rank is compiling now (its peers' wait restarts meanwhile)
    compiling: Optional[Callable[[int], bool]] = None
    #: ``(ranks, rank) -> str``: what a rank waits on at a graph's first call ("" when it does not)
    first_call: Optional[Callable[[tuple, int], str]] = None
    #: the site as written competes (not under the split, which needs the fused op)
    written_competes: bool = True
    backend: str = ""


@dataclasses.dataclass
class Outcome:
    """The answer for a request, or why there is none (the shipped rules apply then)."""

    answer: Optional[dict]
    source: str  # where the answer came from, or why there is none
    digest: str = ""
    seconds: float = 0.0
    #: designs whose workspaces, reserved for this measurement, were freed (they won nowhere)
    freed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.answer is not None

    def kernel(self, sigs: list[Signature]) -> str:
        return choice.site_kernel(self.answer, [s.key() for s in sigs])


#: answers the group settled in this process: (ranks, digest) -> answer
_settled: dict[tuple, dict] = {}
#: test hook: ``timer(candidate, signature, bucket, group_rank) -> Stat`` in place of the timing
_timer: Optional[Callable[[str, Signature, int, int], Stat]] = None


def set_timer(timer: Optional[Callable[[str, Signature, int, int], Stat]]) -> None:
    """Replace the timing of every candidate by ``timer`` (None: real timing). For tests of what the
    settling and the dispatch do with timings that differ between ranks or buckets; the checks,
    the meeting and the exchange run as always."""
    global _timer
    _timer = timer


def forget() -> None:
    """Forget what was settled in this process (a test that builds a new group)."""
    _settled.clear()
    rendezvous.reset()


def candidates_for(req: Request) -> list[str]:
    """The designs that may compete before anything collective runs: every registered design that
    takes what the sites need; on CUDA not the eager ``reference`` chain (the CPU path and the
    oracle, measured 1.1-1.7x plain Inductor's time: docs/performance.md), then the site as written."""
    from ..auto import takes, written_invariant

    device = next(iter(req.where.values())).device
    out = []
    for impl in registry.implementations():
        if impl.fallback and device.type == "cuda":
            continue
        if all(takes(impl, site) is None for site in req.where.values()):
            out.append(impl.name)
    # batch_invariant: the site as written only where it is invariant too (two CPU ranks)
    written = req.written_competes and (not req.options.get("batch_invariant")
                                        or written_invariant(len(req.ranks), device))
    return out + ([AS_WRITTEN] if written else [])


def _digest(req: Request, candidates: list[str]) -> str:
    shape = sorted(choice.site_key([s.key() for s in sigs]) for sigs in req.sites.values())
    sigs = {s.key(): s.to_json() for sigs in req.sites.values() for s in sigs}
    text = json.dumps({"sites": shape, "sigs": sigs, "candidates": candidates, "options": req.options},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def choose(req: Request) -> Outcome:
    """The answer for ``req`` (module doc); where anything raises, no answer, with the reason (the
    shipped rules apply): a peer then inside a timing collective fails at the process group's
    timeout, as at any collective a rank leaves."""
    try:
        return _choose(req)
    except Exception as e:  # noqa: BLE001 - the compile goes on under the shipped rules
        log.warning("tokenweave: the measured choice failed, the shipped rules apply: %s: %s", type(e).__name__, e)
        log.debug("tokenweave: where the measured choice failed", exc_info=True)
        return Outcome(None, f"not measured: {type(e).__name__}: {e}")


def _choose(req: Request) -> Outcome:
    start = time.monotonic()
    cands = candidates_for(req)
    digest = _digest(req, cands)
    device = next(iter(req.where.values())).device
    settled = _settled.get((req.ranks, digest))
    if settled is not None:
        return Outcome(settled, "settled earlier in this run", digest)
    fp = cache.fingerprint(device, req.ranks, req.backend, req.options, cands, digest)
    cached, cache_why = cache.load(fp)
    post = {"cached": cached, "served": False}
    if req.store is None:
        meeting = rendezvous.alone(post)
    else:
        meeting = rendezvous.meet(req.store, req.ranks, _my_rank(), digest, post, req.timeout_s,
                                  compiling=req.compiling,
                                  first_call=req.first_call and (lambda r: req.first_call(req.ranks, r)))
    if not meeting.ok:
        return Outcome(None, f"not measured: {meeting.reason}", digest, time.monotonic() - start)
    posted = _posted_answer(meeting.posts)
    freed: list[str] = []
    if posted is not None:
        answer, source = posted
        if answer != cached:
            cache.save(fp, answer)
    else:
        with _real_tensors():
            answer, freed = _measure(req, cands, meeting)
        source = f"measured now ({cache_why}), {time.monotonic() - start:.1f} s"
        cache.save(fp, answer)
    _settled[(req.ranks, digest)] = answer
    return Outcome(answer, source, digest, time.monotonic() - start, tuple(freed))


def served(store, ranks: tuple[int, ...], digest: str, answer: dict) -> None:
    """A rank whose graph Inductor served from its FX graph cache posts the answer that graph holds:
    peers measuring the same sites take it instead of waiting for this rank."""
    if store is not None:
        rendezvous.post_only(store, ranks, _my_rank(), digest, {"cached": answer, "served": True})
    _settled[(ranks, digest)] = answer


def _my_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _posted_answer(posts: list[dict]) -> Optional[tuple[dict, str]]:
    """The answer every rank takes where some rank posted one: a served graph's first (its graph
    is fixed), else the lowest rank's cache entry."""
    for want, what in ((True, "served by rank {}'s cached graph"), (False, "cache of rank {}")):
        for i, p in enumerate(posts):
            if p.get("cached") is not None and bool(p.get("served")) == want:
                return p["cached"], ("disk cache" if len(posts) == 1 else what.format(i))
    return None


# ----------------------------------------------------------------------------- measuring


def _measure(req: Request, cands: list[str], meeting: rendezvous.Meeting) -> tuple[dict, list[str]]:
    """Checks, workspaces, the oracle check, the timing, the settling: every step collective in one
    order on every rank (they met on the same sites and candidates). Returns the answer and the
    designs whose workspaces were freed after."""
    from ...rows import group_size_rank
    from ..auto import unavailable

    _, group_rank = group_size_rank(req.group_name)
    sites = list(req.where.values())
    device = sites[0].device
    fake = req.backend == "fake"
    designs = [c for c in cands if c != AS_WRITTEN]
    # 1. what can run (collective probes), agreed: a design runs only where it runs on every rank
    why_not = {}
    for d in designs:
        found = [unavailable(registry.get(d), s) for s in sites]  # every site: the probes are collective
        why_not[d] = next((w for w in found if w), None)
    posted = meeting.exchange("available", why_not)
    excluded = {d: next(p[d] for p in posted if p[d]) for d in designs if any(p[d] for p in posted)}
    designs = [d for d in designs if d not in excluded]
    # 2. workspaces for the largest bucket (collective); what each table held before, so that the
    # entries added for designs that win nowhere are freed after
    sigs = {s.key(): s for ss in req.sites.values() for s in ss}
    reserved = list(designs)
    held = {id(t): t.keys() for t in _tables(reserved)}
    for d in reserved:
        impl = registry.get(d)
        if impl.reserve is not None:
            for site in _reserve_sites(req):
                impl.reserve(site)
    # 3. the site as written, compiled once per written form when first timed
    written = _WrittenRunners(req) if AS_WRITTEN in cands else None
    # 4. the oracle check (collective runs, local comparison), agreed
    seed = int(_digest_seed(meeting))
    failures = {}
    if not fake:
        for d in designs:
            # Every signature on every rank (collective calls), whatever an earlier one found.
            found = [timing.check(d, s, req.group_name, group_rank, device, seed) for s in sigs.values()]
            failures[d] = next((w for w in found if w), None)
        posted = meeting.exchange("checked", failures)
        for d in designs:
            bad = [(i, p[d]) for i, p in enumerate(posted) if p[d]]
            if bad:
                excluded[d] = f"wrong result on rank {bad[0][0]}: {bad[0][1]}"
        designs = [d for d in designs if d not in excluded]
    # 5. the timing
    competing = designs + ([AS_WRITTEN] if AS_WRITTEN in cands else [])
    local: choice.Stats = {}
    barrier = _barrier(req.group_name, device)
    for key, sig in sigs.items():
        for b in sig.buckets():
            stats = _time_bucket(req, sig, b, competing, written, group_rank, device, meeting, barrier)
            for cand, st in stats.items():
                local.setdefault(cand, {}).setdefault(key, {})[str(b)] = st.to_json()
    if written is not None:
        written.release()
    table = choice.settle(meeting.exchange("stats", local), competing)
    answer = choice.decide(table, sigs, [[s.key() for s in ss] for ss in req.sites.values()], competing,
                           one_design=bool(req.options.get("batch_invariant")))
    answer["excluded"] = excluded
    answer["checked"] = "skipped: the fake process group's collectives move nothing" if fake else "float64 oracle"
    return answer, _free_losers(reserved, choice.used(answer), held, barrier)


def _tables(designs: list[str]) -> list:
    """The distinct workspace tables of ``designs`` (designs may share one)."""
    out = {}
    for d in designs:
        t = registry.get(d).workspaces
        if t is not None:
            out[id(t)] = t
    return list(out.values())


def _free_losers(designs: list[str], winners: set[str], held: dict, barrier: Callable[[], None]) -> list[str]:
    """Drop the workspace entries this measurement added for designs that won nowhere (a table a
    winner shares is kept whole; an entry held before, even grown since, is kept): every rank
    decided the same answer, and the barrier puts every rank past its last timed call (no peer
    still writes into the memory) before any entry goes. Returns the designs freed."""
    keep = {id(t) for t in _tables(sorted(winners))}
    losers = [d for d in designs if d not in winners and registry.get(d).workspaces is not None]
    drop = {id(t): t for t in _tables(losers) if id(t) not in keep}
    if not drop:
        return []
    barrier()
    for tid, t in drop.items():
        t.drop(t.keys() - held.get(tid, frozenset()))
    freed = [d for d in losers if id(registry.get(d).workspaces) in drop]
    log.info("tokenweave: freed the workspaces reserved to time %s (won nowhere)", ", ".join(freed))
    return freed


@contextlib.contextmanager
def _real_tensors():
    """Real tensors and eager kernels inside the graph's compile: the post-grad passes run under
    the compile's fake tensor mode (and maybe a tracing mode), which would make every timed input
    a fake tensor, and under the Python dispatcher, which AOT autograd enables: there a gloo
    all-gather of one rank never completed (seen on torch 2.13)."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing(), no_python_dispatcher(), torch.no_grad():
        yield


def _digest_seed(meeting: rendezvous.Meeting) -> int:
    """A seed every rank of the meeting shares."""
    return int(hashlib.sha256((meeting.root or "alone").encode()).hexdigest()[:8], 16)


class _WrittenRunners:
    """The site as written per signature, compiled when first timed, once per *written form*: the
    residual's layout and the op's own settings are the fused op's, not the plain graph's (a
    sequence-parallel site's shard is the model's), so signatures that differ only there share
    one compile."""

    def __init__(self, req: Request):
        self.req = req
        self.compiled: dict[str, Callable] = {}

    def __call__(self, sig: Signature) -> Callable:
        sharded = sig.sequence_parallel
        form = dataclasses.replace(sig, residual_in_sharded=sharded and sig.residual_in is not None,
                                   residual_out_sharded=sharded, split=False, comm_ctas=1, out_slot=False)
        if form.key() not in self.compiled:
            self.compiled[form.key()] = timing.written_runner(form, self.req.group_name, self.req.compiler,
                                                              self.req.mode)
        return self.compiled[form.key()]

    def release(self) -> None:
        for runner in self.compiled.values():
            runner.release()


def _reserve_sites(req: Request) -> list[Site]:
    """One site per distinct (hidden, dtypes) with the largest bucket as its size hint."""
    out = {}
    for name, site in req.where.items():
        top = max(b for s in req.sites[name] for b in s.buckets())
        k = (site.hidden, site.dtype, site.residual_dtype, site.out_dtype, site.residual_in_dtype, site.out_in_place)
        if k not in out or (out[k].size_hint or 0) < top:
            out[k] = dataclasses.replace(site, size_hint=top)
    return list(out.values())


def _barrier(group_name: str, device: torch.device) -> Callable[[], None]:
    """A device barrier on the group: a one-element all_reduce, waited for on the host."""
    flag = torch.ones(1, device=device)
    c10d = torch.ops._c10d_functional

    def barrier():
        c10d.wait_tensor(c10d.all_reduce(flag, "sum", group_name))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return barrier


def _time_bucket(req: Request, sig: Signature, bucket: int, competing: list[str], written, group_rank: int,
                 device: torch.device, meeting: rendezvous.Meeting, barrier) -> dict[str, Stat]:
    """Every competing candidate's :class:`Stat` at one signature and bucket on this rank."""
    if _timer is not None:
        stats = {c: _timer(c, sig, bucket, group_rank) for c in competing}
        barrier()  # the injected timer still meets the group where the real timing would
        return stats
    inp = timing.make_inputs(sig, bucket, group_rank, device, seed=bucket, all_ranks=False)
    runs = {c: (written(sig)(inp) if c == AS_WRITTEN else timing.fused_runner(c, sig, req.group_name, inp))
            for c in competing}
    calib = {c: timing.calibrate(r, device) for c, r in runs.items()}
    agreed = meeting.exchange(f"calib/{sig.key()}/{bucket}", calib)
    graphs = req.mode == "reduce-overhead"
    blocks = {c: timing.Block(r, timing.calls_per_block(max(a[c] for a in agreed)), device, graphs)
              for c, r in runs.items()}
    return timing.time_rounds(blocks, barrier)


# ----------------------------------------------------------------------------- what explain() says


def site_reason(outcome: Outcome, sigs: list[Signature]) -> str:
    """A site's kernel reason under the measured choice: its design(s) and times against the site
    as written, at up to three buckets (the graph's table in ``explain()`` has them all)."""
    answer = outcome.answer
    kernel = outcome.kernel(sigs)
    shown = []
    for sig in sigs[:1]:
        per = answer["times"]
        winners = answer["winners"][choice.site_key([s.key() for s in sigs])]
        for b in [str(b) for b in sig.buckets()][:3]:
            d = winners.get(b)
            t = per.get(d, {}).get(sig.key(), {}).get(b)
            w = per.get(AS_WRITTEN, {}).get(sig.key(), {}).get(b)
            if t is None:
                continue
            text = f"T={b}: {d} {t[0]:.1f} us"
            if w is not None:
                text += f" vs as written {w[0]:.1f} us ({t[0] / w[0]:.2f}x)"
            shown.append(text)
    more = len(sigs[0].buckets()) - 3 if sigs else 0
    return (f"auto, measured ({outcome.source}): {dispatch.describe(kernel)}; " + "; ".join(shown)
            + (f"; +{more} more buckets" if more > 0 else ""))


def _time_cell(median_us: float, spread: float) -> str:
    """A table cell: the median per call (whole microseconds from 100 us up, where a tenth is
    below the noise) and its spread."""
    digits = 0 if median_us >= 100 else 1
    return f"{median_us:.{digits}f} us ±{spread:.0%}"


def report(outcome: Outcome, req: Request) -> dict:
    """One group's measured choice for ``explain()`` (JSON: it is stored with the graph's report)."""
    out = {"group": list(req.ranks), "source": outcome.source, "digest": outcome.digest}
    if not outcome.ok:
        return {**out, "reason": "shipped rules: " + outcome.source, "rows": []}
    answer = outcome.answer
    sigs = {s.key(): s for ss in req.sites.values() for s in ss}
    counts: dict[str, int] = {}
    for ss in req.sites.values():
        for s in ss:
            counts[s.key()] = counts.get(s.key(), 0) + 1
    rows = []
    for key, sig in sigs.items():
        for b in sig.buckets():
            cells = {c: answer["times"][c][key][str(b)] for c in answer["candidates"]
                     if str(b) in answer["times"].get(c, {}).get(key, {})}
            designs = {c: v for c, v in cells.items() if c != AS_WRITTEN}
            best = min(designs, key=lambda c: designs[c][0]) if designs else "-"
            rows.append({"signature": sig.describe(), "sites": counts[key], "T": b, "best": best,
                         "times": {c: _time_cell(*v) for c, v in cells.items()}})
    return {**out, "reason": answer["reason"], "rows": rows, "excluded": answer.get("excluded", {}),
            "checked": answer.get("checked", ""), "freed": list(outcome.freed)}
