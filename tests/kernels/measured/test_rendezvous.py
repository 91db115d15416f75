"""The meeting before any timing collective: every rank at the same sites, or none measures."""

import threading
import time

import pytest
import torch.distributed as dist

from weave_compile.kernels.measured import rendezvous


@pytest.fixture(autouse=True)
def fresh_visits():
    rendezvous.reset()
    yield
    rendezvous.reset()


def meet_all(store, digests, timeout_s=5.0, delays=None, compiling=None, first_call=None):
    """Each global rank (its position in ``digests``) meets for its digest in a thread; a digest of
    None: that rank never comes."""
    ranks = tuple(range(len(digests)))
    out = [None] * len(digests)

    def one(r):
        time.sleep((delays or {}).get(r, 0.0))
        # every rank counts its own visits (its own process in real use)
        rendezvous._visits.clear()
        out[r] = rendezvous.meet(store, ranks, r, digests[r], {"rank": r}, timeout_s, compiling=compiling,
                                first_call=first_call)

    threads = [threading.Thread(target=one, args=(r,)) for r, d in enumerate(digests) if d is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_rank_meets_and_reads_every_post():
    store = dist.HashStore()
    got = meet_all(store, ["d1", "d1", "d1"])
    assert all(m.ok for m in got)
    assert [p["rank"] for p in got[0].posts] == [0, 1, 2]


def test_a_rank_measuring_other_sites_stops_the_meeting_on_every_rank():
    store = dist.HashStore()
    start = time.monotonic()
    got = meet_all(store, ["d1", "d2"], timeout_s=20.0)
    assert not any(m.ok for m in got)
    assert all("measures other sites" in m.reason for m in got), [m.reason for m in got]
    assert time.monotonic() - start < 10  # not by the timeout


def test_a_rank_that_never_comes_times_out_the_others():
    store = dist.HashStore()
    start = time.monotonic()
    got = meet_all(store, ["d1", "d1", None], timeout_s=0.3)
    assert time.monotonic() - start < 10
    assert not got[0].ok and not got[1].ok and "rank 2 did not reach the same sites" in got[0].reason


def test_a_peer_waiting_at_a_first_call_ends_the_meeting_without_the_timeout():
    """Rank 2 compiled past these sites and waits at its graph's first call: it will not come."""
    store = dist.HashStore()
    start = time.monotonic()
    got = meet_all(store, ["d1", "d1", None], timeout_s=30.0,
                   first_call=lambda r: "digest@#1" if r == 2 else "")
    assert time.monotonic() - start < 10
    assert not got[0].ok and not got[1].ok
    assert all("rank 2 runs a graph whose sites" in m.reason for m in got[:2]), [m.reason for m in got[:2]]


def test_a_first_call_mark_seen_only_briefly_is_not_a_wait():
    """A peer leaving its first-call check clears the mark at once: the meeting waits for its post."""
    store = dist.HashStore()
    seen = {"n": 0}

    def first_call(r):  # rank 1's mark is there for the first look only, then rank 1 comes
        seen["n"] += 1
        return "digest@#1" if r == 1 and seen["n"] < 3 else ""

    got = meet_all(store, ["d1", "d1"], timeout_s=10.0, delays={1: 2 * rendezvous.SETTLE_S}, first_call=first_call)
    assert all(m.ok for m in got), [m.reason for m in got]


def test_a_compiling_peer_is_waited_for():
    store = dist.HashStore()
    arrived = threading.Event()

    def compiling(rank):
        return rank == 1 and not arrived.is_set()

    def late():
        time.sleep(0.8)
        arrived.set()

    threading.Thread(target=late).start()
    got = meet_all(store, ["d1", "d1"], timeout_s=0.3, delays={1: 0.8}, compiling=compiling)
    assert all(m.ok for m in got), [m.reason for m in got]


def test_go_set_by_a_peer_holds_for_a_rank_past_its_deadline():
    store = dist.HashStore()
    root = "weave_measure/0,1/d1#1"
    store.set(f"{root}/post/1", '{"rank": 1}')
    store.set(f"{root}/state", "go")  # rank 1 saw every post first
    m = rendezvous.meet(store, (0, 1), 0, "d1", {"rank": 0}, 0.05)
    assert m.ok and [p["rank"] for p in m.posts] == [0, 1]


def test_exchange_after_go_returns_every_ranks_payload():
    store = dist.HashStore()
    meetings = meet_all(store, ["d1", "d1"])
    out = [None, None]

    def ex(r):
        out[r] = meetings[r].exchange("stats", {"r": r})

    threads = [threading.Thread(target=ex, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out[0] == out[1] == [{"r": 0}, {"r": 1}]


def test_a_second_measurement_of_the_same_sites_is_another_meeting():
    store = dist.HashStore()
    ranks = (0, 1)
    results = []

    def rank_body(r):
        mine = []
        for _ in range(2):
            mine.append(rendezvous.meet(store, ranks, r, "d1", {"rank": r}, 5.0))
        results.append((r, mine))

    # one process per rank in real use: the visit counters are per process, emulated by a key per rank
    saved = rendezvous._visits
    counters = {0: {}, 1: {}}

    class PerThread(dict):
        def get(self, k, d=None):
            return counters[threading.current_thread().rank].get(k, d)

        def __setitem__(self, k, v):
            counters[threading.current_thread().rank][k] = v

    rendezvous._visits = PerThread()
    try:
        threads = []
        for r in ranks:
            t = threading.Thread(target=rank_body, args=(r,))
            t.rank = r
            threads.append(t)
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        rendezvous._visits = saved
    assert len(results) == 2 and all(m.ok for _, ms in results for m in ms)
    roots = {m.root for _, ms in results for m in ms}
    assert roots == {"weave_measure/0,1/d1#1", "weave_measure/0,1/d1#2"}
