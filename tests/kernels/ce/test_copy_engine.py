"""CPU simulation of the ``ce`` design (kernels/ce/copy_engine.py) and its add+norm kernel (kernels/shared/addnorm.py).

The simulation runs the very programs the GPU executes (``build_program``: copies, flag
signals/waits/resets, add+norm) for N ranks in one process, on CPU tensors, with plain torch
copies, interleaving the ranks' ops in a random order that respects only the flag waits, as
independent streams could. Stale or unwritten data would show: data regions start as NaN and
every call gets fresh random inputs. Checked against the float64 oracle for 2 and 3 ranks,
awkward T and H, sharded and unsharded residual, several calls back to back (flags must be 0
after each, which is what makes CUDA-graph replay safe). Two tests break the protocol on purpose
and check that the simulation notices. The Triton add+norm kernel runs under
``TRITON_INTERPRET=1`` in a subprocess (the interpreter is chosen when Triton functions are
defined, so it needs a fresh process).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.ce import program
from weave_compile.kernels.ce import workspace as ce_workspace
from weave_compile.kernels.ce.watchdog import Watchdog
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref as _oracle
from weave_compile.kernels.shared import addnorm
from weave_compile.kernels.spec import FusedSpec, Rows

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}


def allreduce_add_rmsnorm_ref(*args, **kwargs):
    """The one oracle (kernels/reference.py), its outputs (rounded where the contract rounds) as float64."""
    return tuple(t.double() for t in _oracle(*args, **kwargs))


def ce_call(ws, x, residual=None, bias=None, weight=None, scale=None, *, num_ctas=8, config=None, run=True,
            eps_tensor=None, norm_bias=None, **spec_kw):
    """:func:`ce.ce_call` for one rank's tensors; ``spec_kw`` are FusedSpec fields (dtypes: the workspace's)."""
    spec = FusedSpec(residual_dtype=ws.dtypes[2], out_dtype=ws.dtypes[1], comm_ctas=num_ctas, **spec_kw)
    return ce.ce_call(ws, Rows(x, residual, bias, weight, scale, eps_tensor, norm_bias=norm_bias), spec, config=config,
                      run=run)


class Deadlock(RuntimeError):
    pass


def simulate(programs: list[list], rng: random.Random, greedy: bool = False) -> None:
    """Run every rank's op list; any interleaving allowed by the waits (``greedy``: lowest rank first)."""
    pcs = [0] * len(programs)
    while True:
        ready = [r for r, prog in enumerate(programs) if pcs[r] < len(prog)
                 and not (isinstance(prog[pcs[r]], ce.Wait) and int(prog[pcs[r]].flag.item()) < 1)]
        if not ready:
            if all(pc == len(p) for pc, p in zip(pcs, programs)):
                return
            raise Deadlock(f"no rank can proceed; program counters {pcs}")
        r = ready[0] if greedy else rng.choice(ready)
        op = programs[r][pcs[r]]
        pcs[r] += 1
        if isinstance(op, ce.Copy):
            op.dst.copy_(op.src)
        elif isinstance(op, ce.Signal):
            op.flag.fill_(1)
        elif isinstance(op, ce.Reset):
            op.flag.fill_(0)
        elif isinstance(op, ce.Mark):
            op.word.fill_(op.value)
        elif isinstance(op, ce.Norm):
            addnorm.add_rmsnorm_rows(**op.kwargs)


def make_inputs(gen, N, T, H, dtype, res_dtype, residual, bias, weight, scale, offset=0.0):
    partials = [(torch.randn(T, H, generator=gen) + offset).to(dtype) for _ in range(N)]
    res_full = torch.randn(T, H, generator=gen).to(res_dtype) if residual else None
    b = torch.randn(H, generator=gen).to(dtype) if bias else None
    w = (1 + 0.1 * torch.randn(H, generator=gen)).to(dtype) if weight else None
    s = torch.tensor([0.7]) if scale else None
    return partials, res_full, b, w, s


