"""The token split's attention against the whole's, one GPU: does splitting cost attention time?

For Llama-3 heads at TP=2 (``8b``: 16 query / 4 kv heads, ``70b``: 32 / 4; d=128; bf16, batch 1)
and T = 1024..16384, split at ``T // 2`` (``half``) and at the smart split's point for the layer
of those dims (``smart``: :func:`weave_compile.passes.split_tokens.smart_split.plan` on cuBLAS curves measured here),
times:

* ``whole``: causal SDPA over all T tokens (what the unsplit layer runs);
* ``prefix``: causal SDPA over the first ``split_at`` tokens (the split's A half);
* ``suffix``: ``weave::causal_suffix_attention`` of the rest (B's queries over A's keys and its own;
  two LSE-returning calls on SDPA's own backend, merged by one Triton kernel); ``merge`` is that
  kernel alone;
* ``rect`` and ``own``: the suffix's two calls alone (B's queries over A's keys, full; over its own
  keys, causal); ``calls_over_whole = (prefix + rect + own + merge) / whole`` is what the halves
  cost with each call at its own speed: the floor of this op on these kernels (SDPA's cuDNN
  kernel aligns a causal mask top-left when queries are fewer than keys, so the suffix cannot be
  one call on it);
* ``old_suffix``: what the suffix ran before: K/V concatenated, repeated per query head, SDPA with a
  lower-right causal mask (FlashAttention-2 on sm90), the result copied to the op's layout.

``--kv gqa`` passes K/V with the kv heads (SDPA's ``enable_gqa``, as a model calling SDPA that way
reaches the graph); ``expanded`` repeats them per query head first (``TPLlama``'s
``repeat_interleave``, what its compiled graph's attention reads). The target: ``prefix + suffix
<= 1.05 x whole`` at T >= 2048 (``halves_over_whole``).

Timing: ``common.Timer``, each variant ``iters`` back-to-back calls captured in one CUDA graph,
median of ``--repeats`` replays (eager launches of a 20-100 us kernel are host-bound below ~4K
tokens: the graph removes the launch overhead, as serving engines run). Warm-up calls run first
(cuDNN builds its plan; the op checks each backend once).

    python benchmarks/bench_split_attention.py --out benchmarks/results       # one GPU, ~2 min
    python benchmarks/bench_split_attention.py --dry-run                       # CPU: exercises the code

Writes ``split_attention.csv`` (after every point) and ``split_attention.png``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, Timer, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: name -> (query heads, kv heads, head dim, hidden, intermediate) per rank at TP=2
HEADS = {"8b": (16, 4, 128, 4096, 14336 // 2), "70b": (32, 4, 128, 8192, 28672 // 2)}
COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "heads", "q_heads", "kv_heads", "head_dim", "kv", "dtype",
           "T", "split_how", "split_at", "whole_us", "prefix_us", "suffix_us", "old_suffix_us", "merge_us",
           "rect_us", "own_us", "halves_over_whole", "calls_over_whole", "old_halves_over_whole", "suffix_path",
           "iters"]


def layer_shape(name: str):
    """The smart split's view of one TP=2 Llama layer of these dims (what the split pass extracts)."""
    from weave_compile.passes.split_tokens.smart_split import LayerShape

    hq, hkv, d, hidden, inter = HEADS[name]
    gemms = ((hq * d, hidden), (hkv * d, hidden), (hkv * d, hidden), (hidden, hq * d),
             (inter, hidden), (inter, hidden), (hidden, inter))
    return LayerShape(gemms=gemms, attn_width=hq * d, hidden=hidden, elem_bytes=2, sites=2)


