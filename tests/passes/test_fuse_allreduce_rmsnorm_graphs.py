"""The fuse pass on hand-written ATen graphs: eps and scales as graph inputs or floats, extra readers.

Each function is traced with ``make_fx`` over a fake 2-rank process group in this process (fast,
no spawn), the tokenweave pass manager runs on the graph, and the test checks what it fused and
how the op's arguments and the other readers were rewired. Numerics of the same forms on real
ranks: ``test_fuse_allreduce_rmsnorm.py``.
"""

import operator

import pytest
import torch

ar_op = torch.ops._c10d_functional.all_reduce
wait = torch.ops._c10d_functional.wait_tensor
from weave_compile.ops import FUSED_OP as FUSED  # noqa: E402  (registers the op)
from tests.passes.conftest import group  # noqa: E402,F401  (the fake 2-rank group fixture, which other test packages import from here)
T, H = 6, 16
F32, BF16 = torch.float32, torch.bfloat16


def _norm(h, w, eps=1e-6):
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def _run(fn, *inputs, **options):
    """Trace ``fn`` on fake inputs and run the passes; returns (graph, graph report)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from weave_compile.config import TokenWeaveConfig
    from weave_compile.passes.pass_manager import WeavePassManager

    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s, dtype=d) for s, d in inputs])
    pm = WeavePassManager(TokenWeaveConfig(**{"kernel": "reference", **options}), compiler="aot_eager")
    pm(gm.graph)
    return gm.graph, pm.graph_reports[0]


def _fused(graph):
    return [n for n in graph.nodes if n.target == FUSED]


def _arg(node, name):
    schema = node.target._schema
    i = [a.name for a in schema.arguments].index(name)
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _outputs(graph):
    return list(graph.output_node().args[0])


# ----------------------------------------------------------------------------- eps as an input


def test_eps_graph_input_is_passed_to_the_op(group):
    """dynamic=True turns the Python-float eps into a 0-d float64 input, converted to fp32 and added."""

    def f(x, res, w, eps):
        h = res + wait(ar_op(x, "sum", group))
        hf = h.float()
        e = eps.to(torch.float32)
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + e))

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32), ((), torch.float64))
    (op,) = _fused(graph)
    assert rep.matched_count == 1 and "(eps a graph input)" in rep.sites[0].reason
    eps_node = _arg(op, "eps_tensor")
    # On a host graph the op reads the host input itself, not its fp32 cast (a cast whose only
    # reader is the op is a node Inductor may place elsewhere).
    assert eps_node.op == "placeholder" and eps_node.name.startswith("eps"), eps_node.format_node()
    assert eps_node.meta["val"].dim() == 0 and eps_node.meta["val"].device.type == "cpu"


def _run_cuda(fn, *inputs, **options):
    """``_run`` on fake CUDA tensors (a 0-d float64 input stays on the host, as Dynamo passes eps)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from weave_compile.config import TokenWeaveConfig
    from weave_compile.passes.pass_manager import WeavePassManager

    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.randn(s, dtype=d, device="cpu" if s == () else "cuda") for s, d in inputs]
        gm = make_fx(fn, tracing_mode="fake")(*args)
    pm = WeavePassManager(TokenWeaveConfig(**options), compiler="inductor")
    pm(gm.graph)
    return gm.graph, pm.graph_reports[0]


