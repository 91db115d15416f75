"""Where the split cuts: the smart split for a static token count, or the forced one."""

import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD, tokens, tp_llama


def _static_smart_split(rank, world_size, seed):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    d, model = tp_llama(rank, world_size, seed)
    out = []
    for t, opts in ((40, {}), (41, {"split_at": 5})):
        weave_compile.reset()
        torch._dynamo.reset()
        c = torch.compile(model, backend="tokenweave", dynamic=False, options={"split": True, "split_threshold": THRESHOLD, **opts})
        x = tokens(d, 1, t, seed)
        with torch.no_grad():
            err = rel_err(c(x), model(x))
        (g,) = weave_compile.explain().graphs
        out.append((err, g.split.describe(), [s.split for s in g.sites]))
    return out


def test_static_token_count_uses_the_smart_split_or_the_forced_one(seed):
    for res in assert_ranks_ok(run_ranks(_static_smart_split, 2, args=(seed,), timeout=600)):
        (err, text, sites), (ferr, ftext, _) = res
        assert err < 1e-5 and ferr < 1e-5
        assert text.startswith("split 40 tokens at 20 (smart split)"), text  # 40 < 2 tiles: t // 2
        assert ftext.startswith("split 41 tokens at 5 (forced)"), ftext
        assert sites == ["per half, comm stream"] * len(sites) and sites
