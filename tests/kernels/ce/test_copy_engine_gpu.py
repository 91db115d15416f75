"""GPU tests of the ``ce`` design on ONE GPU: N ranks emulated in one process.

Each rank's workspace comes from ordinary device allocations (``copy_engine.emulated_workspaces``:
peers' "symmetric" regions are the other ranks' tensors), every call goes through
``copy_engine.emulated_run`` (each rank on its own stream, the programs enqueued so that every
wait's signal is enqueued first), and the flags live in ordinary device memory. What this cannot
show: copies and flag writes over NVLink into another GPU (peers here are local HBM).

Checked: the stream-memory primitives across streams and in a graph; float64 oracle with poisoned
outputs at awkward T and H; every add+norm variant loaded before any call (no token count loads a
kernel); 1000 back-to-back calls without a host sync (rotating inputs: a stale slot shows); several
calls of both ranks captured in one CUDA graph and replayed with new data; a cold start in a fresh
process under ``CUDA_MODULE_LOADING=LAZY`` (the scenario that deadlocked: a kernel's first load
while a stream waits on a peer); and the watchdog: a rank whose peer never issues its call gets
NaN outputs, a released stream and an error within the timeout. The last two run in subprocesses
with hard timeouts; every synchronisation here goes through :func:`_sync` (an event polled against
a deadline: never a device-wide synchronize, which a stream still blocked would hang).

    CUDA_DEVICE_MAX_CONNECTIONS=32 python -m pytest -q tests/kernels/ce/test_copy_engine_gpu.py
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import textwrap
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts, if this module starts it

import pytest
import torch

from tests.kernels._symm_cases import run_script
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.ce import program
from weave_compile.kernels.ce.watchdog import Watchdog
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref as _oracle
from weave_compile.kernels.shared import addnorm
from weave_compile.kernels.spec import FusedSpec, Rows
from weave_compile.testing.graphs import capture

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and ce.unavailable_reason() is not None,
                                 reason=f"ce unavailable: {ce.unavailable_reason()}")]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}
DEADLINE_S = 60.0
BF16 = torch.bfloat16
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "src")


def allreduce_add_rmsnorm_ref(*args, **kwargs):
    """The one oracle (kernels/reference.py), its outputs (rounded where the contract rounds) as float64."""
    return tuple(t.double() for t in _oracle(*args, **kwargs))


def _sync(deadline_s: float = DEADLINE_S) -> None:
    """Wait for the current stream's work with a deadline (a blocked wait fails, never hangs)."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > deadline_s:
            pytest.fail(f"device work did not finish in {deadline_s} s: a wait was never satisfied")
        time.sleep(0.001)


_STREAM_POOL: list = []


def _streams(n):
    """The same n rank streams for every test."""
    while len(_STREAM_POOL) < n:
        _STREAM_POOL.append(torch.cuda.Stream())
    return _STREAM_POOL[:n]


def emulated_call(wss, xs, residuals, bias, weight, scale, *, num_ctas=8, eps_tensor=None, norm_bias=None,
                  **spec_kw):
    """Every rank's call through ``ce.emulated_run``; ``spec_kw`` are FusedSpec fields, ``eps_tensor``
    (0-d, on the device) replaces ``eps``; ``norm_bias``: a LayerNorm's (with ``norm="layernorm"``)."""
    spec = FusedSpec(residual_dtype=wss[0].dtypes[2], out_dtype=wss[0].dtypes[1], comm_ctas=num_ctas, **spec_kw)
    rows = [Rows(x, r, bias, weight, scale, eps_tensor, norm_bias=norm_bias) for x, r in zip(xs, residuals)]
    return ce.emulated_run(wss, rows, spec, _streams(len(wss)))


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


