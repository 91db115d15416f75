"""The split's one decision per graph (passes/split_tokens/decision.py), made before the fuse pass."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)
from weave_compile.passes.split_tokens.decision import SEQUENCE_PARALLEL_DECLINED, below_threshold, decide
from weave_compile.passes.split_tokens.options import SplitOptions

c10d = torch.ops._c10d_functional
ON = SplitOptions(split=True, split_threshold=64)


def _graph(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes]).graph


def test_the_threshold_and_the_option_decide(group):
    def f(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    assert decide(_graph(f, (2, 32, 8)), ON).applies  # 64 tokens: batch x sequence
    small = decide(_graph(f, (2, 31, 8)), ON)
    assert not small.applies and small.reason == "62 tokens < split_threshold=64"
    assert decide(_graph(f, (2, 32, 8)), SplitOptions()).reason == "split disabled by option"
    assert below_threshold(64, ON) is None and below_threshold(63, ON) == "63 tokens < split_threshold=64"


def test_a_graph_without_an_all_reduce_or_with_sequence_parallel_collectives_is_not_split(group):
    def none(x):
        return x * 2

    def sp(x):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", 2, group))

    assert decide(_graph(none, (128, 8)), ON).reason == "no all_reduce site"
    assert decide(_graph(sp, (128, 8)), ON).reason == SEQUENCE_PARALLEL_DECLINED


def test_a_symbolic_token_count_is_guarded_one_graph_per_side(group):
    def f(x):
        return c10d.wait_tensor(c10d.all_reduce(x, "sum", group))

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(200, 8))
    rows = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"].shape[0]
    assert isinstance(rows, torch.SymInt)
    env = rows.node.shape_env
    before = len(env.guards)
    assert decide(gm.graph, ON).applies  # the hint (200) is above: guarded so
    assert len(env.guards) > before
