"""The ranks' decision, driven with threads standing in for ranks on one in-memory store.

Fast, and they reach every path: agreement, each way to degrade, each way to fail, the timeout,
the compiling marker, a graph over two groups. The same protocol on gloo ranks, with real graphs,
is in ``tests/test_agreement.py``.
"""

import threading
import time

import pytest
import torch.distributed as dist

from weave_compile import consensus
from weave_compile.consensus import RankDisagreement

X8 = "float32[8, 32]"
FUSED_A = f"weave::allreduce_add_rmsnorm(x={X8}, residual={X8}, residual_out_sharded=False)"
FUSED_B = f"weave::allreduce_add_rmsnorm(x={X8}, residual={X8}, residual_out_sharded=True)"
AR = f"_c10d_functional.all_reduce(input={X8}, reduce_op='sum')"
AR10 = "_c10d_functional.all_reduce(input=float32[10, 32], reduce_op='sum')"
A = ([FUSED_A, FUSED_A], [AR, AR])  # (rewritten, as written)
B = ([FUSED_A, FUSED_B], [AR, AR])  # the same collectives as written, fused differently
A1 = ([FUSED_A], [AR])  # A cut short after its first collective (a graph break)


def _as_ranks(plans_per_rank, timeout_s=30.0, store=None, what=None, strict=False):
    """Each rank's ``agree`` in a thread: per rank the Decision or the exception, and the seconds taken.

    ``plans_per_rank[r]``: ``{ranks: (ops, written)}``, or one ``(ops, written)`` for the group of all.
    ``strict``: every rank's check is its frame's first compile (a new model), else a recompile.
    """
    store = dist.HashStore() if store is None else store
    n = len(plans_per_rank)
    results = [None] * n

    def one(r):
        plans = plans_per_rank[r]
        plans = plans if isinstance(plans, dict) else {tuple(range(n)): plans}
        try:
            results[r] = consensus.agree(store, r, plans, timeout_s, what or f"graph {r}", strict=strict)
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            results[r] = e

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(n) if plans_per_rank[r] is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 20)
    assert not any(t.is_alive() for t in threads), "agree() did not return"
    return results, time.monotonic() - start


def _fused(results):
    return [isinstance(r, consensus.Decision) and r.fused for r in results]


def _degraded(results):
    return [isinstance(r, consensus.Decision) and not r.fused for r in results]


def test_same_graphs_run_fused():
    results, _ = _as_ranks([A, A, A])
    assert _fused(results) == [True] * 3, results


@pytest.mark.parametrize("world", [2, 3])
def test_different_graphs_degrade_on_every_rank_without_waiting_for_the_timeout(world):
    plans = [A] * world
    plans[world - 1] = B  # the last rank's graph shards its residual differently
    results, seconds = _as_ranks(plans, timeout_s=60.0)
    assert seconds < 10, seconds
    assert _degraded(results) == [True] * world, results
    for d in results:  # one decision, so one reason, on every rank: it names the differing argument
        assert d.reason == results[0].reason
        assert f"process group {list(range(world))}: its ranks compiled different graphs" in d.reason
        assert "the first difference is op 2" in d.reason and "residual_out_sharded=" in d.reason
        assert d.groups == ((tuple(range(world)), d.reason.split(": ", 1)[1]),)


def test_a_graph_cut_short_on_one_rank_degrades():
    """A graph break on rank 0: its first graph's collectives as written are a prefix of rank 1's."""
    results, _ = _as_ranks([A1, A])
    assert _degraded(results) == [True, True], results
    assert "the first 1 op(s) are the same; rank 1 has 1 more" in results[0].reason + results[1].reason


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_that_differ_even_as_written_raise_on_every_rank(world):
    """Inputs of other shapes on one rank: falling back would meet a size mismatch, so it stops."""
    plans = [([FUSED_A], [AR])] * world
    plans[0] = ([FUSED_A.replace("[8, 32]", "[10, 32]")], [AR10])
    results, seconds = _as_ranks(plans, timeout_s=60.0)
    assert seconds < 10, seconds
    for e in results:
        assert isinstance(e, RankDisagreement), results
        assert "differ even as written" in str(e) or "first report" in str(e), e
    first = next(str(e) for e in results if "differ even as written" in str(e))
    assert "float32[10, 32]" in first and X8 in first and "fuse': False" in first


