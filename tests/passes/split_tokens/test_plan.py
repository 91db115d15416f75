"""Where the split cuts: the smart split for a static token count (its prediction in explain()),
the forced one, and the tile-aligned near-half Inductor carries for a symbolic token count."""

import re

import pytest
import torch
import torch.distributed as dist

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD, tokens, tp_llama


def _static_smart_split(rank, world_size, seed):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    d, model = tp_llama(rank, world_size, seed)
    out = []
    for b, t, opts in ((1, 40, {}), (1, 41, {"split_at": 5}), (4, 10, {})):
        weave_compile.reset()
        torch._dynamo.reset()
        c = torch.compile(model, backend="tokenweave", dynamic=False, options={"split": True, "split_threshold": THRESHOLD, **opts})
        x = tokens(d, b, t, seed)
        with torch.no_grad():
            err = rel_err(c(x), model(x))
        (g,) = weave_compile.explain().graphs
        out.append((err, g.split.describe(), [s.split for s in g.sites]))
    return out


def test_static_token_count_uses_the_smart_split_or_the_forced_one_and_a_batch_splits_by_sequence(seed):
    for res in assert_ranks_ok(run_ranks(_static_smart_split, 2, args=(seed,), timeout=600)):
        (err, text, sites), (ferr, ftext, _), (berr, btext, _) = res
        assert err < 1e-5 and ferr < 1e-5 and berr < 1e-5
        assert text.startswith("split 40 tokens at 20 (smart split: T // 2"), text  # no 64-row grid point in [10, 30]
        assert ftext.startswith("split 41 tokens at 5 (forced)"), ftext
        assert btext.startswith("split a batch of 4 sequences at 2 (half): "), btext  # whole sequences per half
        assert sites == ["per half, comm stream"] * len(sites) and sites


def _plans(rank, world_size, seed):
    import weave_compile
    from weave_compile import smart_split
    from weave_compile.testing.models import LlamaDims, TPLlama
    from weave_compile.testing.numerics import rel_err

    d = LlamaDims(layers=2)
    model = TPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    out = {"dynamic": [], "static": None}
    c = torch.compile(model, backend="tokenweave", options={"split": True, "split_threshold": 128})
    with torch.no_grad():
        for t in (130, 257, 400):  # >= 2 tiles: the near-half expression, evaluated per call
            x = torch.randint(0, d.vocab, (1, t), generator=gen)
            torch._dynamo.mark_dynamic(x, 1)
            out["dynamic"].append((t, rel_err(c(x), model(x)), smart_split.near_half(t)))
    out["dynamic_graphs"] = [g.split.describe() for g in weave_compile.explain().graphs if g.split is not None]
    weave_compile.reset()
    torch._dynamo.reset()
    c = torch.compile(model, backend="tokenweave", dynamic=False,
                      options={"split": True, "split_threshold": 128, "compiler": "aot_eager"})
    x = torch.randint(0, d.vocab, (1, 300), generator=gen)
    with torch.no_grad():
        err = rel_err(c(x), model(x))
    out["static"] = (err, weave_compile.explain().graphs[-1].split.describe())
    return out


@pytest.mark.slow
def test_plan_in_explain_and_near_half_for_symbolic_lengths(seed):
    for res in assert_ranks_ok(run_ranks(_plans, 2, args=(seed,), timeout=900)):
        for t, err, _ in res["dynamic"]:
            assert err < 1e-5, (t, err)
        graphs = res["dynamic_graphs"]
        assert len(graphs) == 1, graphs  # one graph for every length: the split point is an expression
        assert "((T // 2 + 63) // 64) * 64" in graphs[0], graphs
        err, text = res["static"]
        assert err < 1e-5
        # Off-GPU the prediction comes from the SM formula, and says so with each half's time.
        m = re.match(r"split 300 tokens at (\d+) \(smart split; SM formula: predicted A ([\d.]+) us, "
                     r"B ([\d.]+) us, whole ([\d.]+) us; comm A [\d.]+ us, B [\d.]+ us, (not )?hidden\)", text)
        assert m, text
        assert int(m.group(1)) % 64 == 0 and 75 <= int(m.group(1)) <= 225
