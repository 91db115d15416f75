"""GPU tests of benchmarks/fake_comm.py and benchmarks/pacing.py on ONE GPU.

Checked: the calibrated copy lines are plausible (PCIe and HBM rates, latencies of microseconds);
a Pace lasts what it is to last, eagerly and replayed from a CUDA graph; ``local``: rank 0's rows
against float64, eagerly and replayed with new data; ``rehearse`` with the peer's kernel run: every
row against float64, two chained calls captured in one graph and replayed with new data, flags 0
after; ``rehearse`` with the peer's add+norm paced: rank 0's rows against float64, and a call lasts
at least its transfers' time at the link rate (without the Paces it would not); a compiled TP Llama
(small dims, 2 layers) on the fake group, split and unsplit, ``mode="reduce-overhead"``: every site
runs the fake ``ce``, and with the peer's kernel run the output equals the eager model whose
all-reduces double (the peer's partials are rank 0's). Every device wait has a deadline (:func:`_sync`):
a wait never released fails the test instead of hanging.

Run: ``CUDA_DEVICE_MAX_CONNECTIONS=32 python -m pytest -m gpu tests/testing/test_fake_comm_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts, if this module starts it

import pytest
import torch

from tests.kernels.ce.test_copy_engine import TOL
from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.kernels.spec import FusedSpec, Rows
import fake_comm
import pacing
from fake_comm import FakeComm, Rehearsal
from weave_compile.testing.graphs import capture
from weave_compile.testing.numerics import rel_err


def _cuda_python() -> bool:
    try:
        pacing.driver()
        return True
    except ImportError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and not _cuda_python(), reason="needs cuda-python")]

BF16 = torch.bfloat16


def _sync(deadline_s: float = 30.0) -> None:
    """Wait for the current stream with a deadline (never an unbounded synchronize)."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > deadline_s:
            pytest.fail(f"device work did not finish in {deadline_s} s: a stream wait was never released")
        time.sleep(0.001)


@pytest.fixture(scope="module")
def pacer_cal():
    pacer = pacing.Pacer(torch.device("cuda", torch.cuda.current_device()))
    return pacer, pacing.calibrate(pacer)


def _graph(fn):
    """``fn()`` captured in a CUDA graph (after one eager warm-up); returns (graph, its outputs)."""
    fn()
    _sync()
    g, out = capture(fn)
    _sync()
    return g, out


def _inputs(seed, T, H, sharded):
    g = torch.Generator(device="cuda").manual_seed(seed)
    S = -(-T // 2)
    xs = [torch.randn(T, H, device="cuda", generator=g).to(BF16) for _ in range(2)]
    res0 = torch.randn(S if sharded else T, H, device="cuda", generator=g).to(BF16)
    weight = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(BF16)
    bias = torch.randn(H, device="cuda", generator=g).to(BF16)
    return xs, res0, weight, bias


def _spec(sharded, ctas=8):
    return FusedSpec(BF16, BF16, eps=1e-5, residual_in_sharded=sharded, residual_out_sharded=sharded, comm_ctas=ctas)


def _full_residual(res0, T, sharded):
    """The oracle's residual: with a sharded residual the peer reads rank 0's shard as its own."""
    return torch.cat([res0, res0])[:T] if sharded else res0


# ----------------------------------------------------------------------------- pacing


@pytest.mark.timing
def test_calibration_is_plausible(pacer_cal):
    _, cal = pacer_cal
    for name, line in (("h2d", cal.h2d), ("d2h", cal.d2h)):
        assert 5 < line.gbps < 200 and line.latency_us < 50, (name, cal.describe())
    assert cal.d2d.gbps > 300 and cal.d2d.latency_us < 50, cal.describe()


@pytest.mark.timing
@pytest.mark.parametrize("direction", [pacing.H2D, pacing.D2H])
def test_a_pace_lasts_what_it_is_to_last(direction, pacer_cal):
    pacer, cal = pacer_cal
    stream = torch.cuda.Stream()
    for us in (50.0, 400.0, 2000.0):  # 2 ms: more than one 32 MiB chunk at PCIe rates
        pace = cal.delay(us, direction)

        def three():
            for _ in range(3):
                pacer.enqueue(pace, torch.cuda.current_stream())

        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                s.record()
                three()
                e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / 3)
        got = statistics.median(times)
        assert 0.85 * us - 2 <= got <= 1.15 * us + 5, (us, got, cal.describe())
        g, _ = _graph(three)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        assert 0.85 * us - 2 <= s.elapsed_time(e) * 1e3 / 3 <= 1.2 * us + 10


# ----------------------------------------------------------------------------- local


