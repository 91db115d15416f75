"""GPU tests of the ``ce`` design on ONE GPU: N ranks emulated in one process.

Each rank's workspace comes from ordinary device allocations (``copy_engine.emulated_workspaces``:
peers' "symmetric" regions are the other ranks' tensors), each rank's program runs on its own
stream, and the flags live in ordinary device memory (stream wait-value works on local memory).
What this cannot show: copies and flag writes over NVLink into another GPU (peers here are local
HBM). Checked: float64 oracle with poisoned outputs, awkward T and H, 1000 back-to-back calls,
CUDA-graph replay with new data, and first of all that cross-stream ``cuStreamWriteValue32`` /
``cuStreamWaitValue32`` order work and replay inside one captured graph.

A minimal emulated-rank harness is local to this file: helper ``kern``'s ``EmulatedRanks`` holds
push-kernel workspaces, and the copy-engine programs need only streams. Every synchronisation goes
through :func:`_sync`, which waits for one event with a deadline (never a device-wide synchronize,
which a stream still blocked by an earlier failure would hang), and every test has a thread-method
timeout that dumps the stacks. The rank streams are created once and reused: a stream blocked in a
wait-value holds its hardware queue, and two ranks' streams sharing one (the pool wraps around;
``CUDA_DEVICE_MAX_CONNECTIONS`` queues, 8 by default) would deadlock. Run with
``CUDA_DEVICE_MAX_CONNECTIONS=32``.

Status: the first device runs of this file (2026-12-01, one H200) hung in the first test. Cause
(found with a step-by-step script and faulthandler, session 5): the host blocked in the first
launch of ``torch.cuda._sleep`` after a wait-value was enqueued on another stream: CUDA's lazy
module loading synchronizes the context at a kernel's first load, which waited for the blocked
stream. Every kernel is now loaded before the first wait is enqueued (``ce.preload``).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts, if this module starts it

import pytest
import torch

from tests.kernels.ce.test_copy_engine import ce_call
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.shared import addnorm
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref as _oracle

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and ce.unavailable_reason() is not None,
                                 reason=f"ce unavailable: {ce.unavailable_reason()}")]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}
DEADLINE_S = 20.0


def allreduce_add_rmsnorm_ref(*args, **kwargs):
    """The one oracle (kernels/reference.py), its outputs (rounded where the contract rounds) as float64."""
    return tuple(t.double() for t in _oracle(*args, **kwargs))


def _sync(wss=None, deadline_s: float = DEADLINE_S, flags=None) -> None:
    """Wait for the current stream's work with a deadline; on timeout fail with the flags' state."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > deadline_s:
            words = flags if flags is not None else [r.flags for r in wss[0].regions] if wss else []
            pytest.fail(f"device work did not finish in {deadline_s} s: a wait was never satisfied "
                        f"({len(words)} flag tensors; not read back: reading would wait too)")
        time.sleep(0.001)


_STREAM_POOL: list = []


def _streams(n):
    """The same n rank streams for every test (see the module docstring)."""
    while len(_STREAM_POOL) < n:
        _STREAM_POOL.append(torch.cuda.Stream())
    return _STREAM_POOL[:n]


def emulated_call(wss, streams, xs, residuals, bias, weight, scale, **kw):
    """Every rank's call on its own stream, forked from and joined back into the current stream.

    Every rank's program is built and its kernels loaded (``ce.preload``) before any is enqueued:
    a lazily loaded kernel's first launch may synchronize the context, which deadlocks once rank
    0's stream waits for a rank whose program is not enqueued yet."""
    main = torch.cuda.current_stream()
    outs, progs = [], []
    for r, ws in enumerate(wss):
        streams[r].wait_stream(main)  # first: under capture this joins the rank's stream to it
        with torch.cuda.stream(streams[r]):
            normed, res_out, prog = ce_call(ws, xs[r], residuals[r], bias, weight, scale, run=False, **kw)
        outs.append((normed, res_out))
        progs.append(prog)
    for prog in progs:
        ce.preload(prog)
    for r, prog in enumerate(progs):
        ce.execute(prog, streams[r])
    for s in streams:
        main.wait_stream(s)
    return outs


