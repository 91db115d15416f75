"""A Hugging Face model sharded with its own tp_plan, compiled with backend="tokenweave".

    python examples/hf_tp.py --arch qwen3                          # no GPUs: 2 CPU ranks over gloo
    torchrun --nproc-per-node 2 examples/hf_tp.py --arch llama --size 8b --tokens 1024 2048 --decode

Builds ``--arch`` at ``--size`` dims with random weights (the same seed on every rank; no
download), shards it with transformers' own tensor-parallel plan, compiles it with
``torch.compile(backend="tokenweave", fullgraph=True)`` and prints the explain report (every
all_reduce site: fused or not and why) and the difference against the eager TP model.

On GPUs it also times prefill (``use_cache=False``; by default the decoder stack ``model.model``,
whose all_reduces are all there is to fuse; ``--target causal_lm`` adds the lm_head on the last
token) for each ``--variants``:

    eager       the TP model as transformers runs it
    default     torch.compile(model, fullgraph=True): Inductor with NCCL all_reduces (module
                backward hooks traced as no-ops, as for tokenweave: ``inductor`` below)
    tokenweave  torch.compile(model, backend="tokenweave", fullgraph=True)
    nocomm      "default" with every all_reduce replaced by the identity: wrong results, the
                ceiling for what hiding communication can give

and with ``--decode`` the decode step (one new token per sequence) at each ``--decode-batches``
size (default 1 8 64 256) against a static KV cache holding ``--decode-context`` tokens (default
1024), compiled with static shapes (one graph per batch size) and timed on GPUs under CUDA graphs
for every variant, eager included (``--phases decode`` alone skips prefill); ``--decode-out DIR``
writes those rows to ``DIR/hf_decode_<arch>_<size>.csv`` (GPU, torch/triton versions, commit,
date) and a PNG. Prefill: medians of ``--iters`` runs timed with CUDA events after ``--warmup``.
``--csv PATH`` appends one row per (phase, T, variant) with the GPU, versions, commit and date.
On CPU nothing is timed unless ``--time`` is given, and only ``tokenweave`` runs by default (the
eager model is the reference every row is compared with). The explain report lists every graph
the ``tokenweave`` variant compiled, labelled with the prefill T or the decode batch it was for.

    torchrun --nproc-per-node 2 examples/hf_tp.py --size 8b --phases decode --decode-out benchmarks/results
    python examples/hf_tp.py --phases decode --decode-context 16 --decode-batches 1 3 --decode-out /tmp/d

Each (variant, T) compiles from scratch (``torch._dynamo.reset()``) with static shapes unless
``--dynamic`` marks the token dim dynamic, which compiles each variant once for all ``--tokens``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

VARIANTS = ("eager", "default", "tokenweave", "nocomm")
CSV_FIELDS = ["date", "gpu", "torch", "transformers", "commit", "world", "arch", "size", "layers", "batch",
              "tokens", "dtype", "phase", "variant", "ms", "compile_s", "max_abs_diff", "rel_err", "fused_sites",
              "all_reduce_sites", "kernel"]


def _progress(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[hf_tp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _bench(fn: Callable[[], object], warmup: int, iters: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()``: CUDA events on GPU, wall clock on CPU."""
    for _ in range(warmup):
        fn()
    if dist.is_initialized():
        dist.barrier()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _compiled(model, variant: str, kernel: str, dynamic: Optional[bool] = None):
    """The callable for ``variant`` (Dynamo state reset first, so nothing is shared between variants)."""
    import weave_compile

    torch._dynamo.reset()
    weave_compile.reset()
    if variant == "eager":
        return model
    if variant == "tokenweave":
        return torch.compile(model, backend="tokenweave", fullgraph=True, dynamic=dynamic, options={"kernel": kernel})
    return torch.compile(model, backend=inductor, fullgraph=True, dynamic=dynamic)  # default, nocomm


def inductor(gm: torch.fx.GraphModule, example_inputs):
    """``torch.compile``'s default backend, Inductor, for the ``default`` and ``nocomm`` variants.

    Under its own name so that transformers 5.17's q/k-norm backward hooks (Qwen3, Gemma3) trace
    as the no-ops they are under no_grad for the baseline too (``weave_compile.backward_hooks``):
    torch.compile alone refuses them with ``fullgraph=True``, and without it would cut the model
    into a graph per q/k norm, not the same program as the ``tokenweave`` variant compiles.
    """
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    from weave_compile.testing.numerics import rel_err

    return (out.float() - ref.float()).abs().max().item(), rel_err(out, ref)


