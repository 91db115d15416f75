"""A sequence-parallel TP model compiled by tokenweave against the same model compiled by plain Inductor.

One GPU, PyTorch's fake process group (world size 2, this process is rank 0 and holds rank 0's
shard): collectives move nothing in either variant, so the ratio is what the fused op costs
locally against what Inductor makes of the same graph (its fused add+norm kernel on the shard,
its reduce-scatter and all-gather). The reduce-scatters and all-gathers write every row of their
outputs with rank 0's rows (``fake_group.written_collectives``): the GEMMs after them read real
values, not what the allocator handed out. Every block boundary of the model is ``reduce_scatter -> +
residual shard -> RMSNorm -> all_gather`` (docs/sequence_parallel.md)::

    python benchmarks/bench_sequence_parallel.py --dims 8b --layers 2 --tokens 1024,2048,4096,8192 --rounds 3

Models (``--model``): ``titan``, torchtitan's Llama parallelized by PyTorch's own TP plan
(DTensor, ``SequenceParallel`` norms; ``weave_compile.testing.sequence_parallel``), or
``megatron``, the Megatron-LM form (``[S, B, H]``, c10d collectives); Llama-3-8B or -70B dims,
bf16, ``--layers`` blocks, batch ``--batch``, the vocabulary cut to 32000 (the embedding is a
gather, the output projection a GEMM whose size does not change the comparison).

Variants, each ``torch.compile``d in this process with ``mode="reduce-overhead"`` (CUDA graphs),
a static graph per T:

* ``inductor``      plain Inductor: the baseline (ratio 1)
* ``tokenweave``    ``backend="tokenweave"``, ``kernel="auto"`` (on a GPU the sites stay as written
  where nothing measured prefers a design: kernels/auto.py; its kernel column then says so)
* ``tokenweave/D``  ``backend="tokenweave"``, ``kernel=D``: ``nccl`` (functional collectives and
  the shared add+norm kernel), ``ce`` (its own program on rank 0's rows with every transfer and
  flag left out: ``benchmarks/fake_comm.py``'s local mode)

A tokenweave variant stops the run where a site was not fused, where a site runs another design
than the one asked for, or where the fused op fell back at run time: it would time something else.

Timing: every variant is compiled for a T first, then timed in ``--rounds`` rounds, the order
reversed every other round, median per variant (the GPU's speed drifts during a run); each timing
is ``--repeats`` x CUDA events around ``--iters`` back-to-back calls of the compiled model, median
per call, divided by the layer count. Writes ``results/sequence_parallel_<model>_<dims>.csv`` after
every T, and a PNG of every variant over ``inductor``. ``--profile``: after timing a T, one more
forward of each variant under torch.profiler, its busy / idle time and its top kernels printed
(``kernel_timeline``): where a variant's time goes. Never enables NVLink multicast.

The FX graph cache is off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``): a graph served from it skips the
passes, and with ``fake_comm`` installed the same graph and options choose another design than
without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"  # (module doc) before torch reads it
os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"
from common import Timer, meta as run_meta, pyplot, write_csv  # noqa: E402  (keeps NVLink multicast off)
import kernel_timeline  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "world_size", "mode", "model", "dims", "layers", "batch",
           "T", "variant", "kernel", "ms_per_layer", "ratio_vs_inductor", "rounds_spread"]
DIMS = {"8b": dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336),
        "70b": dict(hidden=8192, heads=64, kv_heads=8, intermediate=28672)}
VOCAB = 32000


def build(model: str, dims: str, layers: int, dev: torch.device) -> torch.nn.Module:
    """Rank 0's shard of the model on the fake group, bf16 on ``dev``."""
    d = DIMS[dims]
    if model == "titan":
        from torch.distributed.device_mesh import init_device_mesh

        from weave_compile.testing.sequence_parallel import TitanLlama, parallelize_titan

        with torch.device(dev):
            m = TitanLlama(vocab=VOCAB, layers=layers, eps=1e-5, **d).to(torch.bfloat16)
        return parallelize_titan(m, init_device_mesh("cuda", (dist.get_world_size(),)))
    from weave_compile.testing.models import LlamaDims
    from weave_compile.testing.sequence_parallel import MegatronSPLlama

    ld = LlamaDims(vocab=VOCAB, layers=layers, eps=1e-5, **d)
    return MegatronSPLlama(ld, tp=dist.get_world_size(), rank=0, group=dist.group.WORLD, dtype=torch.bfloat16,
                           device=dev)


