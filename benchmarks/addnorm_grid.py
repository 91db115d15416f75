"""Does a wider grid make the shared add+norm kernel faster on few rows? On ONE GPU, one kernel.

    python benchmarks/addnorm_grid.py
    python benchmarks/addnorm_grid.py --hidden 4096 --rows 128,512,2048 --quant 1

With no received slots (its reduce-scatter has summed the partials) ``nccl``'s add+norm (and its
fp8 epilogue) runs the row tile, not the one-warp-per-row loop: 2 rows a tile at H=4096, 1 at 8192.
On a CTA per 8 rows (the loop's block, the grid it had before :func:`addnorm.plan`) each CTA takes
4 or 8 tiles one after another, each waiting on its rows' sums (and the epilogue's amax). This
times ``nccl``'s launch shape on four grids, rotating which goes first, each ``--calls`` calls
captured in one CUDA graph (median of ``--repeats`` replays, then the median over ``--rounds``):

* ``per8``: a CTA per 8 rows;
* ``per8_again``: the same launch again, the control: how far apart the method reads two identical
  launches;
* ``plan``: ``nccl``'s call (``num_ctas=addnorm.ctas_for(spec)``, None: :func:`addnorm.plan`'s
  grid, at least a CTA per SM while tiles last);
* ``per_tile``: a CTA per tile.

A grid's gain counts only beyond the control's spread. Every arm's outputs are compared bit for
bit with ``per8``'s (the grid must not change a row). Prints a line per point; a diagnostic for
the grid ``nccl`` should take, not a target: it writes no CSV.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402

FP8 = torch.float8_e4m3fn
ARMS = ("per8", "per8_again", "plan", "per_tile")


def grids(hidden: int, rows: int, quant: bool, sms: int):
    """``(launch shape, {arm: CTAs})``: the shape ``nccl`` picks for ``rows`` bf16 rows (no received
    slots: :func:`addnorm.plan`) and each arm's grid for it (``plan``'s on ``sms`` SMs)."""
    from weave_compile.kernels.shared import addnorm
    from weave_compile.kernels.spec import FusedSpec

    num_ctas = addnorm.ctas_for(FusedSpec(residual_dtype=torch.bfloat16, out_dtype=torch.bfloat16))  # nccl's call
    cfg, grid = addnorm.plan(hidden, rows, num_ctas, slots=0, quant=quant, sms=sms)
    per8 = -(-rows // addnorm.ROWWISE_WARPS)
    tiles = max(1, -(-rows // cfg.block_rows))
    return cfg, {"per8": min(per8, tiles), "per8_again": min(per8, tiles), "plan": grid, "per_tile": tiles}


def point(hidden: int, rows: int, quant: bool, args, dev) -> dict:
    from weave_compile.kernels.shared import addnorm
    import weave_compile.quant as wq

    cfg, ctas = grids(hidden, rows, quant, addnorm.sm_count(dev))  # the SMs the launcher's plan reads
    g = torch.Generator(device=dev).manual_seed(rows * 31 + hidden)
    x = torch.randn(rows, hidden, device=dev, generator=g).bfloat16()
    res = torch.randn(rows, hidden, device=dev, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device=dev, generator=g)).bfloat16()
    normed = torch.empty(rows, hidden, device=dev, dtype=FP8 if quant else torch.bfloat16)
    res_out = torch.empty(rows, hidden, device=dev, dtype=torch.bfloat16)
    scales = torch.empty(rows, 1, device=dev, dtype=torch.float32)
    extra = dict(quant=wq.QuantSpec("row", FP8, 448.0, 1.0 / (448.0 * 512.0), reciprocal=True), row_scales=scales,
                 out_dtype=torch.bfloat16) if quant else {}

    def call(arm):
        n = None if arm == "plan" else ctas[arm]  # plan: nccl's own call, the grid picked in the launcher
        return lambda: addnorm.add_rmsnorm_rows(x, None, res, None, w, None, normed, res_out, n_valid=rows, eps=1e-6,
                                                mid_dtype=None, weight_offset=0.0, num_ctas=n, config=cfg, **extra)

    outs, times = {}, {a: [] for a in ARMS}
    for r in range(args.rounds):
        for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
            normed.view(torch.uint8).fill_(0xFF)  # poison: every output byte must be written
            res_out.fill_(float("nan"))
            scales.fill_(float("nan"))
            call(arm)()
            torch.cuda.synchronize()
            outs[arm] = (normed.view(torch.uint8).clone(), res_out.clone(), scales.clone() if quant else None)
            times[arm].append(Timer(args.repeats)(call(arm), args.calls))
    same = all(torch.equal(a, b) for arm in ARMS for a, b in zip(outs["per8"], outs[arm]) if a is not None)
    if not same:
        raise SystemExit(f"H={hidden} rows={rows} quant={quant}: a grid changed the outputs")
    us = {a: statistics.median(t) for a, t in times.items()}
    return {"cfg": cfg, "ctas": ctas, "us": us}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="4096,8192")
    ap.add_argument("--rows", default="16,128,512,1024,2048,8192")
    ap.add_argument("--quant", default="1,0", help="1: the fp8 per-row epilogue, 0: bf16 rows")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), torch.__version__, flush=True)
    for hidden in (int(h) for h in args.hidden.split(",")):
        for quant in (q == "1" for q in args.quant.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                p = point(hidden, rows, quant, args, dev)
                base = p["us"]["per8"]
                print(f"H={hidden} rows={rows:5d} quant={int(quant)} {p['cfg']}: " + "  ".join(
                    f"{a} {p['us'][a]:7.2f} us on {p['ctas'][a]} ({p['us'][a] / base:.3f}x)" for a in ARMS), flush=True)


if __name__ == "__main__":
    main()
