"""The op rules: a token-mixing op is a barrier, with a correct result and a recorded reason."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD


class CumsumBetween(nn.Module):
    """Two fused sites with a token-mixing op (cumsum over tokens) between them."""

    def __init__(self, h):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(h, h) / h ** 0.5), nn.Parameter(torch.randn(h, h) / h ** 0.5)
        self.nw = nn.Parameter(1 + 0.1 * torch.randn(h))

    def norm(self, x):
        return self.nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x, res):
        y = x @ self.w1
        dist.all_reduce(y)
        res = res + y
        h = self.norm(res)
        h = torch.cumsum(h, dim=1) / 10  # mixes tokens: the split must end here
        y = h @ self.w2
        dist.all_reduce(y)
        res = res + y
        return self.norm(res)


def _barrier(rank, world_size, seed):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    torch.manual_seed(seed)
    m = CumsumBetween(32)
    x, r = torch.randn(1, 40, 32), torch.randn(1, 40, 32)
    weave_compile.reset()
    with torch.no_grad():
        got = torch.compile(m, backend="tokenweave", options={"split": True, "split_threshold": THRESHOLD})(x, r)
        err = rel_err(got, m(x, r))
    return err, weave_compile.explain().graphs[0].split.describe()


def test_token_mixing_op_ends_the_split_with_a_correct_result(seed):
    for err, text in assert_ranks_ok(run_ranks(_barrier, 2, args=(seed,), timeout=300)):
        assert err < 1e-5
        assert "1 barrier(s)" in text and "aten.cumsum.default): operates along the token dimension" in text, text


# ----------------------------------------------------------------------------- rules one by one (one process)


@pytest.fixture
def rw(monkeypatch):
    """A Rewriter over a graph with x [1, 8, 16] split 3 + 5 along the tokens (dim 1)."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    import weave_compile.ops.allreduce_rmsnorm as fused_mod
    from weave_compile.config import TokenWeaveConfig
    from weave_compile.ops import FUSED_OP
    from weave_compile.passes.graph_utils import call_named
    from weave_compile.passes.split_tokens.rewriter import Rewriter
    from weave_compile.passes.split_tokens.values import Split
    from weave_compile.report import SplitSummary

    monkeypatch.setattr(fused_mod, "group_size", lambda name: 2)
    mode = FakeTensorMode()
    g = fx.Graph()
    nodes = {}
    with mode:
        for name, shape in (("x", (1, 8, 16)), ("full", (1, 8, 16)), ("row", (16,))):
            nodes[name] = g.placeholder(name)
            nodes[name].meta["val"] = torch.empty(shape)
    fused = call_named(g, mode, FUSED_OP, x=nodes["x"], residual=None, bias=None, weight=None, eps=1e-6,
                       group_name="g", residual_dtype=torch.float32, out_dtype=torch.float32, mid_dtype=None,
                       weight_offset=0.0, residual_in_sharded=False, residual_out_sharded=False,
                       kernel="reference", comm_ctas=8)
    r = Rewriter(g, TokenWeaveConfig(split=True, split_threshold=2), [fused], SplitSummary())
    r.sizes, r.total_arg = (3, 5), 8
    r.env[nodes["x"]] = Split(1, r.sliced(nodes["x"], 1))
    return r, nodes


def _node(rw, target, *args):
    from weave_compile.passes.graph_utils import call_with_meta

    return call_with_meta(rw.graph, rw.fake_mode, target, args)


def _shapes(sp):
    from weave_compile.passes.graph_utils import val

    return [tuple(val(h).shape) for h in sp.halves]


def test_layout_rules_track_the_token_dimension(rw):
    from weave_compile.passes.split_tokens import rules

    r, n = rw
    aten = torch.ops.aten
    view = _node(r, aten.view.default, n["x"], [8, 16])
    sp = rules.apply(r, view)
    assert (sp.dim, sp.unit, _shapes(sp)) == (0, 1, [(3, 16), (5, 16)])
    tr = _node(r, aten.transpose.int, n["x"], 1, 2)
    sp = rules.apply(r, tr)
    assert (sp.dim, _shapes(sp)) == (2, [(1, 16, 3), (1, 16, 5)])
    unsq = _node(r, aten.unsqueeze.default, n["x"], 1)
    assert rules.apply(r, unsq).dim == 2


def test_pointwise_rule_slices_a_full_operand_and_broadcasts_a_row(rw):
    from weave_compile.passes.split_tokens import rules

    r, n = rw
    aten = torch.ops.aten
    add = _node(r, aten.add.Tensor, n["x"], n["full"])
    sp = rules.apply(r, add)
    assert sp.dim == 1 and _shapes(sp) == [(1, 3, 16), (1, 5, 16)]
    assert [h.args[1].target for h in sp.halves] == [aten.slice.Tensor] * 2  # the full operand, sliced
    mul = _node(r, aten.mul.Tensor, n["x"], n["row"])
    sp = rules.apply(r, mul)
    assert [h.args[1] for h in sp.halves] == [n["row"], n["row"]]  # broadcast: read whole by both
    # clone is tagged pointwise and has no entry of its own: it takes the pointwise rule.
    assert aten.clone.default not in rules.TOKENWISE.entries and torch.Tag.pointwise in aten.clone.default.tags
    assert _shapes(rules.apply(r, _node(r, aten.clone.default, n["x"]))) == [(1, 3, 16), (1, 5, 16)]


def test_token_mixing_and_unknown_ops_are_barriers_with_reasons(rw):
    from weave_compile.passes.split_tokens import rules
    from weave_compile.passes.split_tokens.values import Barrier

    r, n = rw
    aten = torch.ops.aten
    cases = [
        (_node(r, aten.sum.dim_IntList, n["x"], [1]), "reduces over the token dimension"),
        (_node(r, aten.cumsum.default, n["x"], 1), "operates along the token dimension"),
        (_node(r, aten.flip.default, n["x"], [2]), "op not known to be token-wise"),
    ]
    # A GEMM whose K (not M) is the token dimension mixes tokens.
    xv = _node(r, aten.view.default, n["x"], [8, 16])
    r.env[xv] = rules.apply(r, xv)
    cases.append((_node(r, aten.mm.default, _node(r, aten.view.default, n["row"], [2, 8]), xv),
                  "argument 0 is not the token-split operand"))
    for node, why in cases:
        with pytest.raises(Barrier, match=why):
            rules.apply(r, node)
    # A reduction over another dimension stays split.
    sp = rules.apply(r, _node(r, aten.sum.dim_IntList, n["x"], [2]))
    assert (sp.dim, _shapes(sp)) == (1, [(1, 3), (1, 5)])
