"""Probe: the add+norm phase (and a row copy) with the tiles ahead prefetched into L2, on ONE GPU.

    python benchmarks/probe_l2_prefetch.py            # H=4096; H=8192 via the H variable

Why: in the push kernel's add+norm loop (``probe_addnorm_prefetch.py``'s ``prefetch2``, ~76 GB/s
per CTA) ptxas issues the next tile's loads only after this tile's sum of squares (their
registers are reused), so little more than one tile is in flight; the same loop without the
math (``probe_sm_ceiling.py``'s r3w3) moves ~95.  A bulk L2 prefetch
(``cp.async.bulk.prefetch.L2.global``, one thread, one instruction per tensor per tile, no
registers) of the tile PF iterations ahead keeps HBM busy whatever ptxas does with the loads;
the loads then hit L2.  Same phase shape, bytes and checks as ``probe_addnorm_prefetch.py``
(per row 3 reads and 3 writes, bf16, 4096 rows); ``copy`` is 1 read + 1 write per row.
LOOP 0: one tile per iteration, nothing in registers ahead; LOOP 1: the register prefetch.
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
def l2_prefetch(ptr, nbytes):
    """Thread 0 of the CTA asks for ``nbytes`` (a multiple of 16) from ``ptr`` into L2."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ld(A, j, S, cols, BR: tl.constexpr, H: tl.constexpr):
    rows = j + tl.arange(0, BR)
    m = (rows < S)[:, None]
    return tl.load(A + rows[:, None] * H + cols[None, :], mask=m, other=0.)


@triton.jit
def _pf(A, j, S, BR: tl.constexpr, H: tl.constexpr):
    if j < S:
        n = tl.minimum(S - j, BR)
        l2_prefetch(A + j * H, n * (H * 2))


@triton.jit
def an_kernel(X, P, R, RO, NO, NP, W, S, eps, H: tl.constexpr, BR: tl.constexpr, PF: tl.constexpr,
              LOOP: tl.constexpr, COPY: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BR
    cols = tl.arange(0, H)
    w = tl.load(W + cols).to(tl.float32)
    if PF > 0:
        for d in tl.static_range(PF):
            _pf(X, pid * BR + d * step, S, BR, H)
            if not COPY:
                _pf(P, pid * BR + d * step, S, BR, H)
                _pf(R, pid * BR + d * step, S, BR, H)
    if LOOP == 1:
        ax = _ld(X, pid * BR, S, cols, BR, H)
        if not COPY:
            ap = _ld(P, pid * BR, S, cols, BR, H)
            ar = _ld(R, pid * BR, S, cols, BR, H)
    for j in tl.range(pid * BR, S, step, num_stages=1):
        if PF > 0:
            _pf(X, j + PF * step, S, BR, H)
            if not COPY:
                _pf(P, j + PF * step, S, BR, H)
                _pf(R, j + PF * step, S, BR, H)
        if LOOP == 1:
            cx = ax
            ax = _ld(X, j + step, S, cols, BR, H)
            if not COPY:
                cp = ap
                cr = ar
                ap = _ld(P, j + step, S, cols, BR, H)
                ar = _ld(R, j + step, S, cols, BR, H)
        else:
            cx = _ld(X, j, S, cols, BR, H)
            if not COPY:
                cp = _ld(P, j, S, cols, BR, H)
                cr = _ld(R, j, S, cols, BR, H)
        rows = j + tl.arange(0, BR)
        cm = (rows < S)[:, None]
        coff = rows[:, None] * H + cols[None, :]
        if COPY:
            tl.store(RO + coff, cx, mask=cm)
        else:
            res = (cx.to(tl.float32) + cp.to(tl.float32) + cr.to(tl.float32)).to(tl.bfloat16)
            rf = res.to(tl.float32)
            y = (rf * tl.rsqrt(tl.sum(rf * rf, axis=1) / H + eps)[:, None] * w[None, :]).to(tl.bfloat16)
            tl.store(RO + coff, res, mask=cm)
            tl.store(NO + coff, y, mask=cm)
            tl.store(NP + coff, y, mask=cm)


def main():
    S, H = 4096, int(os.environ.get("H", 4096))
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    X, P, R, W, outs, ref_res, ref_y = phase_case(S, H, g)
    # the copy's source: a buffer the add+norm does not touch, so L2 holds none of it
    C = torch.randn(S, H, device="cuda", generator=g).to(dt)
    variants = [("an", br, nw, pf, loop) for br, nw in ((2, 8), (2, 16), (4, 16), (1, 8), (4, 8))
                for loop in (1, 0) for pf in (0, 2, 4, 8)]
    variants += [("copy", br, nw, pf, loop) for br, nw in ((2, 8), (4, 16), (1, 8))
                 for loop in (1, 0) for pf in (0, 2, 4, 8)]
    for ctas in (8, 32):
        for name, br, nw, pf, loop in variants:
            copy = name == "copy"
            src = (C, P, R) if copy else (X, P, R)

            def call():
                an_kernel[(ctas,)](*src, *outs, W, S, 1e-6, H=H, BR=br, PF=pf, LOOP=loop, COPY=copy,
                                   num_warps=nw)
            try:
                for o in outs:
                    o.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
            except Exception as e:
                print(f"{name:5s} ctas={ctas} br={br} nw={nw} pf={pf} loop={loop}: {type(e).__name__} {str(e)[:80]}", flush=True)
                continue
            if copy:
                ok = torch.equal(outs[0], C)
            else:
                ok = phase_ok(outs, ref_res, ref_y)
            us = Timer(repeats=5, warmup=0)(call, 10)  # median of 5 graph replays of 10 calls
            nbytes = (2 if copy else 6) * S * H * 2
            print(f"{name:5s} ctas={ctas} br={br} nw={nw} pf={pf} loop={loop}: {us:8.1f} us "
                  f"{nbytes / us / 1e3 / ctas:6.1f} GB/s/CTA {'ok' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
