"""Settling the ranks' timings into one answer, and the graph's verdict."""

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from weave_compile.kernels.measured import choice
from weave_compile.kernels.measured.signature import Signature
from weave_compile.kernels.measured.timing import AS_WRITTEN, Stat, stat_of


def sig(tokens=None, token_range=None, **kw):
    base = dict(device="cuda", ranks=(0, 1), hidden=4096, dtype="bfloat16", residual_in="bfloat16",
                residual_dtype="bfloat16", out_dtype="bfloat16", weight="bfloat16")
    return Signature(**{**base, **kw}, tokens=tokens, token_range=token_range)


def table(entries):
    """{(cand, sig key, bucket): (median, spread)} -> a Stats table."""
    out = {}
    for (c, k, b), v in entries.items():
        out.setdefault(c, {}).setdefault(k, {})[str(b)] = list(v)
    return out


def test_stat_is_median_and_interquartile_spread():
    s = stat_of([10.0, 11.0, 12.0, 13.0, 100.0])
    assert s.median_us == 12.0 and abs(s.spread - (13.0 - 11.0) / 12.0) < 1e-12
    assert Stat.from_json(s.to_json()) == Stat(12.0, round(s.spread, 5))


def test_settle_takes_the_slowest_rank_and_the_largest_spread():
    a = sig(tokens=64)
    r0 = table({("p2p", a.key(), 64): (10.0, 0.01), (AS_WRITTEN, a.key(), 64): (20.0, 0.05)})
    r1 = table({("p2p", a.key(), 64): (12.0, 0.03), (AS_WRITTEN, a.key(), 64): (19.0, 0.01)})
    got = choice.settle([r0, r1], ["p2p", AS_WRITTEN])
    assert got == table({("p2p", a.key(), 64): (12.0, 0.03), (AS_WRITTEN, a.key(), 64): (20.0, 0.05)})


def test_settle_keeps_only_entries_every_rank_measured():
    a = sig(tokens=64)
    r0 = table({("p2p", a.key(), 64): (10.0, 0.0), ("ce", a.key(), 64): (9.0, 0.0)})
    r1 = table({("p2p", a.key(), 64): (11.0, 0.0)})
    assert choice.settle([r0, r1], ["p2p", "ce"]) == table({("p2p", a.key(), 64): (11.0, 0.0)})


def test_fused_only_where_it_wins_by_the_margin_at_every_bucket():
    a = sig(token_range=(1, 4))  # buckets 1, 2, 4
    k = a.key()
    times = {("nccl", k, 1): (30, 0.0), (AS_WRITTEN, k, 1): (20, 0.0),  # loses at T=1
             ("nccl", k, 2): (10, 0.0), (AS_WRITTEN, k, 2): (20, 0.0),
             ("nccl", k, 4): (10, 0.0), (AS_WRITTEN, k, 4): (20, 0.0)}
    got = choice.decide(table(times), {k: a}, [[k]], ["nccl", AS_WRITTEN])
    assert not got["fused"] and "T=1" in got["reason"]
    times[("nccl", k, 1)] = (19.7, 0.0)  # 1.5% faster: under MIN_GAIN
    assert not choice.decide(table(times), {k: a}, [[k]], ["nccl", AS_WRITTEN])["fused"]
    times[("nccl", k, 1)] = (19.0, 0.0)  # 5% faster
    got = choice.decide(table(times), {k: a}, [[k]], ["nccl", AS_WRITTEN])
    assert got["fused"] and choice.site_kernel(got, [k]) == "nccl"


def test_the_margin_grows_with_the_spread():
    a = sig(tokens=64)
    k = a.key()
    t = table({("p2p", k, 64): (18.0, 0.15), (AS_WRITTEN, k, 64): (20.0, 0.01)})  # 10% faster, 15% spread
    got = choice.decide(t, {k: a}, [[k]], ["p2p", AS_WRITTEN])
    assert not got["fused"] and got["buckets"]["64"]["margin"] == 0.15


def test_sites_are_decided_together():
    first, inner = sig(tokens=64, residual_in=None), sig(tokens=64, residual_in_sharded=True, residual_out_sharded=True)
    t = table({("p2p", first.key(), 64): (30.0, 0.0), (AS_WRITTEN, first.key(), 64): (20.0, 0.0),
               ("p2p", inner.key(), 64): (15.0, 0.0), (AS_WRITTEN, inner.key(), 64): (20.0, 0.0)})
    sigs = {first.key(): first, inner.key(): inner}
    # one slow first site and four faster inner ones: 90 against 100, fused as a whole
    got = choice.decide(t, sigs, [[first.key()]] + [[inner.key()]] * 4, ["p2p", AS_WRITTEN])
    assert got["fused"] and got["buckets"]["64"] == {"fused_us": 90.0, "written_us": 100.0, "margin": 0.02,
                                                      "wins": True}
    # one inner site only: 45 against 40, as written as a whole
    assert not choice.decide(t, sigs, [[first.key()], [inner.key()]], ["p2p", AS_WRITTEN])["fused"]


