"""Quickstart: compile a Megatron-style tensor-parallel model with backend="tokenweave".

    python examples/quickstart.py                          # no GPUs: 2 CPU ranks over gloo
    torchrun --nproc-per-node 2 examples/quickstart.py     # GPUs: NCCL, one GPU per rank

The model is written below the way Megatron-LM writes tensor parallelism: each rank holds a slice
of every projection (column-parallel q/k/v and gate/up, row-parallel o and down) and sums the
row-parallel partial outputs with ``dist.all_reduce``, which a residual add and an RMSNorm follow.
Compiled with ``torch.compile(backend="tokenweave")``, each all_reduce + add + RMSNorm is a site of
the fused op; the default ``kernel="auto"`` times the designs that can run against the sites as
written and keeps the faster (on CPU ranks: as written, the CPU reference design is slower;
``--kernel reference`` shows the rewrite). The script prints the explain report (with the measured
table), the largest difference against the same model run eagerly, and what ``kernel="auto"`` does
with these sites on GPUs.
"""

from __future__ import annotations

import argparse
import os
import textwrap

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: What the default kernel="auto" does on GPUs today (kernels/measured, kernels/auto.py; docs/kernels.md).
ON_GPUS = ("on GPUs: kernel='auto' times each design that can run against these sites as written at the first "
           "compile (cached after) and fuses only where one wins by 2% or more; autotune=False keeps them as "
           "written (no design measured faster across GPUs yet)")


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(hidden)), eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class TPBlock(nn.Module):
    """One decoder layer, this rank's 1/tp of it: ``heads / tp`` heads, ``inter / tp`` MLP columns."""

    def __init__(self, hidden: int, heads: int, inter: int, tp: int):
        super().__init__()
        self.heads = heads // tp
        self.attn_norm, self.mlp_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden // tp, bias=False)  # column-parallel: this rank's heads
        self.o = nn.Linear(hidden // tp, hidden, bias=False)  # row-parallel: a partial sum of the output
        self.gate_up = nn.Linear(hidden, 2 * inter // tp, bias=False)  # column-parallel
        self.down = nn.Linear(inter // tp, hidden, bias=False)  # row-parallel

    def forward(self, x):  # x: [batch, tokens, hidden], the same on every rank
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        dist.all_reduce(y)  # site: all_reduce -> + residual -> mlp_norm
        x = x + y
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        y = self.down(F.silu(gate) * up)
        dist.all_reduce(y)  # site: all_reduce -> + residual -> the next layer's attn_norm (or the final norm)
        return x + y


class TPModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, tp: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)  # replicated
        self.layers = nn.ModuleList(TPBlock(hidden, heads, 4 * hidden, tp) for _ in range(layers))
        self.norm = RMSNorm(hidden)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def main(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import weave_compile

    device = torch.device("cuda", rank) if torch.cuda.is_available() and dist.get_backend() == "nccl" else None
    dtype = torch.bfloat16 if device is not None else torch.float32
    # One seed on every rank: what is replicated (the embedding, the norms) must be equal on every
    # rank, as a checkpoint loaded on each would be (the slices here happen to be equal too).
    torch.manual_seed(0)
    model = TPModel(1000, args.hidden, 8, args.layers, world_size).to(device=device, dtype=dtype)
    tokens = torch.randint(0, 1000, (1, args.tokens), device=device)
    with torch.no_grad():
        eager = model(tokens)
        compiled = (torch.compile(model, backend="tokenweave") if args.kernel == "auto" else
                    torch.compile(model, backend="tokenweave", options={"kernel": args.kernel}))
        out = compiled(tokens)
    diff = (out.float() - eager.float()).abs().max().item()
    return {"report": str(weave_compile.explain()), "max_abs_diff": diff, "dtype": str(dtype),
            "matched": weave_compile.explain().matched_count}


def _parse() -> argparse.Namespace:
    from weave_compile.config import Options  # (importing it does not pull in Inductor)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=37, help="tokens in the prompt (default 37)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--kernel", default="auto", choices=Options.choices("kernel"),
                   help="the fused op's design (default auto: measured)")
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks when not under torchrun (default 2)")
    return p.parse_args()


def _print(result: dict) -> None:
    print(result["report"])
    print(f"fused sites: {result['matched']}; max |compiled - eager| = {result['max_abs_diff']:.3g} "
          f"({result['dtype']})")
    print(textwrap.fill(ON_GPUS, 100))


if __name__ == "__main__":
    args = _parse()
    if "RANK" in os.environ:  # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank = int(os.environ["RANK"])
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend)
        result = main(rank, dist.get_world_size(), args)
        if rank == 0:
            _print(result)
        dist.destroy_process_group()
    else:
        from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

        print(f"no torchrun: spawning {args.ranks} CPU ranks (gloo)")
        results = assert_ranks_ok(run_ranks(main, args.ranks, args=(args,), timeout=600))
        _print(results[0])
