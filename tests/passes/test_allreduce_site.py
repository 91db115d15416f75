"""One site, matched and replaced (passes/allreduce_site.py): the match object and its replace_with()."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)
from weave_compile.ops import FUSED_OP
from weave_compile.passes.allreduce_site import NoMatch, match_site
from weave_compile.passes.graph_utils import fake_mode_of, named_args

ar_op = torch.ops._c10d_functional.all_reduce
wait = torch.ops._c10d_functional.wait_tensor
T, H = 6, 16


def _graph(fn, n_inputs=4):
    shapes = [(T, H), (T, H), (H,), (H,)][:n_inputs]
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes]).graph


def _all_reduce(graph):
    return next(n for n in graph.nodes if n.target == ar_op.default)


def test_a_site_with_bias_and_residual_is_matched_and_replaces_itself(group):
    def f(x, res, b, w):
        h = res + (wait(ar_op(x, "sum", group)) + b)
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), h

    g = _graph(f)
    x, res, b, w = [n for n in g.nodes if n.op == "placeholder"]
    m = match_site(_all_reduce(g))
    assert (m.residual, m.bias, m.norm.weight, m.scale) == (res, b, w, None)
    assert m.anchor is m.residual_out and m.describe() == "all_reduce +bias +residual -> rmsnorm *w in fp32"
    fused = m.replace_with(fake_mode_of(g), kernel="reference", comm_ctas=8)
    g.lint()
    assert fused.target == FUSED_OP and not any(n.target == ar_op.default for n in g.nodes)
    args = named_args(fused)
    assert (args["x"], args["residual"], args["bias"], args["weight"]) == (x, res, b, w)
    assert (args["kernel"], args["comm_ctas"], args["eps"], args["group_name"]) == ("reference", 8, 1e-6, group)
    normed, residual_out = g.output_node().args[0]  # both outputs now read the op's results
    assert normed.args == (fused, 0) and residual_out.args == (fused, 1)


@pytest.mark.parametrize("form,reason", [
    ("max", "reduce op 'max' is not sum"),
    ("no_norm", "feeds aten.relu.default before any RMSNorm"),
    ("sum_read_elsewhere", "the fused op returns only the sum after"),
])
def test_sites_left_alone_say_why(group, form, reason):
    def f(x, res):
        y = wait(ar_op(x, "max" if form == "max" else "sum", group))
        if form == "no_norm":
            return torch.relu(res + y)
        h = res + y
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        if form == "sum_read_elsewhere":
            return out, y * 2  # the reduced sum before the residual add: the op does not return it
        return out

    g = _graph(f, 2)
    with pytest.raises(NoMatch, match=reason):
        match_site(_all_reduce(g))


def _layernorm_graph(group, form):
    def f(x, res, w, b):
        h = res + wait(ar_op(x, "sum", group))
        if form == "layer_norm_op":
            return torch.nn.functional.layer_norm(h, (H,), w, b)
        if form == "mean_subtracted":
            c = h - h.mean(-1, keepdim=True)
            return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5) * w + b
        if form == "divided_by_std":  # a LayerNorm written with div(sqrt): not the grammar
            c = h - h.mean(-1, keepdim=True)
            return c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5) * w + b
        r = h.float() if form == "cast_then_var_mean" else h
        var, mean = torch.var_mean(r, -1, correction=1 if form == "unbiased" else 0, keepdim=True)
        return (r - mean) * torch.rsqrt(var + 1e-5) * w + b

    shapes = [(T, H), (T, H), (H,), (H,)]
    dtype = torch.bfloat16 if form == "cast_then_var_mean" else torch.float32
    return make_fx(f, tracing_mode="fake")(*[torch.randn(s, dtype=dtype) for s in shapes]).graph


@pytest.mark.parametrize("form", ["var_mean", "mean_subtracted", "cast_then_var_mean"])
def test_a_layernorm_after_the_all_reduce_is_matched_with_its_bias_after_the_weight(group, form):
    g = _layernorm_graph(group, form)
    _, res, w, b = [n for n in g.nodes if n.op == "placeholder"]
    m = match_site(_all_reduce(g))
    assert (m.residual, m.bias, m.norm.weight, m.norm.bias, m.norm.kind) == (res, None, w, b, "layernorm")
    assert m.describe() == "all_reduce +residual -> layernorm *w +b in fp32"
    fused = m.replace_with(fake_mode_of(g), kernel="reference", comm_ctas=8)
    g.lint()
    args = named_args(fused)
    assert (args["norm"], args["norm_bias"], args["bias"], args["weight"], args["eps"]) == ("layernorm", b, None, w, 1e-5)
    assert g.output_node().args[0].args == (fused, 0)


@pytest.mark.parametrize("form,reason", [
    ("layer_norm_op", "a LayerNorm left as one op (aten.native_layer_norm.default), not decomposed"),
    ("unbiased", "a LayerNorm with an unbiased variance (correction=1)"),
    ("divided_by_std", "its form is not one the fused op takes"),
])
def test_a_layernorm_the_op_does_not_compute_is_named_in_the_users_words(group, form, reason):
    with pytest.raises(NoMatch) as e:
        match_site(_all_reduce(_layernorm_graph(group, form)))
    assert str(e.value).startswith("all_reduce result feeds a LayerNorm the fused op does not compute: ")
    assert reason in str(e.value)


def test_an_rmsnorm_whose_input_is_also_averaged_elsewhere_is_still_matched(group):
    def f(x, res, w):
        h = res + wait(ar_op(x, "sum", group))
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)), h.mean(-1)

    assert match_site(_all_reduce(_graph(f, 3))).norm.weight is not None
