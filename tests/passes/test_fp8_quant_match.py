"""The fp8 quant matcher (passes/fp8_quant_match.py) on Inductor's post-grad graphs of the forms
users write (testing/fp8.py), traced on CPU: what it takes in, the parameters it records, the
q/k/v deduplication, and the reasons it gives for what it declines.

Each recorded parameter is checked by recomputing q and the scales from it alone (a float64
oracle with the fp32 / scale-dtype roundings the chain does) and comparing bit for bit with the
graph run as captured.
"""

import pytest
import torch
import torch.distributed as dist

from weave_compile.passes.fp8_quant_match import PER_TENSOR_REASON, match_quant, match_quant_readers
from weave_compile.passes.rmsnorm_match import match_rmsnorm
from weave_compile.testing import fp8
from weave_compile.testing.models import LlamaDims
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks
from weave_compile.testing.pass_graphs import post_grad_graph

T, H = 7, 32
BF16, F32, E4M3, E5M2 = torch.bfloat16, torch.float32, fp8.E4M3, fp8.E5M2


def _norm(h, w, eps=1e-6):
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def _inputs(seed, static=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(T, H, generator=g) * 3).to(BF16)
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(BF16)
    s = (0.01 + 0.02 * torch.rand((), generator=g)).to(F32)  # a static scale: some values clamp
    return (h, w, s) if static else (h, w)


def _capture(fn, inputs):
    """(post-grad graph module, the normed node: the RMSNorm's output on the first input)."""
    gm = post_grad_graph(fn, *inputs)
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    return gm, match_rmsnorm(first).out


def _run(gm, inputs):
    return [t.clone() for t in gm(*inputs)]


def _round(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float64)


def _oracle(m, rows: torch.Tensor, static_scale=None):
    """q (as float64) and the scales from the match's parameters alone, in float64 with the
    chain's roundings: fp32 steps, the scale's dtype, the fp8 cast."""
    x = rows.to(torch.float64)
    if m.kind == "row":
        amax = x.abs().amax(-1, keepdim=True)
        scale = _round(_round(amax / m.fp8_max, F32), m.scale_dtype)
        if m.scale_floor is not None:
            scale = scale.clamp(min=m.scale_floor)
        scale = _round(scale, F32)
    else:
        scale = static_scale.to(torch.float64)
    y = _round(x * _round(1 / scale, F32), F32) if m.reciprocal else _round(x / scale, F32)
    if m.clamp:
        y = y.clamp(-m.fp8_max, m.fp8_max)
    return y.to(m.dtype).to(torch.float64), scale


def _per_token_max_then_view(x):
    """vLLM's per-token form as DTensor decomposes ``max(dim=-1)``: keepdim=True, then a view
    dropping the 1, then the unsqueeze the model wrote."""
    fmax = 448.0
    row_max = x.abs().max(dim=-1, keepdim=True).values.view(x.shape[:-1]).unsqueeze(-1).to(F32)
    scale = (row_max / fmax).clamp(min=1.0 / (fmax * 512.0))
    return (x.to(F32) * scale.reciprocal()).clamp(-fmax, fmax).to(E4M3), scale


