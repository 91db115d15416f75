"""Quickstart: compile a tensor-parallel Llama-style model with backend="tokenweave".

    python examples/quickstart.py                          # no GPUs: 2 CPU ranks over gloo
    torchrun --nproc-per-node 2 examples/quickstart.py     # GPUs: NCCL, one GPU per rank

Builds a small hand-written Megatron-style TP model (dist.all_reduce after o_proj and
down_proj), compiles it with torch.compile(backend="tokenweave"), runs it, prints the explain
report and the largest difference against the same model run eagerly.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def main(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama

    device = torch.device("cuda", rank) if torch.cuda.is_available() and dist.get_backend() == "nccl" else None
    dtype = torch.bfloat16 if device is not None else torch.float32
    dims = LlamaDims(hidden=args.hidden, heads=8, kv_heads=4, intermediate=2 * args.hidden, layers=args.layers)
    model = TPLlama(dims, tp=world_size, rank=rank, group=dist.group.WORLD, dtype=dtype, device=device)
    torch.manual_seed(0)  # same tokens on every rank
    tokens = torch.randint(0, dims.vocab, (1, args.tokens), device=device)
    with torch.no_grad():
        eager = model(tokens)
        compiled = torch.compile(model, backend="tokenweave")
        out = compiled(tokens)
    diff = (out.float() - eager.float()).abs().max().item()
    return {"report": str(weave_compile.explain()), "max_abs_diff": diff, "dtype": str(dtype),
            "matched": weave_compile.explain().matched_count}


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=37, help="tokens in the prompt (default 37)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks when not under torchrun (default 2)")
    return p.parse_args()


def _print(result: dict) -> None:
    print(result["report"])
    print(f"fused sites: {result['matched']}; max |compiled - eager| = {result['max_abs_diff']:.3g} "
          f"({result['dtype']})")


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
