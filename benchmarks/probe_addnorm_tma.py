"""Probe: the push kernel's add+norm phase with its loads (and optionally stores) by TMA, on ONE GPU.

    python benchmarks/probe_addnorm_tma.py            # H=4096; H=8192 via the H variable

Same phase shape as ``probe_addnorm_prefetch.py`` (2 ranks, sharded residual: per row 3 reads and
3 writes, bf16, 4096 rows, local buffers only), same byte count and checks.  Question: does a
bulk tensor copy into shared memory (one thread issues it; a ``tl.range`` pipeline of STAGES
stages keeps STAGES-1 tiles in flight without holding registers) move more bytes per CTA than
the register prefetch (``prefetch2``, the push kernel's loop today, ~76 GB/s per CTA)?
Kernels: ``tma`` (descriptor loads, ordinary stores), ``tma_st`` (the same kernel with
``TMA_STORE``: descriptor loads and stores).  Host-side descriptors (``triton.tools.tensor_descriptor``): every buffer the phase
reads is local to the rank in the push design (the peers' partials arrive in its own region).
"""
import os
import sys

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer  # noqa: E402  (multicast off)
from probe_addnorm_prefetch import phase_case, phase_ok, prefetch2_kernel  # noqa: E402


@triton.jit
def _add_norm(x, p, r, w, eps, H: tl.constexpr):
    res = (x.to(tl.float32) + p.to(tl.float32) + r.to(tl.float32)).to(tl.bfloat16)
    rf = res.to(tl.float32)
    return res, (rf * tl.rsqrt(tl.sum(rf * rf, axis=1) / H + eps)[:, None] * w[None, :]).to(tl.bfloat16)


@triton.jit
def tma_kernel(XD, PD, RD, RO, NO, NP, W, S, eps, H: tl.constexpr, BR: tl.constexpr,
               STAGES: tl.constexpr, TMA_STORE: tl.constexpr):
    """Descriptor loads of [BR, H] tiles in a STAGES-deep pipeline; the outputs ordinary
    pointers, or with ``TMA_STORE`` descriptors stored through (S a multiple of BR)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BR
    cols = tl.arange(0, H)
    w = tl.load(W + cols).to(tl.float32)
    for j in tl.range(pid * BR, S, step, num_stages=STAGES):
        res, y = _add_norm(XD.load([j, 0]), PD.load([j, 0]), RD.load([j, 0]), w, eps, H)
        if TMA_STORE:
            RO.store([j, 0], res)
            NO.store([j, 0], y)
            NP.store([j, 0], y)
        else:
            rows = j + tl.arange(0, BR)
            m = (rows < S)[:, None]
            off = rows[:, None] * H + cols[None, :]
            tl.store(RO + off, res, mask=m)
            tl.store(NO + off, y, mask=m)
            tl.store(NP + off, y, mask=m)


def main():
    S, H = 4096, int(os.environ.get("H", 4096))
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    X, P, R, W, outs, ref_res, ref_y = phase_case(S, H, g)
    nbytes = 6 * S * H * 2
    variants = [("prefetch2", 2, 8, 1), ("prefetch2", 2, 16, 2)]
    variants += [("tma", br, nw, st) for br in (1, 2, 4) for st in (2, 3, 4) for nw in (4, 8, 16)]
    variants += [("tma_st", br, nw, st) for br in (1, 2) for st in (2, 3) for nw in (8, 16)]
    only = os.environ.get("ONLY")
    for ctas in (8, 32):
        for name, br, nw, st in variants:
            if only and name not in only.split(","):
                continue
            if name == "prefetch2":
                args, kern, extra = (X, P, R, *outs), prefetch2_kernel, {}
            else:
                d = [TensorDescriptor.from_tensor(t, [br, H]) for t in (X, P, R)]
                o = outs if name == "tma" else [TensorDescriptor.from_tensor(t, [br, H]) for t in outs]
                args, kern, extra = (*d, *o), tma_kernel, dict(TMA_STORE=name == "tma_st")

            def call():
                kern[(ctas,)](*args, W, S, 1e-6, H=H, BR=br, STAGES=st, num_warps=nw, **extra)
            try:
                for o in outs:
                    o.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
            except Exception as e:  # a shape that does not fit (shared memory, registers)
                print(f"{name:10s} ctas={ctas} br={br} nw={nw} st={st}: {type(e).__name__} {str(e)[:80]}", flush=True)
                continue
            ok = phase_ok(outs, ref_res, ref_y)
            us = Timer(repeats=5, warmup=0)(call, 10)  # median of 5 graph replays of 10 calls
            print(f"{name:10s} ctas={ctas} br={br} nw={nw} st={st}: {us:8.1f} us "
                  f"{nbytes / us / 1e3 / ctas:6.1f} GB/s/CTA {'ok' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
