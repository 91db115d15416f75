"""What ``batch_invariant`` costs the fused op, and whether a row comes out the same, on ONE GPU.

    python benchmarks/bench_batch_invariant.py --out benchmarks/results
    python benchmarks/bench_batch_invariant.py --world 2,4 --hidden 4096 --tokens 1,1024

The op alone (``weave::allreduce_add_rmsnorm``), per implementation that claims the option
(``nccl``; ``reference`` with ``--designs nccl,reference``), with and without ``batch_invariant``:
bf16, hidden ``--hidden`` (default 4096, 8192), the residual sharded in and out (an interior
site's layout), T = ``--tokens``, each point ``--calls`` calls captured in one CUDA graph and its
replays timed (median of ``--repeats``; the two variants alternate, ``--rounds`` rounds, the median
of the per-round ratios). On PyTorch's fake process group of ``--world`` ranks (this process is
rank 0; :mod:`fake_group`): the collectives move nothing and write real rows
(``fake_group.written_collectives``, the all-to-all included: every peer's partial rows of this
rank's slice are this rank's own), so what is timed is the local part: the invariant path's
all-to-all output read back and summed in rank order in fp32 (N partial rows per row, one
rounding) against the reduce-scatter path. What the all-to-all costs on the wire against a
reduce-scatter (the same bytes) needs two GPUs.

``ce`` (``--designs nccl,ce``): its copies move the same bytes with or without the option, so what
the mode changes is its add+norm kernel (the rank-order sum of the N-1 received slots and its own
partial, on the pipelined row tile at every T, against the default launch shape, the one warp per
row from 8 rows per CTA on): that kernel is timed alone on this rank's S = ceil(T/N) rows and N-1
received slots (32 CTAs, this rank the last, whose own partial is added last in rank order).

Checked at every point: rows 0, S-1 and one drawn row of this rank's slice of a T-row call equal,
bit for bit, the same row run in a call of its own (the add+norm kernel's launch differs with T);
``invariant`` is that check's verdict (with the option: must be ``yes``).

Writes ``batch_invariant.csv`` and ``batch_invariant.png`` (time with the option over without, per
T, one line per design, world size and hidden size). NVLink multicast stays off (common.py).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Timer, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402

COLUMNS = ["gpu", "design", "world_size", "hidden", "T", "us_default", "us_invariant", "ratio", "invariant",
           "torch", "triton", "git_commit", "date"]


def _op(design: str, x, residual, weight, group_name: str, invariant: bool):
    return torch.ops.weave.allreduce_add_rmsnorm(
        x, residual=residual, bias=None, weight=weight, eps=1e-6, group_name=group_name,
        residual_dtype=x.dtype, out_dtype=x.dtype, mid_dtype=None, weight_offset=0.0,
        residual_in_sharded=True, residual_out_sharded=True, kernel=design, comm_ctas=32,
        batch_invariant=invariant)[:2]


def _inputs(T: int, H: int, world: int, seed: int, dev):
    g = torch.Generator(device=dev).manual_seed(seed)
    S = -(-T // world)
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    residual = torch.randn(S, H, generator=g, device=dev).to(torch.bfloat16)
    return x, residual


def _ce_inputs(T: int, H: int, world: int, seed: int, dev):
    """This rank's S rows of its own partial, the N-1 received slots, the residual shard."""
    g = torch.Generator(device=dev).manual_seed(seed)
    S = -(-T // world)
    x = torch.randn(S, H, generator=g, device=dev).to(torch.bfloat16)
    recv = torch.randn(world - 1, S, H, generator=g, device=dev).to(torch.bfloat16)
    residual = torch.randn(S, H, generator=g, device=dev).to(torch.bfloat16)
    return x, recv, residual


def _ce_addnorm(x, recv, residual, weight, invariant: bool):
    """ce's SM phase on these rows: the add+norm kernel as its program launches it (the last rank's
    rank order with the option)."""
    from weave_compile.kernels.shared import addnorm

    normed, res = torch.empty_like(x), torch.empty_like(residual)
    addnorm.add_rmsnorm_rows(x, recv, residual, None, weight, None, normed, res, n_valid=x.shape[0], eps=1e-6,
                             mid_dtype=None, weight_offset=0.0, num_ctas=32,
                             rank_order=recv.shape[0] if invariant else None)
    return normed, res


def row_check(design: str, T: int, H: int, world: int, weight, group_name: str, dev, seed: int = 1) -> bool:
    """Rows of this rank's slice of a T-row call against the same rows alone, bit for bit (inputs
    drawn from ``seed``)."""
    if design == "ce":
        x, recv, residual = _ce_inputs(T, H, world, seed, dev)
        normed, res = _ce_addnorm(x, recv, residual, weight, True)
        S = x.shape[0]
        for p in sorted({0, S - 1, random.Random(T).randrange(S)}):
            n1, r1 = _ce_addnorm(x[p:p + 1], recv[:, p:p + 1].contiguous(), residual[p:p + 1], weight, True)
            if not (torch.equal(normed[p], n1[0]) and torch.equal(res[p], r1[0])):
                return False
        return True
    x, residual = _inputs(T, H, world, seed, dev)
    normed, res = _op(design, x, residual, weight, group_name, True)
    S = residual.shape[0]
    rows = sorted({0, S - 1, random.Random(T).randrange(S)})
    for p in rows:
        n1, r1 = _op(design, x[p:p + 1], residual[p:p + 1], weight, group_name, True)
        if not (torch.equal(normed[p], n1[0]) and torch.equal(res[p], r1[0])):
            return False
    return True


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", default="nccl")
    ap.add_argument("--world", default="2,4,8", help="fake group sizes")
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--tokens", default="1,16,128,1024,4096,8192,16384")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)

    import fake_group
    import weave_compile.ops  # noqa: F401  (registers the op)

    meta = run_meta()
    rows: list[dict] = []
    path = os.path.join(args.out, "batch_invariant.csv")
    for world, dev, group_name in fake_group.each_world(int(w) for w in args.world.split(",")):
        for H in [int(h) for h in args.hidden.split(",")]:
            weight = (1 + 0.1 * torch.randn(H, device=dev)).to(torch.bfloat16)
            for design in args.designs.split(","):
                for T in [int(t) for t in args.tokens.split(",")]:
                    if design == "ce":
                        x, recv, residual = _ce_inputs(T, H, world, 0, dev)

                        def call(inv, x=x, recv=recv, residual=residual):
                            return _ce_addnorm(x, recv, residual, weight, inv)
                    else:
                        x, residual = _inputs(T, H, world, 0, dev)

                        def call(inv, x=x, residual=residual, design=design):
                            return _op(design, x, residual, weight, group_name, inv)
                    ok = row_check(design, T, H, world, weight, group_name, dev)
                    times = {False: [], True: []}
                    for r in range(args.rounds):
                        for inv in ((False, True) if r % 2 == 0 else (True, False)):
                            times[inv].append(Timer(args.repeats)(lambda inv=inv: call(inv), args.calls))
                    ratio = statistics.median(b / a for a, b in zip(times[False], times[True]))
                    row = {**meta, "design": design, "world_size": world, "hidden": H, "T": T,
                           "us_default": f"{statistics.median(times[False]):.2f}",
                           "us_invariant": f"{statistics.median(times[True]):.2f}", "ratio": f"{ratio:.3f}",
                           "invariant": "yes" if ok else "NO"}
                    rows.append(row)
                    print(f"{design} N={world} H={H} T={T:6d}: {row['us_default']} -> {row['us_invariant']} us "
                          f"({ratio:.3f}x), rows invariant: {row['invariant']}", flush=True)
                    write_csv(path, rows, COLUMNS)
    plot(rows, path[:-4] + ".png")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["design"], r["world_size"], r["hidden"]) for r in rows}):
        pts = [r for r in rows if (r["design"], r["world_size"], r["hidden"]) == key]
        ax.plot([r["T"] for r in pts], [float(r["ratio"]) for r in pts], marker="o", ms=3,
                label=f"{key[0]} N={key[1]} H={key[2]}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("op time with batch_invariant / without")
    m = rows[0]
    ax.set_title(f"batch_invariant's cost, op alone, fake group (local part): {m['gpu']}, commit {m['git_commit']}",
                 fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