FORMS = {
    # name: (function of (h, w[, s]), expected fields)
    "vllm_per_token_max_keepdim_then_view": (lambda h, w: _per_token_max_then_view(_norm(h, w)),
                                             dict(kind="row", dtype=E4M3, fp8_max=448.0, reciprocal=True,
                                                  clamp=True, scale_dtype=F32)),
    "vllm_per_token": (lambda h, w: fp8.quant_per_token(_norm(h, w)),
                       dict(kind="row", dtype=E4M3, fp8_max=448.0, reciprocal=True, clamp=True,
                            scale_floor=float(torch.tensor(1 / (448 * 512.0)).float()), scale_dtype=F32)),
    "vllm_per_token_keepdim_e5m2": (lambda h, w: fp8.quant_per_token(_norm(h, w), E5M2, keepdim=True),
                                    dict(kind="row", dtype=E5M2, fp8_max=57344.0, reciprocal=True, clamp=True,
                                         scale_floor=float(torch.tensor(1 / (57344 * 512.0)).float()))),
    # torchao divides the bf16 amax in bf16: the scale is rounded to bf16 before .to(float32)
    "torchao_per_row": (lambda h, w: fp8.quant_per_row(_norm(h, w)),
                        dict(kind="row", dtype=E4M3, fp8_max=448.0, reciprocal=False, clamp=True,
                             scale_floor=None, scale_dtype=BF16)),
    # a floor on a bf16 scale acts at its bf16 rounding (Inductor clamps in fp32, then rounds)
    "torchao_per_row_floor": (lambda h, w: fp8.quant_per_row(_norm(h, w), floor=1e-3),
                              dict(kind="row", reciprocal=False, scale_dtype=BF16,
                                   scale_floor=float(torch.tensor(1e-3).to(BF16).float()))),
    "static_div": (lambda h, w, s: fp8.quant_static(_norm(h, w), s),
                   dict(kind="static", dtype=E4M3, fp8_max=448.0, reciprocal=False, clamp=True, scales=None)),
    "static_div_unclamped_e5m2": (lambda h, w, s: fp8.quant_static(_norm(h, w), s, E5M2, clamp=False),
                                  dict(kind="static", dtype=E5M2, fp8_max=57344.0, reciprocal=False, clamp=False)),
    "static_reciprocal": (lambda h, w, s: fp8.quant_static(_norm(h, w), s, reciprocal=True),
                          dict(kind="static", reciprocal=True, clamp=True)),
    "static_reciprocal_unclamped": (lambda h, w, s: fp8.quant_static(_norm(h, w), s, reciprocal=True, clamp=False),
                                    dict(kind="static", reciprocal=True, clamp=False)),
}


@pytest.mark.parametrize("form", FORMS)
def test_each_form_is_matched_with_its_parameters(form, seed):
    fn, expected = FORMS[form]
    inputs = _inputs(seed)[:fn.__code__.co_argcount]  # Dynamo drops an unread input
    gm, normed = _capture(fn, inputs)
    m, reason = match_quant_readers(normed)
    assert m is not None and reason is None, reason
    assert m is match_quant(normed) or m.q is match_quant(normed).q
    for k, v in expected.items():
        assert getattr(m, k) == v, (k, getattr(m, k), v)
    out = gm.graph.output_node().args[0]
    assert m.q is out[0] and m.nodes[-1] is m.q and m.rows is normed
    if m.kind == "row":
        assert m.scales is out[1] and m.static_scale is None
    else:
        assert m.static_scale.op == "placeholder" and m.static_scale.meta["val"].dim() == 0
    # every node of the chain is in it: only q and the scales are read from outside
    inside = set(m.nodes)
    for n in m.nodes:
        if n is not m.q and n is not m.scales:
            assert set(n.users) <= inside, n.format_node()
    # the parameters alone give the graph's q and scales, bit for bit
    got = _run(gm, inputs)
    rows = _norm(inputs[0], inputs[1])
    want_q, want_scale = _oracle(m, rows, inputs[2] if m.kind == "static" else None)
    assert torch.equal(got[0].to(torch.float64).nan_to_num(), want_q.nan_to_num()), form
    if m.kind == "row":
        assert torch.equal(got[1].to(torch.float64), want_scale), form
    assert m.describe().startswith(f"fp8 {str(m.dtype).replace('torch.float8_', '')} ")


def _torchao_flattened(x):
    """torchao's per-row quant as its plain-torch path writes it on a 3-D input: the amax over the
    rows flattened to 2-D, the bf16 quotient viewed back to the input's leading dims, then fp32."""
    x2 = x.reshape(-1, x.shape[-1])
    scale = (x2.abs().amax(dim=-1, keepdim=True) / 448.0).reshape(*x.shape[:-1], 1).to(F32)
    return (x.to(F32) / scale).clamp(-448.0, 448.0).to(E4M3), scale


