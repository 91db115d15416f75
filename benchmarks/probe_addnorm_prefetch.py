"""Probe: loop structures for the push kernel's add+norm phase, standalone, on ONE GPU.

    python benchmarks/probe_addnorm_prefetch.py            # H=4096; H=8192 via the H variable

The phase's shape with 2 ranks and a sharded residual: per row 3 reads (x, the peer's partial,
the residual) and 3 writes (residual, normed, normed for the peer), bf16, 4096 rows, local
buffers only.  Kernels: ``base`` (the ``tl.range`` cp.async pipeline of STAGES stages, the push
kernel's loop until session 5), ``prefetch`` / ``prefetch2`` (the next tile's loads issued into
registers before this tile's math; ``prefetch2`` STAGES = tiles ahead, +10 = streaming cache
hints), ``stream_hints`` (base with evict-first loads and .cs stores).  Prints time and GB/s per
CTA (bytes read + written / time / CTAs) per (kernel, tile rows, warps, stages); every output is
checked against torch (``ok``/``WRONG``).  Results: ``results/addnorm_probe.txt`` (its first run
used the base/prefetch/stream_hints variant list, since replaced by the one below).
"""
import torch
import triton
import triton.language as tl

@triton.jit
def base_kernel(X, P, R, RO, NO, NP, W, S, eps, H: tl.constexpr, BR: tl.constexpr, STAGES: tl.constexpr,
                HINT: tl.constexpr = False):
    """The tl.range pipeline of STAGES stages (HINT: evict-first loads, streaming stores)."""
    pid = tl.program_id(0); step = tl.num_programs(0) * BR
    cols = tl.arange(0, H)
    w = tl.load(W + cols).to(tl.float32)
    for j0 in tl.range(pid * BR, S, step, num_stages=STAGES):
        x, p, r, off, m = _ld3(X, P, R, j0, S, cols, BR, H, HINT)
        _math_store(x, p, r, off, m, RO, NO, NP, w, eps, H, HINT)


@triton.jit
def prefetch_kernel(X, P, R, RO, NO, NP, W, S, eps, H: tl.constexpr, BR: tl.constexpr, STAGES: tl.constexpr):
    """Registers double-buffered: the next tile's loads are issued before this tile's math."""
    pid = tl.program_id(0); step = tl.num_programs(0) * BR
    cols = tl.arange(0, H)
    w = tl.load(W + cols).to(tl.float32)
    j0 = pid * BR
    rows = j0 + tl.arange(0, BR); m = (rows < S)[:, None]; off = rows[:, None] * H + cols[None, :]
    nx = tl.load(X + off, mask=m, other=0.); npp = tl.load(P + off, mask=m, other=0.); nr = tl.load(R + off, mask=m, other=0.)
    for j in tl.range(pid * BR, S, step, num_stages=1):
        cx = nx; cp = npp; cr = nr; coff = off; cm = m
        rows = j + step + tl.arange(0, BR); m = (rows < S)[:, None]; off = rows[:, None] * H + cols[None, :]
        nx = tl.load(X + off, mask=m, other=0.); npp = tl.load(P + off, mask=m, other=0.); nr = tl.load(R + off, mask=m, other=0.)
        acc = cx.to(tl.float32) + cp.to(tl.float32) + cr.to(tl.float32)
        res = acc.to(tl.bfloat16)
        r = res.to(tl.float32)
        y = (r * tl.rsqrt(tl.sum(r * r, axis=1) / H + eps)[:, None] * w[None, :]).to(tl.bfloat16)
        tl.store(RO + coff, res, mask=cm); tl.store(NO + coff, y, mask=cm); tl.store(NP + coff, y, mask=cm)

@triton.jit
def _ld3(X, P, R, j, S, cols, BR: tl.constexpr, H: tl.constexpr, HINT: tl.constexpr):
    rows = j + tl.arange(0, BR); m = (rows < S)[:, None]; off = rows[:, None] * H + cols[None, :]
    if HINT:
        return (tl.load(X + off, mask=m, other=0., eviction_policy="evict_first"),
                tl.load(P + off, mask=m, other=0., eviction_policy="evict_first"),
                tl.load(R + off, mask=m, other=0., eviction_policy="evict_first"), off, m)
    return tl.load(X + off, mask=m, other=0.), tl.load(P + off, mask=m, other=0.), tl.load(R + off, mask=m, other=0.), off, m

@triton.jit
def _math_store(cx, cp, cr, coff, cm, RO, NO, NP, w, eps, H: tl.constexpr, HINT: tl.constexpr):
    acc = cx.to(tl.float32) + cp.to(tl.float32) + cr.to(tl.float32)
    res = acc.to(tl.bfloat16)
    r = res.to(tl.float32)
    y = (r * tl.rsqrt(tl.sum(r * r, axis=1) / H + eps)[:, None] * w[None, :]).to(tl.bfloat16)
    if HINT:
        tl.store(RO + coff, res, mask=cm, cache_modifier=".cs"); tl.store(NO + coff, y, mask=cm, cache_modifier=".cs"); tl.store(NP + coff, y, mask=cm, cache_modifier=".cs")
    else:
        tl.store(RO + coff, res, mask=cm); tl.store(NO + coff, y, mask=cm); tl.store(NP + coff, y, mask=cm)

