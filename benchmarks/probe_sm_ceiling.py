"""Probe: what one SM can read and write per second, on ONE GPU (the ceiling of every SM phase).

    python benchmarks/probe_sm_ceiling.py

Grid-stride kernels over [S, H] bf16 buffers (S=4096 rows, H=4096), one CTA per SM at 8 and 32
CTAs, [BR, H] tiles, the next tile's loads issued before this tile's stores (the push kernel's
register prefetch):

* ``read k``: k buffers read, summed into registers (one value per row block written at the end,
  so nothing is dead code; those bytes are not counted);
* ``write k``: k buffers written (values from the row index, nothing read);
* ``rNwM``: N buffers read, their sum written to M buffers (r1w1 is a copy, r3w3 the add+norm
  phase's traffic without its math).

Bytes counted as read + written, as in ``bench_comm_per_cta.py``; GB/s per CTA = bytes / time /
CTAs.  The question it answers: is the add+norm phase (3 reads, 3 writes per row at 2 ranks)
held by its loop or by what one SM can move?  Outputs are checked against torch.
"""
import os

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer  # noqa: E402  (multicast off)


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


def main():
    S, H = 4096, int(os.environ.get("H", 4096))
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    ins = [torch.randn(S, H, device="cuda", generator=g).to(dt) for _ in range(3)]
    outs = [torch.empty(S, H, device="cuda", dtype=dt) for _ in range(3)]
    sink = torch.empty(1 << 16, device="cuda", dtype=torch.float32)
    kinds = [(3, 0), (1, 0), (0, 1), (0, 3), (1, 1), (3, 1), (1, 3), (3, 3), (2, 2)]
    shapes = [(2, 8), (2, 16), (4, 16), (1, 8)]
    for ctas in (8, 32):
        for nr, nw_ in kinds:
            for br, warps in shapes:
                def call():
                    rw_kernel[(ctas,)](*ins, *outs, sink, S, H=H, BR=br, NR=nr, NW=nw_, num_warps=warps)
                for o in outs:
                    o.fill_(float("nan"))
                try:
                    call()
                    torch.cuda.synchronize()
                except Exception as e:
                    print(f"r{nr}w{nw_} ctas={ctas} br={br} nw={warps}: {type(e).__name__}", flush=True)
                    continue
                if nw_:
                    want = (sum(i.float() for i in ins[:nr]).to(dt) if nr else
                            (torch.arange(S * H, device="cuda").view(S, H) % 251).to(dt))
                    ok = all(torch.equal(outs[k], want) for k in range(nw_))
                else:
                    ok = True
                us = Timer(repeats=5, warmup=0)(call, 10)  # median of 5 graph replays of 10 calls
                nbytes = (nr + nw_) * S * H * 2
                print(f"r{nr}w{nw_} ctas={ctas} br={br} nw={warps}: {us:8.1f} us "
                      f"{nbytes / us / 1e3 / ctas:6.1f} GB/s/CTA {'ok' if ok else 'WRONG'}", flush=True)


if __name__ == "__main__":
    main()
