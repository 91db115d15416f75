"""Rank functions shared by tests that must also run where only the installed package is importable.

``run_ranks`` pickles its function by module name; spawned ranks on a machine that installs the
package (not the tests folder) can import these.
"""

import torch


def compiled_tp_llama_vs_eager(rank, world_size, mode, token_counts, options=None):
    """On each GPU rank: compile the TP Llama with tokenweave (``mode``, ``options``), compare with
    eager per T. Returns (errors, fused sites, kernels, expected sites, the sites' output labels)."""
    import torch.distributed as dist

    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama, expected_fused_sites
    from weave_compile.testing.numerics import rel_err

    dev = torch.device("cuda", rank)
    d = LlamaDims(hidden=1024, heads=8, kv_heads=4, intermediate=2048, layers=2, bias=True)
    model = TPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD, dtype=torch.bfloat16, device=dev)
    if options:  # torch.compile refuses mode= together with options=
        compiled = torch.compile(model, backend="tokenweave", dynamic=False,
                                 options={**options, **({"mode": mode} if mode else {})})
    else:
        compiled = torch.compile(model, backend="tokenweave", mode=mode, dynamic=False)
    errs = []
    with torch.no_grad():
        for t in token_counts:
            for _ in range(3):  # reduce-overhead: warm-up, record, replay; fresh data each time
                tokens = torch.randint(0, d.vocab, (1, t), device=dev,
                                       generator=torch.Generator(device=dev).manual_seed(t * 7 + _))
                out = compiled(tokens).clone()
                errs.append(rel_err(out, model(tokens)))
    rep = weave_compile.explain()
    return (errs, rep.matched_count, sorted({s.kernel for s in rep.sites}), expected_fused_sites(d, world_size),
            [s.output for s in rep.sites])


def split_tp_llama_vs_eager(rank, world_size, mode, token_counts, repeats=3, options=None):
    """On each GPU rank: the token-split TP Llama (two streams) against eager, per T, fresh data.

    ``token_counts`` are run in a random order with ``repeats`` calls each; with ``mode=None`` the
    token dimension is marked dynamic (one graph for all T above the threshold), with
    "reduce-overhead" each T is a static CUDA-graph recording replayed with new inputs.
    ``options`` are added to the split's. Returns (errors, split summaries, split-vs-unsplit
    errors, the sites' output labels).
    """
    import random

    import torch.distributed as dist

    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama
    from weave_compile.testing.numerics import rel_err

    dev = torch.device("cuda", rank)
    d = LlamaDims(hidden=1024, heads=8, kv_heads=4, intermediate=2048, layers=2, bias=True)
    model = TPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD, dtype=torch.bfloat16, device=dev)
    dynamic = mode is None
    mode_opt = {"mode": mode} if mode else {}
    split = torch.compile(model, backend="tokenweave", dynamic=False if not dynamic else None,
                          options={"split": True, **mode_opt, **(options or {})})
    plain = torch.compile(model, backend="tokenweave", dynamic=None, options={"split": False}) if dynamic else None
    order = [t for t in token_counts for _ in range(repeats)]
    random.Random(0).shuffle(order)  # the same order on every rank (collectives in lockstep)
    errs, vs_plain = [], []
    with torch.no_grad():
        for i, t in enumerate(order):
            tokens = torch.randint(0, d.vocab, (1, t), device=dev,
                                   generator=torch.Generator(device=dev).manual_seed(1000 * t + i))
            if dynamic:
                torch._dynamo.mark_dynamic(tokens, 1)
            out = split(tokens).clone()
            errs.append((t, rel_err(out, model(tokens))))
            if plain is not None:
                vs_plain.append((t, rel_err(out, plain(tokens))))
    rep = weave_compile.explain()
    summaries = [g.split.describe() for g in rep.graphs if g.split is not None]
    return errs, summaries, vs_plain, [s.output for s in rep.sites]
