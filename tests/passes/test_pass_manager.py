"""The pass manager (passes/pass_manager.py): which passes run for a config is decided there alone."""

import pytest
import torch
import torch.fx as fx

import weave_compile
from weave_compile.config import TokenWeaveConfig
from weave_compile.passes.pass_manager import WeavePassManager


class _MustNotRun:
    def __call__(self, *args, **kwargs):
        raise AssertionError("the manager ran a pass its config turns off")


@pytest.fixture(autouse=True)
def _clean_report():
    weave_compile.reset()
    yield
    weave_compile.reset()


def _graph() -> fx.Graph:
    """``wait(all_reduce(x))``: one site, nothing after it to fuse."""
    g = fx.Graph()
    x = g.placeholder("x")
    ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    g.output(g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,)))
    return g


def test_fuse_off_runs_neither_merge_nor_fuse_and_reports_every_site_unfused():
    m = WeavePassManager(TokenWeaveConfig(fuse=False), compiler="aot_eager")
    m.merge, m.fuse = _MustNotRun(), _MustNotRun()
    m(_graph())
    (site,) = weave_compile.explain().sites
    assert not site.fused and site.reason == "fuse disabled by option"
    assert m.comm_plans == [{}]  # nothing rewritten: nothing for the ranks to agree on


@pytest.fixture
def no_group(monkeypatch):
    """No process group here: the ranks' communication plan is not built."""
    from weave_compile import agreement

    monkeypatch.setattr(agreement, "plan", lambda graph: {})


def test_split_off_does_not_run_the_split_pass(no_group):
    m = WeavePassManager(TokenWeaveConfig(split=False, kernel="reference"), compiler="aot_eager")
    m.merge, m.fuse, m.split = (lambda g: []), (lambda g, split=False, chooser=None: []), _MustNotRun()
    m(_graph())
    assert weave_compile.explain().graphs[-1].split.reason == "split disabled by option"


def test_shard_residual_off_does_not_run_the_shard_pass(no_group):
    m = WeavePassManager(TokenWeaveConfig(shard_residual=False, split=False, kernel="reference"), compiler="aot_eager")
    m.merge, m.fuse, m.shard = (lambda g: []), (lambda g, split=False, chooser=None: []), _MustNotRun()
    m(_graph())


def test_an_all_reduce_leaving_the_graph_before_any_norm_is_recorded(no_group):
    """What leaves the graph unnormed (``leaves``): where a graph break ends the graph, the report
    says the break cut that site. A result that only reaches the output through a norm does not."""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    cut = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (x, "sum", "0")),))
    normed = g.call_function(c10d.wait_tensor.default, (g.call_function(c10d.all_reduce.default, (w, "sum", "0")),))
    var = g.call_function(aten.mean.dim, (g.call_function(aten.pow.Tensor_Scalar, (normed, 2)), [-1], True))
    rstd = g.call_function(aten.rsqrt.default, (g.call_function(aten.add.Tensor, (var, 1e-6)),))
    g.output((g.call_function(aten.mul.Tensor, (cut, 2)), g.call_function(aten.mul.Tensor, (normed, rstd))))
    m = WeavePassManager(TokenWeaveConfig(split=False, kernel="reference"), compiler="aot_eager")
    m.merge, m.fuse = (lambda g: []), (lambda g, split=False, chooser=None: [])
    m(g)
    assert weave_compile.explain().graphs[-1].leaves == [cut.args[0].name]
