"""The push kernel's fp8 epilogue (``QUANT``) on the CPU, in the tile loops it runs in.

Under ``TRITON_INTERPRET=1`` (a subprocess running this file as a script) the push kernel runs on 2
and 3 emulated ranks (``weave_compile.testing.emulated_ranks``: one phase of every rank at a time),
each case twice on the same fresh rows: without the epilogue (the kernel's own normed rows, checked
against the float64 oracle by ``tests/kernels/_layernorm_cases.py``) and with it, outputs and regions
poisoned first. Every rank's codes and row scales must equal
:func:`weave_compile.quant.quantize_rows` of its normed rows from the first launch bit for bit (the
codes and scales of the peers' rows came through the gather: codes first, scales after them in the
peers' output regions), the residual must be the first launch's, and the codes must agree with the
float64 oracle (:func:`weave_compile.quant.quotient_ref`: one step at a rounding boundary at most);
both launches run on one shape (the one-warp-per-row loop, which the epilogue never takes, reduces
a row in another order).
The forms the fuse pass records (``_addnorm_cases.quant_forms``: vLLM's per-token, torchao's
per-row with a bf16 quotient, e5m2, static with and without the clamp) go round the cases and the
loop kinds (the launcher's default, the ``tl.range`` pipeline, the register-prefetched tile), with
RMSNorm and LayerNorm, bf16 and fp32 rows, full, sharded and no residual, T not divisible by the
ranks and T < ranks, and ``batch_invariant``'s rank-order loop. The GPU runs (concurrent ranks,
real barriers): ``tests/kernels/p2p/test_push.py``, with :func:`run_case` (written, not run yet).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

THIS_FILE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))))  # script mode

from tests.kernels import _layernorm_cases as lc  # noqa: E402
from tests.kernels._symm_cases import assert_interpreted_run, interpreted_main  # noqa: E402
from weave_compile.kernels.shared.common import HAS_TRITON  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

CASES = [
    lc.ln_case(7, 40, "bf16", norm="rmsnorm", offset=0.0, norm_bias=False, seed=1),  # a residual, weight
    lc.ln_case(13, 40, "bf16", res="shard_both", seed=2),  # LayerNorm, the residual sharded
    lc.ln_case(11, 48, "fp32", res="shard_in", out_dtype="bf16", norm="rmsnorm", offset=0.0, norm_bias=False,
               seed=3),  # fp32 rows rounded to bf16 before the codes
    lc.ln_case(9, 40, "bf16", res="first", norm="rmsnorm", offset=0.0, norm_bias=False, ctas=3, seed=4),
    lc.ln_case(1, 40, "bf16", norm="rmsnorm", offset=0.0, norm_bias=False, seed=5),  # T < ranks
]
KINDS = ("default", "pipelined", "prefetch")


def _forms():
    from tests.kernels.shared._addnorm_cases import quant_forms

    return list(quant_forms().items())


def run_case(c, world: int, kind: str, form, seed: int, invariant: bool = False, device: str = "cpu") -> list[str]:
    """Case ``c`` without and with the epilogue ``form`` on the same fresh rows, on emulated ranks of
    ``device`` (the CPU under the interpreter, or one GPU: concurrent ranks, real barriers), both on
    one launch shape (``kind``, forced; ``default``: the launcher's shape with the epilogue, which
    never takes the one-warp-per-row loop); what is wrong."""
    import math

    from weave_compile.kernels.p2p import launch
    from weave_compile.quant import quantize_rows, quotient_ref
    from weave_compile.testing.emulated_ranks import push_allreduce_rmsnorm
    from weave_compile.testing.numerics import codes_agree

    name, quant = form
    c = dict(c, seed=seed)
    inputs = lc.make_inputs(c, world, device)
    dt, rdt, _ = lc.dtypes(c)
    if invariant:
        meta = None
    elif kind == "default":
        meta = launch.push_meta(c["H"], math.ceil(c["T"] / world), c["ctas"], world, dt.itemsize, rdt.itemsize,
                                quant=True)
    else:
        meta = lc.meta_for(c, world, kind, interp=device == "cpu")
    extra = 5 * world if device == "cpu" else 64
    plain = None if invariant else lc.run_push(lc.ranks_for(c, world, device, extra_rows=extra), c, inputs, meta=meta,
                                               device=device)
    errs = [] if plain is None else lc.check(c, world, plain, inputs)
    xs, residual, bias, weight, nb = inputs
    T, H = c["T"], c["H"]
    scale = torch.tensor([0.02], device=device) if quant.kind == "static" else None
    res_in = [lc.rank_residual(c, world, r, residual) for r in range(world)]
    kw = lc.spec_kwargs(c, device)
    ranks = lc.ranks_for(c, world, device, extra_rows=extra)
    if invariant:  # the rank-order loop; its plain launch is the reference here
        plain = push_allreduce_rmsnorm(ranks, xs, res_in, bias, weight, comm_ctas=c["ctas"], norm_bias=nb,
                                       batch_invariant=True, **kw)
        ranks = lc.ranks_for(c, world, device, extra_rows=extra)
        kw["batch_invariant"] = True
    outputs = [(torch.full((T, H), 0x5A, dtype=torch.uint8, device=device).view(quant.dtype), ro,
                torch.full((T, 1), float("nan"), device=device) if quant.kind == "row" else None)
               for _, ro in lc.poisoned_outputs(c, world, device)]
    got = push_allreduce_rmsnorm(ranks, xs, res_in, bias, weight, comm_ctas=c["ctas"], outputs=outputs, meta=meta,
                                 norm_bias=nb, quant=quant, quant_scale=scale, **kw)
    if device != "cpu":
        torch.cuda.synchronize()
        if ranks.barrier_state() != (0, 0):
            errs.append("barrier timeouts / signal pads not reset")
    for r in range(world):
        codes, res, scales = got[r]
        normed, want_res = plain[r][0], plain[r][1]
        want_q, want_s = quantize_rows(normed, quant, scale)
        if not torch.equal(res.view(torch.uint8), want_res.view(torch.uint8)):
            errs.append(f"rank {r}: the residual differs from the launch without the epilogue")
        if not torch.equal(codes.view(torch.uint8), want_q.view(torch.uint8)):
            n = int((codes.view(torch.uint8) != want_q.view(torch.uint8)).sum())
            errs.append(f"rank {r}: {n} codes differ from quantize_rows of the normed rows")
        if quant.kind == "row" and not torch.equal(scales, want_s):
            errs.append(f"rank {r}: row scales differ from quantize_rows' (max "
                        f"{(scales - want_s).abs().nan_to_num(1e9).max().item():.3g})")
        _, bad = codes_agree(codes, quant_ref_codes(normed, quant, scale), quotient_ref(normed, quant, scale)[0])
        if bad:
            errs.append(f"rank {r}: against the float64 oracle, {bad}")
    return [f"{name}: {e}" for e in errs]


def quant_ref_codes(normed, quant, scale):
    from weave_compile.quant import quantize_ref

    return quantize_ref(normed, quant, scale)[0]


def _main(world: int, seed: int) -> int:
    torch.set_num_threads(1)
    forms = _forms()
    runs = [(c, kind, forms[(i * len(KINDS) + k) % len(forms)], False)
            for i, c in enumerate(CASES) for k, kind in enumerate(KINDS)]
    runs += [(CASES[1], "default", forms[0], True), (CASES[0], "default", forms[3], True)]
    fails = 0
    for i, (c, kind, form, inv) in enumerate(runs):
        errs = run_case(c, world, kind, form, seed + i, inv)
        print(f"[world {world}] {lc.case_name(c):62s} {kind:9s} {form[0]:22s}{' invariant' if inv else ''} "
              f"{'ok' if not errs else 'FAIL ' + '; '.join(errs)}", flush=True)
        fails += bool(errs)
    print("PUSH-FP8 OK" if fails == 0 else f"{fails} of {len(runs)} runs failed")
    return 1 if fails else 0


def test_the_launcher_refuses_what_the_epilogue_cannot_take():
    """The ring output, a per-row epilogue without its scales, a static one without its scale, a
    workspace whose output dtype is not the normed rows', and the one-warp-per-row loop: named."""
    import dataclasses

    from weave_compile.kernels.p2p import launch
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.quant import QuantSpec
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    H, T, bf, e4 = 64, 6, torch.bfloat16, torch.float8_e4m3fn
    ws = EmulatedRanks.create(2, H, T, dtype=bf, device="cpu").workspaces[0]
    x = torch.randn(T, H).to(bf)
    row, static = QuantSpec("row", e4, 448.0, 1e-12, True), QuantSpec("static", e4, 448.0, 0.0, False)
    codes, res, scales = torch.empty(T, H, dtype=e4), torch.empty(T, H, dtype=bf), torch.empty(T, 1)

    def launch_with(quant, rows=Rows(x), scales=scales, **spec_kw):
        spec = FusedSpec(residual_dtype=bf, out_dtype=spec_kw.pop("out_dtype", bf), comm_ctas=2, quant=quant,
                         **spec_kw)
        launch.launch_push(ws, rows, spec, codes, res, scales=scales, compile_only=True)

    with pytest.raises(ValueError, match="out_slot must be -1"):
        launch_with(row, out_slot=1)
    with pytest.raises(ValueError, match="needs scales"):
        launch_with(row, scales=None)
    with pytest.raises(ValueError, match="needs rows.quant_scale"):
        launch_with(static, scales=None)
    with pytest.raises(ValueError, match="output dtype"):
        launch_with(row, out_dtype=torch.float32)
    rowwise = dataclasses.replace(launch.push_meta(H, 64, 2, 2, 2, 2), norm_chunk=16, norm_prefetch=False)
    with pytest.raises(ValueError, match="not one warp per row"):
        spec = FusedSpec(residual_dtype=bf, out_dtype=bf, comm_ctas=2, quant=row)
        launch.launch_push(ws, Rows(x), spec, codes, res, scales=scales, meta=rowwise, compile_only=True)
    assert launch.push_meta(4096, 64, 2, 2, 2, 2).norm_chunk > 0
    assert launch.push_meta(4096, 64, 2, 2, 2, 2, quant=True).norm_chunk == 0


