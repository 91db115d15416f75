"""Sequence-parallel sites on hand-written ATen graphs (passes/sequence_parallel.py, allreduce_site.py).

``reduce_scatter -> (+residual shard) -> RMSNorm -> all_gather`` traced with ``make_fx`` over a fake
2-rank group in this process: what the fuse pass matches, how the op is called (the reduce-scatter's
input as ``x``, the model's shard as the residual), how the readers are rewired, and why a chain is
left alone. Numerics on real ranks: ``test_fuse_sequence_parallel_models.py``.
"""

import operator

import pytest
import torch

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import _arg, _fused, _norm, _run, group  # noqa: F401
from weave_compile.passes.fuse_allreduce_rmsnorm import MODEL_SHARDED
from weave_compile.passes.sequence_parallel import SEQUENCE_PARALLEL

c10d = torch.ops._c10d_functional
B, S, H, N = 2, 6, 16, 2
F32 = torch.float32


def _rs(x, group, op="sum"):
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, op, N, group))


def _ag(x, group):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, N, group))


def _collectives(graph) -> set:
    return {str(n.target) for n in graph.nodes if n.op == "call_function" and "_c10d_functional" in str(n.target)}


def test_a_block_boundary_becomes_the_fused_op_on_the_models_own_rows(group):
    """Megatron's [S, B, H]: x is the reduce-scatter's input, the residual the model's shard; the op
    returns the shard (viewed back to [S/N, B, H]) and the gathered rows."""
    def f(x, res, w):
        h = res + _rs(x, group)
        return _ag(_norm(h, w), group), h

    graph, rep = _run(f, ((S, B, H), F32), ((S // N, B, H), F32), ((H,), F32))
    (fused,) = _fused(graph)
    x, res, w = [n for n in graph.nodes if n.op == "placeholder"]
    assert (_arg(fused, "x"), _arg(fused, "residual"), _arg(fused, "weight")) == (x, res, w)
    assert _arg(fused, "residual_in_sharded") and _arg(fused, "residual_out_sharded")
    assert _collectives(graph) == set()  # no collective left but the op's
    normed, residual = graph.output_node().args[0]
    assert normed.target == operator.getitem and normed.args == (fused, 0)
    assert residual.target == torch.ops.aten.view.default and residual.args[0].args == (fused, 1)
    assert list(residual.meta["val"].shape) == [S // N, B, H]
    (site,) = rep.sites
    assert site.fused and site.form == SEQUENCE_PARALLEL and site.residual == MODEL_SHARDED
    assert site.reason == "reduce_scatter +residual -> rmsnorm *w in fp32 -> all_gather"


def test_dtensor_shard1_layout_is_kept_as_written(group):
    """DTensor's Shard(1) of [B, S, H]: chunks of the sequence concatenated along dim 0 before the
    reduce-scatter, chunked and concatenated back after the gather. The op takes x after the first
    and hands its gathered rows to the second: no copy or collective added."""
    def f(y, res, w):
        x = torch.cat(torch.split(y, S // N, dim=1))  # [N*B, S/N, H]
        h = res + _rs(x, group)  # [B, S/N, H]
        g = _ag(_norm(h, w), group)  # [N*B, S/N, H]
        return torch.cat(torch.split(g, B), dim=1), h

    graph, rep = _run(f, ((B, S, H), F32), ((B, S // N, H), F32), ((H,), F32))
    (fused,) = _fused(graph)
    assert _arg(fused, "x").target == torch.ops.aten.cat.default
    cats = [n for n in graph.nodes if n.target == torch.ops.aten.cat.default]
    assert len(cats) == 2 and cats[1].args[0][0].args[0].args[0].args == (fused, 0)  # split(normed)[0]
    assert rep.op_counts["reduce_scatter"] == (1, 0) and rep.op_counts["all_gather"] == (1, 0)


def test_the_first_site_has_no_residual_and_its_sum_becomes_the_shard(group):
    """The embedding's reduce-scatter feeds the norm and is the residual the next block adds to."""
    def f(x, w):
        e = _rs(x, group)
        return _ag(_norm(e, w), group), e * 3

    graph, rep = _run(f, ((S, B, H), F32), ((H,), F32))
    (fused,) = _fused(graph)
    assert _arg(fused, "residual") is None and not _arg(fused, "residual_in_sharded")
    assert _arg(fused, "residual_out_sharded")
    mul = next(n for n in graph.nodes if n.target == torch.ops.aten.mul.Tensor and 3 in n.args)
    assert mul.args[0].target == torch.ops.aten.view.default and mul.args[0].args[0].args == (fused, 1)
    assert rep.sites[0].reason.startswith("reduce_scatter -> rmsnorm")


@pytest.mark.parametrize("form,reason", [
    ("avg", "reduce op 'avg' is not sum"),
    ("no_gather", "not only all-gathered"),
    ("normed_read_twice", "read by 2 op(s)"),
    ("gather_elsewhere", "feed aten.tanh.default, not an all_gather"),
    ("no_norm", "feeds aten.relu.default before any RMSNorm"),
])
def test_chains_left_alone_say_why_and_keep_their_collectives(group, form, reason):
    def f(x, res, w):
        h = res + _rs(x, group, "avg" if form == "avg" else "sum")
        if form == "no_norm":
            return _ag(torch.relu(h), group)
        n = _norm(h, w)
        if form == "no_gather":
            return n, n.sum()  # the normed shard read as it is
        if form == "normed_read_twice":
            return _ag(n, group), n * 2
        if form == "gather_elsewhere":
            return _ag(torch.tanh(n), group)
        return _ag(n, group)

    graph, rep = _run(f, ((S, B, H), F32), ((S // N, B, H), F32), ((H,), F32))
    assert _fused(graph) == []
    (site,) = rep.sites
    assert not site.fused and reason in site.reason, site.reason
    assert "reduce_scatter_tensor.default" in str(_collectives(graph))


def test_a_gather_over_other_ranks_is_left_alone(group):
    import torch.distributed as dist

    other = dist.new_group([0])  # another group (its name differs, and so do its ranks)
    try:
        def f(x, res, w):
            return _ag(_norm(res + _rs(x, group), w), other.group_name)

        graph, rep = _run(f, ((S, B, H), F32), ((S // N, B, H), F32), ((H,), F32))
    finally:
        dist.destroy_process_group(other)
    assert _fused(graph) == [] and "all-gathered over another group" in rep.sites[0].reason


def test_both_forms_in_one_graph_are_counted_apart(group):
    ar = c10d.all_reduce

    def f(x, xs, res, rs, w):
        a = _norm(res + c10d.wait_tensor(ar(x, "sum", group)), w)
        b = _ag(_norm(rs + _rs(xs, group), w), group)
        return a, b

    graph, rep = _run(f, ((S, H), F32), ((S, H), F32), ((S, H), F32), ((S // N, H), F32), ((H,), F32))
    assert len(_fused(graph)) == 2
    assert [s.form for s in rep.sites] == ["all_reduce", SEQUENCE_PARALLEL]
    from weave_compile import report

    assert "2 site(s) (1 all_reduce, 1 reduce_scatter/all_gather)" in str(report.WeaveReport(graphs=[rep]))
