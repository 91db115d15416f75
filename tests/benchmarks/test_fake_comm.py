"""Tests for benchmarks/fake_comm.py on the CPU: what each mode keeps, drops and paces, and the results.

The programs are the ``ce`` design's own (``copy_engine.build_program`` on emulated workspaces),
transformed; they run here in the ``ce`` CPU simulation (tests/kernels/ce/test_copy_engine.py:
the ranks' ops interleaved in random orders that respect only the flag waits, Paces are no-ops)
with the add+norm's torch path. Data regions start as NaN (poison) and every call gets fresh
random inputs. GPU runs (copies, flags, Paces, CUDA graphs, a compiled model on the fake group):
tests/testing/test_fake_comm_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.ce.test_copy_engine import TOL, Deadlock, simulate
from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)
from weave_compile.kernels import registry
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.kernels.registry import Site
from weave_compile.kernels.spec import FusedSpec, Rows
import fake_comm
from fake_comm import FakeComm, Rehearsal
from pacing import D2H, H2D, Calibration, Line, Pace

CAL = Calibration(d2d=Line(2.0, 1800.0), h2d=Line(3.0, 50.0), d2h=Line(4.0, 45.0))
#: PCIe latencies far below these tests' transfers (a few KB), so that every transfer gets a Pace
FINE = Calibration(d2d=Line(2.0, 1800.0), h2d=Line(1e-4, 50.0), d2h=Line(2e-4, 45.0))
BF16 = torch.bfloat16


def make(mode, peer_rows=None, cal=CAL, **model):
    return FakeComm(mode, 2, Rehearsal(**model), cal if mode == "rehearse" else None, None, peer_rows)


def inputs(gen, T, H, sharded):
    S = -(-T // 2)
    xs = [torch.randn(T, H, generator=gen).to(BF16) for _ in range(2)]
    res_full = torch.randn(T, H, generator=gen).to(BF16)
    padded = torch.nn.functional.pad(res_full, (0, 0, 0, 2 * S - T))
    res0 = padded[:S].clone() if sharded else res_full
    weight = (1 + 0.1 * torch.randn(H, generator=gen)).to(BF16)
    bias = torch.randn(H, generator=gen).to(BF16)
    return xs, res_full, res0, weight, bias


def spec_for(sharded):
    return FusedSpec(BF16, BF16, eps=1e-5, residual_in_sharded=sharded, residual_out_sharded=sharded, comm_ctas=8)


def kinds(prog):
    return [type(op).__name__ for op in prog]


def run_fifo(programs, rng):
    """The issue order executed as ONE queue, strictly in order (two streams sharing a hardware
    queue): a wait reached before its signal can never be released (Deadlock)."""
    for _, ops in fake_comm.issue_order(programs):
        simulate([ops], rng)


# ----------------------------------------------------------------------------- local


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("T,H", [(7, 40), (130, 96)])
def test_local_runs_rank0s_addnorm_and_the_copies_into_its_outputs(sharded, T, H, seed):
    fc = make("local")
    gen = torch.Generator().manual_seed(seed)
    xs, res_full, res0, weight, bias = inputs(gen, T, H, sharded)
    normed, res_out, [prog] = fc.programs(Rows(xs[0], res0, bias, weight), spec_for(sharded))
    ws = fc.slots[next(iter(fc.slots))].wss[0]
    assert kinds(prog).count("Norm") == 1
    assert not {"Signal", "Wait", "Reset"} & set(kinds(prog))
    # The pulls of every rank's rows into rank 0's outputs stay (and residual, unsharded); the push goes.
    copies = [fake_comm.copy_ranks(ws, op) for op in prog if isinstance(op, ce.Copy)]
    assert copies == ([(0, 0), (1, 0)] if sharded else [(0, 0), (0, 0), (1, 0), (1, 0)]), copies
    recv, peer = ws.regions[0].recv, ws.regions[1]
    for t in (recv, peer.out, peer.res):
        assert torch.isfinite(t.float()).all(), "the scratch regions must hold finite values"
    normed.fill_(float("nan"))
    res_out.fill_(float("nan"))
    simulate([prog], random.Random(seed))
    # Rank 0's rows: the op's result for partials (x, the scratch slot as the peer's rows).
    S = -(-T // 2)
    partial = torch.zeros_like(xs[0])
    partial[:S] = recv[0, :S]
    y, acc = allreduce_add_rmsnorm_ref([xs[0], partial], res_full, bias, weight, eps=1e-5)
    torch.testing.assert_close(normed[:S].double(), y[:S].double(), **TOL[BF16])
    torch.testing.assert_close(res_out[:S].double(), acc[:S].double(), **TOL[BF16])
    # The peer's rows hold real values (its region's), never what the allocator handed out: a GEMM
    # reading them runs at its speed on real data.
    assert torch.equal(normed[S:], peer.out[:T - S])
    if not sharded:
        assert torch.equal(res_out[S:], peer.res[:T - S])


def test_local_works_for_a_larger_fake_group(seed):
    fc = FakeComm("local", 4, Rehearsal(), None, None, None)
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(37, 32, generator=gen).to(BF16), torch.ones(32, dtype=BF16)
    normed, _, [prog] = fc.programs(Rows(x, None, None, w), spec_for(False))
    norm = next(op for op in prog if isinstance(op, ce.Norm))
    assert norm.kwargs["recv"].shape[0] == 3 and norm.kwargs["n_valid"] == 10


# ----------------------------------------------------------------------------- rehearse


@pytest.mark.parametrize("sharded", [False, True])
def test_rehearse_paces_every_cross_gpu_copy_and_the_peers_norm(sharded, seed):
    T, H = 67, 96
    fc = make("rehearse", cal=FINE, link_gbps=370.0)
    gen = torch.Generator().manual_seed(seed)
    xs, _, res0, weight, bias = inputs(gen, T, H, sharded)
    _, _, (p0, p1) = fc.programs(Rows(xs[0], res0, bias, weight), spec_for(sharded))
    wss = fc.slots[next(iter(fc.slots))].wss
    production = ce.build_program(wss[0], Rows(xs[0], res0, bias, weight), spec_for(sharded),
                                  torch.empty(T, H, dtype=BF16), torch.empty(T, H, dtype=BF16))
    # Rank 0: its production program, unchanged, with a Pace after each cross-GPU copy only.
    assert [k for k in kinds(p0) if k != "Pace"] == kinds(production)
    for i, op in enumerate(p0):
        if isinstance(op, ce.Copy):
            src, dst = fake_comm.copy_ranks(wss[0], op)
            nxt = p0[i + 1] if i + 1 < len(p0) else None
            if src == dst:
                assert not isinstance(nxt, Pace), "a local copy is not paced"
                continue
            assert isinstance(nxt, Pace) and nxt.direction == (D2H if src == 0 else H2D)
            n = op.src.numel() * op.src.element_size()
            link_us = FINE.d2d.latency_us + n / 370e3
            assert link_us - 1e-6 <= FINE.d2d.time_us(n) + FINE.line(nxt.direction).time_us(nxt.nbytes) \
                <= link_us + 0.01
    assert kinds(p0).count("Pace") == (2 if sharded else 3)  # push, pull of the peer's rows (+ residual)
    # Peer: its flags as in production, its norm a Pace of the modelled kernel time.
    assert "Norm" not in kinds(p1)
    for k in ("Signal", "Wait", "Reset"):
        assert kinds(p1).count(k) == kinds(production).count(k)
    norm_kw = dict(next(op for op in production if isinstance(op, ce.Norm)).kwargs, n_valid=T - (T + 1) // 2)
    delay = [op for op in p1 if isinstance(op, Pace) and op.what == "peer add+norm"]
    assert len(delay) == 1 and delay[0].us == pytest.approx(fake_comm.norm_us(norm_kw, fc.model))
    cross = [op for op in p1 if isinstance(op, Pace) and "->" in op.what]
    assert [p.direction for p in cross] == [H2D] + [D2H] * (1 if sharded else 2)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("T,H", [(1, 24), (67, 96), (130, 40)])
def test_rehearse_rank0_matches_float64_of_both_ranks(sharded, T, H, seed):
    """Peer's kernel run (peer_norm="kernel") and distinct peer partials: every row of rank 0's
    outputs is the oracle's for (x0, x1); three calls back to back, flags 0 after."""
    gen = torch.Generator().manual_seed(seed)
    calls = [inputs(gen, T, H, sharded) for _ in range(3)]
    peer_of = {}
    fc = make("rehearse", peer_norm="kernel", peer_rows=lambda rows: Rows(
        peer_of[rows.x.data_ptr()], rows.residual, rows.bias, rows.weight))
    progs, outs = [[], []], []
    for xs, res_full, res0, weight, bias in calls:
        peer_of[xs[0].data_ptr()] = xs[1]
        normed, res_out, (p0, p1) = fc.programs(Rows(xs[0], res0, bias, weight), spec_for(sharded))
        normed.fill_(float("nan"))
        res_out.fill_(float("nan"))
        progs[0] += p0
        progs[1] += p1
        outs.append((normed, res_out))
    if sharded:  # the peer reads rank 0's residual shard as its own: make the oracle's residual agree
        calls = [(xs, torch.cat([r0, r0])[:T], r0, w, b) for xs, _, r0, w, b in calls]
    simulate(progs, random.Random(seed))
    S = -(-T // 2)
    for (xs, res_full, _, weight, bias), (normed, res_out) in zip(calls, outs):
        y, acc = allreduce_add_rmsnorm_ref(xs, res_full, bias, weight, eps=1e-5)
        torch.testing.assert_close(normed.double(), y.double(), **TOL[BF16])
        torch.testing.assert_close(res_out[:min(S, T)].double(), acc[:min(S, T)].double(), **TOL[BF16])
        if not sharded:
            torch.testing.assert_close(res_out.double(), acc.double(), **TOL[BF16])
    for ws in fc.slots[next(iter(fc.slots))].wss:
        assert int(ws.regions[ws.rank].flags.abs().sum()) == 0, "a flag was left set: replay would break"


def test_rehearse_with_the_peers_norm_paced_keeps_rank0s_rows_exact(seed):
    T, H = 41, 64
    gen = torch.Generator().manual_seed(seed)
    xs, res_full, res0, weight, bias = inputs(gen, T, H, True)
    fc = make("rehearse")  # peer partials: rank 0's own (what costs nothing)
    normed, res_out, programs = fc.programs(Rows(xs[0], res0, bias, weight), spec_for(True))
    normed.fill_(float("nan"))
    res_out.fill_(float("nan"))
    simulate(programs, random.Random(seed))
    S = -(-T // 2)
    y, acc = allreduce_add_rmsnorm_ref([xs[0], xs[0]], torch.cat([res0, res0])[:T], bias, weight, eps=1e-5)
    torch.testing.assert_close(normed[:S].double(), y[:S].double(), **TOL[BF16])
    torch.testing.assert_close(res_out.double(), acc[:S].double(), **TOL[BF16])
    # The peer's rows are its out region as filled once (finite, not computed).
    peer_out = fc.slots[next(iter(fc.slots))].wss[1].regions[1].out
    assert torch.equal(normed[S:], peer_out[:T - S])
    assert torch.isfinite(normed.float()).all()


def test_issue_order_cannot_deadlock_in_one_shared_queue(seed):
    T, H = 33, 32
    gen = torch.Generator().manual_seed(seed)
    xs, _, res0, weight, bias = inputs(gen, T, H, True)
    fc = make("rehearse", peer_norm="kernel", peer_skew_us=50.0)
    normed, res_out, programs = fc.programs(Rows(xs[0], res0, bias, weight), spec_for(True))
    run_fifo(programs, random.Random(seed))
    y, acc = allreduce_add_rmsnorm_ref([xs[0], xs[0]], torch.cat([res0, res0])[:T], bias, weight, eps=1e-5)
    torch.testing.assert_close(normed.double(), y.double(), **TOL[BF16])
    torch.testing.assert_close(res_out.double(), acc[:(T + 1) // 2].double(), **TOL[BF16])
    # Rank 0 enqueued whole, then the peer: its wait would block the shared queue forever.
    _, _, programs = fc.programs(Rows(xs[0], res0, bias, weight), spec_for(True))
    with pytest.raises(Deadlock):
        for prog in programs:
            run_fifo([prog], random.Random(seed))


def test_norm_model_and_rehearsal_arguments():
    kw = dict(x=torch.empty(10, 4096, dtype=BF16), recv=torch.empty(1, 16, 4096, dtype=BF16),
              residual=torch.empty(10, 4096, dtype=BF16), normed=torch.empty(16, 4096, dtype=BF16),
              res_out=torch.empty(10, 4096, dtype=BF16), n_valid=10, num_ctas=32)
    assert fake_comm.norm_bytes(kw) == 10 * 4096 * 2 * 5
    assert fake_comm.norm_us(kw, Rehearsal()) == pytest.approx(10 * 4096 * 10 / (68.1 * 32 * 1e3))
    assert fake_comm.norm_us(kw, Rehearsal(norm_gbps_per_cta=100.0)) == pytest.approx(10 * 4096 * 10 / 3.2e6)
    assert fake_comm.norm_gbps_per_cta(8000, 9) == 76.5
    for bad in (dict(link_gbps=0), dict(peer_norm="spin"), dict(peer_skew_us=-1), dict(norm_gbps_per_cta=0)):
        with pytest.raises(ValueError):
            Rehearsal(**bad)


# ----------------------------------------------------------------------------- install and the entry


def test_install_replaces_ce_and_uninstall_restores():
    original = registry.get("ce")
    with fake_comm.installed("local") as fc:
        assert registry.get("ce").run == fc.run and fake_comm.active() is fc
        assert "fake_comm local" in registry.get("ce").summary
        with pytest.raises(RuntimeError, match="already installed"):
            fake_comm.install("local")
    assert registry.get("ce") is original and fake_comm.active() is None
    with pytest.raises(ZeroDivisionError):
        with fake_comm.installed("rehearse", calibration=CAL, link_gbps=100.0):
            1 / 0
    assert registry.get("ce") is original
    with pytest.raises(ValueError, match="local takes no"):
        fake_comm.install("local", link_gbps=100.0)
    with pytest.raises(ValueError, match="one peer"):
        fake_comm.install("rehearse", world_size=4, calibration=CAL)
    with pytest.raises(ValueError, match="mode"):
        fake_comm.install("free")
    assert registry.get("ce") is original


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_rehearse_without_cuda_needs_a_calibration():
    with pytest.raises(RuntimeError, match="calibration"):
        fake_comm.install("rehearse")
    assert fake_comm.active() is None


def test_other_designs_refuse_fake_groups_while_installed(group):
    """No symmetric-memory probe on a fake group: it would try a rendezvous the group cannot do. The
    designs on the group's own collectives (reference, nccl: the GPU fallback) stay as they are."""
    site = Site(device=torch.device("cuda", 0), dtype=BF16, residual_dtype=BF16, out_dtype=BF16, hidden=4096,
                group_name=group, world_size=2)
    before = {e.name: e for e in registry.implementations()}
    with fake_comm.installed("local"):
        for name in ("p2p", "multimem", "oneshot"):
            assert registry.get(name).check(site) == fake_comm.NOT_EMULATED
        assert registry.get("reference") is before["reference"] and registry.get("nccl") is before["nccl"]
    assert all(registry.get(n) is e for n, e in before.items())


def test_entry_check_wants_a_fake_group_of_its_world_size(group, monkeypatch):
    site = Site(device=torch.device("cuda", 0), dtype=BF16, residual_dtype=BF16, out_dtype=BF16, hidden=4096,
                group_name=group, world_size=2)
    fc = make("local")
    monkeypatch.setattr(fake_comm.addnorm, "unavailable_reason", lambda *a: None)  # no GPU here
    assert fc.check(site) is None
    assert "world size 2" in fc.check(Site(**{**site.__dict__, "world_size": 4}))
    monkeypatch.setattr(fake_comm, "_backend", lambda name: "nccl")
    assert "fake process group only" in fc.check(site)
    monkeypatch.undo()
    assert "cpu" in fc.check(Site(**{**site.__dict__, "device": torch.device("cpu")}))


def test_buffers_grow_with_the_token_count(seed):
    fc = make("local")
    site = Site(device=torch.device("cpu"), dtype=BF16, residual_dtype=BF16, out_dtype=BF16, hidden=32,
                group_name="g", world_size=2, num_tokens=300)
    fc.reserve(site)
    (slot,) = fc.slots.values()
    assert slot.capacity == 256
    x = torch.randn(1000, 32).to(BF16)
    fc.programs(Rows(x, None, None, torch.ones(32, dtype=BF16)), spec_for(False))
    (bigger,) = fc.slots.values()
    assert bigger.capacity >= 500 and fc.retired == [slot]