def split_points(name: str, t: int, smart: bool, device) -> list[tuple[str, int]]:
    """``T // 2`` and the smart split's point (on the CPU: its SM formula), if different."""
    points = [("half", t // 2)]
    if smart:
        from weave_compile.passes.split_tokens import smart_split

        at = smart_split.plan(t, layer_shape(name), cost="measured", device=device).at
        if at != t // 2:
            points.append(("smart", at))
    return points


def make_inputs(name: str, t: int, kv: str, dtype, device):
    """q, k, v as the graph has them: views of the projections' [B, T, heads, D] outputs."""
    hq, hkv, d = HEADS[name][:3]
    g = torch.Generator(device=device).manual_seed(t)

    def proj(heads):
        return torch.randn(1, t, heads, d, generator=g, device=device, dtype=torch.float32).to(dtype).transpose(1, 2)

    q, k, v = proj(hq), proj(hkv), proj(hkv)
    if kv == "expanded":
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    return q, k, v


def timer(dry: bool, repeats: int):
    if not dry:
        return Timer(repeats=repeats, warmup=3, graph=True)

    def wall(fn, iters):
        fn()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e6

    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="8b,70b")
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--kv", default="gqa,expanded", help="K/V layouts to time: gqa, expanded")
    ap.add_argument("--no-smart", action="store_true", help="only the T // 2 split (no cuBLAS measurement)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny T: runs every code path, times nothing real")
    args = ap.parse_args()

    csa = importlib.import_module("weave_compile.ops.causal_suffix_attention")
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    dtype = torch.float32 if dry else torch.bfloat16
    ts = [64, 320] if dry else [int(v) for v in args.tokens.split(",")]
    meta = run_meta(None if dry else device)
    name_out = "split_attention_dryrun" if dry else "split_attention"
    path = os.path.join(args.out, name_out + ".csv")
    time_us = timer(dry, args.repeats)
    rows = []
    for name in args.heads.split(","):
        hq, hkv, d = HEADS[name][:3]
        for kv in args.kv.split(","):
            gqa = kv == "gqa"
            for t in ts:
                q, k, v = make_inputs(name, t, kv, dtype, device)
                iters = 2 if dry else max(5, min(200, 131072 // t))
                whole = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), iters)
                for how, s in split_points(name, t, smart=not args.no_smart, device=device):
                    a = (q[:, :, :s], k[:, :, :s], v[:, :, :s])
                    b = (q[:, :, s:], k[:, :, :s], v[:, :, :s], k[:, :, s:], v[:, :, s:])
                    prefix = time_us(lambda: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=gqa), iters)
                    suffix = time_us(lambda: csa.causal_suffix_attention(*b, None), iters)
                    old = time_us(lambda: csa._fallback(*b, None, why="the old path, timed"), iters)
                    attend, path_desc = csa.plan(*b, None)
                    attend = attend or csa.attend_math
                    rect = time_us(lambda: attend(*b[:3], False, None), iters)
                    own = time_us(lambda: attend(b[0], *b[3:], True, None), iters)
                    o1, l1 = attend(*b[:3], False, None)  # the merge alone, on the prefix call's outputs
                    o2, l2 = o1.clone(), l1.clone()
                    out = csa._out_like(b[0], b[2])
                    merge = time_us(lambda: csa.combine(o1, l1, o2, l2, out), iters)
                    row = {**meta, "heads": name, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "kv": kv,
                           "dtype": str(dtype).replace("torch.", ""), "T": t, "split_how": how, "split_at": s,
                           "whole_us": f"{whole:.1f}", "prefix_us": f"{prefix:.1f}", "suffix_us": f"{suffix:.1f}",
                           "old_suffix_us": f"{old:.1f}", "merge_us": f"{merge:.1f}", "rect_us": f"{rect:.1f}",
                           "own_us": f"{own:.1f}", "halves_over_whole": f"{(prefix + suffix) / whole:.3f}",
                           "calls_over_whole": f"{(prefix + rect + own + merge) / whole:.3f}",
                           "old_halves_over_whole": f"{(prefix + old) / whole:.3f}", "suffix_path": path_desc,
                           "iters": iters}
                    rows.append(row)
                    print(f"{name} {kv:8s} T={t:6d} {how:5s}@{s:6d}: whole {whole:8.1f} prefix {prefix:8.1f} "
                          f"suffix {suffix:8.1f} (old {old:8.1f}; calls {rect:8.1f} + {own:8.1f}, merge {merge:6.1f}) "
                          f"-> "
                          f"{row['halves_over_whole']} (floor {row['calls_over_whole']}, old "
                          f"{row['old_halves_over_whole']}) [{path_desc}]", flush=True)
                    write_csv(path, rows, COLUMNS)
    print("wrote", path)
    try:
        plot(rows, os.path.join(args.out, name_out + ".png"))
    except Exception as e:  # the CSV is the result; a missing matplotlib is not fatal
        print("plot skipped:", e)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = dict.fromkeys((r["heads"], r["kv"], r["split_how"]) for r in rows)
    for heads, kv, how in keys:
        sel = sorted((int(r["T"]), float(r["halves_over_whole"]), float(r["old_halves_over_whole"])) for r in rows
                     if (r["heads"], r["kv"], r["split_how"]) == (heads, kv, how))
        line, = ax.plot([p[0] for p in sel], [p[1] for p in sel], "o-", label=f"{heads} {kv} {how}")
        ax.plot([p[0] for p in sel], [p[2] for p in sel], "x:", color=line.get_color(), alpha=0.6,
                label=f"{heads} {kv} {how}, old suffix")
    ax.axhline(1.05, color="k", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T (batch 1)")
    ax.set_ylabel("(prefix + suffix attention) / whole")
    meta = rows[0]
    ax.set_title(f"split attention vs whole, TP=2 heads, {meta['gpu']}, torch {meta['torch']}, {meta['git_commit']}",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