def test_torchaos_flattened_per_row_form_is_matched(seed):
    """The form torchao's own ``Float8DynamicActivationFloat8WeightConfig(PerRow())`` traces to on a
    [B, S, H] activation (tests/passes/test_torchao_fp8.py runs torchao itself): the reshapes on the
    way to and from the amax are part of the chain, the rows and scales the same per-row values."""
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(2, T, H, generator=g) * 3).to(BF16)
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(BF16)
    gm, normed = _capture(lambda h, w: _torchao_flattened(_norm(h, w)), (h, w))
    m, reason = match_quant_readers(normed)
    assert m is not None and reason is None, reason
    assert (m.kind, m.reciprocal, m.clamp, m.scale_dtype, m.fp8_max) == ("row", False, True, BF16, 448.0)
    out = gm.graph.output_node().args[0]
    assert m.q is out[0] and m.scales is out[1] and m.rows is normed
    inside = set(m.nodes)
    for n in m.nodes:
        if n is not m.q and n is not m.scales:
            assert set(n.users) <= inside, n.format_node()
    got = _run(gm, (h, w))
    want_q, want_scale = _oracle(m, _norm(h, w))
    assert torch.equal(got[0].to(torch.float64), want_q) and torch.equal(got[1].to(torch.float64), want_scale)


def test_describe_names_the_form():
    fn, _ = FORMS["vllm_per_token"]
    gm, normed = _capture(fn, _inputs(0, static=False))
    assert match_quant(normed).describe() == "fp8 e4m3fn per-row (vLLM per-token form)"
    gm, normed = _capture(FORMS["static_reciprocal"][0], _inputs(0))
    assert match_quant(normed).describe() == "fp8 e4m3fn static per-tensor (x * (1/s), clamped)"


# ----------------------------------------------------------------------------- q/k/v: one chain


@pytest.mark.parametrize("quant", ["per_token", "per_row"])
def test_identical_chains_are_deduplicated_and_the_graph_computes_the_same(quant, seed):
    """q, k and v each quantize the same normed rows: one chain remains, every reader of the
    others' q and scales reads the survivor's, and the graph's outputs are unchanged."""
    qf = getattr(fp8, f"quant_{quant}")

    def qkv(h, w):
        n = _norm(h, w).reshape(-1, H)
        return [t for _ in range(3) for t in qf(n)]

    inputs = _inputs(seed, static=False)
    gm, normed = _capture(qkv, inputs)
    casts = lambda: [n for n in gm.graph.nodes if n.target == torch.ops.prims.convert_element_type.default  # noqa: E731
                     and n.args[1] == E4M3]
    assert len(casts()) == 3  # Inductor's post-grad graph keeps the three (no CSE there)
    before = _run(gm, inputs)
    m, reason = match_quant_readers(normed)
    assert m is not None and reason is None, reason
    assert casts() == [m.q]
    gm.graph.lint()
    gm.recompile()
    out = gm.graph.output_node().args[0]
    assert list(out) == [m.q, m.scales] * 3
    after = _run(gm, inputs)
    for a, b in zip(before, after):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a, b.view(torch.uint8) if b.dtype == E4M3 else b)
    assert match_quant_readers(normed)[0].q is m.q  # a second call finds the one chain


# ----------------------------------------------------------------------------- declined, with reasons


def test_per_tensor_dynamic_is_declined():
    gm, normed = _capture(lambda h, w: fp8.quant_per_tensor_dynamic(_norm(h, w)), _inputs(0, static=False))
    assert match_quant(normed) is None
    assert match_quant_readers(normed) == (None, PER_TENSOR_REASON)


def test_another_reader_of_the_bf16_rows_keeps_the_quant_outside():
    """An MoE router (a bf16 matmul) reads the normed rows besides the quant."""

    def routed(h, w, s, router):
        n = _norm(h, w)
        return fp8.quant_static(n, s), n @ router

    inputs = _inputs(1) + (torch.randn(H, 4).to(BF16),)
    gm, normed = _capture(routed, inputs)
    assert match_quant(normed) is not None  # the chain itself is one
    assert match_quant_readers(normed) == (None, "another reader needs the bf16 rows: aten.mm")


def test_a_reader_of_the_fp32_copy_is_another_reader():
    def shared(h, w, s):
        xf = _norm(h, w).float()
        return (xf / s).clamp(-448, 448).to(E4M3), xf.sum(-1)

    gm, normed = _capture(shared, _inputs(2))
    assert match_quant_readers(normed) == (None, "another reader needs the bf16 rows: aten.sum.dim_IntList")


