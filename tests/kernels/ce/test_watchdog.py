"""The ``ce`` watchdog (kernels/ce/watchdog.py) on CPU: emulated ranks' programs simulated op by op,
a fake clock, the CPU rescue (NaN, abort words, flags) that the device rescue mirrors.

A rank whose peer never issues its call blocks in a wait; the watchdog must fire after the
timeout and not before, name the group, rank, peer and flag, poison and release, make later calls
raise, release calls that were enqueued before the failure, and never fire on progress or idling.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tests.kernels.ce.test_copy_engine import ce_call, simulate
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.ce import watchdog as wd_mod
from weave_compile.kernels.ce.watchdog import Watchdog

N, T, H = 2, 10, 16
FP32 = torch.float32


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Ranks:
    """Each rank's ops, run one at a time as far as the flags allow (as independent streams)."""

    def __init__(self, programs):
        self.programs, self.pcs = programs, [0] * len(programs)

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for r, prog in enumerate(self.programs):
                while self.pcs[r] < len(prog):
                    op = prog[self.pcs[r]]
                    if isinstance(op, ce.Wait) and int(op.flag.item()) < 1:
                        break
                    simulate([[op]], random.Random(0))
                    self.pcs[r] += 1
                    moved = True

    def done(self, r: int) -> bool:
        return self.pcs[r] == len(self.programs[r])


def _setup(timeout=10.0, rescue=None):
    clock = Clock()
    wss = ce.emulated_workspaces(N, 8, H, (FP32,) * 3)
    wd = Watchdog(timeout_s=timeout, poll_s=1.0, clock=clock, rescue=rescue)
    wd.watch(wss)
    return clock, wss, wd


def _call(ws, residual_out_sharded=False):
    x, res = torch.randn(T, H), torch.randn(T, H)
    normed, res_out, prog = ce_call(ws, x, res, residual_out_sharded=residual_out_sharded, run=False)
    normed.fill_(7.0)  # finite sentinels: what must turn NaN
    res_out.fill_(7.0)
    return normed, res_out, prog


def test_a_peer_that_never_signals_is_caught(caplog):
    clock, wss, wd = _setup()
    normed, res_out, prog = _call(wss[0])  # rank 1's call is never issued
    ranks = Ranks([prog])
    ranks.run()
    assert not ranks.done(0)  # blocked in its reduce-scatter wait
    with caplog.at_level(logging.ERROR, logger=wd_mod.__name__):
        for t in (0.0, 5.0, 9.9):
            clock.now = t
            assert wd.check() == [] and wss[0].failed is None
        assert int(wss[0].regions[0].abort) == 0
        clock.now = 10.0
        fired = wd.check()
    assert len(fired) == 1
    msg = fired[0]
    for part in (repr(wss[0].group_name), "rank 0 of 2", "from rank 1", "flag RS[1] of rank 0", "call #0",
                 "reduce-scatter", "WEAVE_CE_TIMEOUT_S"):
        assert part in msg, (part, msg)
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [msg]
    assert wss[0].failed == msg and "aborted" in wss[1].failed  # the whole group
    assert all(int(reg.abort) == 1 for reg in wss[0].regions)
    ranks.run()  # released: the stream drains
    assert ranks.done(0)
    assert torch.isnan(normed).all() and torch.isnan(res_out).all()
    for ws in wss:
        with pytest.raises(ce.CeAbortedError, match="no reduce-scatter"):
            ce_call(ws, torch.randn(T, H), run=False)
    with pytest.raises(ce.CeAbortedError):  # emulated_run too (it builds through ce_call)
        ce.emulated_run(wss, [ce.Rows(torch.randn(T, H))] * N, ce.FusedSpec(residual_dtype=FP32, out_dtype=FP32),
                        [object(), object()])