@pytest.mark.parametrize("kernel", ["nccl", "p2p"])
def test_a_host_eps_reaches_a_cuda_op_through_one_device_copy_at_the_start(group, kernel, monkeypatch):
    """Under dynamic=True eps is a host graph input. A host tensor must not reach an op inside a
    CUDA-graph partition (Inductor's recording rejects it), so the pass copies it to the device
    once, before any other work, and every site reads that copy, whichever design it runs (p2p
    stands for the symmetric-memory designs: the probe here says it can run)."""

    def f(x, res, w, eps):
        outs = []
        h = res
        for xi in (x, 2 * x):  # two sites, one eps input
            h = h + wait(ar_op(xi, "sum", group))
            hf = h.float()
            outs.append(w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps.to(torch.float32))))
        return outs

    import dataclasses

    from weave_compile.kernels import auto_table, registry
    from weave_compile.kernels.shared import probe

    # A floor where nccl wins at this T: the GPU fallback of a design that cannot run is nccl.
    monkeypatch.setattr(auto_table, "FLOOR", {(2, H): {1: {"nccl": 0.9}, 16: {"nccl": 0.9}}})
    monkeypatch.setattr(auto_table, "FLOOR_SOURCE", "test floor")
    monkeypatch.setattr(probe, "probe", lambda group, device, dtype, hidden: probe.SymmProbe(True, False, "test"))
    # p2p's compile-time workspace reservation needs a GPU: stood in for by none.
    old = registry.replace(dataclasses.replace(registry.get("p2p"), reserve=None))
    try:
        graph, rep = _run_cuda(f, ((T, H), BF16), ((T, H), BF16), ((H,), BF16), ((), torch.float64), kernel=kernel)
    finally:
        registry.replace(old)
    ops = _fused(graph)
    assert len(ops) == 2 and all(s.kernel == kernel for s in rep.sites), [(s.kernel, s.kernel_reason) for s in rep.sites]
    copies = [n for n in graph.nodes if n.target == torch.ops.prims.device_put.default]
    assert len(copies) == 1, [c.format_node() for c in copies]
    (copy,) = copies
    nodes = list(graph.nodes)
    first_work = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    assert nodes.index(copy) == first_work, graph
    assert copy.args[0].op == "placeholder" and copy.args[2] is True  # the host input, non-blocking
    assert copy.meta["val"].device.type == "cuda" and copy.meta["val"].dim() == 0
    assert all(_arg(op, "eps_tensor") is copy for op in ops)


def test_eps_cast_below_fp32_stays_the_cast(group):
    """An eps rounded to bf16 before the add is that rounded value: the op reads the cast."""

    def f(x, res, w, eps):
        h = res + wait(ar_op(x, "sum", group))
        hf = h.float()
        e = eps.to(torch.bfloat16)
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + e))

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32), ((), torch.float64))
    (op,) = _fused(graph)
    eps_node = _arg(op, "eps_tensor")
    assert eps_node.op != "placeholder" and eps_node.meta["val"].dtype == torch.bfloat16, eps_node.format_node()


def test_eps_from_another_tensor_is_not_an_eps(group):
    """An add of a non-scalar tensor where eps goes is not an RMSNorm: left alone."""

    def f(x, res, w, e):
        h = res + wait(ar_op(x, "sum", group))
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + e))

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32), ((T, 1), F32))
    assert rep.matched_count == 0 and not _fused(graph)


# ----------------------------------------------------------------------------- scales


@pytest.mark.parametrize("form", ["float", "float_after_cast", "tensor_first", "tensor_input"])
def test_scaled_sublayer_output_is_fused(group, form):
    """Granite's ``residual + hidden * residual_multiplier``: a float (before or after a widening
    cast), or a 0-d tensor (either operand order; dynamic=True makes the float one)."""

    def f(x, res, w, s):
        y = wait(ar_op(x, "sum", group))
        if form == "float":
            y = y * 0.22
        elif form == "float_after_cast":
            y = y.float() * 0.22
        elif form == "tensor_first":
            y = torch.ops.aten.mul.Tensor(s, y)
        else:
            y = y * s.to(y.dtype)
        h = res + y
        return _norm(h, w), h

    graph, rep = _run(f, ((T, H), BF16), ((T, H), F32), ((H,), F32), ((), F32))
    (op,) = _fused(graph)
    assert "*scale +residual" in rep.sites[0].reason, rep.sites[0].reason
    scale = _arg(op, "scale")
    assert scale is not None and scale.meta["val"].dim() == 0
    if form.startswith("float"):
        assert scale.target == torch.ops.aten.scalar_tensor.default and scale.args[0] == pytest.approx(0.22)
    assert rep.sites[0].kernel == "reference"


def test_scale_after_the_residual_add_is_not_absorbed(group):
    """(residual + y) * s scales the residual too: not the op's contract."""

    def f(x, res, w):
        h = (res + wait(ar_op(x, "sum", group))) * 0.5
        return _norm(h, w)

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32))
    assert rep.matched_count == 0 and "aten.mul.Tensor" in rep.sites[0].reason


# ----------------------------------------------------------------------------- more addends