def test_no_quant_reader_gives_no_reason():
    gm, normed = _capture(lambda h, w: _norm(h, w) @ w.new_ones(H, 3), _inputs(0, static=False))
    assert match_quant(normed) is None
    assert match_quant_readers(normed) == (None, None)


@torch.library.custom_op("weave_test::fp8_rows", mutates_args=())
def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.quant_per_token(x)


@_fp8_rows.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty(*x.shape[:-1], 1, dtype=F32)


def test_an_opaque_quant_op_is_declined():
    gm, normed = _capture(lambda h, w: _fp8_rows(_norm(h, w)), _inputs(0, static=False))
    assert match_quant_readers(normed) == (None, "quantized by an opaque op weave_test.fp8_rows")


def test_chains_that_differ_are_not_one_quant():
    def two(h, w, s):
        n = _norm(h, w)
        return fp8.quant_static(n, s), fp8.quant_static(n, 2 * s)

    gm, normed = _capture(two, _inputs(3))
    m, reason = match_quant_readers(normed)
    assert m is None and reason.startswith("the readers quantize the rows differently") and "static scales" in reason


def test_values_scaled_in_bf16_are_not_in_the_grammar():
    """``x_bf16 / s``: a 0-d fp32 scale does not promote the rows, so they round to bf16 first."""
    gm, normed = _capture(lambda h, w, s: (_norm(h, w) / s).clamp(-448, 448).to(E4M3), _inputs(4))
    m, reason = match_quant_readers(normed)
    assert m is None and reason.startswith("fp8 quant with the values rounded to torch.bfloat16"), reason


# ----------------------------------------------------------------------------- models


def _norm_outs(gm):
    outs = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and n.op != "output":
            m = match_rmsnorm(n)
            if m is not None and m.out not in outs:
                outs.append(m.out)
    return outs


def _model_matches(model, tokens):
    gm = post_grad_graph(model, tokens)
    found = [match_quant_readers(n) for n in _norm_outs(gm)]
    gm.graph.lint()
    return [(m.describe() if m else None, reason) for m, reason in found]


@pytest.mark.parametrize("form,merged,reciprocal,want", [
    ("per_token", False, False, "fp8 e4m3fn per-row (vLLM per-token form)"),  # q/k/v, gate/up deduplicated
    ("static", True, True, "fp8 e4m3fn static per-tensor (x * (1/s), clamped)"),
])
def test_fp8_llama_every_layer_norm_is_matched(form, merged, reciprocal, want):
    d = LlamaDims(layers=2, merged=merged)
    model = fp8.FP8TPLlama(d, fp8.Fp8Config(form=form, reciprocal=reciprocal))
    got = _model_matches(model, torch.randint(0, d.vocab, (2, 5)))
    # two norms per layer read by quantized linears; the final norm by nothing quantized
    assert got == [(want, None)] * (2 * d.layers) + [(None, None)]


def test_separate_static_scales_per_projection_are_not_one_quant():
    d = LlamaDims(layers=1)
    model = fp8.FP8TPLlama(d, fp8.Fp8Config(form="static"))
    got = _model_matches(model, torch.randint(0, d.vocab, (1, 4)))
    assert all(m is None and r.startswith("the readers quantize the rows differently") for m, r in got[:2]), got


def _tp_per_row(rank, world_size, seed):
    d = LlamaDims(layers=2)
    cfg = fp8.Fp8Config(form="per_row")
    model = fp8.FP8TPLlama(d, cfg, tp=world_size, rank=rank, group=dist.group.WORLD, seed=seed)
    tokens = torch.randint(0, d.vocab, (2, 6), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        tp_out = model(tokens).float()
        full = model.unsharded(seed)(tokens).float()
    return _model_matches(model, tokens), ((tp_out - full).norm() / full.norm()).item()


def test_two_rank_tp_llama_per_row_sites_match(seed):
    """2 gloo ranks, Megatron-style: each norm after an all_reduce is read by torchao-form quants only."""
    for matches, rel in assert_ranks_ok(run_ranks(_tp_per_row, 2, args=(seed,), timeout=180)):
        assert matches == [("fp8 e4m3fn per-row (torchao per-row form)", None)] * 4 + [(None, None)]
        # the TP fp8 model is the unsharded one up to the collectives' rounding (it moves fp8 codes)
        assert rel < 0.03, rel