def test_per_bucket_winners_make_a_table_and_ties_go_to_the_earlier_candidate():
    a = sig(token_range=(1, 4))
    k = a.key()
    t = table({("nccl", k, 1): (5, 0), ("p2p", k, 1): (7, 0), (AS_WRITTEN, k, 1): (50, 0),
               ("nccl", k, 2): (7, 0), ("p2p", k, 2): (7, 0), (AS_WRITTEN, k, 2): (50, 0),
               ("nccl", k, 4): (9, 0), ("p2p", k, 4): (6, 0), (AS_WRITTEN, k, 4): (50, 0)})
    got = choice.decide(t, {k: a}, [[k]], ["nccl", "p2p", AS_WRITTEN])
    assert got["fused"] and choice.site_kernel(got, [k]) == "by_tokens:nccl<=2,p2p"
    got = choice.decide(t, {k: a}, [[k]], ["p2p", "nccl", AS_WRITTEN])
    assert choice.site_kernel(got, [k]) == "by_tokens:nccl<=1,p2p"


def test_batch_invariant_gives_each_site_one_design_for_every_bucket():
    """``one_design``: the design with the least time summed over the buckets, everywhere (a row
    must not change implementation with the token count), ties to the earlier candidate."""
    a = sig(token_range=(1, 4))
    k = a.key()
    t = table({("nccl", k, 1): (5, 0), ("reference", k, 1): (7, 0), (AS_WRITTEN, k, 1): (50, 0),
               ("nccl", k, 2): (7, 0), ("reference", k, 2): (6, 0), (AS_WRITTEN, k, 2): (50, 0),
               ("nccl", k, 4): (9, 0), ("reference", k, 4): (6, 0), (AS_WRITTEN, k, 4): (50, 0)})
    assert choice.site_kernel(choice.decide(t, {k: a}, [[k]], ["nccl", "reference", AS_WRITTEN]), [k]) \
        == "by_tokens:nccl<=1,reference"  # per bucket, without the option
    got = choice.decide(t, {k: a}, [[k]], ["nccl", "reference", AS_WRITTEN], one_design=True)
    assert got["fused"] and choice.site_kernel(got, [k]) == "reference"  # 19 us over the buckets against 21
    tie = table({(d, k, b): (5, 0) for d in ("nccl", "reference") for b in (1, 2, 4)})
    assert choice.site_kernel(choice.decide(tie, {k: a}, [[k]], ["reference", "nccl"], one_design=True), [k]) \
        == "reference"


def test_under_the_split_the_halves_decide_together_and_the_site_as_written_is_no_candidate():
    pre, suf = sig(tokens=1024, split=True), sig(tokens=3072, split=True)
    t = table({("p2p", pre.key(), 1024): (10, 0), ("ce", pre.key(), 1024): (12, 0),
               ("p2p", suf.key(), 3072): (40, 0), ("ce", suf.key(), 3072): (30, 0)})
    got = choice.decide(t, {pre.key(): pre, suf.key(): suf}, [[pre.key(), suf.key()]], ["p2p", "ce"])
    assert got["fused"] and choice.site_kernel(got, [pre.key(), suf.key()]) == "by_tokens:p2p<=1024,ce"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(1, 1000), min_size=3, max_size=3), min_size=2, max_size=4))
def test_every_rank_settles_the_same_answer_whatever_order_the_posts_come_in(per_rank):
    """What each rank computes from the same posts is the same answer (the posts arrive in group
    order on every rank; the settled table does not depend on which rank is slowest where)."""
    a = sig(tokens=256)
    k = a.key()
    cands = ["nccl", "p2p", AS_WRITTEN]
    posts = [table({(c, k, 256): (v, 0.0) for c, v in zip(cands, vals)}) for vals in per_rank]
    answers = []
    for perm in itertools.islice(itertools.permutations(range(len(posts))), 6):
        settled = choice.settle([posts[i] for i in perm], cands)
        answers.append(choice.decide(settled, {k: a}, [[k]], cands))
    assert all(x == answers[0] for x in answers)
    worst = {c: max(r[i] for r in per_rank) for i, c in enumerate(cands)}
    best = min(("nccl", "p2p"), key=lambda c: (worst[c], c != "nccl"))
    assert answers[0]["fused"] == (worst[best] <= worst[AS_WRITTEN] * (1 - choice.MIN_GAIN))
    if answers[0]["fused"]:
        assert choice.site_kernel(answers[0], [k]) == best
