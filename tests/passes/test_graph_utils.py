"""The FX helpers: node kinds, fake values, and the fused op's arguments built, read and replaced by name."""

import operator

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import weave_compile.ops.allreduce_rmsnorm as fused_mod
from weave_compile.ops import ARG_NAMES, FUSED_OP
from weave_compile.passes import graph_utils as gu

aten = torch.ops.aten


def _placeholder(graph, name, fake):
    n = graph.placeholder(name)
    n.meta["val"] = fake
    return n


@pytest.fixture
def graph4(monkeypatch):
    """A graph with x [5, 8] bf16, residual [5, 8] fp32 and weight [8]; a 4-rank group."""
    monkeypatch.setattr(fused_mod, "group_size", lambda name: 4)
    mode = FakeTensorMode()
    with mode:
        vals = torch.empty(5, 8, dtype=torch.bfloat16), torch.empty(5, 8), torch.empty(8)
    g = fx.Graph()
    x, res, w = (_placeholder(g, n, v) for n, v in zip(("x", "res", "w"), vals))
    return g, mode, x, res, w


def _fused_kwargs(x, res, w):
    return dict(x=x, residual=res, bias=None, weight=w, eps=1e-6, group_name="g", residual_dtype=torch.float32,
                out_dtype=torch.bfloat16, mid_dtype=None, weight_offset=0.0, residual_in_sharded=False,
                residual_out_sharded=False, kernel="reference", comm_ctas=8)


def test_call_named_then_named_args_round_trip(graph4):
    g, mode, x, res, w = graph4
    kw = _fused_kwargs(x, res, w)
    node = gu.call_named(g, mode, FUSED_OP, **kw)
    # Held positionally in schema order (Inductor's FallbackKernel takes a ``kernel`` parameter).
    assert node.kwargs == {} and len(node.args) == len(ARG_NAMES)
    assert gu.named_args(node) == {**kw, "scale": None, "eps_tensor": None, "out_slot": -1, "norm": "rmsnorm",
                                   "norm_bias": None, "batch_invariant": False, "quant": "", "quant_dtype": None,
                                   "quant_max": 0.0, "quant_floor": 0.0, "quant_reciprocal": False,
                                   "quant_clamp": True, "quant_scale": None,
                                   "quant_scale_dtype": None}  # the defaults filled in
    normed, res_out, scales = node.meta["val"]
    assert scales.shape == (0,)  # no epilogue: no scales
    assert normed.shape == (5, 8) and normed.dtype == torch.bfloat16 and res_out.dtype == torch.float32


def test_call_named_rejects_unknown_and_missing_arguments(graph4):
    g, mode, x, res, w = graph4
    with pytest.raises(TypeError, match="unknown \\['resid'\\]"):
        gu.call_named(g, mode, FUSED_OP, **{**_fused_kwargs(x, res, w), "resid": res})
    kw = _fused_kwargs(x, res, w)
    del kw["eps"]
    with pytest.raises(TypeError, match="missing \\['eps'\\]"):
        gu.call_named(g, mode, FUSED_OP, **kw)


def test_replace_args_by_name_and_refresh_the_fake_value(graph4):
    g, mode, x, res, w = graph4
    node = gu.call_named(g, mode, FUSED_OP, **_fused_kwargs(x, res, w))
    item = gu.getitem_with_meta(g, node, 1)
    gu.replace_args(node, residual_out_sharded=True)
    assert gu.named_args(node)["residual_out_sharded"] is True
    assert gu.named_args(node)["residual"] is res  # the others unchanged
    gu.set_fake_val(node, mode)
    gu.set_fake_val(item, mode)
    assert item.meta["val"].shape == (2, 8)  # ceil(5 / 4) rows: this rank's shard
    with pytest.raises(TypeError, match="unknown"):
        gu.replace_args(node, residual_sharded=True)


def test_named_args_reads_positional_kwargs_and_defaults():
    g = fx.Graph()
    a = g.placeholder("a")
    n = g.call_function(aten.sum.dim_IntList, (a, [1]), {"keepdim": True})
    assert gu.named_args(n) == {"self": a, "dim": [1], "keepdim": True, "dtype": None}


def test_node_kinds_and_small_predicates():
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    add = g.call_function(aten.add.Tensor, (a, b))
    conv = g.call_function(torch.ops.prims.convert_element_type.default, (add, torch.float32))
    to = g.call_function(aten._to_copy.default, (add,), {"dtype": torch.bfloat16})
    to_dev = g.call_function(aten._to_copy.default, (add,), {"dtype": torch.bfloat16, "device": "cpu"})
    assert gu.is_call(add, aten.add.Tensor) and gu.is_call(add, {aten.mul.Tensor, aten.add.Tensor})
    assert not gu.is_call(a, aten.add.Tensor) and not gu.is_call(3, aten.add.Tensor)
    assert gu.cast_dtype(conv) == torch.float32 and gu.cast_dtype(to) == torch.bfloat16
    assert gu.cast_dtype(to_dev) is None and gu.cast_dtype(add) is None
    assert gu.other_operand(add, a) is b and gu.other_operand(add, b) is a
    assert gu.is_last_dim([-1], 3) and gu.is_last_dim((2,), 3) and not gu.is_last_dim([1], 3)
    assert not gu.is_last_dim(-1, 3)
    assert gu.broadcasts_as_row(torch.empty(8), 8) and gu.broadcasts_as_row(torch.empty(1, 1, 8), 8)
    assert not gu.broadcasts_as_row(torch.empty(2, 8), 8) and not gu.broadcasts_as_row(torch.empty(()), 8)
    assert gu.val(a) is None and gu.val("x") is None


def test_erase_if_dead_removes_whole_dead_chains_only(graph4):
    g, mode, x, res, w = graph4
    with g.inserting_after(w):
        a = gu.call_with_meta(g, mode, aten.add.Tensor, (res, res))
    with g.inserting_after(a):
        b = gu.call_with_meta(g, mode, aten.mul.Tensor, (a, 2.0))
    with g.inserting_after(b):
        kept = gu.call_with_meta(g, mode, aten.neg.default, (res,))
    g.output((kept,))
    assert b.meta["val"].shape == (5, 8)
    gu.erase_if_dead(g, [a, b, kept])
    assert [n.name for n in g.nodes if n.op == "call_function"] == [kept.name]
    assert gu.fake_mode_of(g) is mode


def test_getitem_with_meta_takes_the_element(graph4):
    g, mode, x, res, w = graph4
    node = gu.call_named(g, mode, FUSED_OP, **_fused_kwargs(x, res, w))
    item = gu.getitem_with_meta(g, node, 0)
    assert item.target is operator.getitem and item.meta["val"] is node.meta["val"][0]


def test_the_anchor_pattern_is_a_wait_that_alone_reads_its_all_reduce():
    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    wait = g.call_function(c10d.wait_tensor.default, (ar,))
    assert gu.all_reduce_wait(ar) is wait
    assert gu.WAIT_ALL_REDUCE.match(wait).kwargs == {"x": x, "reduce_op": "sum", "group": "0"}
    read_early = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    g.call_function(c10d.wait_tensor.default, (read_early,))
    g.call_function(aten.neg.default, (read_early,))  # read before (besides) its wait
    assert gu.all_reduce_wait(read_early) is None
    not_waited = g.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    g.call_function(aten.neg.default, (not_waited,))
    assert gu.all_reduce_wait(not_waited) is None
