"""Per-CTA bandwidth of each SM phase of the push kernel, on ONE GPU with emulated ranks.

    python benchmarks/bench_comm_per_cta.py --out benchmarks/results

Two ranks are emulated in one process (``weave_compile.testing.emulated_ranks``): each rank's
buffers and signal pad are ordinary allocations, each rank's launch runs on its own stream, all
grids resident at once, the kernel's real barriers between them.  **A peer here is local HBM,
not NVLink**: these are the bytes one SM can move with the bytes it keeps in flight, an upper
bound for the NVLink case (higher latency needs more in flight still).

Phases are isolated by the kernel's ``PHASES`` constexpr (1 scatter, 2 reduce+norm, 4 gather;
7 all; 0 = the three block barriers alone): a run that keeps one phase still runs all three
barriers, so each phase's time includes them (the ``barriers`` rows show how much).  Bytes per
rank are counted as read + written (bf16, H columns, S rows per rank, N ranks):

* scatter: (N-1) shards read from x, written to the peers: ``2 (N-1) S H 2``;
* reduce+norm: reads x, N-1 partials, the residual; writes the residual (local, and to N-1
  peers unless sharded) and the normed rows (local and to N-1 peers);
* gather: N-1 peers' normed (and residual, unless sharded) rows read and written.

``gbps_per_cta`` = bytes / time / CTAs of one rank; ``timeouts`` counts barrier waits that hit
the spin limit during the point (0 expected).  Designs: ``push`` (today's launch shape,
:func:`weave_compile.kernels.p2p.launch.push_meta`: several tiles in flight per CTA; the add+norm
one warp per row at 2 ranks and 2048 <= H <= 4096, else the next tile prefetched into registers) and
``push_v1`` (the same kernel with the first push kernel's launch shape: the pull kernel's rows
per iteration, nothing unrolled or pipelined, :func:`push_v1_meta`), ``push_pipelined`` (the
shape before the add+norm prefetch: 16 warps, its add+norm loop a 3-stage ``tl.range``
cp.async pipeline, :func:`weave_compile.kernels.p2p.launch.pipelined_meta`), ``push_ring`` (``push``
leaving its normed output in ring slot 1, ``out_slot``: its gather phase copies nothing with a
sharded residual, so its ``gather`` rows time the barriers and its ``all`` row is the op without
the second copy of the peers' rows); ``--sweep`` adds
``push:<knob>`` rows (H=4096, 8 CTAs) with one knob of ``push`` changed (see ``SWEEP``).  Residual layout: sharded in and out (what a
compiled model runs between fused sites) unless ``--full-residual``.  CUDA-graph replays of
back-to-back calls (``benchmarks/common.py``'s Timer), median of repeats.
Target (issue 11): every SM phase >= 80 GB/s per CTA at 8 CTAs, H=4096, 4096 rows per rank.
Writes ``comm_per_cta.csv`` and ``comm_per_cta.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Timer, meta as run_meta, write_csv  # noqa: E402  (multicast off)

import torch  # noqa: E402

# A barrier that never completes becomes a counted timeout (reported below), not a hang.
os.environ.setdefault("WEAVE_SYMM_SPIN_LIMIT", str(1 << 24))

COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "design", "phase", "ctas", "rows_per_rank",
           "hidden", "world_size", "residual", "block_rows", "copy_unroll", "copy_stages",
           "norm_unroll", "norm_stages", "norm_prefetch", "norm_chunk", "norm_depth", "num_warps", "bytes", "us", "gbps_per_cta", "timeouts"]
PHASES = {"scatter": 1, "reduce_norm": 2, "gather": 4, "all": 7, "barriers": 0,
          "scatter+norm": 3, "norm+gather": 6}  # pairs: how the phases interact
TARGET = 80.0
#: ``--sweep`` (``--sweep-ctas``, default 8; ``--sweep-hidden``, default 4096): the push kernel with one knob changed, on the phases the knob affects
#: (name: (LaunchMeta overrides, phases)); block_rows changes apply to every phase's tiles.
_PREFETCH = dict(norm_chunk=0, norm_unroll=1, norm_prefetch=True, num_warps=16)
SWEEP = {  # the first entries time knobs of the copy phases, then of the pipelined add+norm loop
    "copy_u1": (dict(copy_unroll=1), ("scatter", "gather")),
    "copy_u2": (dict(copy_unroll=2), ("scatter", "gather")),
    "copy_u8": (dict(copy_unroll=8), ("scatter", "gather")),
    "copy_u1_s4": (dict(copy_unroll=1, copy_stages=4), ("scatter", "gather")),
    "copy_u2_s3": (dict(copy_unroll=2, copy_stages=3), ("scatter", "gather")),
    "norm_s1": (dict(norm_stages=1, norm_prefetch=False), ("reduce_norm",)),
    "norm_s2": (dict(norm_stages=2, norm_prefetch=False), ("reduce_norm",)),
    "norm_u2_s1": (dict(norm_unroll=2, norm_stages=1, norm_prefetch=False), ("reduce_norm",)),
    "norm_r4_s2": (dict(block_rows=4, norm_stages=2, norm_prefetch=False), ("reduce_norm",)),
    "norm_r1_s3": (dict(block_rows=1, norm_stages=3, norm_prefetch=False), ("reduce_norm",)),
    # fewer warps: fewer issue slots per row (SASS of the add+norm loop at H=4096, per row:
    # 16 warps 856, 8 warps 703, 4 warps 585 issue cycles), less latency hiding
    "norm_w8": (dict(num_warps=8, norm_prefetch=False), ("reduce_norm",)),
    "norm_w4": (dict(num_warps=4, norm_prefetch=False), ("reduce_norm",)),
    "norm_w8_r4": (dict(num_warps=8, block_rows=4, norm_prefetch=False), ("reduce_norm",)),
    "norm_w4_r1_s4": (dict(num_warps=4, block_rows=1, norm_stages=4, norm_prefetch=False), ("reduce_norm",)),
    # the same 8 warps in every phase (the warp count is the launch's, not one loop's)
    "w8_all": (dict(num_warps=8, norm_prefetch=False), ("scatter", "reduce_norm", "gather", "all")),
    # the register-prefetched add+norm loop (push's default before session 7: a [2, H] tile over
    # 16 warps, the next tile loaded before this one's math) and at other warp counts / tile rows
    "prefetch": (dict(_PREFETCH), ("scatter", "reduce_norm", "gather", "all")),
    "pf_w8": (dict(_PREFETCH, num_warps=8), ("reduce_norm",)),
    "pf_r1": (dict(_PREFETCH, block_rows=1), ("reduce_norm",)),
    # the one-warp-per-row loop (push's default at 2 ranks, 2048 <= H <= 4096) with fewer chunks ahead
    "rw_d6": (dict(norm_depth=6), ("reduce_norm", "all")),
    "rw_d4": (dict(norm_depth=4), ("reduce_norm", "all")),
}


def phase_bytes(phase: str, N: int, S: int, H: int, elem: int, sharded: bool, ring: bool = False) -> int:
    """Bytes read + written by ``phase``; ``ring``: the normed output stays in the output ring
    (``out_slot``), so the gather copies only a full residual."""
    tile = S * H * elem
    scatter = 2 * (N - 1) * tile
    reduce_norm = (N + 1) * tile + (1 + (0 if sharded else N - 1) + N) * tile
    gather = (N - 1) * ((0 if ring else 2) + (0 if sharded else 2)) * tile
    return {"scatter": scatter, "reduce_norm": reduce_norm, "gather": gather,
            "all": scatter + reduce_norm + gather, "barriers": 0, "scatter+norm": scatter + reduce_norm,
            "norm+gather": reduce_norm + gather}[phase]


def push_v1_meta(hidden: int, rows_per_rank: int, comm_ctas: int):
    """The push kernel's first launch shape, kept for comparison: the pull kernel's rows per
    iteration, no unrolling, no software pipelining."""
    from weave_compile.kernels.shared.shapes import launch_meta

    return launch_meta(hidden, rows_per_rank, comm_ctas)


def _points(args, H: int, S: int, N: int):
    """(design, meta, phases) to time at this hidden size."""
    import dataclasses

    from weave_compile.kernels.p2p import launch

    for design in args.designs:
        for ctas in args.ctas:
            if design == "push_v1":
                m = push_v1_meta(H, S, ctas)
            elif design == "push_pipelined":
                m = launch.pipelined_meta(H, S, ctas, N, 2, 2)
            else:
                m = launch.push_meta(H, S, ctas, N, 2, 2)
            yield design, m, args.phases
    if args.sweep and H in args.sweep_hidden:
        for ctas in args.sweep_ctas:
            bases = {True: launch.push_meta(H, S, ctas, N, 2, 2),  # knobs of the default shape
                     False: launch.pipelined_meta(H, S, ctas, N, 2, 2)}  # of the pipelined one
            for name, (over, phases) in SWEEP.items():
                if args.sweep_only and name not in args.sweep_only:
                    continue
                yield f"push:{name}", dataclasses.replace(bases[over.get("norm_prefetch", True)], **over), phases
                if args.sweep_ring and over.get("norm_prefetch", True):  # the same knob, output in the ring
                    yield (f"push_ring:{name}",
                           dataclasses.replace(bases[True], **over), phases)


def run(args) -> list:
    from weave_compile.testing.emulated_ranks import EmulatedRanks, push_allreduce_rmsnorm

    N, S = args.world, args.rows
    T = N * S
    dt = torch.bfloat16
    timer = Timer(args.repeats, args.warmup, graph=True)
    meta = run_meta(torch.device("cuda"))
    rows = []
    for H in args.hidden:
        ranks = EmulatedRanks.create(N, H, T, dtype=dt)
        g = torch.Generator(device="cuda").manual_seed(H)
        xs = [torch.randn(T, H, generator=g, device="cuda").to(dt) for _ in range(N)]
        sharded = not args.full_residual
        res = [torch.randn(S if sharded else T, H, generator=g, device="cuda").to(dt) for _ in range(N)]
        weight = torch.randn(H, generator=g, device="cuda").to(dt)
        outs = {}  # per output kind: fresh tensors, or the ring slot views (push_ring)
        timeouts_before = 0
        for design, m, phases in _points(args, H, S, N):
            ring = design.split(":")[0] == "push_ring"
            for phase in phases:
                def call(m=m, phase=phase, ring=ring):
                    outs[ring] = push_allreduce_rmsnorm(
                        ranks, xs, res, None, weight, residual_in_sharded=sharded,
                        residual_out_sharded=sharded, comm_ctas=m.grid, meta=m,
                        phases=PHASES[phase], outputs=outs.get(ring), out_slot=1 if ring else -1)

                try:
                    us = timer(call, args.iters)
                except Exception as e:  # a sweep shape that does not fit (shared memory, registers)
                    if ":" not in design or "OutOfResources" not in type(e).__name__:
                        raise
                    print(f"{design:18s} H={H:5d} ctas={m.grid:2d} {phase}: skipped ({e})", flush=True)
                    continue
                timeouts = ranks.barrier_state()[0]
                nbytes = phase_bytes(phase, N, S, H, 2, sharded, ring)
                gbps = nbytes / us / 1e3 / m.grid if nbytes else 0.0
                rows.append(dict(meta, design=design, phase=phase, ctas=m.grid, rows_per_rank=S,
                                 hidden=H, world_size=N, residual="sharded" if sharded else "full",
                                 block_rows=m.block_rows, copy_unroll=m.copy_unroll,
                                 copy_stages=m.copy_stages, norm_unroll=m.norm_unroll,
                                 norm_stages=m.norm_stages, norm_prefetch=int(m.norm_prefetch), norm_chunk=m.norm_chunk,
                                 norm_depth=m.norm_depth,
                                 num_warps=m.num_warps, bytes=nbytes, us=round(us, 2),
                                 gbps_per_cta=round(gbps, 1), timeouts=timeouts - timeouts_before))
                timeouts_before = timeouts
                print(f"{design:18s} H={H:5d} ctas={m.grid:2d} rows={m.block_rows} "
                      f"w{m.num_warps} copy u{m.copy_unroll}/s{m.copy_stages} "
                      f"norm {f'rowwise c{m.norm_chunk}/d{m.norm_depth}' if m.norm_chunk else 'prefetch' if m.norm_prefetch else f'u{m.norm_unroll}/s{m.norm_stages}'} "
                      f"{phase:12s} {us:9.1f} us {gbps:7.1f} GB/s/CTA"
                      + (f"  {rows[-1]['timeouts']} BARRIER TIMEOUTS" if rows[-1]["timeouts"] else ""),
                      flush=True)
                write_csv(os.path.join(args.out, "comm_per_cta.csv"), rows, COLUMNS)
        timeouts, pads = ranks.barrier_state()
        if timeouts or pads:
            print(f"# H={H}: {timeouts} barrier timeouts, {pads} pad slots not reset!", flush=True)
        ranks = xs = res = None  # free this H's buffers before the next H's; not del: `call` closes over them
    return rows


def plot(rows, path: str) -> None:
    """One panel per hidden size: GB/s per CTA over CTAs, a line per (design, phase)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except Exception as e:  # optional: the CSV is the result
        return print(f"# matplotlib unavailable ({e}); no plot")
    hs = sorted({int(r["hidden"]) for r in rows})
    fig, axes = pyplot.subplots(1, len(hs), figsize=(6.5 * len(hs), 4.5), squeeze=False)
    colors = {"scatter": "tab:blue", "reduce_norm": "tab:red", "gather": "tab:green", "all": "k"}
    for ax, H in zip(axes[0], hs):
        for (design, phase) in dict.fromkeys((r["design"], r["phase"]) for r in rows):
            if phase == "barriers":
                continue
            pts = sorted((int(r["ctas"]), float(r["gbps_per_cta"])) for r in rows
                         if int(r["hidden"]) == H and r["design"] == design and r["phase"] == phase)
            if pts and ":" not in design:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o" if design in ("push", "push_ring") else ":x",
                        color=colors.get(phase, "gray"), label=f"{design} {phase}")
        ax.axhline(TARGET, color="gray", lw=0.8, ls="--", label=f"target {TARGET:.0f} GB/s/CTA")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CTAs per rank")
        ax.set_ylabel("GB/s per CTA (read + written)")
        r0 = rows[0]
        ax.set_title(f"H={H}, {r0['rows_per_rank']} rows/rank, {r0['world_size']} emulated ranks "
                     f"(local HBM)\n{r0['gpu']}, commit {r0['git_commit']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rows", type=int, default=4096, help="rows per rank")
    ap.add_argument("--world", type=int, default=2, help="emulated ranks")
    ap.add_argument("--ctas", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--designs", nargs="+", default=["push", "push_ring", "push_pipelined", "push_v1"],
                    choices=["push", "push_ring", "push_pipelined", "push_v1"],
                    help="push_ring: the push kernel leaving its output in the ring (out_slot=1)")
    ap.add_argument("--phases", nargs="+", default=["scatter", "reduce_norm", "gather", "all", "barriers"],
                    choices=list(PHASES))
    ap.add_argument("--full-residual", action="store_true", help="residual in and out [T, H]")
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP variants")
    ap.add_argument("--sweep-hidden", type=int, nargs="+", default=[4096], help="hidden sizes of the sweep")
    ap.add_argument("--sweep-ctas", type=int, nargs="+", default=[8], help="CTA counts of the sweep")
    ap.add_argument("--sweep-only", nargs="+", choices=list(SWEEP), help="only these SWEEP variants")
    ap.add_argument("--sweep-ring", action="store_true",
                    help="also time each SWEEP variant of the default shape with the output in the ring (push_ring:<knob>)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--plot-only", metavar="CSV", help="redraw the plot from a CSV")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            rows = list(csv.DictReader(f))
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU")
        rows = run(args)
    plot(rows, os.path.join(args.out, "comm_per_cta.png"))
    best = {}
    for r in rows:
        if int(r["hidden"]) == 4096 and int(r["ctas"]) == 8 and r["phase"] in ("scatter", "reduce_norm", "gather"):
            best.setdefault(r["design"], []).append(f"{r['phase']} {float(r['gbps_per_cta']):.1f}")
    for design, items in best.items():
        print(f"# H=4096, 8 CTAs, {design}: " + ", ".join(items) + f" GB/s/CTA (target >= {TARGET:.0f})")


if __name__ == "__main__":
    main()