def test_stuck_in_the_all_gather_names_it_and_poisons_rows_finished_before():
    clock, wss, wd = _setup()
    normed0, res0, prog0 = _call(wss[0])
    _, _, prog1 = _call(wss[1])
    # rank 1 pushes and signals, then dies before its add+norm: rank 0 passes its reduce-scatter
    # wait, norms its rows (correct values in its regions), and blocks in its all-gather wait
    dead_at = next(i for i, op in enumerate(prog1) if isinstance(op, ce.Norm))
    ranks = Ranks([prog0, prog1[:dead_at]])
    ranks.run()
    assert not ranks.done(0) and not torch.isnan(wss[0].regions[0].out[:T // N]).any()
    clock.now = 1.0
    wd.check()
    clock.now = 11.0
    (msg,) = wd.check()
    assert "all-gather" in msg and "flag AG[1] of rank 0" in msg
    ranks.run()
    assert ranks.done(0)
    assert torch.isnan(normed0).all() and torch.isnan(res0).all()


def test_progress_and_idling_never_fire():
    clock, wss, wd = _setup()
    for _ in range(3):
        progs = [_call(ws)[2] for ws in wss]
        ranks = Ranks(progs)
        # one op of each rank at a time, 4 s apart (the whole call lasts longer than the timeout)
        pcs_before = None
        while not all(ranks.done(r) for r in range(N)):
            for r, prog in enumerate(progs):
                if ranks.pcs[r] < len(prog):
                    op = prog[ranks.pcs[r]]
                    if not (isinstance(op, ce.Wait) and int(op.flag.item()) < 1):
                        simulate([[op]], random.Random(0))
                        ranks.pcs[r] += 1
                        if isinstance(op, ce.Wait):
                            clock.now += 4.0
                            assert wd.check() == []
            assert ranks.pcs != pcs_before
            pcs_before = list(ranks.pcs)
    clock.now += 1000.0  # idle: every mark says "done"
    assert wd.check() == [] and all(ws.failed is None for ws in wss)


def test_calls_enqueued_before_the_failure_are_released_too(caplog):
    clock, wss, wd = _setup()
    calls = [_call(wss[0]) for _ in range(3)]
    ranks = Ranks([[op for _, _, prog in calls for op in prog]])
    ranks.run()
    with caplog.at_level(logging.ERROR, logger=wd_mod.__name__):
        wd.check()
        clock.now = 10.0
        assert len(wd.check()) == 1
        for _ in range(2 * len(calls)):  # every later wait is released at the next poll
            ranks.run()
            clock.now += 1.0
            assert wd.check() == []
    assert ranks.done(0)
    for normed, res_out, _ in calls:
        assert torch.isnan(normed).all() and torch.isnan(res_out).all()
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_a_release_that_cannot_run_is_logged_once(caplog):
    released = []
    clock, wss, wd = _setup(rescue=released.append)  # a rescue that does nothing
    _, _, prog = _call(wss[0])
    Ranks([prog]).run()
    with caplog.at_level(logging.CRITICAL, logger=wd_mod.__name__):
        wd.check()
        clock.now = 10.0
        assert len(wd.check()) == 1
        for clock.now in (15.0, 19.9):
            wd.check()
        assert not [r for r in caplog.records if r.levelno == logging.CRITICAL]
        for clock.now in (20.0, 30.0, 40.0):
            wd.check()
    critical = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1 and "still blocked" in critical[0]
    assert released and all(ws is wss[0] for ws in released)  # released at every poll while it waits


def test_timeout_option(monkeypatch):
    monkeypatch.delenv(wd_mod.ENV_TIMEOUT, raising=False)
    assert wd_mod.timeout_from_env() == wd_mod.DEFAULT_TIMEOUT_S == 600
    monkeypatch.setenv(wd_mod.ENV_TIMEOUT, "2.5")
    assert wd_mod.timeout_from_env() == 2.5
    monkeypatch.setenv(wd_mod.ENV_TIMEOUT, "soon")
    assert wd_mod.timeout_from_env() == 600
    monkeypatch.setenv(wd_mod.ENV_TIMEOUT, "0")
    assert wd_mod.timeout_from_env() == 0 and wd_mod.default() is None
    ws = ce.emulated_workspaces(2, 8, H, (FP32,) * 3)[0]
    wd_mod.watch_default(ws)  # off: the workspace stays unwatched (no marks, no abort read)
    assert ws.mark is None
    with pytest.raises(ValueError):
        Watchdog(timeout_s=0)



@pytest.mark.parametrize("unwatched", [True, False])
def test_an_unwatched_workspace_is_no_longer_polled(unwatched):
    """A workspace the measured choice dropped (its design won nowhere) is not watched any more: a
    stall on it does not fire (and the watchdog holds no reference to it); watched, the same fires."""
    clock, wss, wd = _setup()
    _, _, prog = _call(wss[0])  # rank 1's call is never issued
    ranks = Ranks([prog])
    ranks.run()
    assert not ranks.done(0)
    assert wd.check() == []  # t=0: the wait starts
    if unwatched:
        wd.unwatch(wss[0])
    clock.now = 100.0
    fired = wd.check()
    assert (fired == [] and wss[0].failed is None) if unwatched else len(fired) == 1
    assert any(e.ws is wss[0] for e in wd._watched) is not unwatched
