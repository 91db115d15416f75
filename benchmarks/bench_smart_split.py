"""The split point on the GEMMs that run: unsplit / equal / smart / best swept split, one GPU.

Issue 12's table. For three per-rank GEMM shape sets (no communication: what is timed is the
split's own GEMM cost), at T = 512..16384 tokens:

* ``70b_ffn_tp8``: Llama-70B FFN at TP=8 (gate/up 7168x8192, down 8192x3584), TokenWeave's Fig. 9;
* ``8b_layer_tp2``: Llama-8B layer at TP=2 (QKV 3072x4096, O 4096x2048 | gate/up 14336x4096,
  down 4096x7168; ``|`` marks the fused site between the two segments);
* ``8b_ffn_tp2``: Llama-8B FFN at TP=2.

Variants, each its own CUDA graph of ``iters`` back-to-back layer GEMM sequences (``N x K`` is
the weight, ``mm(x, w.t())`` as Inductor calls cuBLAS for ``nn.Linear``), timed by
``common.Timer`` (median of replays):

* ``unsplit``: every GEMM at T rows;
* split at ``s``: per segment, A's GEMMs at ``s`` rows then B's at ``T - s`` (the order the split
  pass schedules them); ``equal`` = ``T // 2``; ``smart`` = ``smart_split.plan`` with cuBLAS curves
  measured in this process (a fresh cache folder per T: the cold compile-time cost), attention
  width 0 (no attention is timed here) and the fused op's comm model for the set's hidden size
  and sites; ``dyn`` = the symbolic-T expression ``near_half``; ``formula`` = the chooser on the
  SM formula; the sweep: every multiple of 64 in [T/4, 3T/4] (``best`` = its fastest).
* **Final, side by side.** The sweep's points are timed one after another, and an H200 running
  bf16 GEMMs back to back drifts by a few percent over seconds (clocks under the power limit), so
  the minimum of a ~100-point sweep is biased low. The reported times therefore come from
  ``--rounds`` interleaved rounds over the finalists (unsplit, equal, smart, dyn, formula and the
  sweep's 5 fastest points), one fresh CUDA graph timing each per round, median over rounds;
  ``best`` is the fastest finalist on the sweep's grid. ``sweep_best_*`` keep the raw sweep minimum
  and ``spread`` the median over finalists of (max - min) / median across rounds (the noise).

Also measured per T: the chooser's wall time with a cold cache and again on a cache hit.

    python benchmarks/bench_smart_split.py --out benchmarks/results       # one GPU
    python benchmarks/bench_smart_split.py --dry-run                       # CPU: exercises the code

Writes ``smart_split.csv`` (after every T), ``smart_split_sweep.csv`` (every swept point) and
``smart_split.png`` (bars: time; line: normalized to unsplit).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Timer, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402

#: name -> (segments of (N, K) GEMMs, fused op hidden size, fused sites)
SHAPES = {
    "70b_ffn_tp8": ((((7168, 8192), (8192, 3584)),), 8192, 1),
    "8b_layer_tp2": ((((3072, 4096), (4096, 2048)), ((14336, 4096), (4096, 7168))), 4096, 2),
    "8b_ffn_tp2": ((((14336, 4096), (4096, 7168)),), 4096, 1),
}
TOKENS = "512,768,1024,1280,1536,1792,2048,2560,3072,3584,4096,5120,6144,8192,10240,12288,16384"
COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "shape", "T", "unsplit_ms", "equal_ms", "smart_ms",
           "smart_at", "best_ms", "best_at", "dyn_ms", "dyn_at", "formula_ms", "formula_at", "sweep_best_ms",
           "sweep_best_at", "sweep_smart_ms", "spread", "rounds", "smart_source", "plan_cold_s", "measure_cold_s",
           "plan_cached_s", "measure_cached_s", "iters"]
SWEEP_COLUMNS = ["gpu", "git_commit", "shape", "T", "split_at", "ms"]


class Layer:
    """The shape set's weights and inputs, big enough for ``tmax`` rows."""

    def __init__(self, segments, tmax: int, device, dtype):
        gen = torch.Generator(device=device).manual_seed(0)
        self.segments = [[(torch.randn(tmax, k, device=device, dtype=dtype, generator=gen),
                           torch.randn(n, k, device=device, dtype=dtype, generator=gen).t(),
                           torch.empty(tmax, n, device=device, dtype=dtype)) for n, k in seg] for seg in segments]

    def run(self, t: int, s: int = 0) -> None:
        """One layer: unsplit (``s == 0``) or A = rows [0, s), B = rows [s, t), per segment."""
        for seg in self.segments:
            for lo, hi in (((0, t),) if s == 0 else ((0, s), (s, t))):
                for x, wt, out in seg:
                    torch.mm(x[lo:hi], wt, out=out[lo:hi])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--repeats", type=int, default=2, help="replays per sweep point")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the finalists")
    ap.add_argument("--target-ms", type=float, default=2.0, help="iters per graph: about this much GPU time")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny T: runs every code path, times nothing real")
    args = ap.parse_args()

    from weave_compile.passes.split_tokens import smart_split as ss

    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    dtype = torch.float32 if dry else torch.bfloat16
    ts = [256, 320] if dry else [int(v) for v in args.tokens.split(",")]
    meta = run_meta(None if dry else device)
    rows, sweep_rows = [], []
    out_name = "smart_split_dryrun" if dry else "smart_split"
    path = os.path.join(args.out, out_name + ".csv")
    sweep_path = os.path.join(args.out, out_name + "_sweep.csv")

    def timed(fn, iters):
        if dry:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t0) * 1e3 / iters
        return Timer(repeats=args.repeats, warmup=1, graph=True)(fn, iters) / 1e3

    def timed1(fn, iters):
        return timed(fn, iters) if dry else Timer(repeats=1, warmup=1, graph=True)(fn, iters) / 1e3

    for name in args.shapes.split(","):
        segments, hidden, sites = SHAPES[name]
        gemms = tuple(g for seg in segments for g in seg)
        if dry:
            gemms = tuple((n // 64, k // 64) for n, k in gemms)
            segments = tuple(tuple((n // 64, k // 64) for n, k in seg) for seg in segments)
        shape = ss.LayerShape(gemms=gemms, hidden=hidden, sites=sites)
        layer = Layer(segments, max(ts), device, dtype)
        with torch.no_grad():
            for t in ts:
                unsplit_est = timed(lambda: layer.run(t), 1)
                iters = 1 if dry else max(2, min(50, round(args.target_ms / max(unsplit_est, 1e-3))))
                with tempfile.TemporaryDirectory(prefix="gemm_cost_") as cache:
                    t0 = time.perf_counter()
                    smart = ss.plan(t, shape, cost="measured", device=device, dtype=dtype, cache_folder=cache)
                    plan_cold = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    cached = ss.plan(t, shape, cost="measured", device=device, dtype=dtype, cache_folder=cache)
                    plan_cached = time.perf_counter() - t0
                formula = ss.plan(t, shape, cost="formula", device=device)
                sweep = {s: timed(lambda: layer.run(t, s), iters) for s in ss.candidates(t)}
                for s in (t // 2, smart.at, ss.near_half(t), formula.at):
                    if s not in sweep:  # off the grid (T not a multiple of 128): its own graph
                        sweep[s] = timed(lambda: layer.run(t, s), iters)
                sweep_best = min(ss.candidates(t), key=sweep.__getitem__)
                top = sorted(ss.candidates(t), key=sweep.__getitem__)[:5]
                finalists = list(dict.fromkeys([0, t // 2, smart.at, ss.near_half(t), formula.at, *top]))
                times = {s: [] for s in finalists}
                for _ in range(args.rounds):
                    for s in finalists:
                        times[s].append(timed1(lambda: layer.run(t, s), iters))
                med = {s: statistics.median(v) for s, v in times.items()}
                spread = statistics.median((max(v) - min(v)) / statistics.median(v) for v in times.values())
                best_at = min((s for s in finalists if s in ss.candidates(t)), key=med.__getitem__)
                unsplit = med[0]
                row = {**meta, "shape": name, "T": t, "unsplit_ms": f"{unsplit:.4f}",
                       "equal_ms": f"{med[t // 2]:.4f}", "smart_ms": f"{med[smart.at]:.4f}", "smart_at": smart.at,
                       "best_ms": f"{med[best_at]:.4f}", "best_at": best_at,
                       "dyn_ms": f"{med[ss.near_half(t)]:.4f}", "dyn_at": ss.near_half(t),
                       "formula_ms": f"{med[formula.at]:.4f}", "formula_at": formula.at,
                       "sweep_best_ms": f"{sweep[sweep_best]:.4f}", "sweep_best_at": sweep_best,
                       "sweep_smart_ms": f"{sweep[smart.at]:.4f}", "spread": f"{spread:.4f}", "rounds": args.rounds,
                       "smart_source": smart.source, "plan_cold_s": f"{plan_cold:.3f}",
                       "measure_cold_s": f"{smart.measure_s:.3f}", "plan_cached_s": f"{plan_cached:.4f}",
                       "measure_cached_s": f"{cached.measure_s:.3f}", "iters": iters}
                assert cached.at == smart.at, (cached, smart)  # the cache gives the same answer
                rows.append(row)
                sweep_rows += [{"gpu": meta["gpu"], "git_commit": meta["git_commit"], "shape": name, "T": t,
                                "split_at": s, "ms": f"{ms:.4f}"} for s, ms in sorted(sweep.items())]
                print(f"{name:13s} T={t:6d} unsplit {unsplit:.4f} equal {med[t // 2]:.4f} smart@{smart.at} "
                      f"{med[smart.at]:.4f} best@{best_at} {med[best_at]:.4f} dyn {med[ss.near_half(t)]:.4f} "
                      f"| sweep best@{sweep_best} {sweep[sweep_best]:.4f} spread {spread:.4f} "
                      f"| cold {plan_cold:.2f}s (measure {smart.measure_s:.2f}s) cached {plan_cached * 1e3:.1f}ms",
                      flush=True)
                write_csv(path, rows, COLUMNS)
                write_csv(sweep_path, sweep_rows, SWEEP_COLUMNS)
        layer = None  # free this shape's tensors before the next's; not del: the lambdas close over it
        if not dry:
            torch.cuda.empty_cache()
    summarize(rows)
    try:
        plot(rows, os.path.join(args.out, out_name + ".png"))
    except Exception as e:  # the CSV is the result; a missing matplotlib is not fatal
        print("plot skipped:", e)


def summarize(rows) -> None:
    f = lambda r, k: float(r[k])  # noqa: E731
    for name in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == name]
        sb = [f(r, "smart_ms") / f(r, "best_ms") for r in rs]
        ssb = [f(r, "sweep_smart_ms") / f(r, "sweep_best_ms") for r in rs]
        se = [f(r, "smart_ms") / f(r, "equal_ms") for r in rs]
        db = [f(r, "dyn_ms") / f(r, "smart_ms") for r in rs]
        noise = [f(r, "spread") for r in rs]
        print(f"{name}: smart/best median {statistics.median(sb):.3f} max {max(sb):.3f} (raw sweep: median "
              f"{statistics.median(ssb):.3f} max {max(ssb):.3f}); smart/equal max {max(se):.3f}; "
              f"equal/unsplit max {max(f(r, 'equal_ms') / f(r, 'unsplit_ms') for r in rs):.3f}; "
              f"best/unsplit max {max(f(r, 'best_ms') / f(r, 'unsplit_ms') for r in rs):.3f}; "
              f"dyn/smart median {statistics.median(db):.3f} max {max(db):.3f}; round spread median "
              f"{statistics.median(noise):.4f} max {max(noise):.4f}; cold plan max "
              f"{max(f(r, 'plan_cold_s') for r in rs):.2f}s, cached max {max(f(r, 'plan_cached_s') for r in rs):.4f}s")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(names), 1, figsize=(13, 3.6 * len(names)), squeeze=False)
    variants = [("unsplit_ms", "unsplit"), ("equal_ms", "equal halves"), ("smart_ms", "smart"),
                ("best_ms", "best swept"), ("dyn_ms", "symbolic-T near-half")]
    for ax, name in zip(axes[:, 0], names):
        rs = [r for r in rows if r["shape"] == name]
        x = range(len(rs))
        width = 0.8 / len(variants)
        twin = ax.twinx()
        for i, (key, label) in enumerate(variants):
            ys = [float(r[key]) for r in rs]
            ax.bar([p + (i - len(variants) / 2 + 0.5) * width for p in x], ys, width, label=label)
            twin.plot(list(x), [y / float(r["unsplit_ms"]) for y, r in zip(ys, rs)], "o-", markersize=3)
        ax.set_yscale("log")
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{r['T']}\n@{r['smart_at']}" for r in rs], fontsize=7)
        ax.set_ylabel("ms per layer (GEMMs)")
        twin.set_ylabel("/ unsplit (lines)")
        twin.axhline(1.0, color="gray", lw=0.5)
        ax.set_title(f"{name}: {rows[0]['gpu']}, bars = time, lines = time / unsplit; x: T and smart split point",
                     fontsize=9)
        ax.legend(fontsize=7, ncol=len(variants), loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


if __name__ == "__main__":
    main()