def test_an_identical_graph_compiled_again_on_one_rank_runs_fused_at_once():
    """A rank-local guard failure recompiles the same graph on one rank: the peer's digest is there."""
    store = dist.HashStore()
    assert _fused(_as_ranks([A, A], store=store)[0]) == [True, True]
    start = time.monotonic()
    assert consensus.agree(store, 0, {(0, 1): A}, 30.0).fused  # rank 0 alone, again
    assert time.monotonic() - start < 1.0


def test_a_peer_that_never_arrives_degrades_the_group_after_the_timeout():
    start = time.monotonic()
    d = consensus.agree(dist.HashStore(), 0, {(0, 1): A}, timeout_s=1.0, what="graph 3")
    assert 1.0 <= time.monotonic() - start < 5
    assert not d.fused
    assert "rank(s) [1] did not reach a graph with the same communication as graph 3 on rank 0 within 1 s" in d.reason
    assert "agreement_timeout_s" in d.reason


def test_a_peer_that_arrives_later_runs_as_written_too():
    store = dist.HashStore()
    assert not consensus.agree(store, 0, {(0, 1): A}, timeout_s=0.5).fused
    start = time.monotonic()
    late = consensus.agree(store, 1, {(0, 1): A}, timeout_s=30.0)  # the same graph, compiled late
    assert not late.fused and "did not reach" in late.reason
    assert time.monotonic() - start < 1.0


def test_a_peer_that_is_compiling_is_waited_for():
    store = dist.HashStore()
    consensus.set_compiling(store, 1, True)

    def arrive_late():
        time.sleep(2.5)  # compiling for 2.5 timeouts
        consensus.set_compiling(store, 1, False)
        consensus.agree(store, 1, {(0, 1): A}, timeout_s=1.0)

    t = threading.Thread(target=arrive_late)
    t.start()
    start = time.monotonic()
    d = consensus.agree(store, 0, {(0, 1): A}, timeout_s=1.0, cap_s=30.0)
    t.join(30)
    assert d.fused, d
    assert time.monotonic() - start > 2.0
    # The cap bounds the wait however long the peer compiles.
    consensus.set_compiling(store, 2, True)
    start = time.monotonic()
    assert not consensus.agree(store, 0, {(0, 2): A}, timeout_s=1.0, cap_s=2.0).fused
    assert 2.0 <= time.monotonic() - start < 5


@pytest.mark.parametrize("strict", [False, True])
def test_after_fused_graphs_ranks_held_at_different_graphs_degrade_those_without_waiting(strict):
    """A second model after the first one's fused graphs: every rank waits at the first call of a
    graph the others did not compile. No rank is inside a collective: they run those graphs as
    written, and what ran fused keeps running fused."""
    store = dist.HashStore()
    assert _fused(_as_ranks([A, A], store=store, strict=True)[0]) == [True, True]
    results, seconds = _as_ranks([A1, B], store=store, timeout_s=60.0, strict=strict)  # the next graphs differ
    assert seconds < 10, seconds
    assert _degraded(results) == [True, True], results
    for d in results:
        assert "its ranks compiled different graphs" in d.reason and "had run fused graphs" in d.reason
    # The agreed graph, compiled again on one rank (a guard failed there), still runs fused at once ...
    start = time.monotonic()
    assert consensus.agree(store, 0, {(0, 1): A}, 30.0).fused
    # ... and a graph whose communication never ran fused runs as written at once, on every rank.
    C = ([FUSED_B, FUSED_B], [AR, AR])
    results, _ = _as_ranks([C, C], store=store, strict=strict)
    assert _degraded(results) == [True, True], results
    assert time.monotonic() - start < 2.0


