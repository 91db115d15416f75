"""From every rank's timings to one answer: settled the same way on every rank.

Each rank posts, per candidate, signature and token bucket, its :class:`~.timing.Stat` (median
time per call over the rounds, and spread). :func:`settle` makes one table of them: per entry the
**largest median over the ranks** (a collective is as slow as its slowest rank) and the largest
spread; every rank computes it from the same posts, candidates in one fixed order (ties go to
the earlier), so every rank gets the same answer.

Then, for one graph's sites of one group:

- **per site and bucket, the fastest design**: the one with the least time summed over the site's
  op calls in that bucket (one call, or a split layer's two halves);
- **fused or as written, once for the graph**: a site left as written breaks its neighbours'
  sharded residual, so the sites are decided together. At every bucket, the graph's fused time
  (each site's fastest design, summed over the sites) must be below the time of the sites as
  written by more than the margin: :data:`MIN_GAIN` or the spread of the entries compared,
  whichever is larger. Where it is not, at any bucket, every site stays as written. Under the
  split the sites must be fused (the split needs the op) and the site as written is not a
  candidate.

The answer is JSON (the disk cache and the store carry it) and names no graph node: a second
graph with the same sites takes the same answer (:func:`site_kernels`).
"""

from __future__ import annotations

from typing import Optional

from . import dispatch
from .signature import Signature
from .timing import AS_WRITTEN, Stat

#: A fused design replaces the sites as written only where it is at least this much faster (or
#: by the measured spread where that is larger): the run-to-run drift of one GPU is a few percent.
MIN_GAIN = 0.02

Stats = dict[str, dict[str, dict[str, list]]]  # candidate -> signature key -> bucket -> [median us, spread]


def settle(per_rank: list[Stats], candidates: list[str]) -> Stats:
    """One table from every rank's: the largest median and the largest spread over the ranks, for
    the entries every rank measured."""
    out: Stats = {}
    for cand in candidates:
        tables = [r.get(cand) or {} for r in per_rank]
        keys = set(tables[0]).intersection(*tables[1:]) if tables else set()
        for sig in sorted(keys):
            buckets = set(tables[0][sig]).intersection(*(t[sig] for t in tables[1:]))
            for b in sorted(buckets, key=int):
                stats = [Stat.from_json(t[sig][b]) for t in tables]
                out.setdefault(cand, {}).setdefault(sig, {})[b] = [max(s.median_us for s in stats),
                                                                   max(s.spread for s in stats)]
    return out


def site_key(sig_keys: list[str]) -> str:
    """A site as its op calls' signatures (one, or a split layer's two halves)."""
    return "|".join(sig_keys)


def decide(table: Stats, sigs: dict[str, Signature], sites: list[list[str]], candidates: list[str],
           min_gain: float = MIN_GAIN, one_design: bool = False) -> dict:
    """The answer for a graph's sites (module doc). ``sites``: each site's signature keys;
    ``candidates``: the fused designs that passed the check, in tie order, then (where it competes)
    :data:`AS_WRITTEN`. ``one_design`` (``batch_invariant``): each site one design at every bucket,
    the one with the least time summed over them (designs that round alike, but a row must not
    change implementation with the token count)."""
    designs = [c for c in candidates if c != AS_WRITTEN and c in table]
    written = AS_WRITTEN in candidates and AS_WRITTEN in table

    def med(cand: str, sig: str, b: str) -> Optional[float]:
        v = table.get(cand, {}).get(sig, {}).get(b)
        return None if v is None else v[0]

    def spread(cand: str, sig: str, b: str) -> float:
        v = table.get(cand, {}).get(sig, {}).get(b)
        return 0.0 if v is None else v[1]

    winners: dict[str, dict[str, str]] = {}
    for keys in {site_key(s): s for s in sites}.values():
        per_bucket: dict[str, str] = {}
        for b in sorted({str(x) for k in keys for x in sigs[k].buckets()}, key=int):
            calls = [k for k in keys if int(b) in sigs[k].buckets()]
            best = None
            for d in designs:
                times = [med(d, k, b) for k in calls]
                if None not in times and (best is None or sum(times) < best[0]):
                    best = (sum(times), d)
            if best is not None:
                per_bucket[b] = best[1]
        if one_design and per_bucket:
            total = {d: sum(med(d, k, b) or 0.0 for b in per_bucket for k in keys if int(b) in sigs[k].buckets())
                     for d in designs if all(med(d, k, b) is not None for b in per_bucket
                                             for k in keys if int(b) in sigs[k].buckets())}
            best = min(total, key=lambda d: (total[d], designs.index(d))) if total else None
            per_bucket = {b: best for b in per_bucket} if best else {}
        winners[site_key(keys)] = per_bucket
    answer = {"winners": winners, "times": table, "candidates": candidates, "checks": {}}
    if any(not w for w in winners.values()):
        return {**answer, "fused": False, "reason": "no fused design was timed at every bucket of a site"}
    if not written:
        return {**answer, "fused": True, "reason": "fastest design per site (the site as written is not a candidate)",
                "buckets": {}}
    verdicts: dict[str, dict] = {}
    for b in sorted({str(x) for s in sites for k in s for x in sigs[k].buckets()}, key=int):
        fused_us = written_us = 0.0
        spreads = [0.0]
        for keys in sites:
            d = winners[site_key(keys)].get(b)
            for k in keys:
                if int(b) not in sigs[k].buckets():
                    continue
                f, w = med(d, k, b), med(AS_WRITTEN, k, b)
                if f is None or w is None:
                    return {**answer, "fused": False, "reason": f"the site as written was not timed at T={b}"}
                fused_us += f
                written_us += w
                spreads += [spread(d, k, b), spread(AS_WRITTEN, k, b)]
        margin = max(min_gain, max(spreads))
        verdicts[b] = {"fused_us": round(fused_us, 3), "written_us": round(written_us, 3), "margin": round(margin, 4),
                       "wins": fused_us <= written_us * (1 - margin)}
    losing = [b for b, v in verdicts.items() if not v["wins"]]
    if losing:
        b = losing[0]
        v = verdicts[b]
        why = (f"as written: the fused sites are not faster by the margin at T={b} ({v['fused_us']:.1f} us fused vs "
               f"{v['written_us']:.1f} us as written, margin {v['margin']:.1%})")
        return {**answer, "fused": False, "reason": why, "buckets": verdicts}
    ratios = [v["fused_us"] / v["written_us"] for v in verdicts.values() if v["written_us"] > 0]
    why = (f"fused: {min(ratios):.2f}-{max(ratios):.2f}x the time of the sites as written at every bucket"
           if ratios else "fused")
    return {**answer, "fused": True, "reason": why, "buckets": verdicts}


def site_kernel(answer: dict, sig_keys: list[str]) -> str:
    """The ``kernel`` argument of a site whose op calls have ``sig_keys``: its design, or a table by
    token count where its buckets' winners differ (:mod:`.dispatch`)."""
    per_bucket = answer["winners"][site_key(sig_keys)]
    return dispatch.encode([(int(b), d) for b, d in per_bucket.items()])


def used(answer: dict) -> set[str]:
    """The designs the answer runs at some site and bucket (none where the sites stay as written)."""
    if not answer.get("fused"):
        return set()
    return {d for per_bucket in answer["winners"].values() for d in per_bucket.values()}
