"""Sibling linears merged into one GEMM under the split: same numbers, parameters re-pointed into
one buffer (no memory added), each skip explained, a replaced parameter still computed right."""

import pytest
import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD, tokens, tp_llama


def _adjacent(*params) -> bool:
    end = params[0].data_ptr()
    for p in params:
        if p.data_ptr() != end or p.untyped_storage().data_ptr() != params[0].untyped_storage().data_ptr():
            return False
        end += p.numel() * p.element_size()
    return True


def _merged(rank, world_size, seed, compiler, bias):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    d, model = tp_llama(rank, world_size, seed)
    if bias:  # Qwen2-style q/k/v biases, as graph inputs
        for layer in model.layers:
            for lin in (layer.q, layer.k, layer.v):
                lin.bias = torch.nn.Parameter(0.1 * torch.randn(lin.out_features,
                                                                generator=torch.Generator().manual_seed(seed)))
    x = tokens(d, 1, 45, seed)
    with torch.no_grad():
        want = model(x)
        before = {n: p.clone() for n, p in model.named_parameters()}
        weave_compile.reset()
        c = torch.compile(model, backend="tokenweave", dynamic=False,
                          options={"split": True, "split_threshold": THRESHOLD, "compiler": compiler,
                                   "merge_projections": True})
        got = c(x)
        again = c(tokens(d, 1, 45, seed + 1))
        again_want = model(tokens(d, 1, 45, seed + 1))
    layer = model.layers[0]
    same_values = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    adjacent = (_adjacent(layer.q.weight, layer.k.weight, layer.v.weight) and _adjacent(layer.gate.weight, layer.up.weight)
                and (not bias or _adjacent(layer.q.bias, layer.k.bias, layer.v.bias)))
    g = weave_compile.explain().graphs[-1]
    return rel_err(got, want), rel_err(again, again_want), same_values, adjacent, g.projections, g.split.describe()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_split_merges_qkv_and_gate_up_into_one_gemm_each(seed, compiler, bias):
    for err, err2, same_values, adjacent, projections, split in assert_ranks_ok(
            run_ranks(_merged, 2, args=(seed, compiler, bias), timeout=600)):
        assert err < 1e-5 and err2 < 1e-5, (err, err2)
        assert same_values, "re-pointing changed a parameter's values"
        assert adjacent, "the merged parameters are not one buffer"
        assert projections.startswith("projections merged: layers.0.q, layers.0.k, layers.0.v -> 1 GEMM"), projections
        assert "layers.1.gate, layers.1.up -> 1 GEMM" in projections, projections
        assert ("biases" in projections) == bias and "left alone" not in projections, projections
        assert split.startswith("split 45 tokens at ") and "barrier" not in split, split


def _replaced(rank, world_size, seed):
    import logging

    import weave_compile
    from weave_compile.testing.numerics import rel_err

    d, model = tp_llama(rank, world_size, seed)
    x = tokens(d, 1, 40, seed)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("weave_compile.ops.sibling_linear").addHandler(handler)
    with torch.no_grad():
        torch.compile(model, backend="tokenweave", dynamic=False,
                      options={"split": True, "split_threshold": THRESHOLD, "compiler": "aot_eager",
                               "merge_projections": False})(x)
        off = weave_compile.explain().graphs[-1].projections
        torch._dynamo.reset()
        c = torch.compile(model, backend="tokenweave", dynamic=False,  # the default: merge_projections on
                          options={"split": True, "split_threshold": THRESHOLD, "compiler": "aot_eager"})
        c(x)
        k = model.layers[1].k
        k.weight = torch.nn.Parameter(torch.randn(k.weight.shape, generator=torch.Generator().manual_seed(seed)))
        got, want = c(x), model(x)
    warned = any("not one buffer any more" in r.getMessage() for r in records)
    return rel_err(got, want), warned, weave_compile.explain().graphs[-1].projections, off


def test_a_parameter_replaced_after_the_compile_is_used_not_its_old_buffer(seed):
    for err, warned, projections, off in assert_ranks_ok(run_ranks(_replaced, 2, args=(seed,), timeout=600)):
        assert err < 1e-5, err
        assert warned
        assert "projections merged:" in projections  # on by default
        assert off == "", off  # merge_projections=False leaves the graph as written


class _Siblings(torch.nn.Module):
    """Three linears on one input (q, k, v), one on another (o), and two on a third (gate, up)."""

    def __init__(self, bias_on=("q", "k", "v", "o", "gate", "up")):
        super().__init__()
        sizes = dict(q=8, k=4, v=4, o=16, gate=12, up=12)
        for name, n in sizes.items():
            setattr(self, name, torch.nn.Linear(16, n, bias=name in bias_on))

    def forward(self, x):
        a = torch.cat([self.q(x), self.k(x) * 2, self.v(x) - 1], -1)
        h = self.o(torch.relu(x))
        return a.sum(-1, keepdim=True) + (torch.nn.functional.silu(self.gate(h)) * self.up(h)).sum(-1, keepdim=True)


