"""The fused op with its fp8 epilogue against plain Inductor's add + norm + quant, on ONE GPU.

    python benchmarks/bench_fp8.py --out benchmarks/results
    python benchmarks/bench_fp8.py --dims 8b --world 8 --tokens 1,1024,8192

One site of a TP Llama (``--dims``: 8B, H=4096; 70B, H=8192), bf16, its normed rows quantized per
row to fp8 e4m3fn (vLLM's per-token form: amax / 448, floored, times the reciprocal, clamped),
three ways, each ``--calls`` calls captured in one CUDA graph and its replays timed (median of
``--repeats``; the variants rotate, ``--rounds`` rounds, medians of the per-round ratios):

* ``inductor``: the site as written (all_reduce, + residual, RMSNorm, the quant chain), compiled by
  plain Inductor, which fuses add + norm + quant into one kernel over all T rows;
* ``op_then_quant``: today's fused op (``nccl``: reduce-scatter, add + norm on this rank's rows,
  all-gather of bf16 rows) followed by the quant chain, compiled by Inductor (the quant outside);
* ``epilogue``: the fused op with the fp8 epilogue (``quant="row"``): the quant on this rank's rows
  inside the op, the all-gather of fp8 codes and one fp32 scale per row.

On PyTorch's fake process group of ``--world`` ranks (this process is rank 0; :mod:`fake_group`):
the collectives move nothing and write real rows, so what is timed is the local part. The gather's
saving (``gathered_B_per_row``: 2H bf16 against H + 4) needs two GPUs
(``benchmarks/check_2gpu.sh``). Each point first checks the epilogue's outputs against the op's own
normed rows quantized in float64 (``codes_off``: the fraction of codes one step off).

Writes ``fp8.csv`` and ``fp8.png`` (time over ``inductor`` per T). NVLink multicast stays off.

``--real`` (under ``torchrun --nproc-per-node N``): the same three variants on a real NCCL group of
the N GPUs, every rank timing the same calls in the same order, rank 0 writing ``fp8_<N>gpu.csv``
and its PNG: the whole op, the fp8 gather's saving included (``benchmarks/check_2gpu.sh`` runs it
on two GPUs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Timer, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402

DIMS = {"8b": 4096, "70b": 8192}
VARIANTS = ("inductor", "op_then_quant", "epilogue")
COLUMNS = ["gpu", "dims", "world_size", "hidden", "T", "us_inductor", "us_op_then_quant", "us_epilogue",
           "op_then_quant_over_inductor", "epilogue_over_inductor", "gathered_B_per_row_bf16", "gathered_B_per_row_fp8",
           "codes_off", "torch", "triton", "git_commit", "date"]
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FLOOR = 1.0 / (FP8_MAX * 512.0)


def per_token_quant(y: torch.Tensor):
    """vLLM's per-token dynamic quant, as a model writes it."""
    s = (y.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(FLOOR)
    q = (y.float() * s.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s


def _op(x, residual, weight, group_name, quant: bool, sharded: bool):
    import weave_compile.quant as wq

    extra = wq.QuantSpec("row", FP8, FP8_MAX, FLOOR, reciprocal=True).op_args() if quant else {}
    return torch.ops.weave.allreduce_add_rmsnorm(
        x, residual=residual, bias=None, weight=weight, eps=1e-6, group_name=group_name,
        residual_dtype=torch.bfloat16, out_dtype=torch.bfloat16, mid_dtype=None, weight_offset=0.0,
        residual_in_sharded=sharded, residual_out_sharded=sharded, kernel="nccl", comm_ctas=32, **extra)


def runners(T: int, H: int, world: int, group_name: str, dev, rank: int = 0):
    """The three variants' calls on fresh random rows (the residual full for ``inductor``, this
    rank's shard for the op: an interior site's layout; every rank draws the same residual, its
    own partial sums)."""
    import torch.distributed._functional_collectives as fcol

    # A fresh compile per point: Dynamo's per-code cache would otherwise reach its recompile limit
    # across the sweep's shapes and run the later points eagerly (what the first GPU run timed).
    torch._dynamo.reset()
    g = torch.Generator(device=dev).manual_seed(T * 7 + H)
    residual_full = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    x = torch.randn(T, H, generator=torch.Generator(device=dev).manual_seed(T * 7 + H + 1000 * (rank + 1)),
                    device=dev).to(torch.bfloat16)
    S = -(-T // world)
    padded = torch.nn.functional.pad(residual_full, (0, 0, 0, S * world - T))
    shard = padded[rank * S:(rank + 1) * S].contiguous()
    weight = (1 + 0.1 * torch.randn(H, generator=g, device=dev)).to(torch.bfloat16)

    def written(x, residual, weight):
        y = fcol.all_reduce(x, "sum", group_name) + residual
        r = y.float()
        n = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * weight
        return per_token_quant(n), y

    def op_then_quant(x, residual, weight):
        normed, res, _ = _op(x, residual, weight, group_name, False, True)
        return per_token_quant(normed), res

    inductor = torch.compile(written, dynamic=False)
    outside = torch.compile(op_then_quant, dynamic=False)
    return {"inductor": lambda: inductor(x, residual_full, weight),
            "op_then_quant": lambda: outside(x, shard, weight),
            "epilogue": lambda: _op(x, shard, weight, group_name, True, True)}, (x, shard, weight)


def codes_off(x, shard, weight, group_name) -> float:
    """The epilogue's codes against the op's own normed rows quantized in float64 (scales to one
    ulp, codes one step off only on a rounding boundary: else SystemExit)."""
    from weave_compile.quant import QuantSpec, quantize_ref, quotient_ref
    from weave_compile.testing.numerics import codes_agree

    spec = QuantSpec("row", FP8, FP8_MAX, FLOOR, reciprocal=True)
    normed, _, _ = _op(x, shard, weight, group_name, False, True)
    q, _, scales = _op(x, shard, weight, group_name, True, True)
    q_ref, s_ref = quantize_ref(normed, spec)
    ulps = ((scales.double() - s_ref.double()).abs() / s_ref.double()).max().item() / 2 ** -23
    frac, bad = codes_agree(q.cpu(), q_ref.cpu(), quotient_ref(normed, spec)[0].cpu())
    if bad or ulps > 1:
        raise SystemExit(f"the epilogue is wrong: {bad or ''} scales {ulps:.2f} ulp off")
    return frac


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="8b,70b")
    ap.add_argument("--world", default="8")
    ap.add_argument("--tokens", default="1,16,128,1024,4096,8192,16384")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--real", action="store_true", help="a real NCCL group of torchrun's ranks (module doc)")
    args = ap.parse_args(argv)

    import weave_compile.ops  # noqa: F401  (registers the op)

    meta = run_meta()
    rows: list[dict] = []
    if args.real:
        worlds, rank = real_world(), int(os.environ.get("RANK", "0"))
        path = os.path.join(args.out, f"fp8_{os.environ.get('WORLD_SIZE', '1')}gpu.csv")
    else:
        import fake_group

        worlds, rank = fake_group.each_world(int(w) for w in args.world.split(",")), 0
        path = os.path.join(args.out, "fp8.csv")
    for world, dev, group_name in worlds:
        for dims in args.dims.split(","):
            H = DIMS[dims]
            for T in [int(t) for t in args.tokens.split(",")]:
                run, inputs = runners(T, H, world, group_name, dev, rank)
                off = codes_off(*inputs, group_name)
                times = {v: [] for v in VARIANTS}
                for r in range(args.rounds):
                    order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
                    for v in order:
                        times[v].append(Timer(args.repeats)(run[v], args.calls))
                ratio = {v: statistics.median(b / a for a, b in zip(times["inductor"], times[v])) for v in VARIANTS}
                row = {**meta, "dims": dims, "world_size": world, "hidden": H, "T": T,
                       **{f"us_{v}": f"{statistics.median(times[v]):.2f}" for v in VARIANTS},
                       "op_then_quant_over_inductor": f"{ratio['op_then_quant']:.3f}",
                       "epilogue_over_inductor": f"{ratio['epilogue']:.3f}",
                       "gathered_B_per_row_bf16": 2 * H, "gathered_B_per_row_fp8": H + 4, "codes_off": f"{off:.2e}"}
                rows.append(row)
                if rank:
                    continue
                print(f"{dims} N={world} T={T:6d}: inductor {row['us_inductor']} us, op+quant "
                      f"{row['us_op_then_quant']} ({ratio['op_then_quant']:.3f}x), epilogue {row['us_epilogue']} "
                      f"({ratio['epilogue']:.3f}x); gathered {2 * H} -> {H + 4} B/row; codes off {off:.2e}",
                      flush=True)
                write_csv(path, rows, COLUMNS)
    if not rank:
        plot(rows, path[:-4] + ".png", "real NCCL group (the whole op)" if args.real else
             "fake group (local part)")


def real_world():
    """``(world size, device, group name)`` of the NCCL group of torchrun's ranks, destroyed after."""
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    try:
        yield dist.get_world_size(), dev, dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def plot(rows: list[dict], path: str, what: str = "fake group (local part)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["dims"], r["world_size"]) for r in rows}):
        pts = [r for r in rows if (r["dims"], r["world_size"]) == key]
        for v, style in (("op_then_quant", "--"), ("epilogue", "-")):
            ax.plot([r["T"] for r in pts], [float(r[f"{v}_over_inductor"]) for r in pts], style, marker="o", ms=3,
                    label=f"{v} {key[0]} N={key[1]}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("time / plain Inductor (add + norm + quant)")
    m = rows[0]
    ax.set_title(f"fp8 per-row epilogue, one site, {what}: {m['gpu']}, commit {m['git_commit']}",
                 fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