def run_calls(N, T, H, *, dtype=torch.bfloat16, res_dtype=None, residual="full", bias=False, weight=True,
              scale=False, weight_offset=0.0, mid_dtype=None, calls=3, seed=0, greedy=False, mutate=None,
              watched=False, eps=1e-5, eps_tensor=False, norm="rmsnorm", norm_bias=False):
    """Simulate ``calls`` back-to-back calls on N ranks; return [(outputs per rank, inputs), ...].
    ``watched``: the workspaces are watched (progress marks, the abort word read by the norm);
    ``eps_tensor``: eps comes as a 0-d float64 tensor, the spec's float being 0.0; ``norm``
    "layernorm" (each partial offset by 1, a mean the LayerNorm removes) with a ``norm_bias``."""
    res_dtype = res_dtype or dtype
    S = -(-T // N)
    wss = ce.emulated_workspaces(N, capacity=S + 3, hidden=H, dtypes=(dtype, dtype, res_dtype))
    if watched:
        Watchdog(timeout_s=60).watch(wss)
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    sharded = residual == "sharded"
    results, programs = [], [[] for _ in range(N)]
    for _ in range(calls):
        partials, res_full, b, w, s = make_inputs(gen, N, T, H, dtype, res_dtype, residual is not None, bias,
                                                  weight, scale, offset=1.0 if norm == "layernorm" else 0.0)
        nb = torch.randn(H, generator=gen).to(dtype) if norm_bias else None
        if sharded:
            padded = torch.nn.functional.pad(res_full, (0, 0, 0, S * N - T))
            res_in = [padded[r * S:(r + 1) * S] for r in range(N)]
        outs = []
        for r in range(N):
            normed, res_out, prog = ce_call(
                wss[r], partials[r], res_in[r] if sharded else res_full, b, w, s, mid_dtype=mid_dtype,
                weight_offset=weight_offset, residual_in_sharded=sharded, residual_out_sharded=sharded,
                num_ctas=4, run=False, eps=0.0 if eps_tensor else eps,
                eps_tensor=torch.tensor(eps, dtype=torch.float64) if eps_tensor else None, norm=norm, norm_bias=nb)
            normed.fill_(float("nan"))
            res_out.fill_(float("nan"))
            if mutate:
                prog = mutate(prog)
            programs[r] += prog
            outs.append((normed, res_out))
        results.append((outs, (partials, res_full, b, w, s, nb)))
    simulate(programs, rng, greedy=greedy)
    for ws in wss:
        assert int(ws.regions[ws.rank].flags.abs().sum()) == 0, "a flag was left set: replay would break"
        if watched:
            assert ws.mark.read() == program.done_mark(ws.calls - 1), "the last mark must say: done waiting"
    return results, S


def check(results, N, S, T, weight_offset=0.0, sharded=False, eps=1e-5, norm="rmsnorm"):
    for outs, (partials, res_full, b, w, s, nb) in results:
        y, acc = allreduce_add_rmsnorm_ref(partials, res_full, b, w, eps=eps, weight_offset=weight_offset, scale=s,
                                           norm=norm, norm_bias=nb)
        if norm == "layernorm":  # the check tells LayerNorm from RMSNorm on these rows
            rms, _ = allreduce_add_rmsnorm_ref(partials, res_full, b, w, eps=eps, weight_offset=weight_offset,
                                               scale=s, norm_bias=nb)
            assert (rms - y).abs().max() > 10 * TOL[outs[0][0].dtype]["atol"]
        for r, (normed, res_out) in enumerate(outs):
            tol = TOL[normed.dtype]
            torch.testing.assert_close(normed.double(), y, **tol)
            if sharded:
                n = max(0, min(S, T - r * S))
                torch.testing.assert_close(res_out[:n].double(), acc[r * S:r * S + n], **tol)
                assert torch.all(res_out[n:] == 0), "padding rows of a sharded residual must be zero"
            else:
                torch.testing.assert_close(res_out.double(), acc, **TOL[res_out.dtype])


@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("T,H", [(1, 24), (7, 40), (67, 96), (130, 3000 // 8)])
@pytest.mark.parametrize("residual", [None, "full", "sharded"])
def test_ce_simulation_matches_float64(N, T, H, residual, seed):
    results, S = run_calls(N, T, H, residual=residual, bias=T % 2 == 1, seed=seed)
    check(results, N, S, T, sharded=residual == "sharded")


@pytest.mark.parametrize("case", [
    dict(dtype=torch.float32, scale=True, bias=True, watched=True),
    dict(dtype=torch.bfloat16, res_dtype=torch.float32, weight_offset=1.0),  # Gemma-style (1 + w), fp32 residual
    dict(dtype=torch.float16, mid_dtype=torch.float16, weight=False),
    # eps as a device tensor (torch.compile(dynamic=True)), large enough that the float 0.0 would fail
    dict(dtype=torch.bfloat16, bias=True, residual="sharded", eps=0.5, eps_tensor=True),
])
def test_ce_simulation_dtypes_and_options(case, seed):
    results, S = run_calls(3, 29, 64, seed=seed, **case)
    check(results, 3, S, 29, weight_offset=case.get("weight_offset", 0.0), sharded=case.get("residual") == "sharded",
          eps=case.get("eps", 1e-5))


@pytest.mark.parametrize("case", [
    dict(norm_bias=True, bias=True),
    dict(dtype=torch.float32, residual="sharded", weight=False),
    dict(norm_bias=True, weight_offset=1.0, mid_dtype=torch.bfloat16, scale=True, watched=True),
])
@pytest.mark.parametrize("N,T,H", [(2, 7, 40), (3, 29, 64)])
def test_ce_simulation_layernorm(N, T, H, case, seed):
    """The LayerNorm variant through ce's program (its Norm op carries the norm and the norm bias)."""
    results, S = run_calls(N, T, H, seed=seed, norm="layernorm", **case)
    check(results, N, S, T, weight_offset=case.get("weight_offset", 0.0), sharded=case.get("residual") == "sharded",
          norm="layernorm")


def test_missing_wait_is_caught(seed):
    """Without the reduce-scatter waits a rank's add+norm reads its recv slots before peers push."""
    def drop_rs_waits(prog):
        out, seen_norm = [], False
        for op in prog:
            seen_norm |= isinstance(op, ce.Norm)
            if isinstance(op, (ce.Wait, ce.Reset)) and not seen_norm:
                continue
            out.append(op)
        return out

    with pytest.raises((AssertionError, Deadlock)):
        results, S = run_calls(2, 16, 32, greedy=True, mutate=drop_rs_waits, seed=seed, calls=1)
        check(results, 2, S, 16)


def test_missing_signal_deadlocks(seed):
    def drop_first_signal(prog):
        i = next(i for i, op in enumerate(prog) if isinstance(op, ce.Signal))
        return prog[:i] + prog[i + 1:]

    with pytest.raises(Deadlock):
        run_calls(2, 8, 16, mutate=drop_first_signal, seed=seed, calls=1)


def test_program_shape():
    """Per call and peer: one push, two signals, two waits, two resets; one norm; N pulls (x2 unsharded)."""
    N, T, H = 3, 10, 16
    ws = ce.emulated_workspaces(N, 8, H, (torch.float32,) * 3)[1]
    x = torch.randn(T, H)
    _, _, prog = ce_call(ws, x, torch.randn(T, H), run=False)
    kinds = [type(op).__name__ for op in prog]
    assert kinds.count("Copy") == (N - 1) + 2 * N
    assert kinds.count("Signal") == kinds.count("Wait") == kinds.count("Reset") == 2 * (N - 1)
    assert kinds.count("Norm") == 1
    # Every wait is followed by the reset of the same word, and signals go to peers' words only.
    for a, b in zip(prog, prog[1:]):
        if isinstance(a, ce.Wait):
            assert isinstance(b, ce.Reset) and b.flag.data_ptr() == a.flag.data_ptr()
    own = ws.regions[1].flags
    for op in prog:
        if isinstance(op, ce.Signal):
            assert not (own.data_ptr() <= op.flag.data_ptr() < own.data_ptr() + own.numel() * 4)


def test_bad_shapes_raise():
    ws = ce.emulated_workspaces(2, 4, 16, (torch.float32,) * 3)[0]
    with pytest.raises(ce.CeCapacityError):
        ce_call(ws, torch.randn(9, 16), run=False)  # 5 rows per rank > capacity 4
    with pytest.raises(ValueError, match="residual"):
        ce_call(ws, torch.randn(6, 16), torch.randn(5, 16), run=False)
    with pytest.raises(ValueError, match="H=16"):
        ce_call(ws, torch.randn(6, 8), run=False)


# ----------------------------------------------------------------------------- Triton interpreter

_INTERP_SCRIPT = r"""
import random, sys, torch
sys.path.insert(0, sys.argv[1])
import test_copy_engine as t
from weave_compile.kernels.shared import addnorm
assert addnorm.use_triton(torch.device("cpu"))
seed = int(sys.argv[2])
# The kernel alone, several launch shapes (rows per iteration, stages, a grid smaller than the row blocks).
g = torch.Generator().manual_seed(seed)
for H, n, slots, cfg in [(40, 5, 1, addnorm.LaunchConfig(2, 3, 4)), (96, 9, 2, addnorm.LaunchConfig(4, 2, 4)),
                         (24, 3, 0, addnorm.LaunchConfig(1, 1, 4)), (40, 5, 1, addnorm.LaunchConfig(2, 1, 4, True)),
                         (96, 9, 3, addnorm.LaunchConfig(4, 1, 4, True)), (24, 3, 0, addnorm.LaunchConfig(1, 1, 4, True)),
                         # one warp per row (rownorm.rowwise_group): column chunks loaded ahead,
                         # H=40 / 24 with a half-masked last chunk, a lookahead past the last chunk
                         (40, 5, 1, addnorm.LaunchConfig(2, 1, 4, chunk=16, depth=2)),
                         (96, 9, 2, addnorm.LaunchConfig(4, 1, 4, chunk=32, depth=1)),
                         (24, 9, 0, addnorm.LaunchConfig(2, 1, 4, chunk=16, depth=3))]:
    x = torch.randn(n + 2, H, generator=g).to(torch.bfloat16)[1:n + 1]
    recv = torch.randn(slots, n + 3, H, generator=g).to(torch.bfloat16) if slots else None
    res = torch.randn(n, H, generator=g).to(torch.bfloat16)
    kw = dict(eps=1e-5, mid_dtype=torch.bfloat16, weight_offset=1.0, num_ctas=2)
    # with a bias and/or a scale (the padding rows' zeros come from the kernel's select; a
    # negative scale would make them -0.0 without it), and without either (they come from
    # inputs loaded as 0: no select then)
    for bias, scale in ((torch.randn(H, generator=g), torch.tensor([1.5])), (None, None),
                        (torch.randn(H, generator=g), None), (None, torch.tensor([-1.5]))):
        w = torch.randn(H, generator=g)
        outs = []
        for force in (False, True):
            normed = torch.full((n + 1, H), float("nan"), dtype=torch.bfloat16)
            res_out = torch.full((n + 2, H), float("nan"), dtype=torch.float32)
            addnorm.add_rmsnorm_rows(x, recv, res, bias, w, scale, normed, res_out, n_valid=n,
                                     config=cfg, force_torch=force, **kw)
            outs.append((normed[:n], res_out))
        torch.testing.assert_close(outs[0][0].float(), outs[1][0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
        assert torch.all(outs[0][1][n:] == 0) and not torch.signbit(outs[0][1][n:]).any()
# The abort word (the ce watchdog's poison): 0 changes nothing, set makes every row NaN; the
# padding rows of a sharded residual stay 0.
for cfg in (addnorm.LaunchConfig(2, 1, 4, True), addnorm.LaunchConfig(2, 1, 4, chunk=16, depth=2),
            addnorm.LaunchConfig(2, 2, 4)):
    H, n = 40, 5
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    recv = torch.randn(1, n, H, generator=g).to(torch.bfloat16)
    w = torch.randn(H, generator=g)
    for word in (0, 1):
        abort = torch.tensor([word], dtype=torch.int32)
        outs = []
        for force in (False, True):
            normed = torch.full((n, H), 7.0, dtype=torch.bfloat16)
            res_out = torch.full((n + 2, H), 7.0, dtype=torch.float32)
            addnorm.add_rmsnorm_rows(x, recv, None, None, w, None, normed, res_out, n_valid=n, config=cfg,
                                     force_torch=force, abort=abort, eps=1e-5, mid_dtype=None, weight_offset=0.0,
                                     num_ctas=2)
            outs.append((normed, res_out))
        for normed, res_out in outs:
            assert bool(torch.isnan(normed).all()) == bool(word) and bool(torch.isnan(res_out[:n]).all()) == bool(word)
            assert torch.all(res_out[n:] == 0)
        if not word:
            torch.testing.assert_close(outs[0][0].float(), outs[1][0].float(), atol=2e-2, rtol=2e-2)
# The whole simulated protocol with the Triton kernel as its add+norm (watched: the abort word read).
for N, residual, watched in ((2, "sharded", False), (3, "full", True)):
    results, S = t.run_calls(N, 11, 40, residual=residual, bias=True, seed=seed, calls=2, watched=watched)
    t.check(results, N, S, 11, sharded=residual == "sharded")
print("interp ok")
"""


@pytest.mark.skipif(not addnorm.HAS_TRITON, reason="triton not installed")
def test_addnorm_triton_interpreter(seed):
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT, here, str(seed)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and "interp ok" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.skipif(not addnorm.HAS_TRITON, reason="triton not installed")
def test_addnorm_shape_that_does_not_fit_is_retried_with_fewer_stages(monkeypatch):
    from triton.runtime.errors import OutOfResources

    tried = []

    def fake_launch(*args, preload=False):
        cfg = args[-2]
        tried.append(cfg.num_stages)
        if cfg.num_stages > 1:
            raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(addnorm, "use_triton", lambda device: True)
    monkeypatch.setattr(addnorm, "_launch", fake_launch)
    monkeypatch.setattr(addnorm, "_SHRUNK", {})
    args = (torch.zeros(4, 8), None, None, None, None, None, torch.empty(4, 8), torch.empty(4, 8))
    kw = dict(n_valid=4, eps=1e-6, mid_dtype=None, weight_offset=0.0, num_ctas=2,
              config=addnorm.LaunchConfig(2, 3, 4))
    addnorm.add_rmsnorm_rows(*args, **kw)
    assert tried == [3, 2, 1]
    addnorm.add_rmsnorm_rows(*args, **kw)  # remembered: straight to the shape that fit
    assert tried == [3, 2, 1, 1]


def test_preload_writes_nothing():
    """``preload`` loads kernels only: the program's outputs (poisoned) stay as they were, also on
    the torch path, which has no kernel to load."""
    N, T, H = 2, 10, 16
    ws = ce.emulated_workspaces(N, 8, H, (torch.float32,) * 3)[0]
    _, _, prog = ce_call(ws, torch.randn(T, H), torch.randn(T, H), run=False)
    norm = next(op for op in prog if isinstance(op, ce.Norm))
    for t in (norm.kwargs["normed"], norm.kwargs["res_out"]):
        t.fill_(float("nan"))
    ce.preload(prog)
    assert torch.isnan(norm.kwargs["normed"]).all() and torch.isnan(norm.kwargs["res_out"]).all()


def test_a_grown_workspace_keeps_the_old_one_alive_and_grows_geometrically(monkeypatch):
    """As for the other workspaces: growth keeps the replaced workspace alive (a copy or flag
    write of an earlier call may still be in flight into it) and grows by at least 1.5x."""
    from tests.kernels._symm_cases import stub_workspace_allocation  # here: a subprocess test imports this file alone

    from weave_compile.kernels.ce import watchdog

    made = stub_workspace_allocation(monkeypatch, ce_workspace)
    watched = []
    monkeypatch.setattr(watchdog, "watch_default", watched.append)
    dev = torch.device("cuda", 0)
    dts = (torch.bfloat16,) * 3
    first = ce.get_workspace("g", dev, 64, dts, 51200)  # large against the 256-row rounding (see oneshot's)
    assert ce.get_workspace("g", dev, 64, dts, 2 * first.capacity) is first and not ce_workspace._RETIRED
    second = ce.get_workspace("g", dev, 64, dts, 2 * first.capacity + 2)
    assert second is not first and ce_workspace._RETIRED == [first]
    assert second.capacity >= 1.5 * first.capacity
    assert len(made) == 2 and watched == made  # every new workspace is watched
    # A workspace whose wait timed out raises before anything else (growing would be a
    # rendezvous with a dead peer).
    second.failed = "ce: group 'g' rank 0: no signal (test)"
    for tokens in (8, 10 * second.capacity):
        with pytest.raises(ce.CeAbortedError, match="no signal"):
            ce.get_workspace("g", dev, 64, dts, tokens)
    assert len(made) == 2


def test_addnorm_default_shapes():
    """The measured defaults (bench_comm_ce.py, one H200): one warp per row for one received
    partial of 16-bit rows with 2048 <= H <= 4096; the prefetched loop with 16 warps on
    8K-element tiles where two tiles of inputs fit the registers; else the pipelined loop."""
    from weave_compile.kernels.shared.common import next_pow2, prefetch_fits

    for H in (2048, 3000, 4096):
        assert addnorm.launch_config(H, slots=1) == addnorm.LaunchConfig(8, 1, 8, False, 256, addnorm.ADDNORM_ROWWISE_DEPTH)
    assert addnorm.launch_config(2047, slots=1).chunk == 0
    assert addnorm.launch_config(4096, slots=2).chunk == 0
    assert addnorm.launch_config(4096, slots=1, res_bytes=4).chunk == 0  # the kept row would not fit
    assert addnorm.launch_config(4096, slots=1, rows_per_cta=4).chunk == 0  # warps would idle
    assert addnorm.launch_config(4096, slots=1, rows_per_cta=8).chunk == 256
    # any shape argument given keeps the caller's loop
    assert addnorm.launch_config(4096, block_rows=2, slots=1) == addnorm.LaunchConfig(2, 1, 16, True)
    assert addnorm.launch_config(8192, slots=1) == addnorm.LaunchConfig(1, 1, 16, True)
    assert addnorm.launch_config(4096, slots=1, elem_bytes=4) == addnorm.LaunchConfig(4, 3, 16, False)
    assert not addnorm.launch_config(4096, slots=3).prefetch
    for H in (64, 1000, 2048, 4096, 5120, 8192, 16384):
        for slots in (0, 1, 2, 3, 7):
            for nbytes in (2, 4):
                c = addnorm.launch_config(H, slots=slots, elem_bytes=nbytes)
                if c.chunk:  # the kept row: H x residual bytes <= 8 KB, 64 registers per lane
                    assert slots == 1 and nbytes == 2 and 2048 <= H <= 4096 and c.block_rows == c.num_warps
                if c.prefetch:
                    e = c.block_rows * next_pow2(H) // (32 * c.num_warps)
                    assert e >= 1 and prefetch_fits(2 + next_pow2(max(1, slots)), e, nbytes, c.num_warps)


# ----------------------------------------------------------------------------- the registry entry

BF16 = torch.bfloat16


def _site(**kw):
    from weave_compile.kernels.registry import NormTerms, Site

    base = dict(device=torch.device("cuda", 0), dtype=BF16, residual_dtype=BF16, out_dtype=BF16, hidden=64,
                group_name="g", world_size=2, size_hint=100, residual_in_dtype=BF16, has_scale=True,
                terms=NormTerms(bias=None, weight=BF16, mid=None, scale=torch.float32))
    return Site(**{**base, **kw})


def test_entry_reserves_the_workspace_and_loads_the_sites_kernels(monkeypatch):
    """reserve(site): the workspace for the site's token count (at least MIN_RESERVED_ROWS) and
    every add+norm variant of the site's terms."""
    from weave_compile.kernels import ce as entry
    from weave_compile.kernels.shared.symm_call import MIN_RESERVED_ROWS

    ws = ce.emulated_workspaces(2, 256, 64, (BF16,) * 3)[0]
    calls = []
    monkeypatch.setattr(ce_workspace, "reserve", lambda *a: calls.append(("reserve", a)) or ws)
    monkeypatch.setattr(program, "preload_site", lambda w, **kw: calls.append(("preload", w, kw)) or 2)
    assert entry.IMPLEMENTATION.reserve is not None and entry.IMPLEMENTATION.auto_rank is not None
    entry.IMPLEMENTATION.reserve(_site())
    assert calls == [("reserve", ("g", torch.device("cuda", 0), 64, (BF16,) * 3, MIN_RESERVED_ROWS)),
                     ("preload", ws, dict(residual_dtype=BF16, terms=[(None, BF16, None, None)],
                                          scale_dtype=torch.float32, eps_on_device=False, norm="rmsnorm",
                                          batch_invariant=False, quant=None))]
    # a LayerNorm site loads its variant: the norm and the norm bias's dtype reach the preload
    from weave_compile.kernels.registry import NormTerms

    calls.clear()
    entry.IMPLEMENTATION.reserve(_site(norm="layernorm", terms=NormTerms(bias=None, weight=BF16, mid=None,
                                                                         scale=torch.float32, norm_bias=BF16)))
    assert calls[1][2]["norm"] == "layernorm" and calls[1][2]["terms"] == [(None, BF16, None, BF16)]
    calls.clear()  # a batch-invariant site loads the rank-order variant
    entry.IMPLEMENTATION.reserve(_site(batch_invariant=True))
    assert calls[1][2]["batch_invariant"] is True
    calls.clear()
    entry.IMPLEMENTATION.reserve(_site(size_hint=3 * MIN_RESERVED_ROWS, terms=None, has_scale=False,
                                       residual_in_dtype=None, residual_dtype=torch.float32, eps_on_device=True))
    assert calls == [("reserve", ("g", torch.device("cuda", 0), 64, (BF16, BF16, torch.float32), 3 * MIN_RESERVED_ROWS)),
                     ("preload", ws, dict(residual_dtype=None, terms=None, scale_dtype=None, eps_on_device=True,
                                          norm="rmsnorm", batch_invariant=False, quant=None))]


def test_entry_check_wants_rows_of_16_bytes(monkeypatch):
    """Rows of every dtype the call touches are a multiple of 16 bytes, else no token count could be
    sure to find its kernel loaded (a row offset would change the pointers' alignment)."""
    from weave_compile.kernels import ce as entry
    from weave_compile.kernels.shared import probe

    monkeypatch.setattr(addnorm, "unavailable_reason", lambda *a: None)
    monkeypatch.setattr(ce, "unavailable_reason", lambda: None)
    monkeypatch.setattr(probe, "probe", lambda *a, **k: probe.SymmProbe(True, False, "mapped (test)"))
    fp32 = torch.float32
    site = _site(dtype=fp32, out_dtype=fp32, residual_dtype=fp32, residual_in_dtype=BF16, hidden=3004)
    assert "3004" in entry._check(site) and "16 bytes" in entry._check(site)
    assert entry._check(_site(dtype=fp32, out_dtype=fp32, residual_dtype=fp32, residual_in_dtype=BF16,
                              hidden=3008)) is None


def test_without_cuda_python_the_reason_says_how_to_install(monkeypatch):
    from weave_compile.kernels.ce import memops

    def missing():
        raise ModuleNotFoundError("No module named 'cuda'")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memops, "driver", missing)
    why = ce.unavailable_reason()
    assert "cuda-python is not installed" in why and "pip install 'weave_compile[ce]'" in why
    assert "No module named 'cuda'" in why


def test_a_failed_workspace_raises_on_the_next_call():
    ws = ce.emulated_workspaces(2, 8, 16, (torch.float32,) * 3)[0]
    ws.failed = "ce: group 'g' rank 0 of 2: no reduce-scatter signal from rank 1 (test)"
    with pytest.raises(ce.CeAbortedError, match="no reduce-scatter signal from rank 1"):
        ce_call(ws, torch.randn(4, 16), run=False)


@pytest.mark.skipif(not addnorm.HAS_TRITON, reason="triton not installed")
def test_addnorm_with_the_abort_word_compiles_for_sm90():
    """The kernel as a watched workspace launches it (the abort word read, NaN as 0x7FC00000),
    compiled for sm_90 by Triton and ptxas here, for both launch shapes ce uses at H=4096."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    k = addnorm._add_rmsnorm_rows_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(k.signature, k.params, backend)
    H = 4096
    for rows in (1, 8):
        cfg = addnorm.launch_config(H, slots=1, rows_per_cta=rows)
        ptx = {}
        for abort in (None, torch.zeros(1, dtype=torch.int32)):
            x = torch.empty(rows, H, dtype=BF16)
            tensors = (x, torch.empty(1, 256, H, dtype=BF16), torch.empty(rows, H, dtype=BF16), None,
                       torch.empty(H, dtype=BF16), None, abort, torch.empty(rows, H, dtype=BF16),
                       torch.empty(rows, H, dtype=BF16))
            args, kw = addnorm.kernel_args(tensors, rows, rows, 1e-6, None, 0.0, cfg, 1)
            bound, spec, opts = binder(*args, **kw)
            options, signature, constexprs, attrs = k._pack_args(backend, kw, bound, spec, opts)
            compiled = triton.compile(ASTSource(k, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
            ptx[abort is not None] = compiled.asm["ptx"]
        assert "0f7FC00000" in ptx[True] and "0f7FC00000" not in ptx[False], cfg


@pytest.mark.parametrize("N,T,H", [(2, 7, 40), (3, 29, 64), (3, 2, 48)])
@pytest.mark.parametrize("form", ["vllm-per-token", "torchao-per-row-bf16", "static-recip-noclamp"])
@pytest.mark.parametrize("residual", ["full", "sharded"])
def test_ce_simulation_fp8_epilogue(N, T, H, form, residual, seed):
    """ce with an fp8 epilogue: each rank's kernel writes codes and row scales into its ``out``
    region's bytes and the pulls move them; the gathered codes and scales equal, bit for bit, the
    same program's normed rows (run without the epilogue on the same inputs) quantized by
    ``quant.quantize_rows``, on every rank, and the residual is unchanged by the epilogue."""
    from tests.kernels.shared._addnorm_cases import quant_forms
    from weave_compile.quant import quantize_rows

    quant = quant_forms()[form]
    sharded = residual == "sharded"
    S = -(-T // N)
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    partials, res_full, b, w, _ = make_inputs(gen, N, T, H, BF16, BF16, True, True, True, False)
    qs = torch.tensor(0.01) if quant.kind == "static" else None
    padded = torch.nn.functional.pad(res_full, (0, 0, 0, S * N - T))

    def run(q):
        wss = ce.emulated_workspaces(N, 256, H, (BF16,) * 3)
        spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, comm_ctas=4, residual_in_sharded=sharded,
                         residual_out_sharded=sharded, quant=q)
        outs, programs = [], []
        for r in range(N):
            res_in = padded[r * S:(r + 1) * S] if sharded else res_full
            scales = ce.allocate_scales(spec, T, "cpu").fill_(float("nan"))
            normed, res_out, prog = ce.ce_call(wss[r], Rows(partials[r], res_in, b, w, quant_scale=qs), spec,
                                               run=False, scales=scales)
            normed.view(torch.uint8).fill_(0x5A) if q is not None else normed.fill_(float("nan"))
            outs.append((normed, res_out, scales))
            programs.append(prog)
        simulate(programs, rng)
        return outs

    plain, quantized = run(None), run(quant)
    want_q, want_s = quantize_rows(plain[0][0], quant, qs)
    for r in range(N):
        codes, res_out, scales = quantized[r]
        assert codes.dtype == quant.dtype and torch.equal(codes.view(torch.uint8), want_q.view(torch.uint8)), r
        assert torch.equal(res_out.view(torch.int16), plain[r][1].view(torch.int16)), r
        if quant.kind == "row":
            assert torch.equal(scales, want_s), r
        else:
            assert scales.numel() == 0


def test_ce_quant_views_leave_the_workspace_layout_as_it_is():
    ws = ce.emulated_workspaces(2, 256, 64, (BF16,) * 3)[0]
    reg = ws.regions[0]
    codes, scales = ce_workspace.quant_views(reg)
    base = reg.out.data_ptr()
    assert codes.shape == (256, 64) and codes.data_ptr() == base and codes.is_contiguous()
    assert scales.shape == (256, 1) and scales.data_ptr() == base + 256 * 64 and scales.data_ptr() % 4 == 0
    assert scales.data_ptr() + 4 * 256 <= base + reg.out.numel() * reg.out.element_size()
    with pytest.raises(ValueError, match="needs scales"):
        spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, quant=ce_workspace_quant())
        ce.ce_call(ws, Rows(torch.randn(4, 64).to(BF16)), spec, run=False)


def ce_workspace_quant():
    from weave_compile.quant import QuantSpec

    return QuantSpec("row", torch.float8_e4m3fn, 448.0)
