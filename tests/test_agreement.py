"""Ranks that compile different graphs stop with a message naming the cause, before any collective.

Unit tests drive the store exchange with threads standing in for ranks (fast, and they reach
the timeout path); the distributed tests make one gloo rank break its graph or recompile alone.
"""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from weave_compile import agreement
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

A = ["weave.allreduce_add_rmsnorm(x=float32[8, 32], residual_out_sharded=False)"]
B = ["_c10d_functional.all_reduce(input=float32[8, 32], reduce_op='sum')"]


def _as_ranks(ops_per_rank, timeout_s=30.0, store=None):
    """Run ``agree`` for every rank in a thread; returns (per-rank exception or None, seconds)."""
    store = store or dist.HashStore()
    ranks = tuple(range(len(ops_per_rank)))
    errors = [None] * len(ranks)

    def one(r):
        try:
            agreement.agree(store, ranks, r, ops_per_rank[r], timeout_s)
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            errors[r] = e

    start = time.monotonic()
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "agree() did not return"
    return errors, time.monotonic() - start


def test_same_graphs_agree():
    errors, _ = _as_ranks([A, A, A])
    assert errors == [None, None, None]


@pytest.mark.parametrize("world", [2, 3])
def test_different_graphs_fail_on_every_rank_without_waiting_for_the_timeout(world):
    ops = [A] * world
    ops[world - 1] = B  # the last rank compiled a different graph
    errors, seconds = _as_ranks(ops, timeout_s=60.0)
    assert seconds < 10, seconds
    for e in errors:
        assert isinstance(e, agreement.RankDisagreement), errors
        assert "compiled different graphs" in str(e) and "fuse': False" in str(e)
    # The first rank to see it names both sides.
    assert any("weave.allreduce_add_rmsnorm" in str(e) and "_c10d_functional.all_reduce" in str(e) for e in errors)


def test_an_identical_graph_compiled_again_on_one_rank_agrees_at_once():
    """A rank-local guard failure recompiles the same graph on one rank: the peer's digest is already there."""
    store = dist.HashStore()
    assert _as_ranks([A, A], store=store)[0] == [None, None]
    start = time.monotonic()
    agreement.agree(store, (0, 1), 0, A, timeout_s=30.0)  # rank 0 alone, again
    assert time.monotonic() - start < 1.0


def test_a_peer_that_never_checks_is_a_bounded_wait_with_a_message():
    start = time.monotonic()
    with pytest.raises(agreement.RankDisagreement, match=r"rank\(s\) \[1\] .* did not compile .* within 1 s"):
        agreement.agree(dist.HashStore(), (0, 1), 0, A, timeout_s=1.0)
    assert time.monotonic() - start < 5


def test_a_disagreement_is_final_for_the_group_and_only_for_it():
    store = dist.HashStore()
    assert all(isinstance(e, agreement.RankDisagreement) for e in _as_ranks([A, B], store=store)[0])
    errors, seconds = _as_ranks([A, A], store=store)  # the same ranks retry with agreeing graphs
    assert all(isinstance(e, agreement.RankDisagreement) and "first report" in str(e) for e in errors), errors
    assert seconds < 5
    errors, _ = _as_ranks([A, A, A], store=store)  # another group (ranks 0, 1, 2): unaffected
    assert errors == [None, None, None]


def test_plan_names_group_by_ranks_and_describes_arguments():
    ops = agreement.merge([{(0, 1): ["a"]}, {(0, 1): ["b"], (0, 2): ["c"]}])
    assert ops == {(0, 1): ["a", "b"], (0, 2): ["c"]}
    assert agreement.digest(["a", "b"]) != agreement.digest(["b", "a"])


# ----------------------------------------------------------------------------- on gloo ranks


def _diverging(rank, world_size, diverge, seed):
    import weave_compile
    from weave_compile.testing.chains import SiteChain, eager_float64

    m = SiteChain(32, [None, None, None], seed=seed, diverge_on_rank=0, diverge=diverge)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for options in ({"compiler": "aot_eager"}, {"compiler": "aot_eager", "fuse": False}):
        torch._dynamo.reset()
        weave_compile.reset()
        compiled = torch.compile(m, backend="tokenweave", options=options)
        errs, error, start = [], None, time.monotonic()
        try:
            for _ in range(3):
                x, r = torch.randn(9, 32, generator=g), torch.randn(9, 32, generator=g)
                with torch.no_grad():
                    got = compiled(x, r)
                ref = eager_float64(m, x, r)
                errs.append(((got.double() - ref).norm() / ref.norm()).item())
        except agreement.RankDisagreement as e:
            error = str(e)
        out[options.get("fuse", True)] = (errs, error, time.monotonic() - start,
                                          len(weave_compile.explain().graphs))
    return out


@pytest.fixture(scope="module")
def diverged():
    import random

    seed = random.randrange(2**31)
    # One run each: a disagreement is final for the group, a later check over the same ranks fails.
    return seed, {d: assert_ranks_ok(run_ranks(_diverging, 2, args=(d, seed), timeout=300)) for d in ("break", "count")}


def test_graph_break_on_one_rank_stops_every_rank_before_a_collective(diverged):
    seed, results = diverged
    for rank, r in enumerate(results["break"]):
        errs, error, seconds, _ = r[True]
        assert error is not None, f"seed={seed} rank {rank}: no disagreement reported; errors {errs}"
        assert "compiled different graphs" in error and "torch.compiler.disable" in error, error
        assert "residual_out_sharded=True" in error  # rank 1's side (one graph, residual sharded) is named
        assert seconds < 60, seconds
        errs, error, _, _ = r[False]  # without the rewrite the collectives are as written: correct
        assert error is None and max(errs) < 1e-5, (seed, error, errs)


def test_identical_recompile_on_one_rank_is_accepted_and_correct(diverged):
    seed, results = diverged
    results = results["count"]
    for r in results:
        errs, error, _, _ = r[True]
        assert error is None and len(errs) == 3 and max(errs) < 1e-5, (seed, error, errs)
    assert results[0][True][3] > results[1][True][3]  # rank 0 did compile more graphs
