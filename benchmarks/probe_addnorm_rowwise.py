"""Probe: the add+norm phase with one warp per row (no CTA barrier), on ONE GPU.

    python benchmarks/probe_addnorm_rowwise.py            # H=4096 and 8192

Why: the push kernel's add+norm loop (a [2, H] tile over 16 warps, ~79 GB/s per CTA at 8 CTAs)
reduces each row across warps: three CTA barriers per tile, so all warps move in lockstep and
a late load stalls the whole CTA.  Here each warp owns whole rows: a [num_warps, CH] chunk of
rows is walked over the H columns in NCH = H / CH unrolled steps (pass 1: load x, the peer's
partial and the residual, round the sum to the residual dtype, store it, keep it in registers,
sum its squares), the row's sum of squares is a reduction inside the warp (shuffles only), and
pass 2 scales the kept chunks by the weight (re-read, an L1 hit) and stores them twice (ours
and the peer's copy).  No shared memory, no barrier: the warps drift apart, and one warp's
loads overlap another's stores.  Same phase shape, bytes and checks as
``probe_addnorm_prefetch.py`` (per row 3 reads and 3 writes, bf16, 4096 rows); ``prefetch`` is
that probe's register-prefetch loop for comparison.
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer  # noqa: E402  (multicast off)
from probe_addnorm_prefetch import phase_case, phase_ok  # noqa: E402


@triton.jit
def _load3(X, P, R, g, S, k, c, H: tl.constexpr, CH: tl.constexpr, ROWS: tl.constexpr):
    """Chunk ``k`` (columns k*CH ..) of rows g .. g+ROWS of the three inputs, as loaded."""
    rows = g + tl.arange(0, ROWS)
    m = (rows < S)[:, None]
    off = rows[:, None] * H + k * CH + c[None, :]
    return (tl.load(X + off, mask=m, other=0.), tl.load(P + off, mask=m, other=0.),
            tl.load(R + off, mask=m, other=0.))


@triton.jit
def rowwise_kernel(X, P, R, RO, NO, NP, W, S, eps, H: tl.constexpr, CH: tl.constexpr,
                   ROWS: tl.constexpr, D: tl.constexpr):
    """Rows g .. g+ROWS (one per warp) per iteration; the loads run D chunks ahead of the math,
    and the next rows' first D chunks are loaded before this rows' pass-2 stores (a load after
    a store in program order cannot be hoisted above it: the compiler cannot prove they do not
    alias)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * ROWS
    c = tl.arange(0, CH)
    NCH: tl.constexpr = H // CH
    pre = ()
    for k in tl.static_range(D):
        pre = pre + (_load3(X, P, R, pid * ROWS, S, k, c, H, CH, ROWS),)
    for g in tl.range(pid * ROWS, S, step, num_stages=1):
        rows = g + tl.arange(0, ROWS)
        m = (rows < S)[:, None]
        off = rows[:, None] * H + c[None, :]
        buf = pre
        kept = ()
        sq = tl.zeros((ROWS, CH), tl.float32)
        for k in tl.static_range(NCH):
            if k + D < NCH:
                buf = buf + (_load3(X, P, R, g, S, k + D, c, H, CH, ROWS),)
            x, p, r = buf[k]
            res = (x.to(tl.float32) + p.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16)
            tl.store(RO + off + k * CH, res, mask=m)
            rf = res.to(tl.float32)
            sq += rf * rf
            kept = kept + (res,)
        rstd = tl.rsqrt(tl.sum(sq, axis=1) / H + eps)[:, None]
        pre = ()
        for k in tl.static_range(D):
            pre = pre + (_load3(X, P, R, g + step, S, k, c, H, CH, ROWS),)
        for k in tl.static_range(NCH):
            # [ROWS, CH] (every warp its own copy, an L1 hit): a [1, CH] or [CH] load gets a
            # layout of its own, and converting it costs a CTA barrier
            w = tl.load(tl.broadcast_to(W + k * CH + c[None, :], (ROWS, CH))).to(tl.float32)
            y = (kept[k].to(tl.float32) * rstd * w).to(tl.bfloat16)
            tl.store(NO + off + k * CH, y, mask=m)
            tl.store(NP + off + k * CH, y, mask=m)


