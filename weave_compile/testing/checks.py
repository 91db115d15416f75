"""Rank functions shared by tests that must also run where only the installed package is importable.

``run_ranks`` pickles its function by module name; spawned ranks on a machine that installs the
package (not the tests folder) can import these.
"""

import torch


def compiled_tp_llama_vs_eager(rank, world_size, mode, token_counts):
    """On each GPU rank: compile the TP Llama with tokenweave (``mode``), compare with eager per T."""
    import torch.distributed as dist

    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama, expected_fused_sites
    from weave_compile.testing.numerics import rel_err

    dev = torch.device("cuda", rank)
    d = LlamaDims(hidden=1024, heads=8, kv_heads=4, intermediate=2048, layers=2, bias=True)
    model = TPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD, dtype=torch.bfloat16, device=dev)
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
    return errs, rep.matched_count, sorted({s.kernel for s in rep.sites}), expected_fused_sites(d, world_size)