def _check(outs, partials, res_full, bias, weight, N, T, sharded, scale=None, eps=1e-5, norm="rmsnorm",
           norm_bias=None):
    # The outputs' dtypes are the contract's: the oracle rounds to them.
    y, acc = allreduce_add_rmsnorm_ref(partials, res_full, bias, weight, eps=eps, scale=scale,
                                       out_dtype=outs[0][0].dtype, residual_dtype=outs[0][1].dtype, norm=norm,
                                       norm_bias=norm_bias)
    S = -(-T // N)
    for r, (normed, res_out) in enumerate(outs):
        torch.testing.assert_close(normed.double(), y, **TOL[normed.dtype])
        if sharded:
            n = max(0, min(S, T - r * S))
            torch.testing.assert_close(res_out[:n].double(), acc[r * S:r * S + n], **TOL[res_out.dtype])
            assert torch.all(res_out[n:] == 0)
        else:
            torch.testing.assert_close(res_out.double(), acc, **TOL[res_out.dtype])


def _poison(outs):
    for normed, res_out in outs:
        normed.fill_(float("nan"))
        res_out.fill_(float("nan"))



@functools.lru_cache(maxsize=1)
def _host_words_reason():
    """None where this device can write host-mapped words with stream write-values (what the
    watchdog's progress marks need), else why not: one H200 in a VM refused both kinds of
    host-mapped memory (CUDA_ERROR_INVALID_VALUE); production then leaves the waits unbounded."""
    from weave_compile.kernels.ce import memops

    try:
        memops.HostWords(1, torch.device("cuda"))
    except RuntimeError as e:
        return str(e)
    return None


def _watch(wss, required=True):
    """Watch ``wss`` (marks and abort word, watchdog not started); skip where the device cannot."""
    why = _host_words_reason()
    if why is not None:
        if required:
            pytest.skip(f"the watchdog cannot run on this device: {why}")
        return False
    Watchdog(timeout_s=600).watch(wss)
    return True

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
        with torch.cuda.stream(a):  # producer first in issue order (a wait's signal is enqueued first)
            torch.cuda._sleep(2_000_000)  # ~1 ms: the producer is late
            src.mul_(2.0)
            ce.stream_write(a, flag.data_ptr(), 1)
        with torch.cuda.stream(b):
            ce.stream_wait(b, flag.data_ptr(), 1)
            ce.stream_write(b, flag.data_ptr(), 0)
            dst.copy_(src)
        main.wait_stream(a)
        main.wait_stream(b)

    torch.cuda._sleep(1000)  # every kernel step() launches, loaded before its first wait
    src.uniform_()
    src.mul_(1.0)
    dst.fill_(float("nan"))
    _sync()
    expect = src * 2
    step()
    _sync()
    torch.testing.assert_close(dst, expect)
    g, _ = capture(step)
    for _ in range(3):
        src.uniform_()
        expect = src * 2
        dst.fill_(float("nan"))
        g.replay()
        _sync()
        torch.testing.assert_close(dst, expect)
        assert int(flag.item()) == 0


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("T", [1, 3, 257, 4099])
@pytest.mark.parametrize("H", [2880, 4096, 8192])
@pytest.mark.parametrize("residual", [None, "full", "sharded", "first"])
def test_ce_emulated_matches_float64(N, T, H, residual, seed):
    """``first``: no residual in, this rank's rows out (a sequence-parallel model's first site)."""
    sharded = residual in ("sharded", "first")
    S = -(-T // N)
    wss = ce.emulated_workspaces(N, S + 5, H, (BF16,) * 3, device="cuda")
    partials, res_full, bias, weight = _inputs(N, T, H, BF16, BF16, residual in ("full", "sharded"), seed)
    outs = emulated_call(wss, partials, _residual_args(res_full, N, T, sharded), bias, weight, None,
                         eps=1e-5, residual_in_sharded=residual == "sharded", residual_out_sharded=sharded)
    _sync()
    _check(outs, partials, res_full, bias, weight, N, T, sharded)


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("T", [3, 257, 4099])
@pytest.mark.parametrize("H", [2048, 4096, 8192])
@pytest.mark.parametrize("residual", ["full", "sharded"])
def test_ce_emulated_layernorm(N, T, H, residual, seed):
    """The LayerNorm variant (a norm bias after the weight; partials offset by 1, a mean the norm
    removes and RMSNorm would not) through ce at model sizes, every loaded kernel preloaded first by
    the site's ``preload_site`` as a reservation does: no kernel compiles or loads at run time."""
    sharded = residual == "sharded"
    S = -(-T // N)
    wss = ce.emulated_workspaces(N, max(256, -(-(S + 5) // 256) * 256), H, (BF16,) * 3, device="cuda")
    for ws in wss:
        program.preload_site(ws, residual_dtype=BF16, terms=[(BF16, BF16, None, BF16)], scale_dtype=None,
                             norm="layernorm")
    cache = addnorm._add_rmsnorm_rows_kernel.device_caches[torch.cuda.current_device()][0]
    before = set(cache)
    partials, res_full, bias, weight = _inputs(N, T, H, BF16, BF16, True, seed)
    partials = [p + 1 for p in partials]
    nb = torch.randn(H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 1)).to(BF16)
    outs = emulated_call(wss, partials, _residual_args(res_full, N, T, sharded), bias, weight, None, eps=1e-5,
                         residual_in_sharded=sharded, residual_out_sharded=sharded, norm="layernorm", norm_bias=nb)
    _sync()
    _check(outs, partials, res_full, bias, weight, N, T, sharded, norm="layernorm", norm_bias=nb)
    y_rms, _ = allreduce_add_rmsnorm_ref(partials, res_full, bias, weight, eps=1e-5, norm_bias=nb)
    assert (outs[0][0].double() - y_rms).abs().max() > 0.2, "the check must tell LayerNorm from RMSNorm here"
    assert set(cache) == before, f"{len(set(cache) - before)} kernels compiled or loaded at run time"


@pytest.mark.parametrize("N", [3, 4])
@pytest.mark.parametrize("H", [4096, 8192])
def test_ce_batch_invariant_rows_on_the_gpu(N, H, seed):
    """``batch_invariant``: one row (ranks 0 and 1 carry cancelling partials, so the order of the sum
    shows) run alone and at several positions in calls of 3..4099 rows, with 2 and 32 CTAs, full and
    sharded residual: its normed and residual rows bitwise the same on the GPU (the kernel's
    rank-order sum on one launch shape). Without the option the row owned by rank 2 differs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    big = (torch.randn(H, device="cuda", generator=g) * 2.0 ** 20).to(BF16)
    parts = [big, -big] + [torch.randn(H, device="cuda", generator=g).to(BF16) for _ in range(N - 2)]
    res_row = torch.randn(H, device="cuda", generator=g).to(BF16)
    weight = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(BF16)

    def run(T, pos, ctas, sharded, invariant):
        S = -(-T // N)
        wss = ce.emulated_workspaces(N, max(256, -(-(S + 1) // 256) * 256), H, (BF16,) * 3, device="cuda")
        xs = [torch.randn(T, H, device="cuda", generator=g).to(BF16) for _ in range(N)]
        residual = torch.randn(T, H, device="cuda", generator=g).to(BF16)
        for r in range(N):
            xs[r][pos] = parts[r]
        residual[pos] = res_row
        outs = emulated_call(wss, xs, _residual_args(residual, N, T, sharded), None, weight, None, eps=1e-5,
                             residual_in_sharded=sharded, residual_out_sharded=sharded, num_ctas=ctas,
                             batch_invariant=invariant)
        _sync()
        owner, j = pos // S, pos % S
        res = outs[owner][1][j] if sharded else outs[0][1][pos]
        return outs[0][0][pos].view(torch.int16), res.view(torch.int16)

    for sharded in (False, True):
        n0, r0 = run(1, 0, 2, sharded, True)
        for T, pos, ctas in ((3, 2, 2), (257, 200, 32), (4099, 4098, 32), (4099, 17, 2)):
            n, r = run(T, pos, ctas, sharded, True)
            assert torch.equal(n, n0) and torch.equal(r, r0), (T, pos, ctas, sharded)
    T = 9  # S = 3 at N = 3 (rank 2 owns row 8), 3 at N = 4 (rank 2 owns rows 6-8)
    assert not torch.equal(run(T, 8, 2, False, False)[0], run(1, 0, 2, False, False)[0]), \
        "without the option the owner must show: else this test proves nothing"


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("T", [3, 257, 4099])
@pytest.mark.parametrize("H", [4096, 8192])
@pytest.mark.parametrize("form", ["vllm-per-token", "torchao-per-row-bf16", "static-recip-noclamp"])
def test_ce_emulated_fp8_epilogue(N, T, H, form, seed, monkeypatch):
    """ce's fp8 epilogue on the GPU: every rank's gathered codes and row scales equal, bit for bit,
    the normed rows of the same call without the epilogue, on the same add+norm loop, quantized by
    ``quant.quantize_rows``; the kernels the site's reservation loads are all a call launches (no
    load at run time). (Without the epilogue 2 ranks at H=4096 take the one-warp-per-row loop from 8
    rows a CTA on, which reduces a row in chunk order: the reference call is kept to the tile loops
    the epilogue runs in.)"""
    from tests.kernels.shared._addnorm_cases import quant_forms
    from weave_compile.quant import quantize_rows

    quant = quant_forms()[form]
    S = -(-T // N)
    cap = max(256, -(-(S + 1) // 256) * 256)
    partials, res_full, bias, weight = _inputs(N, T, H, BF16, BF16, True, seed)
    qs = torch.tensor(0.01, device="cuda") if quant.kind == "static" else None
    wss_q = ce.emulated_workspaces(N, cap, H, (BF16,) * 3, device="cuda")
    for ws in wss_q:
        program.preload_site(ws, residual_dtype=BF16, terms=[(BF16, BF16, None, None)], scale_dtype=None,
                             quant=quant)
    cache = addnorm._add_rmsnorm_rows_kernel.device_caches[torch.cuda.current_device()][0]
    before = set(cache)
    spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, comm_ctas=8, quant=quant, eps=1e-5)  # as `plain`'s
    rows = [Rows(x, res_full, bias, weight, quant_scale=qs) for x in partials]
    outs = ce.emulated_run(wss_q, rows, spec, _streams(N))
    _sync()
    assert set(cache) == before, f"{len(set(cache) - before)} kernels compiled or loaded at run time"
    tile_loops = addnorm.launch_config
    monkeypatch.setattr(addnorm, "launch_config", lambda *a, **k: tile_loops(*a, **{**k, "quant": True}))
    plain = emulated_call(ce.emulated_workspaces(N, cap, H, (BF16,) * 3, device="cuda"), partials, [res_full] * N,
                          bias, weight, None, eps=1e-5)
    _sync()
    monkeypatch.undo()
    want_q, want_s = quantize_rows(plain[0][0], quant, qs)
    for r, (codes, res_out, scales) in enumerate(outs):
        assert torch.equal(codes.view(torch.uint8), want_q.view(torch.uint8)), r
        assert torch.equal(res_out, plain[r][1]), r
        if quant.kind == "row":
            assert torch.equal(scales, want_s), r


@pytest.mark.parametrize("dtype,res_dtype,out_dtype", [(torch.float32, torch.float32, torch.float32),
                                                       (torch.bfloat16, torch.float32, torch.bfloat16),
                                                       (torch.float16, torch.float16, torch.float32)])
def test_ce_emulated_dtypes_scale(dtype, res_dtype, out_dtype, seed):
    N, T, H = 2, 77, 1024
    wss = ce.emulated_workspaces(N, 64, H, (dtype, out_dtype, res_dtype), device="cuda")
    partials, res_full, bias, weight = _inputs(N, T, H, dtype, res_dtype, True, seed)
    scale = torch.tensor([0.5], device="cuda")
    outs = emulated_call(wss, partials, [res_full] * N, bias, weight, scale, eps=1e-5, num_ctas=4)
    _sync()
    _check(outs, partials, res_full, bias, weight, N, T, False, scale=scale)


@pytest.mark.parametrize("eps_dtype", [None, torch.float64, torch.float32])
def test_no_token_count_loads_a_kernel_at_run_time(eps_dtype, seed):
    """What the registry entry's reserve loads (``preload_site``, on watched workspaces as in
    production) is every kernel that calls of any T, CTA count and residual layout launch: the
    Triton kernel cache does not grow. ``eps_dtype``: eps a 0-d device tensor of that dtype (a site
    whose eps is on the device)."""
    N, H = 2, 4096
    wss = ce.emulated_workspaces(N, 2304, H, (BF16,) * 3, device="cuda")  # a multiple of 256 rows
    _watch(wss, required=False)  # as in production: watched where the device can write the marks
    for ws in wss:
        assert program.preload_site(ws, residual_dtype=BF16, terms=[(BF16, BF16, None)], scale_dtype=None,
                                    eps_on_device=eps_dtype is not None) >= 1
    cache = addnorm._add_rmsnorm_rows_kernel.device_caches[torch.cuda.current_device()][0]
    before = set(cache)
    eps = 1e-5 if eps_dtype is None else 0.5
    eps_kw = dict(eps=eps) if eps_dtype is None else dict(eps=0.0, eps_tensor=torch.tensor(eps, dtype=eps_dtype,
                                                                                         device="cuda"))
    for T in (1, 3, 257, 4099):
        partials, res_full, bias, weight = _inputs(N, T, H, BF16, BF16, True, seed + T)
        for sharded in (False, True):
            for ctas in (2, 32):
                outs = emulated_call(wss, partials, _residual_args(res_full, N, T, sharded), bias, weight, None,
                                     residual_in_sharded=sharded, residual_out_sharded=sharded, num_ctas=ctas,
                                     **eps_kw)
                _sync()
                _check(outs, partials, res_full, bias, weight, N, T, sharded, eps=eps)
    assert set(cache) == before, f"{len(set(cache) - before)} kernels compiled or loaded at run time"


@pytest.mark.parametrize("watched", [False, True])
def test_ce_1000_back_to_back_calls(watched, seed):
    """Rotating inputs, every call's output checked, no host sync between calls: a stale or
    half-written row would show. Watched: the progress marks and the abort word in every call."""
    N, T, H, calls, sets = 2, 203, 1024, 1000, 7
    wss = ce.emulated_workspaces(N, 128, H, (BF16,) * 3, device="cuda")
    if watched:
        _watch(wss)
    data = [_inputs(N, T, H, BF16, BF16, True, seed + i) for i in range(sets)]
    refs = [allreduce_add_rmsnorm_ref(p, r, b, w, eps=1e-5) for p, r, b, w in data]
    res_args = [_residual_args(r, N, T, True) for _, r, _, _ in data]
    outs = []
    for i in range(calls):
        p, _, b, w = data[i % sets]
        outs.append(emulated_call(wss, p, res_args[i % sets], b, w, None, eps=1e-5, residual_in_sharded=True,
                                  residual_out_sharded=True, num_ctas=4))
    _sync(deadline_s=120)
    S = -(-T // N)
    bad = []
    for i, o in enumerate(outs):
        y, acc = refs[i % sets]
        for rk, (normed, res_out) in enumerate(o):
            n = min(S, T - rk * S)
            if not (torch.allclose(normed.double(), y, **TOL[BF16])
                    and torch.allclose(res_out[:n].double(), acc[rk * S:rk * S + n], **TOL[BF16])):
                bad.append((i, rk))
    assert not bad, f"{len(bad)} wrong (call, rank) pairs, first {bad[:5]}"
    if watched:
        assert all(ws.mark.read() == program.done_mark(ws.calls - 1) for ws in wss)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("watched", [False, True])
@pytest.mark.parametrize("eps", ["float", "tensor"])
def test_ce_graph_replay_new_data(sharded, watched, eps, seed):
    """Three chained calls of both ranks captured in one graph, replayed with new inputs copied
    into the captured buffers and every output poisoned first: flags reset themselves, so every
    replay is a full protocol; each replay's outputs against the float64 oracle. eps="tensor": a
    0-d device tensor given a new value before each replay, which the replay must read."""
    N, T, H = 2, 1001, 4096
    wss = ce.emulated_workspaces(N, 512, H, (BF16,) * 3, device="cuda")
    if watched:
        _watch(wss)
    partials, res_full, bias, weight = _inputs(N, T, H, BF16, BF16, True, seed)
    static_x = [p.clone() for p in partials]
    static_res = [t.clone() for t in _residual_args(res_full, N, T, sharded)]
    eps_t = torch.tensor(0.5, dtype=torch.float64, device="cuda")
    kw = dict(eps=1e-5, residual_in_sharded=sharded, residual_out_sharded=sharded)
    if eps == "tensor":
        kw.update(eps=0.0, eps_tensor=eps_t)

    def three_calls():
        calls = [emulated_call(wss, static_x, static_res, bias, weight, None, **kw)]
        for _ in range(2):  # each reduces the previous call's normed output (a chain, as layers are)
            calls.append(emulated_call(wss, [o[0] for o in calls[-1]], static_res, bias, weight, None, **kw))
        return calls

    three_calls()  # warm-up (Triton compile) outside capture
    _sync()
    g, calls = capture(three_calls)
    _sync()
    for rep in range(4):
        partials, res_full, _, _ = _inputs(N, T, H, BF16, BF16, True, seed + 100 + rep)
        for r in range(N):
            static_x[r].copy_(partials[r])
        for dst, src in zip(static_res, _residual_args(res_full, N, T, sharded)):
            dst.copy_(src)
        eps_t.fill_(0.25 * (rep + 1))  # of the order of the rows' mean square: it moves every output
        for outs in calls:
            _poison(outs)
        g.replay()
        _sync()
        inputs = partials
        for outs in calls:
            _check(outs, inputs, res_full, bias, weight, N, T, sharded, eps=eps_t.item() if eps == "tensor" else 1e-5)
            inputs = [o[0] for o in outs]  # every rank's normed output (identical across ranks)
        for ws in wss:
            assert int(ws.regions[ws.rank].flags.abs().sum()) == 0


# ----------------------------------------------------------------------------- fresh processes

_COLD = r"""
import faulthandler, sys, time
faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)  # a deadlock prints every stack, exits
import torch
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.kernels.spec import FusedSpec, Rows

mode = sys.argv[1]
N, T, H, dt = 2, 2 * 257, 4096, torch.bfloat16
wss = ce.emulated_workspaces(N, 512, H, (dt,) * 3, device="cuda")
g = torch.Generator(device="cuda").manual_seed(0)
xs = [torch.randn(T, H, device="cuda", generator=g).to(dt) for _ in range(N)]
res = torch.randn(T, H, device="cuda", generator=g).to(dt)
w = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(dt)
spec = FusedSpec(residual_dtype=dt, out_dtype=dt, eps=1e-5, comm_ctas=8)
streams = [torch.cuda.Stream() for _ in range(N)]
main = torch.cuda.current_stream()
if mode == "per_rank":  # one rank's call after the other, as a one-rank-per-process caller would
    for s in streams:
        s.wait_stream(main)
    outs = []
    for r in range(N):
        with torch.cuda.stream(streams[r]):
            outs.append(ce.ce_call(wss[r], Rows(xs[r], res, None, w), spec)[:2])
    for s in streams:
        main.wait_stream(s)
else:
    outs = ce.emulated_run(wss, [Rows(x, res, None, w) for x in xs], spec, streams)
ev = torch.cuda.Event()
ev.record()
t0 = time.monotonic()
while not ev.query():
    if time.monotonic() - t0 > 60:
        print("device work blocked"); sys.exit(3)
    time.sleep(0.001)
y, acc = allreduce_add_rmsnorm_ref(xs, res, None, w, eps=1e-5)
for normed, res_out in outs:
    torch.testing.assert_close(normed.double(), y.double(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(res_out.double(), acc.double(), atol=3e-2, rtol=3e-2)
print("cold ok", mode)
"""


def _fresh_env(**extra):
    env = dict(os.environ, CUDA_MODULE_LOADING="LAZY", CUDA_DEVICE_MAX_CONNECTIONS="32",
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="weave-ce-triton-"), **extra)
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(SRC), os.path.abspath(os.path.join(SRC, "..")),
                                         env.get("PYTHONPATH", "")])
    return env


def _script(tmp_path, text: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("mode", ["per_rank", "emulated_run"])
def test_cold_start_of_two_emulated_ranks_does_not_deadlock(tmp_path, mode):
    """A fresh process (lazy module loading, empty Triton cache): the first calls of two emulated
    ranks compile and load the add+norm kernel while nothing else is loaded. Calling one rank
    after the other deadlocked (rank 0's stream waits for rank 1 while the host loads rank 0's
    kernel, and the load waits for that stream); now ce_call loads an emulated rank's kernels
    before it enqueues, and emulated_run is safe by construction."""
    code, out = run_script(_script(tmp_path, _COLD), [mode, "150"], timeout=240, env=_fresh_env())
    assert code == 0 and f"cold ok {mode}" in out, out[-6000:]


_WATCHDOG = r"""
import faulthandler, logging, sys, time
faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
import torch
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.ce.watchdog import Watchdog
from weave_compile.kernels.spec import FusedSpec, Rows

N, T, H, dt, TIMEOUT = 2, 1000, 4096, torch.bfloat16, 2.0
wss = ce.emulated_workspaces(N, 512, H, (dt,) * 3, device="cuda")
wd = Watchdog(timeout_s=TIMEOUT, poll_s=0.1).start()
wd.watch(wss)
x = torch.randn(T, H, device="cuda").to(dt)
res = torch.randn(T, H, device="cuda").to(dt)
w = torch.randn(H, device="cuda").to(dt)
spec = FusedSpec(residual_dtype=dt, out_dtype=dt, eps=1e-5, comm_ctas=8)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    normed, res_out, prog = ce.ce_call(wss[0], Rows(x, res, None, w), spec, run=False)
    normed.fill_(7.0)
    res_out.fill_(7.0)
    ce.preload(prog)
    ce.execute(prog, stream)  # rank 0 only: rank 1's call is never issued
t0 = time.monotonic()
ev = torch.cuda.Event()
ev.record(stream)
while not ev.query():
    if time.monotonic() - t0 > 60:
        print("STREAM STILL BLOCKED"); sys.exit(3)
    time.sleep(0.01)
elapsed = time.monotonic() - t0
torch.cuda.current_stream().wait_stream(stream)
assert torch.isnan(normed).all() and torch.isnan(res_out).all(), "outputs not poisoned"
assert wss[0].failed and wss[1].failed
assert int(wss[0].regions[0].abort) == 1 and int(wss[1].regions[1].abort) == 1
for ws in wss:
    try:
        ce.ce_call(ws, Rows(x, res, None, w), spec)
        print("NO ERROR ON THE NEXT CALL"); sys.exit(4)
    except ce.CeAbortedError as e:
        print("next call raised:", e)
print(f"watchdog ok {elapsed:.2f}")
"""


def test_watchdog_a_peer_that_never_signals(tmp_path):
    """Two emulated ranks, rank 1's call never issued: within the 2 s timeout (+ a poll) rank 0's
    stream is released, its outputs are NaN, the error names group, rank, peer and flag, and the
    next call of either rank raises. Under lazy module loading: the rescue launches no kernel."""
    if _host_words_reason() is not None:
        pytest.skip(f"the watchdog cannot run on this device: {_host_words_reason()}")
    code, out = run_script(_script(tmp_path, _WATCHDOG), ["120"], timeout=240, env=_fresh_env())
    assert code == 0 and "watchdog ok" in out, out[-6000:]
    elapsed = float(out.split("watchdog ok ")[1].split()[0])
    assert 1.9 <= elapsed <= 8.0, out[-3000:]
    assert "ERROR" in out and "from rank 1" in out and "flag RS[1] of rank 0" in out, out[-3000:]
    assert out.count("next call raised:") == 2


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
