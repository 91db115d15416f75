"""What one SM can read and write per second: the ceiling of every SM phase of the fused op.

    python benchmarks/bench_sm_ceiling.py --out benchmarks/results          # ONE GPU

The fused op's SM phases (the ``p2p`` kernel's scatter, add+norm and gather; ``ce``'s add+norm)
are judged in GB/s per CTA (``bench_comm_per_cta.py``, ``bench_comm_ce.py``).  This benchmark gives
the number to judge them against: the same traffic without any math, from kernels that do nothing
but stream.  At 2 ranks with a sharded residual the add+norm phase reads 3 and writes 3 rows per
row of output (``r3w3`` below); if a phase moves close to its ``rNwM`` row, its loop is not what
holds it back.

Grid-stride kernels over ``[S, H]`` bf16 buffers, one CTA per SM, ``[BR, H]`` tiles, the next
tile's loads issued before this tile's stores (the ``p2p`` kernel's register prefetch):

* ``rNw0``: N buffers read, summed in registers (one fp32 value per row block written at the end,
  so nothing is dead code; those bytes are not counted);
* ``r0wM``: M buffers written (values from the element index, nothing read);
* ``rNwM``: N buffers read, their sum written to M buffers (``r1w1`` is a copy).

Bytes are read + written, as in ``bench_comm_per_cta.py``; ``gbps_per_cta`` = bytes / time / CTAs.
Each point's outputs are poisoned (NaN) first and checked bit-exactly against torch (``ok``); a
point whose buffers all fit in L2 (``l2_fits``) measures L2, not HBM.  Times: ``common.Timer``,
median of ``--repeats`` CUDA-graph replays of ``--iters`` calls.  Writes ``sm_ceiling.csv`` (after
every point) and ``sm_ceiling.png``; exits non-zero if any output was wrong.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Timer, meta, write_csv  # noqa: E402  (sets the no-multicast variables)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: (reads, writes) per row; r3w3 is the add+norm phase's traffic at 2 ranks, sharded residual.
KINDS = [(3, 0), (1, 0), (0, 1), (0, 3), (1, 1), (3, 1), (1, 3), (3, 3), (2, 2)]
#: (tile rows, warps): the launch shapes of the fused op's phases.
SHAPES = [(1, 8), (2, 8), (2, 16), (4, 16)]
COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "kind", "reads", "writes", "ctas", "rows",
           "hidden", "block_rows", "num_warps", "bytes", "l2_fits", "us", "gbps_per_cta", "ok"]


@triton.jit
def rw_kernel(I0, I1, I2, O0, O1, O2, SINK, S, H: tl.constexpr, BR: tl.constexpr, NR: tl.constexpr,
              NW: tl.constexpr):
    """NR inputs read (0-3), NW outputs written (0-3); the next tile's loads before this tile's stores."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BR
    cols = tl.arange(0, H)
    rows = pid * BR + tl.arange(0, BR)
    m = (rows < S)[:, None]
    off = rows[:, None] * H + cols[None, :]
    a0 = tl.load(I0 + off, mask=m, other=0.)
    if NR >= 2:
        a1 = tl.load(I1 + off, mask=m, other=0.)
    if NR >= 3:
        a2 = tl.load(I2 + off, mask=m, other=0.)
    acc = tl.zeros([BR, H], tl.float32)
    for j in tl.range(pid * BR, S, step, num_stages=1):
        c0 = a0
        if NR >= 2:
            c1 = a1
        if NR >= 3:
            c2 = a2
        crow = j + tl.arange(0, BR)
        cm = (crow < S)[:, None]
        coff = crow[:, None] * H + cols[None, :]
        rows = j + step + tl.arange(0, BR)
        m = (rows < S)[:, None]
        off = rows[:, None] * H + cols[None, :]
        if NR >= 1:
            a0 = tl.load(I0 + off, mask=m, other=0.)
        if NR >= 2:
            a1 = tl.load(I1 + off, mask=m, other=0.)
        if NR >= 3:
            a2 = tl.load(I2 + off, mask=m, other=0.)
        if NR == 0:
            v = (coff % 251).to(tl.bfloat16)
        else:
            s = c0.to(tl.float32)
            if NR >= 2:
                s += c1.to(tl.float32)
            if NR >= 3:
                s += c2.to(tl.float32)
            v = s.to(tl.bfloat16)
            acc += s
        if NW >= 1:
            tl.store(O0 + coff, v, mask=cm)
        if NW >= 2:
            tl.store(O1 + coff, v, mask=cm)
        if NW >= 3:
            tl.store(O2 + coff, v, mask=cm)
    if NW == 0:
        tl.store(SINK + pid * BR + tl.arange(0, BR), tl.sum(acc, axis=1))


