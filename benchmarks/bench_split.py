"""Per-layer prefill latency of a TP=2 Llama stack: default vs nocomm vs fused vs fused+split.

TokenWeave's Figures 9 and 11 as one script. Run on 2 GPUs:

    torchrun --nproc-per-node 2 benchmarks/bench_split.py --dims 8b --out benchmarks/results
    torchrun --nproc-per-node 2 benchmarks/bench_split.py --dims 8b --sweep 8192,16384 --out ...

Model: ``weave_compile.testing.models.TPLlama`` (Megatron-style TP, vocab-parallel embedding,
``--layers`` decoder layers, bf16, batch 1), Llama-3-8B dims (H=4096, I=14336, 32/8 heads) or
70B dims (H=8192, I=28672, 64/8 heads); the vocabulary is cut to 32000 (the embedding is a
gather: its size does not change the time).

Variants, every one ``torch.compile``d in this process and timed side by side:

* ``default``   Inductor, ``dist.all_reduce`` through NCCL (what users get today)
* ``nocomm``    the same graph with every all_reduce deleted (wrong results: the ceiling)
* ``fused``     ``backend="tokenweave"`` with ``split=False`` (fused AllReduce-RMSNorm only)
* ``split``     ``backend="tokenweave"``: fused + token split + two-stream overlap
* ``V@N``       variant V with ``comm_ctas=N`` (e.g. ``split@16``)

Every variant runs under ``--mode`` (default "reduce-overhead": CUDA graphs). Without CUDA graphs
a 4-layer stack at these sizes is bound by host launch overhead (the split doubles the launches),
which hides what the GPU does.

Every variant is compiled as a static graph per T (``dynamic=False``; the split then uses the
smart split of ``weave_compile.smart_split``); ``--dynamic`` compiles one graph per variant with
the token dimension dynamic instead (the split then uses T // 2). ``--sweep T,...`` also times
forced split points ``T//2 + offset`` (variants ``split:<offset>``) at those T, to compare the
smart choice with the best swept one.

``--fake-comm``: one GPU, no peers. The process group is PyTorch's fake one (``FakeStore``,
backend "fake", world size 2, this process is rank 0 and holds rank 0's shard); the fused op runs
its ``reference`` implementation, whose collectives (like ``default``'s all_reduce) then move
nothing. What is left is every variant's local work, so the split's own cost (per-half GEMMs,
attention, launches, the stream joins) is tracked without 2 GPUs: ``split`` against ``fused``
and ``nocomm``. Writes ``split_fake_<dims>.csv`` / ``.png``::

    python benchmarks/bench_split.py --fake-comm --dims 8b --out benchmarks/results

Kernel counts: ``kernels`` is every Inductor kernel launch in the variant's generated code per
forward (Triton or C++; cuBLAS and custom ops not counted), ``pointwise_kernels`` the pointwise ones
(``weave_compile.testing.kernel_counts``), from the compile at that T (with ``--dynamic``, the one
compile). The split runs each per-token kernel once per half, so about twice the fused variant's.

Timing: warm-up, then ``--repeats`` x (barrier, CUDA events around ``--iters`` back-to-back
forward calls), median per call, max over ranks, divided by the layer count (the embedding's
gather and the final norm are included, amortized). Rank 0 writes ``split_<dims>.csv`` (after
every point) and a PNG (left: each variant over default; right: the sweep, star = smart split).
Never enables NVLink multicast.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "world_size", "mode", "dims", "layers", "T", "variant",
           "split_at", "ms_per_layer", "kernels", "pointwise_kernels"]
DIMS = {"8b": dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32000, eps=1e-5),
        "70b": dict(hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=32000, eps=1e-5)}


def build(dims: str, layers: int, comm: bool, dev):
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(layers=layers, **DIMS[dims])
    group = dist.group.WORLD if comm else None
    # Without a group TPLlama keeps its sharded weights and skips every all_reduce ("nocomm").
    return d, TPLlama(d, tp=dist.get_world_size(), rank=dist.get_rank(), group=group, dtype=torch.bfloat16,
                      device=dev)


def setup(fake_comm: bool = False) -> tuple[int, torch.device]:
    """NCCL process group from torchrun's environment, or the fake one of world size 2 on one
    GPU (``--fake-comm``); this rank's GPU."""
    if fake_comm:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        torch.cuda.set_device(0)
        return 0, torch.device("cuda", 0)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    return rank, dev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", choices=sorted(DIMS), default="8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--variants", default="default,nocomm,fused,split")
    ap.add_argument("--sweep", default="", help="T values at which to also time forced split points")
    ap.add_argument("--sweep-offsets", default="-256,0,256,512,1024", help="forced split points: T//2 + offset")
    ap.add_argument("--dynamic", action="store_true", help="one graph per variant with the token dimension "
                    "dynamic (the split then uses T // 2) instead of a static graph per T")
    ap.add_argument("--comm-ctas", type=int, default=32)
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode for every variant "
                    "('default': no CUDA graphs, launch-bound below ~8K tokens)")
    ap.add_argument("--fake-comm", action="store_true", help="one GPU, fake process group of 2 ranks: "
                    "collectives move nothing, the fused op runs kernel='reference' (the split's own cost)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()

    rank, dev = setup(args.fake_comm)
    import weave_compile
    from weave_compile.testing.kernel_counts import compiled_launches, pointwise

    meta = dict(run_meta(dev), world_size=dist.get_world_size(),
                dims=args.dims, layers=args.layers)
    rows = []
    tw = {"comm_ctas": args.comm_ctas, **({"kernel": "reference"} if args.fake_comm else {})}
    mode = None if args.mode == "default" else args.mode
    meta["mode"] = args.mode
    dynamic = True if args.dynamic else False

    def tokens_for(t, dynamic):
        x = torch.randint(0, 32000, (1, t), device=dev, generator=torch.Generator(device=dev).manual_seed(t))
        if dynamic:
            torch._dynamo.mark_dynamic(x, 1)
        return x

    name = f"split_fake_{args.dims}" if args.fake_comm else f"split_{args.dims}"
    meta["mode"] = args.mode + (" fake-comm" if args.fake_comm else "")
    path = os.path.join(args.out, name + ".csv")
    sweep_ts = {int(v) for v in args.sweep.split(",") if v}
    variants = args.variants.split(",") + [f"split:{o}" for o in args.sweep_offsets.split(",") if sweep_ts]
    ts = [int(v) for v in args.tokens.split(",")]
    for variant in variants:
        kind, _, ctas = variant.partition("@")
        kind, _, offset = kind.partition(":")
        d, model = build(args.dims, args.layers, kind != "nocomm", dev)
        c = None
        torch._dynamo.reset()
        weave_compile.reset()
        if kind in ("default", "nocomm"):
            c = torch.compile(model, mode=mode, dynamic=dynamic)
        counts, fresh = {}, True
        for t in ts:
            if offset and t not in sweep_ts:
                continue
            if kind not in ("default", "nocomm"):
                if offset or not dynamic:  # a static graph per T (and per forced split point)
                    torch._dynamo.reset()
                opts = {**tw, "split": kind == "split", "mode": args.mode,
                        **({"comm_ctas": int(ctas)} if ctas else {}),
                        **({"split_at": t // 2 + int(offset)} if offset else {})}
                if t == ts[0] or offset or not dynamic:
                    c = torch.compile(model, backend="tokenweave", dynamic=dynamic, options=opts)
                    fresh = True
            elif not dynamic:
                fresh = True  # Dynamo recompiles the static graph for this T
            x = tokens_for(t, dynamic)
            with torch.no_grad():
                if fresh:  # the compiling call: count the kernels it generated
                    counts, fresh = compiled_launches(c, x), False
                ms = Timer(args.repeats, warmup=3, graph=False)(lambda: c(x), args.iters) / 1e3 / args.layers
            at = "-"
            if kind == "split":
                text = weave_compile.explain().graphs[-1].split.describe()
                at = text.split(" at ")[1].split(" (")[0].split(":")[0] if " at " in text else "unsplit"
                if rank == 0:
                    print("  ", text[:300], flush=True)
            rows.append({**meta, "T": t, "variant": variant, "split_at": at, "ms_per_layer": f"{ms:.4f}",
                         "kernels": sum(counts.values()), "pointwise_kernels": pointwise(counts)})
            if rank == 0:
                print(f"{variant:12s} T={t:6d} split_at={at}: {ms:.4f} ms/layer, {sum(counts.values())} kernels "
                      f"({pointwise(counts)} pointwise) per forward", flush=True)
                write_csv(path, rows, COLUMNS)  # after every point: a timeout keeps what was measured
        c = model = None
        torch.cuda.empty_cache()
    if rank == 0:
        print("wrote", path)
        try:
            plot(rows, os.path.join(args.out, name + ".png"))
        except Exception as e:  # the CSV is the result; a missing matplotlib is not fatal
            print("plot skipped:", e)
    dist.destroy_process_group()


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    meta = rows[0]
    base = {int(r["T"]): float(r["ms_per_layer"]) for r in rows if r["variant"] == "default"}
    for variant in dict.fromkeys(r["variant"] for r in rows if ":" not in r["variant"]):
        pts = sorted((int(r["T"]), float(r["ms_per_layer"])) for r in rows if r["variant"] == variant)
        if pts and base:
            ax.plot([p[0] for p in pts], [p[1] / base[p[0]] for p in pts], "o-", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (batch 1, prefill)")
    ax.set_ylabel("latency / torch.compile default")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    for t in sorted({int(r["T"]) for r in rows if ":" in r["variant"]}):
        pts = sorted((int(r["split_at"]), float(r["ms_per_layer"])) for r in rows
                     if int(r["T"]) == t and (r["variant"] == "split" or r["variant"].startswith("split:"))
                     and r["split_at"].isdigit())
        bx.plot([p[0] / t for p in pts], [p[1] for p in pts], "o-", label=f"T={t}")
        for r in rows:
            if int(r["T"]) == t and r["variant"] == "split" and r["split_at"].isdigit():
                bx.plot(int(r["split_at"]) / t, float(r["ms_per_layer"]), "k*", markersize=12)
    bx.set_xlabel("split point / T (star: smart split)")
    bx.set_ylabel("ms per layer")
    if bx.lines:
        bx.legend(fontsize=8)
    else:
        bx.text(0.5, 0.5, "no split-point sweep in this run", ha="center", va="center", transform=bx.transAxes)
    bx.grid(alpha=0.3)
    ax = bx
    ax.set_title(f"TP=2 Llama-{meta['dims']} dims, {meta['layers']} layers, {meta['gpu']}, mode={meta['mode']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