class _ArgsStub:
    """Stands in for the push kernel: ``stub[grid](*args, **kw)`` records ``(args, kw)``, runs nothing."""

    def __init__(self):
        self.seen = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.seen.append((args, kw))


def test_push_on_returns_the_codes_and_the_scales_it_launched_with(monkeypatch):
    """``push_on`` with the epilogue: fresh fp8 rows and, per row, a [T, 1] float32 scales tensor that is
    the kernel's ``QSCALES`` (a static scale: an empty one, and ``QSTATIC`` the rows' scale); the
    normed rows' byte view is the kernel's ``NORMED``. The kernel is stubbed: nothing runs."""
    from weave_compile.kernels.p2p import launch
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.quant import QuantSpec
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    stub = _ArgsStub()
    seen = stub.seen
    monkeypatch.setattr(launch, "push_allreduce_rmsnorm_kernel", stub)
    H, T, bf, e4 = 64, 6, torch.bfloat16, torch.float8_e4m3fn
    ws = EmulatedRanks.create(2, H, T, dtype=bf, device="cpu").workspaces[0]
    for kind in ("row", "static"):
        quant = QuantSpec(kind, e4, 448.0, 1e-12 if kind == "row" else 0.0, kind == "row")
        qs = torch.full((1,), 0.5) if kind == "static" else None
        spec = FusedSpec(residual_dtype=bf, out_dtype=bf, comm_ctas=2, quant=quant)
        codes, res, scales = launch.push_on(ws, Rows(torch.randn(T, H).to(bf), quant_scale=qs), spec)
        args, kw = seen.pop()
        assert codes.dtype == e4 and codes.shape == (T, H) and res.shape == (T, H), (codes.dtype, codes.shape)
        assert args[5].dtype == torch.uint8 and args[5].data_ptr() == codes.data_ptr()
        if kind == "row":
            assert scales.shape == (T, 1) and kw["QSCALES"] is scales and kw["QUANT"] == 1
        else:
            assert scales.numel() == 0 and kw["QSCALES"] is None and kw["QUANT"] == 2
            assert kw["QSTATIC"].data_ptr() == qs.data_ptr()