def main(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import contextlib

    from weave_compile import backward_hooks
    from hf_models import build_model, expected_fused_sites, prompt, without_all_reduce

    backward_hooks.install(inductor)

    # A graph served from Inductor's caches skips the passes (the report then shows what they did
    # when it was compiled): off unless asked for, so that a run shows this run's passes.
    torch._inductor.config.fx_graph_cache = args.fx_cache
    torch._functorch.config.enable_autograd_cache = args.fx_cache
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    timing = cuda or args.time
    _progress(rank, f"building {args.arch} ({args.size}, {args.layers or 'default'} layers, {dtype}) on "
                    f"{world_size} ranks ({dist.get_backend()})")
    t0 = time.perf_counter()
    model = build_model(args.arch, args.size, layers=args.layers, seed=args.seed, dtype=dtype, device=device)
    cfg = model.config
    _progress(rank, f"built and sharded in {time.perf_counter() - t0:.1f} s: H={cfg.hidden_size}, "
                    f"layers={cfg.num_hidden_layers}, expected fusable sites={expected_fused_sites(model)}")
    target = model.model if args.target == "model" else model
    kwargs = dict(use_cache=False) if args.target == "model" else dict(use_cache=False, logits_to_keep=1)

    def out_of(o) -> torch.Tensor:
        return o.last_hidden_state if args.target == "model" else o.logits

    rows, reports = [], []  # reports: the tokenweave graphs, labelled
    base = dict(arch=args.arch, size=args.size, layers=cfg.num_hidden_layers, batch=args.batch, dtype=str(dtype),
                world=world_size)
    prefill = "prefill" in args.phases
    steps = (len(args.tokens) if prefill else 0) * len(args.variants)
    steps += len(args.variants) * len(args.decode_batches) if "decode" in args.phases else 0
    step = 0
    with torch.no_grad():
        refs = {}
        for T in args.tokens if prefill else []:
            ids = prompt(args.batch, T, cfg.vocab_size, args.seed, device)
            refs[T] = out_of(target(ids, **kwargs))
        # One variant at a time over every T: with --dynamic it compiles once.
        for variant in args.variants if prefill else []:
            fn = _compiled(target, variant, args.kernel) if args.dynamic else None
            for T in args.tokens:
                step += 1
                ids = prompt(args.batch, T, cfg.vocab_size, args.seed, device)
                if args.dynamic:
                    torch._dynamo.mark_dynamic(ids, 1)
                else:
                    fn = _compiled(target, variant, args.kernel)
                _progress(rank, f"{step}/{steps} prefill T={T} {variant}: compiling / first run")
                with without_all_reduce() if variant == "nocomm" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    out = out_of(fn(ids, **kwargs))
                    if cuda:
                        torch.cuda.synchronize()
                    compile_s = time.perf_counter() - t0
                    max_abs, rel = _diff(out, refs[T])
                    ms = _bench(lambda: fn(ids, **kwargs), args.warmup, args.iters, cuda) if timing else None
                rep = _new_graphs(reports, f"prefill T={T}" + (" (dynamic T)" if args.dynamic else ""), variant)
                rows.append(_row(base, "prefill", T, variant, ms, compile_s, max_abs, rel, rep))
                _progress(rank, f"{step}/{steps} prefill T={T} {variant}: {_ms(ms)}, first call "
                                f"{compile_s:.1f} s, max |out - eager| {max_abs:.3g} (rel {rel:.2g})")
        if "decode" in args.phases:
            rows += _decode(rank, model, args, base, reports, cuda, timing, step, steps)
    return {"rows": rows, "reports": reports}


def _decode(rank, model, args, base, reports, cuda, timing, step, steps) -> list[dict]:
    """The decode step after ``--decode-context`` cached tokens, per ``--decode-batches`` size and variant.

    One new token per sequence (T = batch rows) against a static KV cache at a fixed position:
    transformers 5.17's static cache layers advance a device counter (``cumulative_length``) on
    every call, so each timed step first resets every layer's counter to the context length (one
    ``_foreach_copy_`` launch, in every variant) and then rewrites the same cache slot with the same
    key/value: every call does the same work. Compiled variants use static shapes, so each batch size gets its own graph, the
    way serving engines capture fixed sizes. On GPUs the step is timed as CUDA-graph replays
    (``benchmarks/common.py``'s Timer: ``--iters`` steps captured in one graph, median of 5 replays,
    max over ranks) for every variant alike, eager included. Logits are checked against the eager
    step of the same batch."""
    import contextlib

    import transformers
    from hf_models import ARCHS, prompt, without_all_reduce

    cfg, device = model.config, next(model.parameters()).device
    ctx_len = args.decode_context
    if ARCHS[args.arch].sliding_cache:
        _progress(rank, "note: sliding-window cache layers keep a Python int position: each decode step "
                        "recompiles until Dynamo makes it dynamic")
    states = {}
    for b in args.decode_batches:  # an eagerly prefilled cache per batch size, shared by the variants
        cache = transformers.StaticCache(config=cfg, max_cache_len=ctx_len + 8)
        model(prompt(b, ctx_len, cfg.vocab_size, args.seed, device), past_key_values=cache, use_cache=True)
        tok = prompt(b, 1, cfg.vocab_size, args.seed + 1, device)
        pos = torch.tensor([ctx_len], device=device)
        counters = [layer.cumulative_length for layer in cache.layers if hasattr(layer, "cumulative_length")]
        rewind = ([torch.full_like(c, ctx_len) for c in counters], counters)
        torch._foreach_copy_(rewind[1], rewind[0])
        ref = model(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits
        states[b] = (cache, tok, pos, rewind, ref)
    rows = []
    for variant in args.variants:
        fn = _compiled(model, variant, args.kernel, dynamic=False)
        for b in args.decode_batches:
            step += 1
            cache, tok, pos, rewind, ref = states[b]

            def run(fn=fn, cache=cache, tok=tok, pos=pos, rewind=rewind):
                torch._foreach_copy_(rewind[1], rewind[0])  # back to ctx_len cached tokens
                return fn(tok, past_key_values=cache, cache_position=pos, use_cache=True)

            _progress(rank, f"{step}/{steps} decode ctx={ctx_len} batch={b} {variant}: compiling / first run")
            with without_all_reduce() if variant == "nocomm" else contextlib.nullcontext():
                t0 = time.perf_counter()
                logits = run().logits
                if cuda:
                    torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                max_abs, rel = _diff(logits, ref)
                ms = None
                if cuda:
                    ms = _graph_timer(args)(run, args.iters) / 1e3
                elif timing:
                    ms = _bench(run, args.warmup, args.iters, cuda)
            rep = _new_graphs(reports, f"decode batch={b} (+{ctx_len} cached)", variant)
            rows.append(_row(dict(base, batch=b), f"decode@{ctx_len}", 1, variant, ms, compile_s, max_abs, rel, rep))
            _progress(rank, f"{step}/{steps} decode batch={b} {variant}: {_ms(ms)}, max |logits - eager| "
                            f"{max_abs:.3g} (rel {rel:.2g})")
    return rows


def _new_graphs(reports: list, label: str, variant: str):
    """The explain report of the graphs the last call compiled, each added to ``reports`` with
    ``label`` (None for other variants). The explain report holds every graph since the last
    ``weave_compile.reset()``: the new ones are those not in ``reports`` yet. A call that compiled
    nothing (``--dynamic`` after the first T) ran the graph compiled last."""
    import weave_compile
    from weave_compile.report import WeaveReport

    if variant != "tokenweave":
        return None
    seen = {id(g) for _, g in reports}
    new = [g for g in weave_compile.explain().graphs if id(g) not in seen]
    reports += [(label, g) for g in new]
    return WeaveReport(graphs=new or [g for _, g in reports[-1:]])


def _ms(ms: Optional[float]) -> str:
    return "not timed" if ms is None else f"{ms:.3f} ms"


def _graph_timer(args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from common import Timer

    return Timer(repeats=5, warmup=args.warmup, graph=True)


def _row(base: dict, phase: str, tokens: int, variant: str, ms: Optional[float], compile_s: float, max_abs: float,
         rel: float, rep) -> dict:
    """One result row: ``tokens`` per sequence, ``ms`` None where not timed; ``rep`` (the explain
    report) only for the tokenweave variant."""
    row = dict(base, tokens=tokens, phase=phase, variant=variant, ms=ms, compile_s=compile_s, max_abs_diff=max_abs,
               rel_err=rel, fused_sites="", all_reduce_sites="", kernel="")
    if rep is not None:
        row.update(fused_sites=rep.matched_count, all_reduce_sites=len(rep.sites),
                   kernel="/".join(sorted({s.kernel for s in rep.sites if s.fused})) or "-")
    return row


# ----------------------------------------------------------------------------- output


def _commit() -> str:
    """The commit these numbers belong to (benchmarks/common.py's rule: ``WEAVE_COMMIT``, else git)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from common import commit

    return commit()


def _report(result: dict, args: argparse.Namespace) -> None:
    import dataclasses

    from weave_compile.report import WeaveReport

    graphs = [dataclasses.replace(g, graph_id=i, label=label) for i, (label, g) in enumerate(result["reports"])]
    if graphs:
        print(f"== tokenweave explain: every graph it compiled\n{WeaveReport(graphs=graphs)}\n")
    rows = result["rows"]
    timed = any(r["ms"] is not None for r in rows)
    columns = [("phase", "<7", lambda r: r["phase"].split("@")[0]), ("batch", ">5", lambda r: r["batch"]),
               ("tokens", ">6", lambda r: r["tokens"]),
               ("cached", ">6", lambda r: r["phase"].split("@")[1] if "@" in r["phase"] else "-"),
               ("variant", "<10", lambda r: r["variant"])]
    if timed:
        columns.append(("ms", ">9", lambda r: "-" if r["ms"] is None else f"{r['ms']:.3f}"))
    columns += [("first call s", ">12", lambda r: f"{r['compile_s']:.1f}"),
                ("max|diff|", ">10", lambda r: "reference" if r["variant"] == "eager" else f"{r['max_abs_diff']:.3g}"),
                ("rel err", ">8", lambda r: "-" if r["variant"] == "eager" else f"{r['rel_err']:.2g}")]
    table = [[name for name, _, _ in columns]] + [[str(get(r)) for _, _, get in columns] for r in rows]
    lines = ["  ".join(f"{cell:{align}}" for cell, (_, align, _) in zip(cells, columns)) for cells in table]
    print("\n".join([lines[0], "-" * len(lines[0])] + lines[1:]))
    print("tokens: per sequence; diff: against the eager TP model (decode: its eager step)")
    if any(r["variant"] == "nocomm" for r in rows):
        print("nocomm drops every all_reduce: its diff is expected to be large")
    if not timed:
        print("ms: not timed on CPU (--time times it)")
    decode_rows = [r for r in result["rows"] if r["phase"].startswith("decode")]
    if args.decode_out and decode_rows:
        _write_decode(decode_rows, args)
    if args.csv:
        import transformers

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and args.launched == "torchrun" else "cpu"
        extra = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), gpu=gpu,
                     torch=torch.__version__, transformers=transformers.__version__,
                     commit=args.commit or _commit())
        new = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                w.writeheader()
            for r in result["rows"]:
                w.writerow({**extra, **{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()}})
        print(f"appended {len(result['rows'])} rows to {args.csv}")


DECODE_COLUMNS = ["gpu", "torch", "triton", "transformers", "git_commit", "date", "world", "arch", "size", "layers",
                  "dtype", "phase", "batch", "variant", "ms", "x_default", "compile_s", "max_abs_diff", "rel_err",
                  "fused_sites", "all_reduce_sites", "kernel"]


def _write_decode(rows: list[dict], args: argparse.Namespace) -> None:
    """``hf_decode_<arch>_<size>.csv`` (+ ``.png`` when matplotlib is there) in ``--decode-out``."""
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from common import meta, write_csv

    info = dict(meta(), transformers=transformers.__version__)
    if args.commit:
        info["git_commit"] = args.commit
    if args.launched != "torchrun":
        info["gpu"] = "cpu"  # spawned CPU ranks: nothing here ran on a GPU
    default = {r["batch"]: r["ms"] for r in rows if r["variant"] == "default"}
    out = []
    for r in rows:
        x = r["ms"] / default[r["batch"]] if default.get(r["batch"]) and r["ms"] is not None else None
        out.append({**info, **{k: r[k] for k in DECODE_COLUMNS if k in r}, "x_default": x})
    stem = os.path.join(args.decode_out, f"hf_decode_{args.arch}_{args.size}")
    write_csv(stem + ".csv", out, DECODE_COLUMNS)
    print(f"wrote {stem}.csv")
    if all(r["ms"] is None for r in out):
        print("nothing timed (--time times it on CPU): no plot")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"# matplotlib unavailable ({e}); no plot")
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for variant in dict.fromkeys(r["variant"] for r in out):
        pts = sorted((r["batch"], r["ms"]) for r in out if r["variant"] == variant and r["ms"] is not None)
        ax.plot([b for b, _ in pts], [m for _, m in pts], marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (sequences, 1 new token each)")
    ax.set_ylabel("ms per decode step (CUDA graph replay)")
    ax.set_title(f"{args.arch} {args.size}, TP={out[0]['world']}, {args.decode_context} cached tokens\n"
                 f"{info['gpu']}, torch {info['torch']}, {info['git_commit']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {stem}.png")


def _parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from weave_compile.config import Options
    from hf_models import ARCHS, SIZES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    p.add_argument("--size", choices=list(SIZES), default="tiny", help="dims preset (default tiny)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the size's own)")
    p.add_argument("--tokens", type=int, nargs="+", default=[37], help="prefill tokens per sequence, one or more")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                   help="default: all on GPU or with --time; tokenweave alone on CPU (the eager model is "
                        "the reference in every case)")
    p.add_argument("--phases", nargs="+", choices=("prefill", "decode"), default=["prefill"],
                   help="prefill (use_cache=False) and/or one decode step with a static KV cache")
    p.add_argument("--decode", action="store_true", help="shorthand: add the decode phase")
    p.add_argument("--decode-context", type=int, default=1024, help="tokens in the cache (default 1024)")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 64, 256],
                   help="decode batch sizes (sequences, one new token each; default 1 8 64 256)")
    p.add_argument("--decode-out", default=None,
                   help="write the decode rows as CSV + PNG here (DIR/hf_decode_<arch>_<size>.{csv,png})")
    p.add_argument("--target", choices=("model", "causal_lm"), default="model",
                   help="prefill: the decoder stack (default) or the whole causal LM with logits of the last token")
    p.add_argument("--dynamic", action="store_true", help="mark the token dim dynamic: one compile per variant")
    p.add_argument("--kernel", default="auto", choices=Options.choices("kernel"),
                   help="tokenweave fused-op kernel (the kernel option; default auto)")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--fx-cache", action="store_true",
                   help="let Inductor serve cached graphs (faster reruns): a graph served from its cache skips "
                        "the passes, and the explain report shows the sites recorded when it was compiled, with "
                        "a note that says so")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--time", action="store_true", help="time on CPU too (always on GPU)")
    p.add_argument("--csv", default=None, help="append the results to this CSV")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    p.add_argument("--ranks", type=int, default=2, help="CPU ranks when not under torchrun (default 2)")
    args = p.parse_args(argv)
    args.launched = "torchrun" if "RANK" in os.environ else "spawn"
    if args.variants is None:
        gpu = args.launched == "torchrun" and torch.cuda.is_available()
        args.variants = list(VARIANTS) if gpu or args.time else ["tokenweave"]
    if args.decode and "decode" not in args.phases:
        args.phases.append("decode")
    return args


if __name__ == "__main__":
    args = _parse()
    if args.launched == "torchrun":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        rank = int(os.environ["RANK"])
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend)
        try:
            result = main(rank, dist.get_world_size(), args)
            if rank == 0:
                _report(result, args)
        finally:
            dist.destroy_process_group()
    else:
        from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

        print(f"no torchrun: spawning {args.ranks} CPU ranks (gloo)", file=sys.stderr)
        # The ranks' harness turns Inductor's caches off (its tests want the passes to run): an
        # environment variable that the config set in main() cannot override, so --fx-cache sets it.
        cache = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"} if args.fx_cache else {}
        results = assert_ranks_ok(run_ranks(main, args.ranks, args=(args,), timeout=1800, env=cache))
        _report(results[0], args)
