"""Attention under the split: masked attention (Hugging Face's form) splits and a mask that is not
causal fails loudly; the suffix's op reads the halves' keys with their kv heads, unconcatenated."""

import pytest
import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD, graph_after_passes


def _hf(rank, world_size, seed):
    import weave_compile
    from examples import hf_models as hf
    from weave_compile.testing.numerics import rel_err

    model = hf.build_model("llama", "tiny", layers=2, seed=seed % 1000)
    c = torch.compile(model, backend="tokenweave", options={"split": True, "split_threshold": THRESHOLD})
    errs = []
    with torch.no_grad():
        for t in (24, 37):
            ids = hf.prompt(1, t, model.config.vocab_size, seed=seed + t)
            errs.append(rel_err(c(ids, use_cache=False).logits, model(ids, use_cache=False).logits))
        text = weave_compile.explain().graphs[-1].split.describe()
        # Left padding: the mask is no longer causal; the split's device-side check must fire.
        ids = hf.prompt(1, 24, model.config.vocab_size, seed=seed)
        pad = torch.ones_like(ids)
        pad[:, :3] = 0
        try:
            c(ids, attention_mask=pad, use_cache=False)
            raised = ""
        except RuntimeError as e:
            raised = str(e)
    return errs, text, raised


@pytest.mark.slow
def test_hf_llama_masked_attention_splits_and_a_non_causal_mask_fails_loudly(seed):
    for errs, text, raised in assert_ranks_ok(run_ranks(_hf, 2, args=(seed,), timeout=900)):
        assert max(errs) < 1e-5, errs
        assert text.startswith("split a symbolic token count") and "barrier" not in text, text
        assert "attention mask is not causal" in raised, raised[-2000:]


def _additive_masks(rank, world_size, seed):
    """A Hugging Face Llama given 4-D additive masks: causal with masked entries at -inf, at
    float16's lowest value (what torch hands cuDNN for a boolean mask: the form a bf16 model's
    mask takes on a GPU), and at -1000 (above what the check accepts as masked: must fail loudly)."""
    import weave_compile
    from examples import hf_models as hf
    from weave_compile.testing.numerics import rel_err

    model = hf.build_model("llama", "tiny", layers=2, seed=seed % 1000)
    t = 24
    ids = hf.prompt(1, t, model.config.vocab_size, seed=seed)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    c = torch.compile(model, backend="tokenweave", dynamic=False,
                      options={"split": True, "split_threshold": THRESHOLD, "compiler": "aot_eager"})
    out = {}
    with torch.no_grad():
        for name, fill in (("-inf", float("-inf")), ("-65504", -65504.0), ("-1000", -1000.0)):
            mask = torch.zeros(1, 1, t, t).masked_fill(~causal, fill)
            want = model(ids, attention_mask=mask, use_cache=False).logits
            try:
                out[name] = rel_err(c(ids, attention_mask=mask, use_cache=False).logits, want)
            except RuntimeError as e:
                out[name] = str(e)
        split = [g.split.describe() for g in weave_compile.explain().graphs if g.split is not None]
    return out, split


@pytest.mark.slow
def test_an_additive_causal_mask_at_cudnns_fill_value_splits_and_a_weak_one_fails(seed):
    for out, split in assert_ranks_ok(run_ranks(_additive_masks, 2, args=(seed,), timeout=900)):
        assert split and all(s.startswith("split 24 tokens") for s in split), split
        assert isinstance(out["-inf"], float) and out["-inf"] < 1e-5, out
        assert isinstance(out["-65504"], float) and out["-65504"] < 1e-5, out
        assert isinstance(out["-1000"], str) and "attention mask is not causal" in out["-1000"], out


# ----------------------------------------------------------------------------- the suffix's keys


def _traced(fn, *shape):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake")(torch.randn(*shape)).graph


def test_unexpanded_sees_through_a_per_query_head_repeat():
    from weave_compile.passes.split_tokens.attention import unexpanded

    def repeats(x):
        b, h, t, d = x.shape
        interleave = x.repeat_interleave(3, dim=1)  # view(clone(expand(unsqueeze(x, 2))))
        kv_style = x[:, :, None].expand(b, h, 3, t, d).reshape(b, h * 3, t, d)  # HF's repeat_kv: _unsafe_view
        tiled = x.unsqueeze(1).expand(b, 3, h, t, d).reshape(b, 3 * h, t, d)  # head order differs: not GQA's
        return interleave, kv_style, tiled, x.view(b, h, t * d // 4, 4)

    graph = _traced(repeats, 1, 2, 5, 4)
    x = next(n for n in graph.nodes if n.op == "placeholder")
    interleave, kv_style, tiled, plain = graph.output_node().args[0]
    assert unexpanded(interleave) == (x, 3)
    assert unexpanded(kv_style) == (x, 3)
    assert unexpanded(tiled) == (tiled, 1)
    assert unexpanded(plain) == (plain, 1)


def _suffix_inputs(rank, world_size, seed):
    from weave_compile.ops import SUFFIX_ATTENTION
    from weave_compile.passes.graph_utils import val

    graph = graph_after_passes(rank, world_size, seed, layers=2)
    calls = [n for n in graph.nodes if n.target is SUFFIX_ATTENTION]
    heads = [[tuple(val(a).shape) for a in n.args[:5]] for n in calls]
    repeats = [n.meta.get("weave_half") for n in graph.nodes if n.target is torch.ops.aten.clone.default]
    cats = sum(n.target is torch.ops.aten.cat.default for n in graph.nodes)
    return heads, repeats, cats


def test_suffix_attention_reads_the_kv_heads_and_nothing_is_concatenated(seed):
    """TPLlama repeats K/V per query head (2 query heads, 1 kv head per rank): the suffix's op gets
    the kv heads (B's repeats are never computed), A's repeat feeds A's attention alone."""
    for heads, repeats, cats in assert_ranks_ok(run_ranks(_suffix_inputs, 2, args=(seed,), timeout=300)):
        assert len(heads) == 2, heads  # one per layer
        for q, kp, vp, k, v in heads:
            assert q[1] == 2 and kp[1] == vp[1] == k[1] == v[1] == 1, heads
            assert kp[2] + k[2] == 40 and q[2] == k[2], heads
        assert repeats == [0] * 4, repeats  # k and v of layer 0 and 1, prefix half only
        assert cats == 1, cats  # the output's join