def _launch(monkeypatch, H: int, T: int, world: int, quant, dtype=torch.bfloat16, norm="rmsnorm"):
    """The push kernel's ``(args, kwargs)`` as the launcher passes them for one rank's launch with the
    default shape (the kernel stubbed: nothing runs), for compiling it for sm_90."""
    from weave_compile.kernels.p2p import launch
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    stub = _ArgsStub()
    monkeypatch.setattr(launch, "push_allreduce_rmsnorm_kernel", stub)
    ws = EmulatedRanks.create(world, H, T, dtype=dtype, device="cpu").workspaces[0]
    S = -(-T // world)
    spec = FusedSpec(residual_dtype=dtype, out_dtype=dtype, comm_ctas=16, quant=quant, norm=norm,
                     residual_in_sharded=True, residual_out_sharded=True)
    nb = torch.empty(H, dtype=dtype) if norm == "layernorm" else None
    rows = Rows(torch.empty(T, H, dtype=dtype), torch.empty(S, H, dtype=dtype), None, torch.empty(H, dtype=dtype),
                norm_bias=nb, quant_scale=torch.ones(1) if quant is not None and quant.kind == "static" else None)
    normed = torch.empty(T, H, dtype=dtype if quant is None else quant.dtype)
    scales = torch.empty(T, 1) if quant is not None and quant.kind == "row" else None
    # the epilogue's default shape for both (without it, 2 ranks at H <= 4096 would take the
    # one-warp-per-row loop, which reduces a row in chunk order: another kernel altogether)
    meta = launch.push_meta(H, S, spec.comm_ctas, world, dtype.itemsize, dtype.itemsize, quant=True)
    launch.launch_push(ws, rows, spec, normed, torch.empty(S, H, dtype=dtype), scales=scales, meta=meta)
    monkeypatch.undo()
    return stub.seen.pop()


@pytest.mark.parametrize("H,T,world,norm", [(4096, 16, 2, "rmsnorm"), (4096, 8192, 2, "layernorm"),
                                            (8192, 64, 4, "rmsnorm"), (8192, 16384, 8, "rmsnorm")])
def test_the_epilogue_compiles_for_sm90_without_spills_reducing_rows_as_without_it(monkeypatch, H, T, world, norm):
    """At the launcher's default shapes (decode and prefill, 2-8 ranks) the epilogue's kernel
    compiles for sm_90 without spilling, and reduces every row (the peers' sum, the mean, the
    squares) in the layout the kernel without it does on the same shape: its codes are then the
    quantized normed rows of that kernel bit for bit (one byte a code would otherwise widen the
    tile's layout; the shared add+norm kernel's 70B codes were a step off so on one H100)."""
    from tests.kernels.shared.test_addnorm import _ptxas_report, compile_sm90
    from tests.kernels.shared.test_addnorm_fp8 import _reduce_layouts
    from weave_compile.kernels.p2p.push import push_allreduce_rmsnorm_kernel as kernel
    from weave_compile.quant import QuantSpec

    plain = compile_sm90(*_launch(monkeypatch, H, T, world, None, norm=norm), kernel)["ttgir"]
    for quant in (QuantSpec("row", torch.float8_e4m3fn, 448.0, 1e-12, True),
                  QuantSpec("static", torch.float8_e4m3fn, 448.0, 0.0, False)):
        args, kw = _launch(monkeypatch, H, T, world, quant, norm=norm)
        assert kw["QUANT"] == (1 if quant.kind == "row" else 2) and kw["NORM_CHUNK"] == 0
        want, got = _reduce_layouts(plain), _reduce_layouts(compile_sm90(args, kw, kernel)["ttgir"])
        assert want and got[:len(want)] == want, (quant.kind, want, got)
        report = _ptxas_report(args, kw, kernel)
        assert "Used" in report and " 0 bytes spill stores" in report, (quant.kind, report)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_push_fp8_epilogue_in_cpu_interpreter(world, seed):
    assert_interpreted_run(THIS_FILE, ["--world", str(world), "--seed", str(seed % 10**6)], "PUSH-FP8 OK")


if __name__ == "__main__":
    interpreted_main(_main)