@triton.jit
def prefetch_kernel(X, P, R, RO, NO, NP, W, S, eps, H: tl.constexpr, BR: tl.constexpr):
    """The register-prefetch loop of today's kernels: a [BR, H] tile, the next one loaded
    before this one's math."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BR
    cols = tl.arange(0, H)
    w = tl.load(W + cols).to(tl.float32)
    rows = pid * BR + tl.arange(0, BR)
    off = rows[:, None] * H + cols[None, :]
    m = (rows < S)[:, None]
    ax = tl.load(X + off, mask=m, other=0.)
    ap = tl.load(P + off, mask=m, other=0.)
    ar = tl.load(R + off, mask=m, other=0.)
    for j in tl.range(pid * BR, S, step, num_stages=1):
        cx, cp, cr = ax, ap, ar
        nrows = j + step + tl.arange(0, BR)
        noff = nrows[:, None] * H + cols[None, :]
        nm = (nrows < S)[:, None]
        ax = tl.load(X + noff, mask=nm, other=0.)
        ap = tl.load(P + noff, mask=nm, other=0.)
        ar = tl.load(R + noff, mask=nm, other=0.)
        rows = j + tl.arange(0, BR)
        cm = (rows < S)[:, None]
        coff = rows[:, None] * H + cols[None, :]
        res = (cx.to(tl.float32) + cp.to(tl.float32) + cr.to(tl.float32)).to(tl.bfloat16)
        rf = res.to(tl.float32)
        y = (rf * tl.rsqrt(tl.sum(rf * rf, axis=1) / H + eps)[:, None] * w[None, :]).to(tl.bfloat16)
        tl.store(RO + coff, res, mask=cm)
        tl.store(NO + coff, y, mask=cm)
        tl.store(NP + coff, y, mask=cm)


#: (warps, chunk columns, chunks ahead) per H.  ptxas (CPU, sm_90): no spills at H=4096 with 8 warps; the
#: 16-warp shape spills (128 registers), every H=8192 shape spills (the kept row alone is 128)
RW_SHAPES = {4096: [(8, 256, 2), (8, 256, 4), (8, 256, 6), (8, 256, 8), (8, 512, 2), (4, 512, 4), (16, 256, 1)],
             8192: [(8, 256, 2), (4, 256, 2), (4, 512, 2)]}


def main():
    S = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    for H in [int(h) for h in os.environ.get("H", "4096,8192").split(",")]:
        X, P, R, W, outs, ref_res, ref_y = phase_case(S, H, g)
        nbytes = 6 * S * H * 2
        variants = [("prefetch", dict(BR=max(1, 8192 // H)), 16)]
        variants += [("rowwise", dict(CH=ch, ROWS=nw, D=d), nw) for nw, ch, d in RW_SHAPES[H]]
        for ctas in (8, 32):
            for name, kw, nw in variants:
                kern = prefetch_kernel if name == "prefetch" else rowwise_kernel

                def call():
                    return kern[(ctas,)](X, P, R, *outs, W, S, 1e-6, H=H, num_warps=nw, **kw)
                tag = f"{name:8s} H={H} ctas={ctas:2d} nw={nw:2d} {kw}"
                try:
                    for o in outs:
                        o.fill_(float("nan"))
                    ck = call()
                    torch.cuda.synchronize()
                except Exception as e:
                    print(f"{tag}: {type(e).__name__} {str(e)[:100]}", flush=True)
                    continue
                ok = phase_ok(outs, ref_res, ref_y)
                us = Timer(repeats=5, warmup=0)(call, 10)  # median of 5 graph replays of 10 calls
                print(f"{tag}: {us:8.1f} us {nbytes / us / 1e3 / ctas:6.1f} GB/s/CTA regs={ck.n_regs} spills={ck.n_spills} "
                      f"{'ok' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
