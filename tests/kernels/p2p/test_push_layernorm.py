"""The push kernel's LayerNorm variant (``IS_LAYERNORM``, ``HAS_NORM_BIAS``) on the CPU, in every add+norm loop.

Under ``TRITON_INTERPRET=1`` (a subprocess running this file as a script) the push kernel runs on 2 and
3 emulated ranks (``weave_compile.testing.emulated_ranks``: one phase of every rank at a time) on fresh
random rows with a common offset added to x, outputs and regions NaN-poisoned first, and is checked
against the float64 oracle by ``tests/kernels/_layernorm_cases.py`` (the residual within one ulp, the
normed rows against the oracle's LayerNorm of the kernel's own residual, bit-identical on every rank,
and a bound RMSNorm would miss tenfold). Each case runs in every loop kind, forced: the launcher's
default, the ``tl.range`` pipeline, the register-prefetched tile (1-row tiles unrolled twice) and one
warp per row (16-column chunks: at H=40 the last one half masked); and with the normed output left in
a slot of the output ring (the default shape and one warp per row). Cases: with and without weight and
norm bias, bf16 and fp32 (mixed residual and output dtypes), H=40, T not divisible by the ranks, full,
sharded and no residual, a mid dtype and Gemma's weight offset, eps from a tensor, and RMSNorm with a
norm bias (``HAS_NORM_BIAS`` alone). A hypothesis property draws shapes, loop kinds and options. The
GPU runs (concurrent ranks, real barriers): tests/kernels/p2p/test_push.py.
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
from weave_compile.kernels.shared.common import HAS_TRITON, OUT_RING_SLOTS  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")

CASES = [
    lc.ln_case(7, 40, "bf16", bias=True, seed=1),  # weight and norm bias; a pre-norm bias too
    lc.ln_case(13, 40, "bf16", res="shard_both", weight=False, seed=2),  # norm bias alone
    lc.ln_case(11, 40, "fp32", res="shard_in", norm_bias=False, seed=3),  # weight alone, fp32
    lc.ln_case(10, 40, "fp32", res_dtype="fp32", out_dtype="bf16", res="shard_out", weight=False, norm_bias=False,
               eps_tensor=True, seed=4),  # neither; eps read from a tensor
    lc.ln_case(9, 48, "bf16", res="first", mid="bf16", woff=1.0, ctas=3, seed=5),  # no residual in, Gemma's 1 + w
    lc.ln_case(5, 64, "bf16", res_dtype="fp32", res="none", seed=6),
    lc.ln_case(1, 40, "bf16", seed=7),  # T < ranks: a rank owns no row
    lc.ln_case(8, 40, "bf16", norm="rmsnorm", offset=0.0, seed=8),  # RMSNorm with a norm bias
]
KINDS = ("default", "pipelined", "prefetch", "rowwise")


def _run(c, world: int, kind: str, out_slot: int, seed: int) -> list[str]:
    """One launch of case ``c`` on fresh inputs and freshly poisoned ranks; what is wrong (empty: ok)."""
    c = dict(c, seed=seed)
    inputs = lc.make_inputs(c, world, "cpu")
    # room for more rows than T: the peers' slots then start elsewhere than the global rows
    ranks = lc.ranks_for(c, world, "cpu", extra_rows=5 * world)
    outs = lc.run_push(ranks, c, inputs, meta=lc.meta_for(c, world, kind, interp=True), out_slot=out_slot)
    return lc.check(c, world, outs, inputs) + (lc.ring_errors(ranks, outs, out_slot) if out_slot >= 0 else [])


def _main(world: int, seed: int) -> int:
    torch.set_num_threads(1)
    fails = 0
    runs = [(c, kind, -1) for c in CASES for kind in KINDS]
    runs += [(c, kind, 1 + i % (OUT_RING_SLOTS - 1)) for i, c in enumerate(CASES) for kind in ("default", "rowwise")]
    for i, (c, kind, out_slot) in enumerate(runs):
        errs = _run(c, world, kind, out_slot, seed + i)
        print(f"[world {world}] {lc.case_name(c):70s} {kind:9s} out_slot={out_slot:2d} "
              f"{'ok' if not errs else 'FAIL ' + '; '.join(errs)}", flush=True)
        fails += bool(errs)
    print("PUSH-LAYERNORM OK" if fails == 0 else f"{fails} of {len(runs)} runs failed")
    return 1 if fails else 0


def _property(examples: int) -> int:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    torch.set_num_threads(1)

    @settings(max_examples=examples, deadline=None, database=None)
    @given(world=st.integers(2, 3), T=st.integers(1, 12), H=st.sampled_from([8, 16, 24, 40, 56, 80]),
           kind=st.sampled_from(KINDS), fp32=st.booleans(), res=st.sampled_from(["full", "shard_both", "shard_in",
                                                                                   "shard_out", "none", "first"]),
           weight=st.booleans(), norm_bias=st.booleans(), bias=st.booleans(), mid=st.booleans(),
           ring=st.booleans(), ctas=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
    def prop(world, T, H, kind, fp32, res, weight, norm_bias, bias, mid, ring, ctas, seed):
        c = lc.ln_case(T, H, "fp32" if fp32 else "bf16", res=res, weight=weight, norm_bias=norm_bias, bias=bias,
                       mid="bf16" if mid else None, ctas=ctas)
        errs = _run(c, world, kind, 1 if ring else -1, seed)
        assert not errs, f"world={world} {lc.case_name(c)} {kind} ring={ring}: {errs}"

    prop()
    print("PUSH-LAYERNORM PROPERTY OK")
    return 0


def test_the_launcher_passes_the_layernorm_keywords_only_for_a_layernorm_or_a_norm_bias(monkeypatch):
    """RMSNorm without a norm bias launches with none of the variant's keywords (its kernel and binary
    are the ones they were); ``norm="layernorm"`` sets IS_LAYERNORM, a norm bias NORM_BIAS and
    HAS_NORM_BIAS, also where ``push_on`` copies a strided x first (``lc.check_layernorm_keywords``). The
    kernel is stubbed: nothing runs."""
    from weave_compile.kernels.p2p import launch
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    stub = lc.KernelStub()
    monkeypatch.setattr(launch, "push_allreduce_rmsnorm_kernel", stub)
    H, T, bf = 64, 6, torch.bfloat16
    ws = EmulatedRanks.create(2, H, T, dtype=bf, device="cpu").workspaces[0]
    x = torch.randn(T, H).to(bf)

    def keywords(norm, nb, strided):
        spec = FusedSpec(residual_dtype=bf, out_dtype=bf, comm_ctas=2, norm=norm)
        if strided:  # push_on copies a non-contiguous x: the norm bias must survive the copy of the rows
            launch.push_on(ws, Rows(torch.randn(T, 2 * H).to(bf)[:, ::2], norm_bias=nb), spec)
        else:
            out = (torch.empty(T, H, dtype=bf), torch.empty(T, H, dtype=bf))
            launch.launch_push(ws, Rows(x, norm_bias=nb), spec, *out)
        return stub.seen.pop()

    lc.check_layernorm_keywords(keywords, H, bf)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_push_layernorm_in_cpu_interpreter(world, seed):
    assert_interpreted_run(THIS_FILE, ["--world", str(world), "--seed", str(seed % 10**6)], "PUSH-LAYERNORM OK")


def test_push_layernorm_property_in_cpu_interpreter():
    """Drawn ranks (2, 3), T (1..12, rows past T and ranks owning none), H (8..80), loop kinds, dtypes,
    residual forms, weight, norm bias, bias, mid dtype and the ring output."""
    pytest.importorskip("hypothesis")
    assert_interpreted_run(THIS_FILE, ["--property", "60"], "PUSH-LAYERNORM PROPERTY OK")


if __name__ == "__main__":
    interpreted_main(_main, _property)