def _inputs(N, T, H, dtype, res_dtype, residual, gen_seed):
    g = torch.Generator(device="cuda").manual_seed(gen_seed)
    partials = [torch.randn(T, H, device="cuda", generator=g).to(dtype) for _ in range(N)]
    res_full = torch.randn(T, H, device="cuda", generator=g).to(res_dtype) if residual else None
    bias = torch.randn(H, device="cuda", generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(dtype)
    return partials, res_full, bias, weight


def _residual_args(res_full, N, T, sharded):
    if res_full is None:
        return [None] * N
    if not sharded:
        return [res_full] * N
    S = -(-T // N)
    padded = torch.nn.functional.pad(res_full, (0, 0, 0, S * N - T))
    return [padded[r * S:(r + 1) * S].clone() for r in range(N)]


def _check(outs, partials, res_full, bias, weight, N, T, sharded, scale=None):
    # The outputs' dtypes are the contract's: the oracle rounds to them (its defaults are the
    # partials' dtype, which would hide an fp32 output behind fp16 rounding).
    y, acc = allreduce_add_rmsnorm_ref(partials, res_full, bias, weight, eps=1e-5, scale=scale,
                                       out_dtype=outs[0][0].dtype, residual_dtype=outs[0][1].dtype)
    S = -(-T // N)
    for r, (normed, res_out) in enumerate(outs):
        torch.testing.assert_close(normed.double(), y, **TOL[normed.dtype])
        if sharded:
            n = max(0, min(S, T - r * S))
            torch.testing.assert_close(res_out[:n].double(), acc[r * S:r * S + n], **TOL[res_out.dtype])
            assert torch.all(res_out[n:] == 0)
        else:
            torch.testing.assert_close(res_out.double(), acc, **TOL[res_out.dtype])


def test_stream_memops_cross_stream_in_graph():
    """The primitive the protocol rests on: a write-value on one stream releases a wait-value on
    another, eagerly and in a captured graph replayed with new data (the waiter resets its flag)."""
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    src = torch.empty(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    a, b = _streams(2)

    def step():
        main = torch.cuda.current_stream()
        a.wait_stream(main)
        b.wait_stream(main)
        with torch.cuda.stream(b):  # waiter first in issue order: it must really wait
            ce.stream_wait(b, flag.data_ptr(), 1)
            ce.stream_write(b, flag.data_ptr(), 0)
            dst.copy_(src)
        with torch.cuda.stream(a):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the producer is late
            src.mul_(2.0)
            ce.stream_write(a, flag.data_ptr(), 1)
        main.wait_stream(a)
        main.wait_stream(b)

    # Load every kernel step() launches before its first wait-value is enqueued: under lazy
    # module loading a first launch may synchronize the context, i.e. wait for stream b, which
    # waits for the flag that launch was to produce (the hang of the first device runs).
    torch.cuda._sleep(1000)
    src.uniform_()
    src.mul_(1.0)
    dst.fill_(float("nan"))
    _sync(flags=[flag])
    expect = src * 2
    step()
    _sync(flags=[flag])
    torch.testing.assert_close(dst, expect)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        src.uniform_()
        expect = src * 2
        dst.fill_(float("nan"))
        g.replay()
        _sync(flags=[flag])
        torch.testing.assert_close(dst, expect)
        assert int(flag.item()) == 0


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("T,H", [(1, 4096), (257, 3000), (4099, 4096), (130, 8192)])
@pytest.mark.parametrize("residual", [None, "full", "sharded"])
def test_ce_emulated_matches_float64(N, T, H, residual, seed):
    sharded = residual == "sharded"
    S = -(-T // N)
    dt = torch.bfloat16
    wss = ce.emulated_workspaces(N, S + 5, H, (dt, dt, dt), device="cuda")
    partials, res_full, bias, weight = _inputs(N, T, H, dt, dt, residual is not None, seed)
    outs = emulated_call(wss, _streams(N), partials, _residual_args(res_full, N, T, sharded), bias, weight, None,
                         eps=1e-5, residual_in_sharded=sharded, residual_out_sharded=sharded, num_ctas=8)
    _sync(wss)
    _check(outs, partials, res_full, bias, weight, N, T, sharded)


@pytest.mark.parametrize("dtype,res_dtype,out_dtype", [(torch.float32, torch.float32, torch.float32),
                                                       (torch.bfloat16, torch.float32, torch.bfloat16),
                                                       (torch.float16, torch.float16, torch.float32)])
def test_ce_emulated_dtypes_scale(dtype, res_dtype, out_dtype, seed):
    N, T, H = 2, 77, 1024
    wss = ce.emulated_workspaces(N, 64, H, (dtype, out_dtype, res_dtype), device="cuda")
    partials, res_full, bias, weight = _inputs(N, T, H, dtype, res_dtype, True, seed)
    scale = torch.tensor([0.5], device="cuda")
    outs = emulated_call(wss, _streams(N), partials, [res_full] * N, bias, weight, scale, eps=1e-5, num_ctas=4)
    _sync(wss)
    _check(outs, partials, res_full, bias, weight, N, T, False, scale=scale)


def test_ce_1000_back_to_back_calls(seed):
    """Rotating inputs, every call's output checked: a stale or half-written row would show."""
    N, T, H, calls, sets = 2, 203, 1024, 1000, 7
    dt = torch.bfloat16
    wss = ce.emulated_workspaces(N, 128, H, (dt, dt, dt), device="cuda")
    streams = _streams(N)
    data = [_inputs(N, T, H, dt, dt, True, seed + i) for i in range(sets)]
    refs = [allreduce_add_rmsnorm_ref(p, r, b, w, eps=1e-5) for p, r, b, w in data]
    outs = []
    for i in range(calls):
        p, r, b, w = data[i % sets]
        outs.append(emulated_call(wss, streams, p, _residual_args(r, N, T, True), b, w, None, eps=1e-5,
                                  residual_in_sharded=True, residual_out_sharded=True, num_ctas=4))
    _sync(wss, deadline_s=120)
    S = -(-T // N)
    bad = []
    for i, o in enumerate(outs):
        y, acc = refs[i % sets]
        for rk, (normed, res_out) in enumerate(o):
            n = min(S, T - rk * S)
            if not (torch.allclose(normed.double(), y, **TOL[dt])
                    and torch.allclose(res_out[:n].double(), acc[rk * S:rk * S + n], **TOL[dt])):
                bad.append((i, rk))
    assert not bad, f"{len(bad)} wrong (call, rank) pairs, first {bad[:5]}"


@pytest.mark.parametrize("sharded", [False, True])
def test_ce_graph_replay_new_data(sharded, seed):
    """Two consecutive calls per rank captured in one graph (all ranks' streams), replayed with new
    inputs and poisoned outputs: flags reset themselves, so every replay is a full protocol."""
    N, T, H = 2, 1001, 4096
    dt = torch.bfloat16
    wss = ce.emulated_workspaces(N, 512, H, (dt, dt, dt), device="cuda")
    streams = _streams(N)
    partials, res_full, bias, weight = _inputs(N, T, H, dt, dt, True, seed)
    static_x = [p.clone() for p in partials]
    static_res = [t.clone() for t in _residual_args(res_full, N, T, sharded)]
    kw = dict(eps=1e-5, residual_in_sharded=sharded, residual_out_sharded=sharded, num_ctas=8)

    def two_calls():
        first = emulated_call(wss, streams, static_x, static_res, bias, weight, None, **kw)
        # The second call reduces the first one's normed output (a chain, as layers are).
        second = emulated_call(wss, streams, [o[0] for o in first], static_res, bias, weight, None, **kw)
        return first, second

    two_calls()  # warm-up (Triton compile) outside capture
    _sync(wss)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        first, second = two_calls()
    torch.cuda.current_stream().wait_stream(side)
    _sync(wss)
    for rep in range(4):
        partials, res_full, _, _ = _inputs(N, T, H, dt, dt, True, seed + 100 + rep)
        for r in range(N):
            static_x[r].copy_(partials[r])
        for dst, src in zip(static_res, _residual_args(res_full, N, T, sharded)):
            dst.copy_(src)
        for o in first + second:
            o[0].fill_(float("nan"))
            o[1].fill_(float("nan"))
        g.replay()
        _sync(wss)
        _check(first, partials, res_full, bias, weight, N, T, sharded)
        # Second call's inputs: every rank's first normed output (identical across ranks).
        second_partials = [o[0] for o in first]
        _check(second, second_partials, res_full, bias, weight, N, T, sharded)
        for ws in wss:
            assert int(ws.regions[ws.rank].flags.abs().sum()) == 0


def _main() -> None:
    """Script mode, without pytest:
    ``python tests/kernels/test_copy_engine_gpu.py`` runs every case, printing one line each."""
    import random
    import sys
    import traceback

    seed = random.randrange(2**31)
    cases = [("memops_cross_stream_in_graph", test_stream_memops_cross_stream_in_graph, {})]
    cases += [(f"float64 N={n} T={t} H={h} residual={r}", test_ce_emulated_matches_float64,
               dict(N=n, T=t, H=h, residual=r, seed=seed))
              for n in (2, 3) for t, h in [(1, 4096), (257, 3000), (4099, 4096), (130, 8192)]
              for r in (None, "full", "sharded")]
    cases += [(f"dtypes {d}", test_ce_emulated_dtypes_scale, dict(dtype=d[0], res_dtype=d[1], out_dtype=d[2], seed=seed))
              for d in [(torch.float32,) * 3, (torch.bfloat16, torch.float32, torch.bfloat16),
                        (torch.float16, torch.float16, torch.float32)]]
    cases += [("1000 calls", test_ce_1000_back_to_back_calls, dict(seed=seed))]
    cases += [(f"graph replay sharded={s}", test_ce_graph_replay_new_data, dict(sharded=s, seed=seed)) for s in (False, True)]
    failed = 0
    print(f"seed={seed}", flush=True)
    for name, fn, kw in cases:
        t0 = time.monotonic()
        try:
            fn(**kw)
            print(f"PASS {name} ({time.monotonic() - t0:.1f} s)", flush=True)
        except BaseException:  # pytest.fail raises an outcome exception, not an Exception
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()[-3000:]}", flush=True)
            if "did not finish" in traceback.format_exc():
                break  # a stream is still blocked: what follows would hang
    print(f"{failed} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    _main()


@pytest.mark.parametrize("cfg", [None, addnorm.LaunchConfig(2, 1, 16, True), addnorm.LaunchConfig(1, 1, 8, True),
                                 addnorm.LaunchConfig(4, 1, 16, True)], ids=["default", "pf_r2w16", "pf_r1w8", "pf_r4w16"])
@pytest.mark.parametrize("slots,H", [(1, 4096), (3, 3000)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_addnorm_kernel_shapes_match_the_torch_path(cfg, slots, H, with_bias, seed):
    """The add+norm kernel (pipelined default and register-prefetched shapes) against its torch
    path on the same inputs, poisoned outputs, a grid smaller than the row blocks; without a
    bias the residual's padding rows are zero with no select in the kernel."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = 1001
    x = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
    recv = torch.randn(slots, n + 7, H, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(n, H, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16) if with_bias else None
    w = torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)
    outs = []
    for force in (False, True):
        normed = torch.full((n, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        res_out = torch.full((n + 3, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        addnorm.add_rmsnorm_rows(x, recv, res, bias, w, None, normed, res_out, n_valid=n, eps=1e-5,
                                    mid_dtype=None, weight_offset=0.0, num_ctas=8, config=cfg, force_torch=force)
        outs.append((normed, res_out))
    _sync()
    (kn, kr), (tn, tr) = outs
    assert not torch.isnan(kn).any() and not torch.isnan(kr).any()
    # fp32 sums in another order, then one rounding to bf16: the residual at most an ulp apart;
    # the normed rows two (a residual an ulp off moves its normed element by about one, and the
    # sum of squares is reduced in another order too)
    assert _bf16_ulps(kr[:n], tr[:n]) <= 1
    assert _bf16_ulps(kn, tn) <= 2
    assert torch.all(kr[n:] == 0)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units in the last place of bf16 at ``b`` (8 significant bits)."""
    _, e = torch.frexp(b.float())
    ulp = torch.ldexp(torch.ones_like(b, dtype=torch.float32), e - 8)
    return float(((a.float() - b.float()).abs() / ulp).max())