def test_a_new_model_whose_graph_communicates_as_an_agreed_one_waits_for_its_peer():
    """Rank 1's second model compiles to communication that ran fused in the first one, rank 0's does
    not (it stores a statistic): a first compile of a frame waits for the peer's same visit, so the
    ranks meet at their checks and degrade, instead of rank 1 entering fused collectives alone."""
    store = dist.HashStore()
    assert _fused(_as_ranks([A, A], store=store, strict=True)[0]) == [True, True]
    results, seconds = _as_ranks([B, A], store=store, timeout_s=60.0, strict=True)
    assert seconds < 10, seconds
    assert _degraded(results) == [True, True], results
    # Where both ranks' new model communicates as the agreed graph, it runs fused.
    results, _ = _as_ranks([A, A], store=dist.PrefixStore("x", store), strict=True)
    assert _fused(results) == [True, True], results


def test_a_rank_held_when_a_peer_decided_leaves_with_that_decision_after_the_peer_left():
    """Rank 0 sees both ranks held and degrades, then leaves its check (its wait key cleared) before
    rank 1 looks again: rank 1's own check (communication that ran fused) must still end, degraded."""
    store = dist.HashStore()
    assert _fused(_as_ranks([A, A], store=store, strict=True)[0]) == [True, True]
    g1 = consensus._Group(store, (0, 1), 1, *A, "graph 1", strict=True)
    g0 = consensus._Group(store, (0, 1), 0, *B, "graph 0", strict=True)
    g1.publish()
    g0.publish()
    outcome, _ = g0.poll("has")
    assert outcome is not None and outcome.from_fused, outcome
    assert not consensus._decide([g0], outcome, "graph 0").fused
    g0.store.set("wait/0", "")  # rank 0 left its check (agree's finally)
    late, _ = g1.poll("has")
    assert late is not None and late.from_fused and "compiled different graphs" in late.detail, late
    assert not consensus._decide([g1], late, "graph 1").fused


def test_a_recompile_whose_communication_ran_both_ways_stops():
    """After the degrade above, rank 1 recompiles its second model's graph (communication A, which
    also ran fused): it cannot tell whether it pairs with the peer's fused or as-written graph."""
    store = dist.HashStore()
    assert _fused(_as_ranks([A, A], store=store, strict=True)[0]) == [True, True]
    assert _degraded(_as_ranks([B, A], store=store, strict=True)[0]) == [True, True]
    start = time.monotonic()
    with pytest.raises(RankDisagreement, match="cannot tell which of its peers' graphs it pairs with"):
        consensus.agree(store, 1, {(0, 1): A}, 30.0)
    assert time.monotonic() - start < 2.0


def test_after_fused_graphs_a_rank_that_does_not_check_keeps_the_others_from_degrading():
    """Three ranks: 0 and 1 wait at different graphs, 2 runs an agreed graph (it may be inside a fused
    collective): not every rank is held, so nobody falls back; the timeout ends it with an error."""
    store = dist.HashStore()
    assert _fused(_as_ranks([A, A, A], store=store)[0]) == [True] * 3
    results, seconds = _as_ranks([A1, B, None], store=store, timeout_s=1.0)
    assert all(isinstance(e, RankDisagreement) for e in results[:2]), results
    assert "already ran fused collectives" in " ".join(map(str, results[:2]))
    assert 1.0 <= seconds < 10, seconds


def test_after_fused_graphs_a_peer_that_never_arrives_raises_after_the_timeout():
    """A guard failed on rank 0 only: rank 1 runs its agreed graph, maybe inside a fused collective."""
    store = dist.HashStore()
    assert _fused(_as_ranks([A, A], store=store)[0]) == [True, True]
    start = time.monotonic()
    with pytest.raises(RankDisagreement, match=r"rank\(s\) \[1\] did not reach .* already ran fused collectives"):
        consensus.agree(store, 0, {(0, 1): B}, timeout_s=1.0)
    assert time.monotonic() - start < 5
    with pytest.raises(RankDisagreement, match="first report"):  # final: rank 1's next check stops too
        consensus.agree(store, 1, {(0, 1): A}, timeout_s=30.0)


