"""Latency of all-reduce + residual add + RMSNorm on one node (TokenWeave Fig. 4/10 style).

Run on 2 GPUs:

    torchrun --nproc-per-node 2 benchmarks/bench_allreduce_rmsnorm.py --out benchmarks/results

Variants (bf16, weight-only RMSNorm with a residual, eps 1e-6):

* ``nccl_ar+norm``      ``dist.all_reduce`` in place + torch.compile'd add+RMSNorm
* ``symm_2shot+norm``   copy into a symmetric buffer + ``symm_mem.two_shot_all_reduce_``
                        + torch.compile'd add+RMSNorm
* ``symm_2shot``        ``two_shot_all_reduce_`` alone, in place (communication only)
* ``fused_symm``        ours (``weave_compile.kernels.p2p.launch.allreduce_rmsnorm``, the push kernel) as compiled
                        models run it: residual sharded by token rows in and out
                        (TokenWeave's layout), one row per CTA count; x is read in place and
                        the outputs written in place (no staging copy, no copy out)
* ``fused_symm_full``   ours with a full residual in and out (all-gathered too: 1.5x the
                        NVLink bytes), at ``--full-ctas``
* ``fused_pull``        the pull kernel (peer loads; multimem's sibling; the measurement hook
                        ``weave_compile.testing.ptx.p2p_pull``) at ``--zc-ctas``, with
                        its staging copy in and copy out
* ``fused_pull_zc``     the same with ``x`` already in the symmetric input buffer (no copy in)

Each point: warm-up, then ``--repeats`` x (barrier, synchronise, CUDA events around
``iters`` back-to-back calls, replayed from a CUDA graph unless ``--mode eager``); the
per-call mean of each repeat, median over repeats, max over ranks.  Rank 0 writes ``<out>/allreduce_rmsnorm.csv`` and ``.png`` and prints a
table.  ``--plot-only CSV`` redraws the table/plot from an existing CSV (no GPU needed).

Never runs the multimem variant: NVLink multicast stays disabled in this process.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, meta as run_meta  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402

from weave_compile.kernels.p2p import launch as p2p  # noqa: E402
from weave_compile.kernels.shared import probe, workspace  # noqa: E402
from weave_compile.kernels.shared.workspace import _WORKSPACES  # noqa: E402
from weave_compile.testing.ptx import p2p_pull  # noqa: E402

logger = logging.getLogger("bench_allreduce_rmsnorm")
HERE = os.path.dirname(os.path.abspath(__file__))
CSV_NAME = "allreduce_rmsnorm.csv"
PNG_NAME = "allreduce_rmsnorm.png"
COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "world_size", "dtype", "mode", "H", "T",
           "variant", "ctas", "us"]
EPS = 1e-6


def add_rmsnorm(x, residual, weight, eps: float = EPS):
    """vLLM fused_add_rms_norm semantics (residual kept in its dtype)."""
    h = x.float() + residual.float()
    res = h.to(residual.dtype)
    r = res.float()
    y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype), res


def iters_for(T: int, H: int) -> int:
    """Same on every rank: ~ a few ms per repeat for big shapes, up to 100 calls small."""
    return max(5, min(100, int(4e8 / (T * H))))


def run(args) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    meta = dict(run_meta(dev), world_size=world, dtype="bf16", mode=args.mode)

    found = probe.probe(group_name, dev, dtype, max(args.hidden))
    variant, reason = ("multimem" if found.multicast else "p2p" if found.mapped else None), found.reason
    if rank == 0:
        print(f"# {meta['gpu']} x{world}, torch {meta['torch']}, triton {meta['triton']}, "
              f"commit {meta['git_commit']}; symm variant: {variant} ({reason})", flush=True)
        if variant == "multimem":
            print("# multicast present, but this benchmark only runs the p2p variant", flush=True)
    run_ours = variant is not None
    if args.explore_warps:
        _explore_warps(dist, group_name, dev, rank, world, dtype, args)
    compiled_norm = torch.compile(add_rmsnorm, dynamic=True)
    timer = Timer(args.repeats, args.warmup, graph=args.mode == "graph")
    rows = []
    for H in args.hidden:
        Tmax = max(args.tokens)
        # The same weight on every rank, as in a real TP model.
        weight = torch.randn(H, device=dev, generator=torch.Generator(device=dev).manual_seed(H)).to(dtype)
        symm_buf = symm_mem.empty(Tmax, H, dtype=dtype, device=dev)
        symm_mem.rendezvous(symm_buf, group_name)
        if run_ours:
            workspace.reserve(group_name, dtype, H, Tmax, device=dev)
        for T in args.tokens:
            g = torch.Generator(device=dev).manual_seed(1000 * rank + T)
            x = torch.randn(T, H, generator=g, device=dev).to(dtype)
            residual = torch.randn(T, H, generator=g, device=dev).to(dtype)
            ar_buf = x.clone()
            sb = symm_buf[:T]
            iters = iters_for(T, H)

            def nccl_norm():
                dist.all_reduce(ar_buf)
                return compiled_norm(ar_buf, residual, weight)

            def symm_norm():
                sb.copy_(x)
                torch.ops.symm_mem.two_shot_all_reduce_(sb, "sum", group_name)
                return compiled_norm(sb, residual, weight)

            def symm_only():
                return torch.ops.symm_mem.two_shot_all_reduce_(sb, "sum", group_name)

            points = [("nccl_ar+norm", 0, nccl_norm), ("symm_2shot+norm", 0, symm_norm),
                      ("symm_2shot", 0, symm_only)]
            if run_ours:
                S = math.ceil(T / world)
                res_shard = torch.nn.functional.pad(residual, (0, 0, 0, S * world - T))[rank * S:(rank + 1) * S].clone()
                sharded = dict(residual_in_sharded=True, residual_out_sharded=True)
                for c in args.ctas:
                    points.append(("fused_symm", c, lambda c=c: p2p.allreduce_rmsnorm(
                        x, res_shard, None, weight, eps=EPS, group_name=group_name, comm_ctas=c, **sharded)))
                for c in args.full_ctas:
                    points.append(("fused_symm_full", c, lambda c=c: p2p.allreduce_rmsnorm(
                        x, residual, None, weight, eps=EPS, group_name=group_name, comm_ctas=c)))
                # The load-based sibling of multimem, with the staging copy and with x
                # already in the symmetric input buffer (zero-copy producer).
                points.append(("fused_pull", args.zc_ctas, lambda: p2p_pull(
                    x, res_shard, None, weight, eps=EPS, group_name=group_name,
                    comm_ctas=args.zc_ctas, **sharded)))
                zc_in = input_buffer(group_name, dtype, T, H, dev)
                zc_in.copy_(x)
                points.append(("fused_pull_zc", args.zc_ctas,
                               lambda: p2p_pull(
                                   zc_in, res_shard, None, weight, eps=EPS,
                                   group_name=group_name, comm_ctas=args.zc_ctas, **sharded)))
            for name, ctas, fn in points:
                us = timer(fn, iters)
                rows.append(dict(meta, H=H, T=T, variant=name, ctas=ctas, us=round(us, 2)))
                if rank == 0 and args.verbose:
                    print(f"H={H:5d} T={T:6d} {name:16s} ctas={ctas:2d} {us:10.1f} us",
                          flush=True)
            if run_ours and T == args.check_tokens:
                _sanity_check(dist, group_name, T, H, weight, dev, rank)
        del symm_buf
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, CSV_NAME)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
        print(f"# wrote {path}")
        print_table(rows)
        plot(rows, os.path.join(args.out, PNG_NAME))
    if run_ours:
        ws_timeouts = sum(ws.check_status() for ws in _WORKSPACES.values())
        if ws_timeouts:
            print(f"# rank {rank}: {ws_timeouts} barrier timeouts recorded!", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def input_buffer(group_name: str, dtype: torch.dtype, num_tokens: int, hidden: int, device) -> torch.Tensor:
    """[T, H] view of this rank's symmetric input buffer (the zero-copy producer path of the pull
    kernel): partial sums written here skip its staging copy. Write it on the stream that launches
    the fused op, after the previous launch on that channel was enqueued."""
    return workspace.get_workspace(group_name, dtype, hidden, num_tokens, device=device).inp[:num_tokens]


def _explore_warps(dist, group_name, dev, rank, world, dtype, args) -> None:
    """Push kernel, sharded residual: time num_warps choices against the default heuristic."""
    timer = Timer(args.repeats, args.warmup, graph=args.mode == "graph")
    for H in (4096, 8192):
        weight = torch.randn(H, device=dev, generator=torch.Generator(device=dev).manual_seed(H)).to(dtype)
        workspace.reserve(group_name, dtype, H, 8192, device=dev)
        for T in (2048, 8192):
            x = torch.randn(T, H, device=dev, dtype=dtype)
            S = math.ceil(T / world)
            res = torch.randn(S, H, device=dev, dtype=dtype)
            for c in (8, 32):
                line = []
                for w in (None, 4, 8, 16, 32):
                    us = timer(lambda: p2p.allreduce_rmsnorm(
                        x, res, None, weight, eps=EPS, group_name=group_name, comm_ctas=c,
                        residual_in_sharded=True, residual_out_sharded=True, num_warps=w), iters_for(T, H))
                    line.append(f"w{w or 'auto'}={us:7.1f}")
                if rank == 0:
                    print(f"# explore H={H} T={T} ctas={c}: " + " ".join(line), flush=True)


def _sanity_check(dist, group_name, T, H, weight, dev, rank):
    """Each variant vs NCCL + eager add/RMSNorm on fresh data (prints max abs diff on rank 0)."""
    g = torch.Generator(device=dev).manual_seed(77 + rank)
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    residual = torch.randn(T, H, device=dev, generator=torch.Generator(device=dev).manual_seed(5)
                           ).to(torch.bfloat16)
    y = x.clone()
    dist.all_reduce(y)
    n2, r2 = add_rmsnorm(y, residual, weight)
    for variant, fn in (("p2p", p2p.allreduce_rmsnorm), ("p2p_pull", p2p_pull)):
        n1, r1 = fn(x, residual, None, weight, eps=EPS, group_name=group_name)
        d = torch.tensor([(n1.float() - n2.float()).abs().max().item(),
                          (r1.float() - r2.float()).abs().max().item()], device=dev)
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"# sanity {variant} H={H} T={T}: max|normed - ref| = {d[0].item():.3g}, "
                  f"max|residual - ref| = {d[1].item():.3g} (bf16: ~1-2 ulp expected)", flush=True)


def print_table(rows) -> None:
    """One line per (H, T): baselines, ours per CTA count, best ours, speed-up."""
    by = {}
    for r in rows:
        by.setdefault((int(r["H"]), int(r["T"])), {})[(r["variant"], int(r["ctas"]))] = float(r["us"])
    ctas = sorted({int(r["ctas"]) for r in rows if r["variant"] == "fused_symm"})
    head = (f"{'H':>5s} {'T':>6s} {'nccl+norm':>10s} {'2shot+norm':>10s} {'2shot':>8s} "
            + " ".join(f"{'ours c' + str(c):>9s}" for c in ctas)
            + f" {'ce c2':>8s} {'ce c8':>8s} {'ce c32':>8s} {'pull zc':>8s} {'full best':>9s} {'best':>8s} {'vs nccl':>7s} {'vs 2shot':>8s}")
    print(head)
    for (H, T), v in sorted(by.items()):
        ours = [v[("fused_symm", c)] for c in ctas if ("fused_symm", c) in v]
        best = min(ours) if ours else float("nan")
        zc = next((u for (n, _), u in v.items() if n == "fused_pull_zc"), float("nan"))
        full = min((u for (n, _), u in v.items() if n == "fused_symm_full"), default=float("nan"))
        ce = " ".join(f"{v.get(('fused_ce', c), float('nan')):8.1f}" for c in (2, 8, 32))
        base = v.get(("nccl_ar+norm", 0), float("nan"))
        two_shot = v.get(("symm_2shot", 0), float("nan"))
        print(f"{H:5d} {T:6d} {base:10.1f} {v.get(('symm_2shot+norm', 0), float('nan')):10.1f} "
              f"{v.get(('symm_2shot', 0), float('nan')):8.1f} "
              + " ".join(f"{v.get(('fused_symm', c), float('nan')):9.1f}" for c in ctas)
              + f" {ce} {zc:8.1f} {full:9.1f} {best:8.1f} {best / base if ours else float('nan'):6.2f}x"
              f" {best / two_shot if ours else float('nan'):7.2f}x")


def plot(rows, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"# matplotlib unavailable ({e}); no plot")
        return
    hs = sorted({int(r["H"]) for r in rows})
    fig, axes = plt.subplots(1, len(hs), figsize=(6 * len(hs), 4.5), squeeze=False)
    styles = {"nccl_ar+norm": ("NCCL AR + compiled add&RMSNorm", "k", "-o"),
              "symm_2shot+norm": ("symm two-shot AR + compiled add&RMSNorm", "tab:blue", "-s"),
              "symm_2shot": ("symm two-shot AR only", "tab:blue", ":^"),
              "fused_pull": ("fused, pull kernel (multimem's sibling)", "tab:green", "--o"),
              "fused_pull_zc": ("fused, pull kernel, zero-copy input", "tab:green", "--D"),
              "fused_symm_full": ("fused (ours, full residual)", "tab:purple", ":x")}
    for c in (2, 8, 32):
        styles[("fused_ce", c)] = (f"fused, copy-engine variant, {c} CTAs", "tab:orange", "-.")
    for ax, H in zip(axes[0], hs):
        sub = [r for r in rows if int(r["H"]) == H]
        Ts = sorted({int(r["T"]) for r in sub})

        def series(variant, ctas=None):
            pts = {int(r["T"]): float(r["us"]) for r in sub if r["variant"] == variant
                   and (ctas is None or int(r["ctas"]) == ctas)}
            return [t for t in Ts if t in pts], [pts[t] for t in Ts if t in pts]

        for v, (label, color, st) in styles.items():
            xs, ys = series(*v) if isinstance(v, tuple) else series(v)
            if xs:
                ax.plot(xs, ys, st, color=color, label=label, ms=4)
        ctas = sorted({int(r["ctas"]) for r in sub if r["variant"] == "fused_symm"})
        for c in ctas:
            xs, ys = series("fused_symm", c)
            ax.plot(xs, ys, "-", color="tab:red", alpha=0.25 + 0.75 * ctas.index(c) / max(1, len(ctas) - 1),
                    lw=1, label=f"fused (ours) {c} CTAs")
        best = {}
        for r in sub:
            if r["variant"] == "fused_symm":
                t = int(r["T"])
                best[t] = min(best.get(t, math.inf), float(r["us"]))
        if best:
            xs = sorted(best)
            ax.plot(xs, [best[t] for t in xs], "-*", color="tab:red", lw=2, ms=7,
                    label="fused (ours), best CTA count")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("latency per call (us)")
        r0 = sub[0]
        ax.set_title(f"H={H}, bf16, {r0['world_size']}x {r0['gpu']}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle("all-reduce + residual add + RMSNorm")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[128, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--ctas", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--zc-ctas", type=int, default=32, help="CTAs of the pull-kernel rows")
    ap.add_argument("--explore-warps", action="store_true",
                    help="first time the push kernel at several num_warps (tuning aid)")
    ap.add_argument("--mode", choices=["graph", "eager"], default="graph",
                    help="time CUDA-graph replays (GPU time) or eager launches (default graph)")
    ap.add_argument("--full-ctas", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-tokens", type=int, default=1024,
                    help="run a correctness sanity check at this T (0: never)")
    ap.add_argument("--plot-only", metavar="CSV", help="redraw table + plot from a CSV")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.plot_only:
        with open(args.plot_only) as f:
            rows = list(csv.DictReader(f))
        print_table(rows)
        os.makedirs(args.out, exist_ok=True)
        plot(rows, os.path.join(args.out, PNG_NAME))
        return
    run(args)


if __name__ == "__main__":
    main()