def _expected(ins, nr: int, S: int, H: int, dt) -> torch.Tensor:
    if nr:
        return sum(i.float() for i in ins[:nr]).to(dt)
    return (torch.arange(S * H, device="cuda").view(S, H) % 251).to(dt)


def run(args) -> tuple[list[dict], int]:
    S, dt = args.rows, torch.bfloat16
    info = meta()
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows, wrong = [], 0
    out_csv = os.path.join(args.out, "sm_ceiling.csv")
    for H in args.hidden:
        g = torch.Generator(device="cuda").manual_seed(0)
        ins = [torch.randn(S, H, device="cuda", generator=g).to(dt) for _ in range(3)]
        outs = [torch.empty(S, H, device="cuda", dtype=dt) for _ in range(3)]
        sink = torch.empty(1 << 16, device="cuda", dtype=torch.float32)
        for ctas in args.ctas:
            for nr, nw in KINDS:
                for br, warps in SHAPES:
                    def call(ctas=ctas, nr=nr, nw=nw, br=br, warps=warps, H=H):
                        rw_kernel[(ctas,)](*ins, *outs, sink, S, H=H, BR=br, NR=nr, NW=nw, num_warps=warps)

                    for o in outs:
                        o.fill_(float("nan"))
                    call()
                    torch.cuda.synchronize()
                    ok = True
                    if nw:
                        want = _expected(ins, nr, S, H, dt)
                        ok = all(torch.equal(outs[k], want) for k in range(nw))
                    wrong += not ok
                    us = Timer(repeats=args.repeats, warmup=1)(call, args.iters)
                    nbytes = (nr + nw) * S * H * 2
                    rows.append(dict(info, kind=f"r{nr}w{nw}", reads=nr, writes=nw, ctas=ctas, rows=S, hidden=H,
                                     block_rows=br, num_warps=warps, bytes=nbytes, l2_fits=nbytes <= l2,
                                     us=round(us, 2), gbps_per_cta=round(nbytes / us / 1e3 / ctas, 1), ok=ok))
                    r = rows[-1]
                    print(f"H={H} {r['kind']} ctas={ctas} br={br} warps={warps}: {us:8.1f} us "
                          f"{r['gbps_per_cta']:6.1f} GB/s/CTA{' (L2)' if r['l2_fits'] else ''}"
                          f"{'' if ok else ' WRONG'}", flush=True)
                    write_csv(out_csv, rows, COLUMNS)
    return rows, wrong


def plot(rows: list[dict], path: str) -> None:
    """Best GB/s per CTA over the launch shapes, per traffic kind and CTA count (one panel per H)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except Exception as e:  # matplotlib is optional
        return print(f"# matplotlib unavailable ({e}); no plot")
    hiddens = sorted({int(r["hidden"]) for r in rows})
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = pyplot.subplots(1, len(hiddens), figsize=(6 * len(hiddens), 4.5), squeeze=False)
    for ax, H in zip(axes[0], hiddens):
        ctas = sorted({int(r["ctas"]) for r in rows if int(r["hidden"]) == H})
        width = 0.8 / max(len(ctas), 1)
        for i, c in enumerate(ctas):
            best = [max((float(r["gbps_per_cta"]) for r in rows
                         if int(r["hidden"]) == H and int(r["ctas"]) == c and r["kind"] == k), default=0.0)
                    for k in kinds]
            ax.bar([j + i * width for j in range(len(kinds))], best, width, label=f"{c} CTAs")
        ax.set_xticks([j + width * (len(ctas) - 1) / 2 for j in range(len(kinds))], kinds)
        ax.set_ylabel("GB/s per CTA (read + written), best shape")
        ax.set_title(f"H={H}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    r0 = rows[0]
    fig.suptitle(f"What one SM moves: {r0['gpu']}, torch {r0['torch']}, triton {r0['triton']}, "
                 f"{r0['git_commit']}, {r0['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"# wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096])
    ap.add_argument("--rows", type=int, default=4096, help="rows of every buffer")
    ap.add_argument("--ctas", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--iters", type=int, default=10, help="calls per CUDA graph")
    ap.add_argument("--repeats", type=int, default=5, help="graph replays; the median is kept")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if args.rows * max(args.hidden) >= 2**31:  # the kernel's offsets are 32-bit
        sys.exit("--rows x --hidden must stay below 2**31 elements")
    rows, wrong = run(args)
    plot(rows, os.path.join(args.out, "sm_ceiling.png"))
    if wrong:
        sys.exit(f"{wrong} point(s) wrote wrong outputs")


if __name__ == "__main__":
    main()
