"""The LayerNorm matcher (passes/layernorm_match.py) on traced post-grad ATen graphs: each form real
code produces, its parameters recorded; what it leaves to the reason."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from weave_compile.passes.layernorm_match import (
    describe_layernorm,
    match_layernorm,
    match_norm,
)

T, H = 5, 16


def _graph(fn, dtype, decompose=True):
    args = [torch.randn(T, H, dtype=dtype), torch.randn(H, dtype=dtype), torch.randn(H, dtype=dtype)]
    table = select_decomp_table() if decompose else None  # what AOT hands Inductor: var_mean
    return make_fx(fn, decomposition_table=table, tracing_mode="fake")(*args).graph


def _inputs(graph):
    return [n for n in graph.nodes if n.op == "placeholder"]


def cohere(h, w, b):
    hf = h.float()
    mean = hf.mean(-1, keepdim=True)
    var = (hf - mean).pow(2).mean(-1, keepdim=True)
    return (w.float() * ((hf - mean) * torch.rsqrt(var + 1e-5))).to(h.dtype)


FORMS = {
    # name: (fn, weight, bias, describe)
    "layer_norm": (lambda h, w, b: F.layer_norm(h, (H,), w, b, 1e-5), True, True, "layernorm *w +b in fp32"),
    "no_bias": (lambda h, w, b: F.layer_norm(h, (H,), w, None, 1e-5), True, False, "layernorm *w in fp32"),
    "no_affine": (lambda h, w, b: F.layer_norm(h, (H,), None, None, 1e-5), False, False, "layernorm"),
    "fp32_upcast": (lambda h, w, b: F.layer_norm(h.float(), (H,), w, b, 1e-5).to(h.dtype), True, True,
                    "layernorm *w +b in fp32"),
    "olmo": (lambda h, w, b: F.layer_norm(h.float(), (H,), None, None, 1e-5).to(h.dtype), False, False, "layernorm"),
    "cohere": (cohere, True, False, "layernorm *w in fp32"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_is_matched_with_its_parameters(form, dtype):
    fn, has_w, has_b, text = FORMS[form]
    g = _graph(fn, dtype)
    h, w, b = _inputs(g)
    m = match_norm(h)
    assert m is not None and m.kind == "layernorm" and m.eps == 1e-5, form
    assert (m.weight, m.bias) == (w if has_w else None, b if has_b else None)
    assert m.weight_offset == 0.0 and m.mid_dtype is None
    assert m.out is g.output_node().args[0]  # the whole norm, to its output cast
    assert m.describe() == text


def test_the_hand_written_form_with_one_sub_and_with_two():
    """Cohere's form computes ``x - mean`` twice; a graph where CSE merged them is the same norm."""
    def one_sub(h, w, b):
        c = h - h.mean(-1, keepdim=True)
        return c * torch.rsqrt((c * c).mean(-1, keepdim=True) + 1e-6) * w

    for fn in (one_sub, cohere):
        g = _graph(fn, torch.float32)
        subs = [n for n in g.nodes if n.target == torch.ops.aten.sub.Tensor]
        m = match_layernorm(_inputs(g)[0])
        assert m is not None and set(subs) <= set(m.nodes) and m.weight is _inputs(g)[1], fn.__name__
        assert len(subs) == (1 if fn is one_sub else 2)


def test_an_rmsnorm_is_still_an_rmsnorm():
    def rms(h, w, b):
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))

    g = _graph(rms, torch.float32)
    assert match_layernorm(_inputs(g)[0]) is None
    assert match_norm(_inputs(g)[0]).kind == "rmsnorm"


def nemotron(h, w, b):
    """LayerNorm1P: ``weight + 1`` in the weight's own dtype, then F.layer_norm."""
    return F.layer_norm(h, (H,), w + 1.0, b, 1e-5)


def test_weight_plus_one_in_bf16_is_the_weight_and_in_fp32_an_offset():
    """Nemotron's ``w + 1`` in bf16 is rounded before the norm reads it: the op's weight is that
    add (offset 0), not ``w`` with ``weight_offset`` 1, which the op adds in fp32. In fp32 the two
    are the same number, and the offset form is kept."""
    g = _graph(nemotron, torch.bfloat16)
    h, w, b = _inputs(g)
    m = match_layernorm(h)
    plus_one = next(n for n in g.nodes if n.target == torch.ops.aten.add.Tensor and n.args[0] is w)
    assert m is not None and m.weight is plus_one and m.weight_offset == 0.0 and m.bias is b
    assert m.describe() == "layernorm *w +b in fp32"
    g = _graph(nemotron, torch.float32)
    h, w, b = _inputs(g)
    m = match_layernorm(h)
    assert m is not None and m.weight is w and m.weight_offset == 1.0 and m.bias is b
    assert m.describe() == "layernorm (1+w) +b in fp32"


def test_the_bias_after_a_rounded_product_stays_outside():
    """``(w * y.to(bf16)) + b`` rounds the product before the bias: the op adds its bias in fp32 and
    rounds once, so the norm ends at the product and the add reads the op's output."""
    def rounded(h, w, b):
        hf = h.float()
        var, mean = torch.var_mean(hf, -1, correction=0, keepdim=True)
        return w * ((hf - mean) * torch.rsqrt(var + 1e-5)).to(h.dtype) + b

    g = _graph(rounded, torch.bfloat16)
    h, w, _ = _inputs(g)
    m = match_layernorm(h)
    assert m is not None and m.weight is w and m.bias is None and m.mid_dtype == torch.bfloat16
    assert m.describe() == "layernorm *w after cast"
    assert [u.target for u in m.out.users] == [torch.ops.aten.add.Tensor]


def test_forms_outside_the_grammar_are_named_in_the_users_words():
    def unbiased(h, w, b):
        return (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True) + 1e-5) * w

    def over_rows(h, w, b):
        var, mean = torch.var_mean(h, 0, correction=0, keepdim=True)
        return (h - mean) * torch.rsqrt(var + 1e-5)

    g = _graph(unbiased, torch.float32)
    assert match_norm(_inputs(g)[0]) is None
    assert describe_layernorm(_inputs(g)[0]).startswith("a LayerNorm with an unbiased variance (correction=1)")
    g = _graph(over_rows, torch.float32)
    assert match_norm(_inputs(g)[0]) is None
    assert describe_layernorm(_inputs(g)[0]) == "a LayerNorm over other dims than the last"
    g = _graph(FORMS["layer_norm"][0], torch.float32, decompose=False)
    assert match_norm(_inputs(g)[0]) is None
    assert describe_layernorm(_inputs(g)[0]) == "a LayerNorm left as one op (aten.native_layer_norm.default), not decomposed"
