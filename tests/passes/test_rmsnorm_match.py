"""The RMSNorm matcher (passes/rmsnorm_match.py) on traced ATen graphs: what it takes in, what it leaves."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from weave_compile.passes.rmsnorm_match import match_rmsnorm

T, H = 5, 16


def _graph(fn, *shapes_dtypes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s, dtype=d) for s, d in shapes_dtypes]).graph


def _placeholder(graph, i):
    return [n for n in graph.nodes if n.op == "placeholder"][i]


def test_hf_norm_weight_after_the_cast_back():
    def f(h, w):
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(h.dtype)

    g = _graph(f, ((T, H), torch.bfloat16), ((H,), torch.bfloat16))
    m = match_rmsnorm(_placeholder(g, 0))
    assert m is not None and m.eps == 1e-5 and m.weight is _placeholder(g, 1) and m.weight_offset == 0.0
    assert m.mid_dtype == torch.bfloat16  # the cast back before the weight: a rounding the op must repeat
    assert m.out is g.output_node().args[0]
    assert m.describe() == "rmsnorm *w after cast"


def test_gemma_one_plus_weight_in_float32():
    def f(h, w):
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(h.dtype)

    g = _graph(f, ((T, H), torch.bfloat16), ((H,), torch.bfloat16))
    m = match_rmsnorm(_placeholder(g, 0))
    assert m is not None and m.weight is _placeholder(g, 1) and m.weight_offset == 1.0 and m.mid_dtype is None
    assert m.out is g.output_node().args[0] and m.describe() == "rmsnorm (1+w) in fp32"


def test_not_a_norm_over_the_last_dim():
    def over_rows(h):
        return h * torch.rsqrt(h.pow(2).mean(0, keepdim=True) + 1e-6)

    def without_keepdim(h):
        return h * torch.rsqrt(h.pow(2).mean(-1) + 1e-6)[:, None]

    for f in (over_rows, without_keepdim):
        g = _graph(f, ((T, H), torch.float32))
        assert match_rmsnorm(_placeholder(g, 0)) is None, f.__name__


def test_a_scalar_is_no_norm_and_no_error():
    """A 0-d float (an all-reduced loss or count, say) is answered None, not an IndexError."""
    def f(s):
        return s * torch.rsqrt(s * s + 1e-6)

    from weave_compile.passes.layernorm_match import match_norm

    g = _graph(f, ((), torch.float32))
    assert match_rmsnorm(_placeholder(g, 0)) is None and match_norm(_placeholder(g, 0)) is None