def test_degraded_is_final_for_the_group_and_only_for_it():
    store = dist.HashStore()
    assert _degraded(_as_ranks([A, B], store=store)[0]) == [True, True]
    results, seconds = _as_ranks([A, A], store=store)  # agreeing graphs of the same group, later
    assert _degraded(results) == [True, True] and seconds < 2, results
    assert _fused(_as_ranks([A, A, A], store=store)[0]) == [True] * 3  # another group (ranks 0, 1, 2)


def test_failed_is_final_for_the_group():
    store = dist.HashStore()
    first, _ = _as_ranks([([FUSED_A], [AR]), ([FUSED_A.replace("[8, 32]", "[10, 32]")], [AR10])], store=store)
    assert all(isinstance(e, RankDisagreement) for e in first), first
    results, seconds = _as_ranks([A, A], store=store)  # the same ranks retry with agreeing graphs
    assert all(isinstance(e, RankDisagreement) and "first report" in str(e) for e in results), results
    assert seconds < 5


def test_a_graph_over_two_groups_degrades_both_when_one_disagrees():
    """Rank 1's graph reduces over {0, 1} and {1, 2}; rank 2 compiled other communication on {1, 2}.

    Rank 0 agrees with rank 1 on {0, 1}, yet must not run fused there: rank 1 runs that graph as
    written. It waits for rank 1's confirmation, which never comes; {0, 1} degrades with {1, 2}.
    """
    plans = [{(0, 1): A}, {(0, 1): A, (1, 2): A}, {(1, 2): B}]
    results, seconds = _as_ranks(plans, timeout_s=60.0)
    assert _degraded(results) == [True] * 3, results
    assert seconds < 10, seconds
    assert "process group [1, 2]: its ranks compiled different graphs" in results[1].reason


def test_first_difference_names_the_differing_arguments_only():
    text = consensus.first_difference(0, [AR, FUSED_A], 1, [AR, FUSED_B])
    assert text == ("the first difference is op 2, weave::allreduce_add_rmsnorm: rank 0 residual_out_sharded=False; "
                    "rank 1 residual_out_sharded=True")
    shapes = consensus.first_difference(0, [AR], 1, [AR10])
    assert shapes.endswith("rank 0 input=float32[8, 32]; rank 1 input=float32[10, 32]")
    names = consensus.first_difference(0, [AR], 1, [FUSED_A])
    assert names == f"the first difference is op 1, rank 0 `{AR}`, rank 1 `{FUSED_A}`"


def test_a_rank_that_gave_up_as_the_group_settled_fused_runs_fused():
    """Rank 0 timed out waiting for rank 1's confirmation just as it came and rank 1 settled the
    group fused: every peer confirmed rank 0's communication, so rank 0 runs fused too."""
    store = dist.HashStore()
    groups = [consensus._Group(store, (0, 1), r, *A, f"graph {r}") for r in (0, 1)]
    for g in groups:
        g.publish()
        g.store.set(f"ready/{g.digest}/{g.me}", "1")
    assert consensus._decide([groups[1]], None, "graph 1").fused
    late = consensus._Outcome("absent", "rank(s) [1] reached the same communication, but ...")
    assert consensus._decide([groups[0]], late, "graph 0").fused
    # Not so where the peer never confirmed this communication: the group ran other fused graphs.
    other = consensus._Group(store, (0, 1), 0, *B, "graph 2")
    other.publish()
    with pytest.raises(RankDisagreement, match="already ran fused collectives"):
        consensus._decide([other], consensus._Outcome("absent", "rank(s) [1] did not reach ..."), "graph 2")
