"""The program of one ``ce`` call (kernels/ce/program.py), on CPU: progress marks, the issue order of
emulated ranks, and the add+norm variants a site can launch.

The variants are checked with Triton's own specialization for sm_90 (its JIT binder, computed from
the launch arguments on CPU tensors): what ``preload_site`` loads at compile time must cover what
every token count launches, or a call would compile and load a kernel while a stream waits.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.ce.test_copy_engine import Deadlock, ce_call, check, make_inputs, simulate
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.ce import program
from weave_compile.kernels.ce.watchdog import Watchdog
from weave_compile.kernels.shared import addnorm
from weave_compile.kernels.spec import FusedSpec, Rows

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def test_marks_round_trip():
    for seq in (0, 1, 17, (1 << 21) - 1, 1 << 21, 123456789):
        for phase in (ce.RS, ce.AG):
            for peer in (0, 1, 7, 255):
                v = program.waiting_mark(seq, phase, peer)
                assert v & 1 and 0 < v < 2**31
                assert program.decode_mark(v) == (seq % (1 << 21), phase, peer)
        d = program.done_mark(seq)
        assert not d & 1 and 0 <= d < 2**31 and program.decode_mark(d) == (seq % (1 << 21), None, None)
    # successive calls never repeat a mark
    values = [f(s) for s in range(50) for f in (lambda s: program.waiting_mark(s, 0, 1), program.done_mark)]
    assert len(set(values)) == len(values)


def test_watched_program_marks_every_wait_and_reads_the_abort_word():
    N, T, H = 3, 10, 16
    wss = ce.emulated_workspaces(N, 8, H, (FP32,) * 3)
    _, _, plain = ce_call(wss[1], torch.randn(T, H), torch.randn(T, H), run=False)
    assert not any(isinstance(op, program.Mark) for op in plain)
    assert "abort" not in next(op for op in plain if isinstance(op, ce.Norm)).kwargs
    Watchdog(timeout_s=60).watch(wss)
    for call in range(2):
        _, _, prog = ce_call(wss[1], torch.randn(T, H), torch.randn(T, H), run=False)
        seq = wss[1].calls - 1
        assert seq == call + 1
        waits = [i for i, op in enumerate(prog) if isinstance(op, ce.Wait)]
        for i in waits:  # each wait right after the mark that names it
            mark = prog[i - 1]
            assert isinstance(mark, program.Mark)
            phase = ce.RS if prog[i].flag.data_ptr() < wss[1].regions[1].flags[ce.AG].data_ptr() else ce.AG
            assert program.decode_mark(mark.value) == (seq, phase, prog[i].peer)
        marks = [op for op in prog if isinstance(op, program.Mark)]
        assert len(marks) == 2 * (N - 1) + 1 and marks[-1].value == program.done_mark(seq)
        # the done mark follows the last wait's reset, before the pulls
        last = prog.index(marks[-1])
        assert isinstance(prog[last - 1], ce.Reset) and all(isinstance(op, ce.Copy) for op in prog[last + 1:])
        assert next(op for op in prog if isinstance(op, ce.Norm)).kwargs["abort"] is wss[1].regions[1].abort


def _fifo(order) -> None:
    """Run chunks in exactly this order, as ONE hardware queue would: a wait that is not yet
    satisfied blocks everything behind it."""
    for _, ops in order:
        for op in ops:
            if isinstance(op, ce.Wait) and int(op.flag.item()) < 1:
                raise Deadlock("a wait reached the head of the queue before its signal")
            simulate([[op]], random.Random(0))


@pytest.mark.parametrize("N", [2, 3, 4])
@pytest.mark.parametrize("watched", [False, True])
def test_issue_order_runs_in_one_queue(N, watched, seed):
    """emulated_run's order: every wait's signal is enqueued before it, so the ranks' programs run
    even through a single FIFO (streams sharing a hardware queue, a host blocked between two
    enqueues); rank by rank, they cannot."""
    T, H = 2 * N + 1, 24
    S = -(-T // N)
    gen = torch.Generator().manual_seed(seed)
    for interleaved in (True, False):
        wss = ce.emulated_workspaces(N, S, H, (FP32,) * 3)
        if watched:
            Watchdog(timeout_s=60).watch(wss)
        results = []
        for _ in range(2):
            partials, res_full, b, w, s = make_inputs(gen, N, T, H, FP32, FP32, True, True, True, False)
            outs, progs = [], []
            for r in range(N):
                normed, res_out, prog = ce_call(wss[r], partials[r], res_full, b, w, eps=1e-5, run=False)
                outs.append((normed, res_out))
                progs.append(prog)
            order = program.issue_order(progs) if interleaved else [(r, p) for r, p in enumerate(progs)]
            # every op exactly once, each rank's in its own order
            for r in range(N):
                assert [op for rk, ops in order if rk == r for op in ops] == progs[r]
            if not interleaved:
                with pytest.raises(Deadlock):
                    _fifo(order)
                break
            _fifo(order)
            results.append((outs, (partials, res_full, b, w, s, None)))
        if interleaved:
            check(results, N, S, T)


# ----------------------------------------------------------------------------- add+norm variants


def _variant_recorder(monkeypatch) -> dict:
    """Record the Triton cache key (specialization and options, as the JIT computes them for
    sm_90) of every add+norm launch and preload; nothing runs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = addnorm._add_rmsnorm_rows_kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    seen: dict = {"preload": {}, "launch": set()}

    def fake_launch(tensors, n_valid, n_res_rows, eps, mid_dtype, weight_offset, num_ctas, cfg, slots, preload=False,
                    **variant):
        args, kw = addnorm.kernel_args(tensors, n_valid, n_res_rows, eps, mid_dtype, weight_offset, cfg, slots,
                                       **variant)
        _, specialization, options = binder(*args, **kw)
        key = str(specialization) + str(options)
        if preload:
            return seen["preload"].setdefault(key, object())  # one "compiled kernel" per key
        seen["launch"].add(key)
        return None

    monkeypatch.setattr(addnorm, "use_triton", lambda device: True)
    monkeypatch.setattr(addnorm, "_launch", fake_launch)
    return seen


