"""The token split end to end: the same numbers as the unsplit graph and eager, for every length."""

import pytest
import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD, tokens, tp_llama


def _equivalence(rank, world_size, seed):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    d, model = tp_llama(rank, world_size, seed)
    split = torch.compile(model, backend="tokenweave", options={"split": True, "split_threshold": THRESHOLD})
    plain = torch.compile(model, backend="tokenweave", options={"split_threshold": THRESHOLD, "split": False})
    errs, graphs = [], {}
    with torch.no_grad():
        for b, lengths in ((1, (24, 33, 57, 7, 9, 100)), (3, (11, 6, 20))):
            weave_compile.reset()
            for i, t in enumerate(lengths):
                x = tokens(d, b, t, seed + i)
                torch._dynamo.mark_dynamic(x, 1)
                want = model(x)
                got_split = split(x)
                got_plain = plain(x)
                errs.append((b, t, rel_err(got_split, want), rel_err(got_split, got_plain)))
            graphs[b] = [g.split.describe() for g in weave_compile.explain().graphs if g.split is not None]
    return errs, graphs


@pytest.mark.slow
def test_split_matches_unsplit_and_eager_dynamic_lengths(seed):
    for errs, graphs in assert_ranks_ok(run_ranks(_equivalence, 2, args=(seed,), timeout=900)):
        for b, t, vs_eager, vs_plain in errs:
            assert vs_eager < 1e-5 and vs_plain < 1e-5, (b, t, vs_eager, vs_plain)
        # Batch 1: one graph for every length above the threshold (symbolic split point) and one
        # below it (the guard), whatever the order the lengths come in; the plain variant's too.
        split_graphs = [g for g in graphs[1] if not g.startswith("not split: split disabled")]
        assert len(split_graphs) == 2, graphs[1]
        assert any(g.startswith("split a symbolic token count at run time") for g in split_graphs), split_graphs
        assert any("fewer than split_threshold" in g for g in split_graphs), split_graphs
        assert all("barrier" not in g for g in split_graphs), split_graphs
        # Batch 3 (Dynamo makes the batch symbolic on this recompile): whole sequences per half,
        # nothing mixes them, so no barrier either.
        batch = [g for g in graphs[3] if g.startswith("split a symbolic batch at run time")]
        assert batch and all("barrier" not in g for g in batch), graphs[3]


def _merged_projections(rank, world_size, seed, compiler):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    d, model = tp_llama(rank, world_size, seed, merged=True)
    weave_compile.reset()
    split = torch.compile(model, backend="tokenweave", dynamic=False,
                          options={"split": True, "split_threshold": THRESHOLD, "compiler": compiler})
    x = tokens(d, 1, 45, seed)
    with torch.no_grad():
        got, want = split(x), model(x)
    graph = weave_compile.explain().graphs[-1]
    return rel_err(got, want), graph.split.describe(), sum(s.fused for s in graph.sites)


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_split_of_merged_projections_slices_the_qkv_and_gate_up_gemms_per_half(seed, compiler):
    """One QKV and one gate/up GEMM (Megatron's, vLLM's layout): their column slices are token-wise,
    so the whole layer splits, no barrier, and the numbers are eager's."""
    from weave_compile.testing.models import LlamaDims, expected_fused_sites

    for err, split, fused in assert_ranks_ok(run_ranks(_merged_projections, 2, args=(seed, compiler), timeout=600)):
        assert err < 1e-5, err
        assert split.startswith("split 45 tokens at ") and "barrier" not in split, split
        assert fused == expected_fused_sites(LlamaDims(layers=2), 2), fused


def _with_grad(rank, world_size, seed, compiler):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    def run(fn, model, x):
        model.zero_grad(set_to_none=True)
        y = fn(x)
        y.float().square().mean().backward()
        return y, {n: p.grad.clone() for n, p in model.named_parameters()}

    d, model = tp_llama(rank, world_size, seed)
    x = tokens(d, 1, 45, seed)
    # The reference is the same model compiled without the passes: eager's dist.all_reduce has no
    # autograd formula (its gradients differ from any compiled graph's), Dynamo's functional one has.
    want, want_grads = run(torch.compile(model, backend=compiler, dynamic=False), model, x)
    torch._dynamo.reset()
    weave_compile.reset()
    split = torch.compile(model, backend="tokenweave", dynamic=False,
                          options={"split": True, "split_threshold": THRESHOLD, "compiler": compiler})
    got, grads = run(split, model, x)
    grad_errs = {n: rel_err(grads[n], want_grads[n]) for n in want_grads}
    # the forward's report (the backward graph has its own, with no site)
    reports = [(g.split.describe(), g.projections) for g in weave_compile.explain().graphs if g.split is not None]
    return rel_err(got, want), grad_errs, reports


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_split_with_grad_mode_on_matches_the_unsplit_forward_and_gradients(seed, compiler):
    """A training graph: the backward reads the forward's saved activations with the strides they
    were traced with (SDPA's output is a transposed layout), so the halves are joined in that
    layout; forward and gradients equal the graph compiled without the passes. The projections
    stay separate (the merged op has no backward)."""
    for err, grad_errs, reports in assert_ranks_ok(run_ranks(_with_grad, 2, args=(seed, compiler), timeout=600)):
        assert err < 1e-5, err
        assert len(grad_errs) == 20 and max(grad_errs.values()) < 1e-4, grad_errs
        split = [p for s, p in reports if s.startswith("split 45 tokens at ")]
        assert len(split) == 1, reports
        assert split[0].startswith("projections not merged: grad mode is on"), split