def _compile_with_pass(model, x, threshold=None):
    from weave_compile.passes.split_tokens.merge_projections import merge_sibling_linears
    from weave_compile.passes.split_tokens.options import SplitOptions

    out = {}

    def backend(gm, example_inputs):
        options = None if threshold is None else SplitOptions(split=True, split_threshold=threshold)
        out["summary"] = merge_sibling_linears(gm, example_inputs, options)
        out["code"] = gm.code
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    got = compiled(x)
    return got, out["summary"], out["code"]


def test_the_pass_merges_each_input_s_linears_and_repoints_after(seed):
    torch.manual_seed(seed)
    model = _Siblings().double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
        before = {n: p.clone() for n, p in model.named_parameters()}
        got, summary, code = _compile_with_pass(model, x)
        assert code.count("weave.sibling_linear") == 2 and code.count("linear(") == 1, code  # o stays alone
        assert [m.split(" -> ")[0] for m in summary.merged] == ["q, k, v", "gate, up"], summary.merged
        assert not _adjacent(model.q.weight, model.k.weight, model.v.weight)  # not before the backend asks
        moved = summary.repoint()
        assert id(model.q.weight) in moved and id(model.up.bias) in moved
        assert _adjacent(model.q.weight, model.k.weight, model.v.weight) and _adjacent(model.q.bias, model.k.bias,
                                                                                      model.v.bias)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        again = torch.compile(model, backend="eager")(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(again, want, rtol=1e-12, atol=1e-12)


def test_each_group_left_alone_says_why(seed):
    torch.manual_seed(seed)
    x = torch.randn(3, 16)
    with torch.no_grad():
        _, summary, _ = _compile_with_pass(_Siblings(bias_on=("q", "gate", "up")), x)
        assert summary.skipped == ["q, k, v (biases on some of them only)"], summary.skipped
        assert [m.split(" -> ")[0] for m in summary.merged] == ["gate, up"]
        tied = _Siblings()
        tied.up.weight = tied.gate.weight
        _, summary, _ = _compile_with_pass(tied, x)
        # (named by the weight they read: both read gate's)
        assert summary.skipped == ["gate, gate (a weight or bias is shared with another linear)"], summary.skipped
        _, summary, _ = _compile_with_pass(_Siblings(), x, threshold=4)
        assert all("3 tokens < split_threshold=4" in s for s in summary.skipped) and not summary.merged
    _, summary, _ = _compile_with_pass(_Siblings(), x)
    assert summary.describe().startswith("projections not merged: grad mode is on"), summary.describe()


def _hf_tp_plan(rank, world_size, seed, compiler):
    import weave_compile
    from examples import hf_models as hf
    from weave_compile.testing.numerics import rel_err

    model = hf.build_model("llama", "tiny", layers=2, tp=True, seed=seed)
    x, x2 = (hf.prompt(1, t, model.config.vocab_size, seed + t) for t in (40, 47))
    torch._dynamo.reset()
    with torch.no_grad():
        want, want2 = model(x).logits, model(x2).logits
        c = torch.compile(model, backend="tokenweave", dynamic=False, options={
            "split": True, "split_threshold": THRESHOLD, "compiler": compiler})
        got = c(x).logits
        got2 = c(x2).logits  # a new token count: Dynamo recompiles, re-fakeifying the DTensors
    return rel_err(got, want), rel_err(got2, want2), [g.projections for g in weave_compile.explain().graphs]


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_hugging_face_tp_plan_projections_are_left_alone_with_the_reason(seed, compiler):
    """tp_plan runs each linear on a DTensor's local shard; re-pointing those would break the
    recompile (merge_sibling_linears' docstring): each group stays separate, with that reason, and
    the model recompiles and computes right."""
    pytest.importorskip("transformers")
    from weave_compile.passes.split_tokens.merge_projections import DTENSOR_REASON

    tol = 1e-5 if compiler == "aot_eager" else 1e-4  # Inductor reorders float32 sums
    for err, err2, projections in assert_ranks_ok(run_ranks(_hf_tp_plan, 2, args=(seed, compiler), timeout=600)):
        assert err < tol and err2 < tol, (err, err2)
        assert len(projections) == 2, projections  # one graph per token count
        for text in projections:
            assert text.startswith("projections merged: none; left alone: "), text
            assert text.count(DTENSOR_REASON) == 4, text  # q/k/v and gate/up of 2 layers