@pytest.mark.parametrize("sharded", [False, True])
def test_local_rank0_rows_match_float64_eager_and_replayed(sharded, seed):
    T, H = 4099, 4096
    fc = FakeComm("local", 2, Rehearsal(), None, None, None)
    xs, res0, weight, bias = _inputs(seed, T, H, sharded)
    static_x = xs[0].clone()
    g, (normed, res_out) = _graph(lambda: fc.run(Rows(static_x, res0, bias, weight), _spec(sharded)))
    recv = next(iter(fc.slots.values())).wss[0].regions[0].recv
    peer_region = next(iter(fc.slots.values())).wss[0].regions[1]
    S = -(-T // 2)
    for rep in range(3):
        x = _inputs(seed + 1 + rep, T, H, sharded)[0][0]
        static_x.copy_(x)
        normed.fill_(float("nan"))
        res_out.fill_(float("nan"))
        g.replay()
        _sync()
        peer = torch.zeros_like(x)
        peer[:S] = recv[0, :S]
        y, acc = allreduce_add_rmsnorm_ref([x, peer], res0 if not sharded else torch.cat([res0, res0])[:T], bias,
                                           weight, eps=1e-5)
        torch.testing.assert_close(normed[:S].double(), y[:S].double(), **TOL[BF16])
        torch.testing.assert_close(res_out[:S].double(), acc[:S].double(), **TOL[BF16])
        # The peer's rows: real values pulled from its (local) region, never left unwritten.
        assert torch.equal(normed[S:], peer_region.out[:T - S])
        if not sharded:
            assert torch.equal(res_out[S:], peer_region.res[:T - S])
    assert fc.calls == 2  # the warm-up and the capture; replays run no Python


# ----------------------------------------------------------------------------- rehearse


@pytest.mark.parametrize("sharded", [False, True])
def test_rehearse_with_the_peers_kernel_matches_float64_in_a_graph(sharded, pacer_cal, seed):
    """Two chained calls per replay (the second reduces the first's normed rows, as layers do)."""
    pacer, cal = pacer_cal
    T, H = 3001, 4096
    xs, res0, weight, bias = _inputs(seed, T, H, sharded)
    static_x, peer_x = xs[0].clone(), xs[1].clone()

    def peer_rows(rows):  # the first call: the peer's own partials; the second: the same as rank 0's
        return dataclasses.replace(rows, x=peer_x) if rows.x.data_ptr() == static_x.data_ptr() else rows

    fc = FakeComm("rehearse", 2, Rehearsal(peer_norm="kernel"), cal, pacer, peer_rows)

    def two_calls():
        first = fc.run(Rows(static_x, res0, bias, weight), _spec(sharded))
        return first, fc.run(Rows(first[0], res0, bias, weight), _spec(sharded))

    g, (first, second) = _graph(two_calls)
    res_full = _full_residual(res0, T, sharded)
    S = -(-T // 2)
    for rep in range(3):
        new = _inputs(seed + 10 + rep, T, H, sharded)[0]
        static_x.copy_(new[0])
        peer_x.copy_(new[1])
        for t in (*first, *second):
            t.fill_(float("nan"))
        g.replay()
        _sync()
        y, acc = allreduce_add_rmsnorm_ref([new[0], new[1]], res_full, bias, weight, eps=1e-5)
        torch.testing.assert_close(first[0].double(), y.double(), **TOL[BF16])
        torch.testing.assert_close(first[1][:S].double(), acc[:S].double(), **TOL[BF16])
        y2, acc2 = allreduce_add_rmsnorm_ref([first[0], first[0]], res_full, bias, weight, eps=1e-5)
        torch.testing.assert_close(second[0].double(), y2.double(), **TOL[BF16])
        torch.testing.assert_close(second[1][:S].double(), acc2[:S].double(), **TOL[BF16])
        for ws in next(iter(fc.slots.values())).wss:
            assert int(ws.regions[ws.rank].flags.abs().sum()) == 0


def _paced_rehearsal(pacer_cal, seed, link: float = 370.0, n: int = 10):
    """Rank 0's rows from ``n`` paced rehearsal calls replayed in one CUDA graph, checked against
    float64; returns (microseconds per call, the link time of its two transfers, the calibration)."""
    pacer, cal = pacer_cal
    T, H = 8192, 4096
    fc = FakeComm("rehearse", 2, Rehearsal(link_gbps=link), cal, pacer, None)
    xs, res0, weight, bias = _inputs(seed, T, H, True)
    g, outs = _graph(lambda: [fc.run(Rows(xs[0], res0, bias, weight), _spec(True, ctas=32)) for _ in range(n)])
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    g.replay()
    e.record()
    _sync()
    S = T // 2
    y, acc = allreduce_add_rmsnorm_ref([xs[0], xs[0]], torch.cat([res0, res0]), bias, weight, eps=1e-5)
    torch.testing.assert_close(outs[-1][0][:S].double(), y[:S].double(), **TOL[BF16])
    torch.testing.assert_close(outs[-1][1].double(), acc[:S].double(), **TOL[BF16])
    # Rank 0's path: its push, (its add+norm), its pull of the peer's rows: two transfers at the
    # link rate; the local copies alone would take a fifth of that.
    return s.elapsed_time(e) * 1e3 / n, 2 * S * H * 2 / (link * 1e3), cal


def test_rehearse_paced_keeps_rank0s_rows(pacer_cal, seed):
    _paced_rehearsal(pacer_cal, seed)


@pytest.mark.timing
def test_rehearse_paced_takes_the_links_time(pacer_cal, seed):
    per_call, link_us, cal = _paced_rehearsal(pacer_cal, seed)
    assert per_call >= 0.9 * link_us, (per_call, link_us, cal.describe())
    assert per_call <= 3 * link_us + 200, (per_call, link_us, cal.describe())


def test_rehearse_launches_no_kernel_but_rank0s_addnorm(pacer_cal, seed):
    """What holds SMs in one rehearsed call (profiled): rank 0's add+norm kernel only; the copies
    and Paces are memcpy activities (copy engines), the flags stream memory operations."""
    pacer, cal = pacer_cal
    T, H = 4096, 4096
    fc = FakeComm("rehearse", 2, Rehearsal(), cal, pacer, None)
    xs, res0, weight, bias = _inputs(seed, T, H, True)
    run = lambda: fc.run(Rows(xs[0], res0, bias, weight), _spec(True))  # noqa: E731
    run()
    _sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        _sync()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.lower().startswith(("memcpy", "memset"))]
    assert len(kernels) == 1 and "add_rmsnorm_rows" in kernels[0], kernels
    assert sum(n.lower().startswith("memcpy") for n in names) >= 5, names  # push, pull, own pull, Paces


# ----------------------------------------------------------------------------- a compiled model


def _model():
    import torch.distributed as dist

    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(hidden=1024, heads=8, kv_heads=2, intermediate=2816, layers=2, vocab=1024, eps=1e-5)
    return TPLlama(d, tp=2, rank=0, group=dist.group.WORLD, dtype=BF16, device=torch.device("cuda"))


@pytest.mark.parametrize("mode,split,merge", [("local", True, False), ("rehearse", False, False),
                                              ("rehearse", True, False), ("rehearse", True, True)])
def test_compiled_model_runs_every_site_on_the_fake_ce(group, mode, split, merge, pacer_cal):  # noqa: F811
    import weave_compile
    from weave_compile.testing import models

    kw = {} if mode == "local" else dict(calibration=pacer_cal[1], peer_norm="kernel")
    model = _model()
    tokens = torch.randint(0, 1024, (1, 2048), device="cuda")
    torch._dynamo.reset()
    weave_compile.reset()
    with fake_comm.installed(mode, **kw) as fc, torch.no_grad():
        # rehearse: the peer's partials and residual rows are taken from rank 0's inputs, so the
        # residual must stay whole (a sharded one gives rank 0 only its own rows)
        c = torch.compile(model, backend="tokenweave",
                          options={"kernel": "ce", "split": split, "mode": "reduce-overhead", "comm_ctas": 8,
                                   "shard_residual": mode == "local", "merge_projections": merge})
        for _ in range(4):
            out = c(tokens).clone()
        _sync(120)
        sites = [s for gr in weave_compile.explain().graphs for s in gr.sites if s.fused]
        assert sites and all(s.kernel == "ce" for s in sites), [(s.node, s.kernel, s.kernel_reason) for s in sites]
        assert fc.calls > 0
        if split:
            assert any(gr.split is not None and gr.split.applied for gr in weave_compile.explain().graphs)
        if merge:  # q/k/v and gate/up of both layers are one GEMM each, their weights one buffer each
            text = " ".join(gr.projections for gr in weave_compile.explain().graphs)
            assert all(f"layers.{i}.q, layers.{i}.k, layers.{i}.v -> 1 GEMM" in text
                       and f"layers.{i}.gate, layers.{i}.up -> 1 GEMM" in text for i in range(2)), text
            for layer in model.layers:
                for group in ((layer.q, layer.k, layer.v), (layer.gate, layer.up)):
                    assert len({m.weight.untyped_storage().data_ptr() for m in group}) == 1
        if mode == "rehearse":  # the peer's partials are rank 0's: every all-reduce doubles
            orig = models._all_reduce
            models._all_reduce = lambda t, group: t.mul_(2)
            try:
                want = model(tokens)
            finally:
                models._all_reduce = orig
            assert rel_err(out, want) < 2e-2
    torch._dynamo.reset()
