"""Phases of the ``ce`` design on ONE GPU, 2 ranks emulated in one process; and the whole op vs push.

    python benchmarks/bench_comm_ce.py --out benchmarks/results          # one GPU

Rows of ``comm_per_cta_ce.csv`` (``comm_per_cta.csv``'s columns; bytes = read + written, bf16,
sharded residual in and out, the layout compiled models run, ``rows_per_rank`` rows each):

* ``ce / addnorm``: the only SM phase, the add+norm kernel of one rank (x, the peer's slot and the
  residual shard in; residual shard and normed rows out) at 2..32 CTAs; ``gbps_per_cta`` is bytes
  / time / CTAs. ``ce_cfg:rRsSwW / addnorm``: the launch-shape sweep at ``--sweep-ctas`` CTAs
  (R rows per iteration, S pipeline stages, W warps) that the default shape was chosen from.
* ``ce / push_copy``, ``ce / pull_copies``: the copy-engine phases (``ctas`` 0: no SM; the column
  ``gbps_per_cta`` then holds the phase's total GB/s). Emulated peers are local HBM, not NVLink:
  these are device-to-device copy rates, not NVLink rates.
* ``ce / whole_op`` and ``p2p_push / whole_op``: one call of every emulated rank (each on its own
  stream, all in one CUDA graph, ``copy_engine.emulated_run``), the copy-engine op vs the current
  p2p push kernel with the same CTA budget; ``gbps_per_cta`` empty. Both ranks share one GPU, so
  each gets half of its HBM. ``ce_watched / whole_op``: the same on workspaces the watchdog
  watches, as in production (a progress mark per wait, the abort word read by the add+norm
  kernel): what the bounded wait costs on the fast path (``--no-watch`` skips it).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Timer, meta, write_csv  # noqa: E402  (sets the no-multicast variables)

import torch  # noqa: E402

from weave_compile.kernels.ce import copy_engine as ce  # noqa: E402
from weave_compile.kernels.ce.watchdog import Watchdog  # noqa: E402
from weave_compile.kernels.shared import addnorm  # noqa: E402
from weave_compile.kernels.spec import FusedSpec, Rows  # noqa: E402

COLUMNS = ["gpu", "design", "phase", "ctas", "rows_per_rank", "hidden", "us", "gbps_per_cta",
           "torch", "triton", "git_commit", "date"]
SWEEP = [(1, 1, 8), (2, 1, 8), (4, 1, 16), (1, 3, 8), (2, 2, 8), (2, 3, 8), (2, 4, 8), (4, 2, 16),
         (4, 3, 16), (2, 3, 16), (1, 4, 4), (8, 2, 16),
         # (rows, -, warps, prefetch): the register-prefetched loop (the push kernel's, session 5)
         (1, 1, 8, True), (2, 1, 8, True), (1, 1, 16, True), (2, 1, 16, True), (4, 1, 16, True),
         # (rows, -, warps, -, chunk, depth): one warp per row, chunks loaded `depth` ahead (session 7)
         (8, 1, 8, False, 256, 8), (8, 1, 8, False, 256, 6), (8, 1, 8, False, 256, 4), (4, 1, 4, False, 256, 8)]


def bytes_moved(hidden: int, rows: int, slots: int, in_bytes: int, res_bytes: int, out_bytes: int,
                has_residual: bool) -> int:
    """HBM bytes read + written by one add+norm launch (for its per-CTA bandwidth)."""
    reads = rows * hidden * (in_bytes * (1 + slots) + (res_bytes if has_residual else 0))
    writes = rows * hidden * (res_bytes + out_bytes)
    return reads + writes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--rows-per-rank", type=int, default=4096)
    ap.add_argument("--ctas", default="2,4,8,16,32")
    ap.add_argument("--sweep-ctas", type=int, default=8)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-push", action="store_true")
    ap.add_argument("--no-watch", action="store_true", help="skip the watched workspaces' whole op")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    path = os.path.join(args.out, "comm_per_cta_ce.csv")
    m = meta()
    rows: list[dict] = []
    timer = Timer(repeats=5, warmup=2, graph=True)
    N, S, dt = 2, args.rows_per_rank, torch.bfloat16
    T = N * S
    ctas_list = [int(c) for c in args.ctas.split(",")]

    def emit(design, phase, ctas, H, us, nbytes):
        gb = "" if nbytes is None else round(nbytes / (us * 1e3) / max(1, ctas), 2)
        rows.append(dict(m, design=design, phase=phase, ctas=ctas, rows_per_rank=S, hidden=H, us=round(us, 2),
                         gbps_per_cta=gb))
        write_csv(path, rows, COLUMNS)
        print(f"{design:>16} {phase:>12} H={H} ctas={ctas:>2} {us:9.1f} us  {gb} GB/s{'' if ctas else ' (total)'}",
              flush=True)

    for H in [int(h) for h in args.hidden.split(",")]:
        wss = ce.emulated_workspaces(N, S, H, (dt, dt, dt), device="cuda", poison=False)
        for ws in wss:
            for t in (ws.regions[ws.rank].recv, ws.regions[ws.rank].out, ws.regions[ws.rank].res):
                t.normal_()
        xs = [torch.randn(T, H, device="cuda").to(dt) for _ in range(N)]
        res_sh = [torch.randn(S, H, device="cuda").to(dt) for _ in range(N)]
        weight = torch.randn(H, device="cuda").to(dt)
        normed = torch.empty(T, H, device="cuda", dtype=dt)
        res_out = torch.empty(S, H, device="cuda", dtype=dt)
        me = wss[0].regions[0]
        nbytes = bytes_moved(H, S, N - 1, 2, 2, 2, True)

        def norm_fn(ctas, cfg):
            return lambda: addnorm.add_rmsnorm_rows(xs[0][:S], me.recv[:N - 1], res_sh[0], None, weight, None, me.out,
                                                    res_out, n_valid=S, eps=1e-6, mid_dtype=None, weight_offset=0.0,
                                                    num_ctas=ctas, config=cfg)

        best_cfg, best_us = addnorm.launch_config(H, slots=N - 1), None
        if not args.no_sweep:
            for shape in SWEEP:
                cfg = addnorm.LaunchConfig(*shape)
                r_, s_, w_ = shape[:3]
                try:
                    us = timer(norm_fn(args.sweep_ctas, cfg), args.iters)
                except Exception as e:  # e.g. out of shared memory for deep pipelines of wide rows
                    print(f"config {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                emit(f"ce_cfg:r{r_}{f'c{cfg.chunk}d{cfg.depth}' if cfg.chunk else 'p' if cfg.prefetch else f's{s_}'}w{w_}", "addnorm", args.sweep_ctas, H, us,
                     nbytes)
                if best_us is None or us < best_us:
                    best_cfg, best_us = cfg, us
            print(f"H={H}: best add+norm shape at {args.sweep_ctas} CTAs: {best_cfg}", flush=True)
        for c in ctas_list:
            emit("ce", "addnorm", c, H, timer(norm_fn(c, best_cfg), args.iters), nbytes)

        # Copy-engine phases (no SM): one push of our partial of the peer's rows, and the pulls.
        peer = wss[1].regions[1]
        emit("ce", "push_copy", 0, H, timer(lambda: peer.recv[0, :S].copy_(xs[0][S:2 * S]), args.iters),
             2 * S * H * 2)

        def pulls():
            for p in range(N):
                normed[p * S:(p + 1) * S].copy_(wss[0].regions[p].out[:S])
        emit("ce", "pull_copies", 0, H, timer(pulls, args.iters), 2 * N * S * H * 2)

        # The whole op, both emulated ranks, each on its own stream; then on watched workspaces.
        streams = [torch.cuda.Stream() for _ in range(N)]
        rank_rows = [Rows(xs[r], res_sh[r], None, weight) for r in range(N)]
        designs = [("ce", wss)]
        if not args.no_watch:
            watched = ce.emulated_workspaces(N, S, H, (dt, dt, dt), device="cuda", poison=False)
            try:
                Watchdog(timeout_s=600).watch(watched)  # not started: marks and the abort word only
                designs.append(("ce_watched", watched))
            except RuntimeError as e:  # the device cannot write host-mapped words: no watched rows
                print(f"ce_watched skipped: {e}", flush=True)
        for design, spaces in designs:
            for c in ctas_list:
                spec = FusedSpec(residual_dtype=dt, out_dtype=dt, eps=1e-6, residual_in_sharded=True,
                                 residual_out_sharded=True, comm_ctas=c)
                fn = lambda spaces=spaces, spec=spec: ce.emulated_run(spaces, rank_rows, spec, streams,  # noqa: E731
                                                                      config=best_cfg)
                emit(design, "whole_op", c, H, timer(fn, args.iters), None)
        if not args.no_push:  # the current push kernel, through helper kern's emulated-rank harness
            from weave_compile.testing.emulated_ranks import EmulatedRanks, push_allreduce_rmsnorm

            pr = EmulatedRanks.create(N, H, T, dtype=dt, device="cuda")
            outs = push_allreduce_rmsnorm(pr, xs, res_sh, None, weight, residual_in_sharded=True,
                                          residual_out_sharded=True, comm_ctas=ctas_list[0])
            for c in ctas_list:
                fn = lambda c=c: push_allreduce_rmsnorm(pr, xs, res_sh, None, weight, residual_in_sharded=True,  # noqa: E731
                                                        residual_out_sharded=True, comm_ctas=c, outputs=outs)
                emit("p2p_push", "whole_op", c, H, timer(fn, args.iters), None)
            timeouts, stuck = pr.barrier_state()
            if timeouts or stuck:
                print(f"push kernel: {timeouts} barrier timeouts, {stuck} pad slots left set: its times are not valid",
                      flush=True)
        torch.cuda.empty_cache()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