class _Fallbacks(logging.Handler):
    """Counts the fused op's run-time fallbacks (a warning of ``ops.allreduce_rmsnorm``)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []
        logging.getLogger("weave_compile.ops.allreduce_rmsnorm").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "fell back" in record.getMessage():
            self.seen.append(record.getMessage())


def ran(variant: str, design: str, expected_sites: int) -> str:
    """The design every site of the last compile runs; RuntimeError where it would time something else."""
    import weave_compile

    graph = weave_compile.explain().graphs[-1]
    fused = [s for s in graph.sites if s.fused]
    if not design and not fused:  # auto keeps the plain graph where nothing measured says otherwise
        return "as written"
    if len(fused) != expected_sites:
        raise RuntimeError(f"{variant}: {len(fused)} of {expected_sites} sites fused:\n{weave_compile.explain()}")
    kernels = sorted({s.kernel for s in fused})
    if design and kernels != [design]:
        raise RuntimeError(f"{variant}: sites run {kernels}, not {design!r}:\n{weave_compile.explain()}")
    return "+".join(kernels)


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for v in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "inductor"):
        pts = sorted((int(r["T"]), float(r["ratio_vs_inductor"])) for r in rows if r["variant"] == v)
        ax.plot([t for t, _ in pts], [y for _, y in pts], marker="o", label=v)
    ax.axhline(1.0, color="gray", linestyle="--", label="plain Inductor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (batch x sequence)")
    ax.set_ylabel("time / plain Inductor's")
    r0 = rows[0]
    ax.set_title(f"sequence parallel, {r0['model']} {r0['dims']}, {r0['layers']} layers, fake group of "
                 f"{r0['world_size']}\n{r0['gpu']}, torch {r0['torch']}, {r0['git_commit']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("titan", "megatron"), default="titan")
    ap.add_argument("--dims", choices=sorted(DIMS), default="8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", default="1024,2048,4096,8192", help="tokens per batch (batch x sequence)")
    ap.add_argument("--variants", default="inductor,tokenweave/nccl,tokenweave/ce,tokenweave")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="also profile one forward per variant and T")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()

    import fake_group

    dev = fake_group.init(2)  # its reduce-scatters and all-gathers write every row (fake_group.py)
    import weave_compile
    import fake_comm
    from weave_compile.testing.sequence_parallel import expected_sequence_parallel_sites

    variants = args.variants.split(",")
    fake = fake_comm.install("local") if any(v.endswith("/ce") for v in variants) else None
    fallbacks = _Fallbacks()
    sites = expected_sequence_parallel_sites(args.layers)
    meta = dict(run_meta(dev), world_size=dist.get_world_size(), mode=f"reduce-overhead fake interleaved x{args.rounds}",
                model=args.model, dims=args.dims, layers=args.layers, batch=args.batch)
    path = os.path.join(args.out, f"sequence_parallel_{args.model}_{args.dims}.csv")
    model = build(args.model, args.dims, args.layers, dev)
    rows: list[dict] = []
    for t in [int(v) for v in args.tokens.split(",")]:
        if t % (args.batch * dist.get_world_size()):
            raise SystemExit(f"T={t}: batch x world size must divide it (the sequence is sharded)")
        torch._dynamo.reset()
        x = torch.randint(0, VOCAB, (args.batch, t // args.batch), device=dev,
                          generator=torch.Generator(device=dev).manual_seed(t))
        live = []
        for variant in variants:
            kind, _, design = variant.partition("/")
            weave_compile.reset()
            if kind == "inductor":
                c = torch.compile(model, mode="reduce-overhead", dynamic=False)
            else:
                c = torch.compile(model, backend="tokenweave", dynamic=False,
                                  options={"mode": "reduce-overhead", **({"kernel": design} if design else {})})
            calls = fake.calls if fake is not None else 0
            with torch.no_grad():
                c(x)
            kernel = "-" if kind == "inductor" else ran(variant, design, sites)
            if design == "ce" and fake.calls <= calls:
                raise RuntimeError(f"{variant}: the fake ce entry was never called")
            live.append((variant, c, kernel))
            print(f"T={t} {variant}: compiled ({kernel})", flush=True)
        times: dict[str, list[float]] = {v: [] for v, *_ in live}
        for r in range(args.rounds):
            for variant, c, _ in (live if r % 2 == 0 else live[::-1]):
                with torch.no_grad():
                    times[variant].append(Timer(args.repeats, warmup=3, graph=False)(lambda: c(x), args.iters))
        if fallbacks.seen:
            raise RuntimeError(f"a fused op fell back at run time: {fallbacks.seen[0]}")
        base = statistics.median(times["inductor"]) if "inductor" in times else float("nan")
        for variant, _, kernel in live:
            us = statistics.median(times[variant])
            spread = (max(times[variant]) - min(times[variant])) / us
            rows.append({**meta, "T": t, "variant": variant, "kernel": kernel,
                         "ms_per_layer": f"{us / 1e3 / args.layers:.4f}", "ratio_vs_inductor": f"{us / base:.3f}",
                         "rounds_spread": f"{spread:.3f}"})
            print(f"T={t:6d} {variant:18s} {kernel:10s} {us / 1e3 / args.layers:.4f} ms/layer  "
                  f"{us / base:.3f}x inductor (rounds spread {spread:.3f})", flush=True)
        write_csv(path, rows, COLUMNS)
        if args.profile:
            for variant, c, _ in live:
                with torch.no_grad():
                    prof = kernel_timeline.profile_once(lambda: c(x), top=12)
                print(f"profile T={t} {variant}: wall {prof['wall_us']:.0f} us, busy {prof['busy_us']:.0f}, "
                      f"idle {prof['idle_us']:.0f}", flush=True)
                for kind, name, us, n in prof["top"]:
                    print(f"    {kind:9s} {us:9.1f} us  x{n:3d}  {name[:110]}", flush=True)
    plot(rows, path.replace(".csv", ".png"))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