@triton.jit
def prefetch2_kernel(X, P, R, RO, NO, NP, W, S, eps, H: tl.constexpr, BR: tl.constexpr, STAGES: tl.constexpr):
    """STAGES = prefetch depth (1 or 2 tiles ahead, in registers); STAGES >= 10: depth - 10 with hints."""
    pid = tl.program_id(0); step = tl.num_programs(0) * BR
    HINT: tl.constexpr = STAGES >= 10
    DEPTH: tl.constexpr = STAGES - 10 if STAGES >= 10 else STAGES
    cols = tl.arange(0, H)
    w = tl.load(W + cols).to(tl.float32)
    ax, ap, ar, aoff, am = _ld3(X, P, R, pid * BR, S, cols, BR, H, HINT)
    if DEPTH == 2:
        bx, bp, br_, boff, bm = _ld3(X, P, R, pid * BR + step, S, cols, BR, H, HINT)
    for j in tl.range(pid * BR, S, step, num_stages=1):
        cx = ax; cp = ap; cr = ar; coff = aoff; cm = am
        if DEPTH == 2:
            ax = bx; ap = bp; ar = br_; aoff = boff; am = bm
            bx, bp, br_, boff, bm = _ld3(X, P, R, j + 2 * step, S, cols, BR, H, HINT)
        else:
            ax, ap, ar, aoff, am = _ld3(X, P, R, j + step, S, cols, BR, H, HINT)
        _math_store(cx, cp, cr, coff, cm, RO, NO, NP, w, eps, H, HINT)

def phase_case(S: int, H: int, g):
    """The phase's bf16 inputs x, the peer's partial, the residual [S, H] and the weight [H]
    (from generator ``g``), three [S, H] outputs, and the torch reference (residual, normed)."""
    dt = torch.bfloat16
    X, P, R = (torch.randn(S, H, device="cuda", generator=g).to(dt) for _ in range(3))
    W = torch.randn(H, device="cuda", generator=g).to(dt)
    outs = [torch.empty(S, H, device="cuda", dtype=dt) for _ in range(3)]
    ref_res = (X.float() + P.float() + R.float()).to(dt)
    rf = ref_res.float()
    ref_y = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6) * W.float()).to(dt)
    return X, P, R, W, outs, ref_res, ref_y


def phase_ok(outs, ref_res, ref_y) -> bool:
    """The residual exact, the normed rows within 0.07 of torch, both normed copies equal."""
    return (torch.equal(outs[0], ref_res) and (outs[1].float() - ref_y.float()).abs().max().item() < 0.07
            and torch.equal(outs[1], outs[2]))


def main():
    import os
    S, H, ctas = 4096, int(os.environ.get("H", 4096)), 8
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    X, P, R, W, outs, ref_res, ref_y = phase_case(S, H, g)
    nbytes = 6 * S * H * 2
    import os
    H = int(os.environ.get("H", H))
    variants = [("prefetch2", prefetch2_kernel, br, nw, st) for br, nw, st in
                [(2, 8, 1), (2, 8, 11), (2, 8, 2), (2, 16, 1), (2, 16, 2), (1, 8, 1), (1, 8, 2), (1, 16, 2),
                 (2, 4, 1), (4, 16, 1), (1, 4, 2)]]
    variants += [("base", base_kernel, 2, 16, 3), ("base", base_kernel, 4, 8, 3)]
    # the first run's list: [(name, kernel, br, nw, st) for name, kernel in (("base", base_kernel),
    # ("prefetch", prefetch_kernel), ("stream_hints", base_kernel with HINT=True)) for br in (1, 2, 4)
    # for nw in (4, 8, 16) for st in (1, 3)] (prefetch: st=1 only)
    for ctas in (8, 32):
        for name, k, br, nw, st in variants:
            def call():
                k[(ctas,)](X, P, R, *outs, W, S, 1e-6, H=H, BR=br, STAGES=st, num_warps=nw)
            try:
                for o in outs: o.fill_(float("nan"))
                call(); torch.cuda.synchronize()
            except Exception as e:
                print(f"{name:12s} ctas={ctas} br={br} nw={nw} st={st}: {type(e).__name__}", flush=True); continue
            ok = phase_ok(outs, ref_res, ref_y)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(10): call()
            gr.replay(); torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                a.record(); gr.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / 10)
            us = sorted(ts)[2]
            print(f"{name:12s} ctas={ctas} br={br} nw={nw} st={st}: {us:8.1f} us {nbytes / us / 1e3 / ctas:6.1f} GB/s/CTA {'ok' if ok else 'WRONG'}", flush=True)

if __name__ == "__main__":
    main()
