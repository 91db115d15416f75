"""Show, from a profiler trace, how much of the fused communication overlaps the other half's GEMMs.

    torchrun --nproc-per-node 2 benchmarks/trace_overlap.py --out benchmarks/results

Compiles a TP=2 Llama stack (Llama-3-8B dims by default) with ``backend="tokenweave"`` (token
split on), runs a few warm-up forwards, records one forward with ``torch.profiler`` (CUDA
activity) on each rank and writes rank 0's Chrome trace. From the kernel events it reports, per
rank: the communication kernels' total time (the fused AllReduce-RMSNorm kernels: names
containing ``allreduce_rmsnorm``; NCCL kernels if the reference path ran), the part of it during
which a GEMM (``gemm``/``cutlass``/``nvjet``/``sm90`` kernels) or attention kernel ran on
another stream, and that as a fraction. Writes ``overlap_<dims>.csv``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import commit as git_commit  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_split import DIMS, setup  # noqa: E402

COMM = ("allreduce_rmsnorm", "nccl")
COMPUTE = ("gemm", "cutlass", "nvjet", "sm90", "flash", "fmha", "attention")


def merge(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap(a_iv, b_merged) -> float:
    total = 0.0
    for a, b in a_iv:
        for c, d in b_merged:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                total += hi - lo
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", choices=sorted(DIMS), default="8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--comm-ctas", type=int, default=32)
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode ('default': no CUDA graphs)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    rank, dev = setup()
    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(layers=args.layers, **DIMS[args.dims])
    model = TPLlama(d, tp=dist.get_world_size(), rank=rank, group=dist.group.WORLD, dtype=torch.bfloat16, device=dev)
    c = torch.compile(model, backend="tokenweave", dynamic=False,
                      options={"split": True, "comm_ctas": args.comm_ctas, "mode": args.mode})
    x = torch.randint(0, d.vocab, (1, args.tokens), device=dev)
    with torch.no_grad():
        for _ in range(4):  # reduce-overhead: warm-up, record, replays
            c(x)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            c(x)
            torch.cuda.synchronize()
    if rank == 0:
        print(weave_compile.explain(), flush=True)
    comm, compute = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        iv = (e.time_range.start, e.time_range.end)
        if any(k in name for k in COMM):
            comm.append(iv)
        elif any(k in name for k in COMPUTE):
            compute.append(iv)
    comm_us = sum(b - a for a, b in comm)
    covered = overlap(comm, merge(compute))
    res = torch.tensor([comm_us, covered, len(comm), len(compute)], dtype=torch.float64, device=dev)
    allres = [torch.zeros_like(res) for _ in range(dist.get_world_size())]
    dist.all_gather(allres, res)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        trace = os.path.join(args.out, f"overlap_{args.dims}_T{args.tokens}_rank0.json")
        prof.export_chrome_trace(trace)
        path = os.path.join(args.out, f"overlap_{args.dims}.csv")
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["gpu", "torch", "git_commit", "date", "mode", "dims", "layers", "T", "comm_ctas", "rank",
                        "comm_kernels", "compute_kernels", "comm_us", "comm_us_overlapped", "fraction"])
            for r, t in enumerate(allres):
                cu, ov, nc, nk = t.tolist()
                frac = ov / cu if cu else 0.0
                w.writerow([torch.cuda.get_device_name(dev), torch.__version__, git_commit(),
                            datetime.date.today().isoformat(), args.mode, args.dims, args.layers, args.tokens, args.comm_ctas,
                            r, int(nc), int(nk), f"{cu:.1f}", f"{ov:.1f}", f"{frac:.3f}"])
                print(f"rank {r}: {int(nc)} comm kernels, {cu:.1f} us, overlapped by GEMM/attention {ov:.1f} us "
                      f"({100 * frac:.1f}%)", flush=True)
        print("wrote", path, trace)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
