"""Models and graph capture shared by the token-split tests.

All on 2 gloo ranks (streams are no-ops on CPU; the order they would run in is checked on the
graph). ``split_threshold`` is lowered so that CPU-sized inputs split; the split is off by
default (measured slower on 2x H200), so every test turns it on.
"""

import torch
import torch.distributed as dist

THRESHOLD = 16


def tp_llama(rank, world_size, seed, **dims):
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(**{"layers": 2, **dims})
    return d, TPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD, seed=seed)


def tokens(d, b, t, seed):
    return torch.randint(0, d.vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def graph_after_passes(rank, world_size, seed, layers):
    """The post-pass graph (aot_eager: the same passes, no Inductor) of a TP Llama at T=40."""
    from weave_compile.passes.pass_manager import WeavePassManager

    d, model = tp_llama(rank, world_size, seed, layers=layers)
    seen = []
    orig = WeavePassManager.__call__

    def keep(self, graph):
        orig(self, graph)
        seen.append(graph)

    WeavePassManager.__call__ = keep
    try:
        c = torch.compile(model, backend="tokenweave",
                          options={"split": True, "split_threshold": THRESHOLD, "compiler": "aot_eager"})
        with torch.no_grad():
            c(tokens(d, 1, 40, seed))
    finally:
        WeavePassManager.__call__ = orig
    return seen[-1]
