"""Masked attention (Hugging Face's form) splits; a mask that is not causal fails loudly."""

import pytest
import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD


def _hf(rank, world_size, seed):
    import weave_compile
    from weave_compile.testing import hf
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