def test_replicated_addend_before_the_residual_is_summed_into_it(group):
    """Qwen2-MoE: experts' all_reduce (on [T, H]) + gated shared expert (replicated) -> view -> + residual."""

    def f(x, shared, res, w):
        y = (wait(ar_op(x, "sum", group)) + shared).view(2, 3, H)
        h = res + y
        return _norm(h, w), h

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((2, 3, H), F32), ((H,), F32))
    (op,) = _fused(graph)
    assert "+1 more addends" in rep.sites[0].reason
    res = _arg(op, "residual")
    assert res.target == torch.ops.aten.add.Tensor and list(res.meta["val"].shape) == [2, 3, H]


# ----------------------------------------------------------------------------- extra readers


def test_reduced_value_also_returned_reads_residual_out(group):
    """all_reduce -> view -> norm, the reduced value (before the view, in bf16) also returned: fused,
    and the output reads residual_out cast and viewed back, not a second all_reduce."""

    def f(x, w):
        y = wait(ar_op(x, "sum", group))  # [T, H] bf16
        h = y.view(2, 3, H).float()
        return _norm(h, w), y

    graph, rep = _run(f, ((T, H), BF16), ((H,), F32))
    (op,) = _fused(graph)
    assert rep.sites[0].fused and "also read by 1 other op" in rep.sites[0].reason
    assert not [n for n in graph.nodes if n.target == ar_op.default]
    extra = _outputs(graph)[1]
    assert extra.target == torch.ops.aten.view.default and list(extra.meta["val"].shape) == [T, H]
    assert extra.meta["val"].dtype == BF16
    # residual_out is the bf16 view (the norm's fp32 cast is inside the norm): viewed back, no cast
    assert extra.args[0].target is operator.getitem and extra.args[0].args == (op, 1)
    assert rep.sites[0].residual.startswith("full"), rep.sites[0].residual


def test_residual_with_an_extra_reader_stays_full_between_sites(group):
    """Two sites in a row; the first one's reduced value is also returned: the shard pass must not
    hand the next site a sharded residual that the other reader would then see."""

    def f(x1, x2, w1, w2):
        y = wait(ar_op(x1, "sum", group)).view(T, H)
        n1 = _norm(y, w1)
        h2 = y + wait(ar_op(x2 + n1, "sum", group))
        return _norm(h2, w2), y * 3

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32), ((H,), F32))
    assert rep.matched_count == 2, [s.reason for s in rep.sites]
    first, second = rep.sites
    assert first.residual.startswith("full (read by"), first.residual
    assert "in" not in second.residual.split()[0], second.residual  # reads the full residual
    ops = _fused(graph)
    assert _arg(ops[0], "residual_out_sharded") is False and _arg(ops[1], "residual_in_sharded") is False


def test_sum_before_the_residual_add_read_elsewhere_stays_unfused(group):
    """The op returns the sum after the residual add only: a reader of the sum before it blocks."""

    def f(x, res, w):
        y = wait(ar_op(x, "sum", group))
        return _norm(res + y, w), y * 2

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32))
    assert rep.matched_count == 0
    assert "users" in rep.sites[0].reason and "returns only the sum after" in rep.sites[0].reason


def test_rms_statistic_returned_is_kept(group):
    """The norm's 1/rms also returned: the site fuses and the statistic is recomputed from residual_out."""

    def f(x, res, w):
        h = res + wait(ar_op(x, "sum", group))
        inv = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * (h * inv), inv

    graph, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32))
    assert rep.matched_count == 1 and "norm intermediates kept" in rep.sites[0].reason


@pytest.mark.parametrize("form", ["unbiased", "over_rows"])
def test_a_layernorm_outside_the_grammar_is_named_in_the_users_words(group, form):
    """A site before a LayerNorm the op does not compute says which LayerNorm and what about it
    (layernorm_match.describe_layernorm), not the aten ops that read the sum."""

    def f(x, res, w):
        h = res + wait(ar_op(x, "sum", group))
        if form == "unbiased":
            var, mean = torch.var_mean(h, -1, correction=1, keepdim=True)
        else:
            var, mean = torch.var_mean(h, 0, correction=0, keepdim=True)
        return (h - mean) * torch.rsqrt(var + 1e-5) * w

    _, rep = _run(f, ((T, H), F32), ((T, H), F32), ((H,), F32))
    detail = {"unbiased": "a LayerNorm with an unbiased variance (correction=1); the fused op divides by H",
              "over_rows": "a LayerNorm over other dims than the last"}[form]
    assert rep.matched_count == 0
    assert rep.sites[0].reason == f"all_reduce result feeds a LayerNorm the fused op does not compute: {detail}"