@pytest.mark.skipif(not addnorm.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("H,dtypes,res_in,terms,scale", [
    (4096, (BF16, BF16, BF16), BF16, (BF16, BF16, None), False),
    (2880, (BF16, BF16, FP32), FP32, (None, FP32, BF16), True),
    (8192, (FP16, FP16, FP16), None, (FP16, None, None), False),
    (1024, (FP32, FP32, FP32), FP32, (None, FP32, None), True),
])
@pytest.mark.parametrize("watched", [False, True])
@pytest.mark.parametrize("eps_dtype", [None, torch.float64, torch.float32])
def test_no_token_count_makes_a_variant_of_its_own(monkeypatch, N, H, dtypes, res_in, terms, scale, watched,
                                                   eps_dtype):
    """Every launch of every T (1, 3, 257, 4099, ...), CTA count and residual layout on rank N-1
    (its rows at an offset) is a variant that ``preload_site`` loaded for the site; with eps a
    tensor (``eps_dtype``, the site's ``eps_on_device``) too, which a float-eps preload misses."""
    seen = _variant_recorder(monkeypatch)
    ws = ce.emulated_workspaces(N, 2304, H, dtypes)[N - 1]  # a multiple of 256 rows, as allocated
    if watched:
        Watchdog(timeout_s=60).watch([ws])
    n = program.preload_site(ws, residual_dtype=res_in, terms=[terms], scale_dtype=FP32 if scale else None,
                             eps_on_device=eps_dtype is not None)
    assert n == len(seen["preload"]) >= 1
    eps = None if eps_dtype is None else torch.tensor(0.25, dtype=eps_dtype)
    bias_dt, weight_dt, mid = terms
    for T in (1, 2, 3, 17, 64, 257, 1000, 4099):
        S = -(-T // N)
        x = torch.randn(T, H).to(dtypes[0])
        for sharded in (False, True):
            residual = None if res_in is None else torch.randn(S if sharded else T, H).to(res_in)
            rows = Rows(x, residual, None if bias_dt is None else torch.randn(H).to(bias_dt),
                        None if weight_dt is None else torch.randn(H).to(weight_dt),
                        torch.tensor(0.5) if scale else None, eps)
            for ctas in (1, 8, 32):
                spec = FusedSpec(residual_dtype=dtypes[2], out_dtype=dtypes[1], mid_dtype=mid, comm_ctas=ctas,
                                 residual_in_sharded=sharded, residual_out_sharded=sharded)
                _, _, prog = ce.ce_call(ws, rows, spec, run=False)
                for op in prog:
                    if isinstance(op, ce.Norm):
                        addnorm.add_rmsnorm_rows(**op.kwargs)
    missing = seen["launch"] - set(seen["preload"])
    assert not missing, f"{len(missing)} launched variants were not preloaded, e.g. {sorted(missing)[0]}"
    if H == 4096 and N == 2:  # both launch shapes occur (one warp per row, the tile loop) and were loaded
        assert len(seen["launch"]) == 2
    if eps_dtype is not None:  # an eps tensor is a variant of its own: a float-eps preload would miss it
        seen["preload"].clear()
        program.preload_site(ws, residual_dtype=res_in, terms=[terms], scale_dtype=FP32 if scale else None)
        assert seen["launch"].isdisjoint(seen["preload"])


@pytest.mark.skipif(not addnorm.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("N", [2, 3])
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("form", [None, "vllm-per-token", "torchao-per-row-bf16", "static-div", "static-recip-noclamp"])
def test_no_token_count_makes_an_epilogue_or_layernorm_variant_of_its_own(monkeypatch, N, norm, form):
    """As above for a site with an fp8 epilogue (``quant``) or a LayerNorm: what ``preload_site``
    loads covers every T, CTA count and residual layout's launch (a static site's calls pass no row
    scales' pointer, so neither may its preload: a pointer where a call has none is another
    specialization, a kernel compiled at run time while the peers wait)."""
    from tests.kernels.shared._addnorm_cases import quant_forms

    seen = _variant_recorder(monkeypatch)
    quant = None if form is None else quant_forms()[form]
    H = 4096
    ws = ce.emulated_workspaces(N, 2304, H, (BF16,) * 3)[N - 1]
    nb = BF16 if norm == "layernorm" else None
    n = program.preload_site(ws, residual_dtype=BF16, terms=[(BF16, BF16, None, nb)], scale_dtype=None, norm=norm,
                             quant=quant)
    assert n == len(seen["preload"]) >= 1
    static = None if quant is None or quant.kind != "static" else torch.tensor(0.01)
    for T in (1, 3, 17, 257, 4099):
        S = -(-T // N)
        x = torch.randn(T, H).to(BF16)
        for sharded in (False, True):
            rows = Rows(x, torch.randn(S if sharded else T, H).to(BF16), torch.randn(H).to(BF16),
                        torch.randn(H).to(BF16), norm_bias=None if nb is None else torch.randn(H).to(nb),
                        quant_scale=static)
            for ctas in (1, 8, 32):
                spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, comm_ctas=ctas, residual_in_sharded=sharded,
                                 residual_out_sharded=sharded, norm=norm, quant=quant)
                scales = ce.allocate_scales(spec, T, "cpu") if quant is not None else None
                _, _, prog = ce.ce_call(ws, rows, spec, run=False, scales=scales)
                for op in prog:
                    if isinstance(op, ce.Norm):
                        addnorm.add_rmsnorm_rows(**op.kwargs)
    assert seen["launch"], "no launch recorded: the test checks nothing"
    missing = seen["launch"] - set(seen["preload"])
    assert not missing, f"{len(missing)} launched variants were not preloaded, e.g. {sorted(missing)[0]}"


def test_unknown_terms_load_every_combination(monkeypatch):
    seen = _variant_recorder(monkeypatch) if addnorm.HAS_TRITON else None
    if seen is None:
        pytest.skip("triton not installed")
    ws = ce.emulated_workspaces(2, 256, 8192, (BF16,) * 3)[0]  # one launch shape at H=8192
    n = program.preload_site(ws, residual_dtype=BF16, terms=None, scale_dtype=None)
    assert n == 8  # bias x weight x mid dtype, each present or not
