"""Per-layer prefill latency of a TP=2 Llama stack: default vs nocomm vs fused vs fused+split.

TokenWeave's Figures 9 and 11 as one script. Run on 2 GPUs:

    torchrun --nproc-per-node 2 benchmarks/bench_split.py --dims 8b --out benchmarks/results
    torchrun --nproc-per-node 2 benchmarks/bench_split.py --dims 8b --sweep 8192,16384 --out ...

Model: ``weave_compile.testing.models.TPLlama`` (Megatron-style TP, vocab-parallel embedding,
``--layers`` decoder layers, bf16, batch 1), Llama-3-8B dims (H=4096, I=14336, 32/8 heads) or
70B dims (H=8192, I=28672, 64/8 heads); the vocabulary is cut to 32000 (the embedding is a
gather: its size does not change the time).

Variants, every one ``torch.compile``d in this process and timed side by side:

* ``default``   Inductor, ``dist.all_reduce`` through NCCL (what users get today)
* ``nocomm``    the same graph with every all_reduce deleted (wrong results: the ceiling)
* ``autotune``  ``backend="tokenweave"`` with the defaults (``kernel="auto"``, ``autotune=True``):
  what a user gets. Its sites are fused where the measured choice at compile time says so, else
  left as written (plain Inductor's program); its ``design`` column says which
* ``fused``     ``backend="tokenweave"`` with ``split=False`` (fused AllReduce-RMSNorm only)
* ``split``     ``backend="tokenweave"``: fused + token split + two-stream overlap
* ``V@N``       variant V with ``comm_ctas=N`` (e.g. ``split@16``)
* ``V/D``       variant V with ``kernel=D`` (e.g. ``split/ce``; default: the config's, ``auto``)

Every variant runs under ``--mode`` (default "reduce-overhead": CUDA graphs). Without CUDA graphs
a 4-layer stack at these sizes is bound by host launch overhead (the split doubles the launches),
which hides what the GPU does.

Every variant is compiled as a static graph per T (``dynamic=False``; the split then uses the
smart split of ``weave_compile.passes.split_tokens.smart_split``); ``--dynamic`` compiles one graph per variant with
the token dimension dynamic instead (the split then uses T // 2). ``--sweep T,...`` also times
forced split points ``T//2 + offset`` (variants ``split:<offset>``) at those T, to compare the
smart choice with the best swept one.

``--designs p2p,ce,reference``: the variants ``fused/<design>`` and ``split/<design>`` for each
(``kernel=<design>``), after ``default`` and ``nocomm``; any variant takes ``/<design>`` the same
way. Every fused site of such a variant must run that design (checked, see below);
``benchmarks/check_2gpu.sh`` runs this on two GPUs for ``p2p``, ``ce`` and ``reference``.

One GPU, no peers (PyTorch's fake process group: ``FakeStore``, backend "fake", world size 2, this
process is rank 0 and holds rank 0's shard; ``benchmarks/fake_comm.py``):

* ``--fake-comm``: the product's own cost with communication free. The fused op runs the ``ce``
  design's own program on rank 0's rows with every transfer into a peer and every flag left out
  (the add+norm kernel, the copies into rank 0's outputs, the peers' rows from local memory holding
  real values: fake_comm.py), so ``split`` against ``fused`` and ``nocomm`` is what the split itself costs
  (per-half GEMMs, attention, add+norm kernels, launches, stream joins). Writes
  ``split_fake_<dims>.csv`` / ``.png``.
* ``--rehearse [--link-gbps 370]``: the whole split rehearsed. Rank 0's ``ce`` program as in
  production, the peer emulated on its own stream (its copies and flags; its add+norm a paced
  delay), every cross-GPU copy paced to the NVLink rate by PCIe copies that hold no SM; what that
  models and what not: docs/rehearsal.md. ``fused`` is the same design unsplit with its peer
  emulated the same way. Writes ``split_rehearsal_<dims>.csv`` / ``.png``.

Both run in one process (no torchrun), refuse ``default`` (its all_reduce moves nothing on the fake
group) and force ``kernel="ce"``; ``--layers 2`` keeps a run short (compiles dominate); ``--merged``
times layers built with one QKV and one gate/up GEMM (as served) instead of Hugging Face's five, which
the split variants merge themselves (``merge_projections``, the default; ``--no-merge-projections``
keeps them separate). ``--hf llama`` times a Hugging Face model at ``--dims`` instead, sharded by its
own ``tp_plan`` (DTensor parameters, whose projections the split leaves separate; variants fused
and split)::

    python benchmarks/bench_split.py --fake-comm --dims 8b --layers 2 --out benchmarks/results
    python benchmarks/bench_split.py --rehearse --dims 70b --layers 2 --out benchmarks/results
    python benchmarks/bench_split.py --fake-comm --hf llama --dims 8b --layers 2 --rounds 3 --tokens 2048,4096

Kernel counts: ``kernels`` is every Inductor kernel launch in the variant's generated code per
forward (Triton or C++; cuBLAS and custom ops not counted), ``pointwise_kernels`` the pointwise ones
(``weave_compile.testing.kernel_counts``), from the compile at that T (with ``--dynamic``, the one
compile). The split runs each per-token kernel once per half, so about twice the fused variant's.

Every variant stops (``--keep-going``: is skipped and listed, exit status 1) rather than time
something else: when no site was fused, when a fused site runs another design than the one asked
for, when a fused op fell back at run time (a warning of the op), or when the fake ``ce`` entry was
never called.

Timing: warm-up, then ``--repeats`` x (barrier, CUDA events around ``--iters`` back-to-back
forward calls), median per call, max over ranks, divided by the layer count (the embedding's
gather and the final norm are included, amortized). Rank 0 writes ``split_<dims>.csv`` (after
every point) and a PNG (left: each variant over default, over nocomm where default is not run;
right: the sweep, star = smart split), and prints each T's ratios with the targets. A point that
hangs (a stream wait never released) ends the run after ``--watchdog-s`` with every thread's stack.
Never enables NVLink multicast.

``--rounds N`` (N > 1): per T, every variant is compiled first and then timed in N rounds, the
order reversed every other round, median per variant: the GPU's speed drifts during a run (the
same variant read 4-9% apart between runs), and timing the variants one after another puts that
drift into their ratio. Static graphs at ``--tokens`` only.

``--profile``: after timing each point, one more forward under torch.profiler, summarized by
``kernel_timeline.summarize`` (times per layer, kernel counts per forward: wall, time with a
compute kernel running, idle time when none ran, time per kind of kernel) into ``<csv
name>_profile.csv``: whether a variant is slower because its kernels take longer or because its
compute streams wait.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)
import kernel_timeline  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COLUMNS = ["gpu", "torch", "triton", "git_commit", "date", "world_size", "mode", "dims", "layers", "T", "variant",
           "split_at", "ms_per_layer", "kernels", "pointwise_kernels", "design"]
DIMS = {"8b": dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=32000, eps=1e-5),
        "70b": dict(hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=32000, eps=1e-5)}


class HFDecoder(torch.nn.Module):
    """A Hugging Face causal LM's decoder stack (what the split covers), called as TPLlama is:
    token ids in, hidden states out (``use_cache=False``: prefill)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.decoder = lm.model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids=x, use_cache=False).last_hidden_state


def build(dims: str, layers: int, comm: bool, dev, merged: bool = False, hf_arch: str = ""):
    from weave_compile.testing.models import LlamaDims, TPLlama

    if hf_arch:  # sharded by its own tp_plan (DTensor parameters), the same seed for every variant
        import hf_models as hf

        if not comm or merged:
            raise SystemExit("--hf: the variants fused and split only, the model's own layout (no --merged)")
        return None, HFDecoder(hf.build_model(hf_arch, dims, layers=layers, tp=True, seed=0, dtype=torch.bfloat16,
                                              device=dev))

    d = LlamaDims(layers=layers, merged=merged, **DIMS[dims])
    group = dist.group.WORLD if comm else None
    # Without a group TPLlama keeps its sharded weights and skips every all_reduce ("nocomm").
    return d, TPLlama(d, tp=dist.get_world_size(), rank=dist.get_rank(), group=group, dtype=torch.bfloat16,
                      device=dev)


def setup(fake: bool = False) -> tuple[int, torch.device]:
    """NCCL process group from torchrun's environment, or the fake one of world size 2 on one
    GPU (``--fake-comm``, ``--rehearse``; its collectives write every row: fake_group.py); this
    rank's GPU."""
    if fake:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("--fake-comm / --rehearse run in ONE process on one GPU; do not use torchrun")
        import fake_group

        return 0, fake_group.init(2)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    return rank, dev


def parse_variant(variant: str) -> tuple[str, str, str, str]:
    """``kind[/design][:offset][@ctas]`` -> ``(kind, design, offset, ctas)`` (empty where absent)."""
    rest, _, ctas = variant.partition("@")
    rest, _, offset = rest.partition(":")
    kind, _, design = rest.partition("/")
    if kind not in ("default", "autotune", "nocomm", "fused", "split"):
        raise SystemExit(f"unknown variant {variant!r}: kind must be default, autotune, nocomm, fused or split")
    if kind == "autotune" and (design or offset):
        raise SystemExit(f"{variant}: autotune is the defaults (kernel='auto' measured, no split): "
                         "no /design or :offset")
    return kind, design, offset, ctas


def variants_of(args) -> list[str]:
    fake = args.fake_comm or args.rehearse
    if args.variants:
        variants = args.variants.split(",")
    elif args.designs:
        variants = ["nocomm"] + [f"{k}/{d}" for d in args.designs.split(",") for k in ("fused", "split")]
        variants = variants if fake else ["default", "autotune"] + variants
    else:
        variants = ["nocomm", "fused", "split"] if fake else ["default", "autotune", "nocomm", "fused", "split"]
    sweep = [f"split:{o}" for o in args.sweep_offsets.split(",")] if args.sweep else []
    variants += sweep
    if args.hf and not args.variants:
        variants = [v for v in variants if parse_variant(v)[0] in ("fused", "split")]
    for v in variants:
        kind, design, _, _ = parse_variant(v)
        if args.hf and kind not in ("fused", "split"):
            raise SystemExit(f"{v}: --hf times the variants fused and split only (the model's all_reduces stay)")
        if fake and kind in ("default", "autotune"):
            raise SystemExit(f"variant {kind!r} on the fake process group times an all_reduce that moves nothing; "
                             "leave it out with --fake-comm / --rehearse")
        if fake and design not in ("", "ce"):
            raise SystemExit(f"{v}: --fake-comm / --rehearse emulate the ce design only")
    return variants


class PointCheck(logging.Handler):
    """Never time the wrong thing: after a variant's compiling call, every fused site must run the
    design asked for, a fake ``ce`` entry must have been called, and no fused op may have fallen
    back at run time (the op logs a warning; a fallback inside CUDA-graph capture would otherwise
    time the ``reference`` op under the design's name)."""

    def __init__(self, fake):
        super().__init__(logging.WARNING)
        self.fake, self.fallbacks, self.calls = fake, [], 0
        logging.getLogger("weave_compile.ops.allreduce_rmsnorm").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "fell back" in record.getMessage():
            self.fallbacks.append(record.getMessage())

    def start(self) -> None:
        self.calls = self.fake.calls if self.fake is not None else 0
        self.fallbacks.clear()

    def no_fallback(self, variant: str) -> None:
        if self.fallbacks:
            raise RuntimeError(f"{variant}: a fused op fell back at run time: {self.fallbacks[0]}")

    def sites(self, variant: str, design: str, fresh: bool) -> str:
        """The design every fused site runs (checked against ``design`` when one is asked for)."""
        import weave_compile

        self.no_fallback(variant)
        kind = parse_variant(variant)[0]
        if kind in ("default", "nocomm"):
            return "-"
        sites = [s for g in weave_compile.explain().graphs for s in g.sites]
        fused = [s for s in sites if s.fused]
        if kind == "autotune":  # the measured choice may keep every site as written: that is its answer
            return "+".join(sorted({s.kernel for s in fused})) if fused else "as written"
        if not fused:
            raise RuntimeError(f"{variant}: no all_reduce site was fused ({[s.reason for s in sites][:3]}): "
                               "this would time the unfused graph")
        got = sorted({s.kernel for s in fused})
        if design and got != [design]:
            bad = [(s.node, s.kernel, s.kernel_reason) for s in fused if s.kernel != design]
            raise RuntimeError(f"{variant}: sites run {got}, not {design!r} only: {bad[:3]}")
        if self.fake is not None and fresh and self.fake.calls <= self.calls:
            raise RuntimeError(f"{variant}: the fake ce entry was never called: something else ran the fused op")
        return "+".join(got)


def summarize(rows: list[dict], label: str) -> None:
    """Each T's ratios (every split variant over its fused one, nocomm and default), with the
    targets this mode is held to (docs/rehearsal.md)."""
    ms = {(int(r["T"]), r["variant"]): float(r["ms_per_layer"]) for r in rows}
    targets = {"fake-comm": "split/fused <= 1.06 at 1024, <= 1.02 from 2048 (8B); <= 1.00 from 2048 (70B)",
               "rehearse": "8B: split <= 0.92x fused from 2048, <= 1.03x nocomm from 4096; 70B: split <= 1.00x "
                           "nocomm from 4096"}
    print(f"summary ({label}; targets: {targets.get(label, 'none')})")
    for t in sorted({t for t, _ in ms}):
        parts = []
        for v in [v for tt, v in ms if tt == t and parse_variant(v)[0] in ("split", "fused", "autotune")
                  and ":" not in v]:
            kind = parse_variant(v)[0]
            bases = (("fused" + v[len("split"):]),) if kind == "split" else ()
            for b in bases + ("nocomm", "default"):
                if (t, b) in ms:
                    parts.append(f"{v} over {b} {ms[(t, v)] / ms[(t, b)]:.3f}")
        print(f"  T={t:6d}: " + ", ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", choices=sorted(DIMS), default="8b")
    ap.add_argument("--merged", action="store_true", help="one QKV and one gate/up GEMM per layer (Megatron's, "
                    "vLLM's layout) instead of Hugging Face's separate projections; CSV stem + '_merged'")
    ap.add_argument("--hf", default="", metavar="ARCH", help="time a Hugging Face model of this architecture "
                    "(weave_compile.testing.hf.ARCHS) at --dims, sharded by its tp_plan, instead of TPLlama; "
                    "variants fused and split; CSV stem 'split[_fake|_rehearsal]_hf_<arch>_<dims>'")
    ap.add_argument("--no-merge-projections", action="store_true", help="merge_projections=False: split variants "
                    "keep sibling linears as separate GEMMs (the default merges them); CSV stem + '_nomp'")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--variants", default="", help="comma list of kind[/design][:offset][@ctas] (default: "
                    "default,nocomm,fused,split; on the fake group nocomm,fused,split)")
    ap.add_argument("--designs", default="", help="comma list of designs: fused/<d> and split/<d> for each")
    ap.add_argument("--sweep", default="", help="T values at which to also time forced split points")
    ap.add_argument("--sweep-offsets", default="-256,0,256,512,1024", help="forced split points: T//2 + offset")
    ap.add_argument("--dynamic", action="store_true", help="one graph per variant with the token dimension "
                    "dynamic (the split then uses T // 2) instead of a static graph per T")
    ap.add_argument("--comm-ctas", type=int, default=32)
    ap.add_argument("--mode", default="reduce-overhead", help="torch.compile mode for every variant "
                    "('default': no CUDA graphs, launch-bound below ~8K tokens)")
    fake_args = ap.add_mutually_exclusive_group()
    fake_args.add_argument("--fake-comm", action="store_true", help="one GPU, fake process group of 2 ranks: "
                           "the ce design's own local work, no transfer (the split's own cost)")
    fake_args.add_argument("--rehearse", action="store_true", help="one GPU, fake process group of 2 ranks: "
                           "ce with its peer emulated and transfers paced to --link-gbps (docs/rehearsal.md)")
    ap.add_argument("--link-gbps", type=float, default=370.0, help="--rehearse: NVLink GB/s per direction")
    ap.add_argument("--peer-skew-us", type=float, default=0.0, help="--rehearse: the peer starts each op later")
    ap.add_argument("--norm-gbps-per-cta", type=float, default=None,
                    help="--rehearse: the peer's add+norm rate (default: the measured table)")
    ap.add_argument("--profile", action="store_true", help="also profile one forward per point (kernel_timeline)")
    ap.add_argument("--rounds", type=int, default=1, help="> 1: per T, compile every variant, then time them "
                    "in this many rounds, the order reversed every other round (median per variant)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--watchdog-s", type=float, default=900.0, help="end the run (stacks printed) when one "
                    "point takes longer: a stream wait that is never released must not hang the machine")
    ap.add_argument("--keep-going", action="store_true", help="a variant whose sites do not run the design "
                    "asked for is skipped (listed, exit status 1) instead of ending the run")
    ap.add_argument("--csv-name", default="", help="file name stem (default by mode: split_<dims>, "
                    "split_fake_<dims>, split_rehearsal_<dims>)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    fake_mode = "fake-comm" if args.fake_comm else "rehearse" if args.rehearse else ""
    if args.rehearse:  # streams blocked in a wait must not share a hardware queue (before CUDA starts)
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    variants = variants_of(args)

    rank, dev = setup(bool(fake_mode))
    import weave_compile
    import fake_comm
    from weave_compile.testing.kernel_counts import compiled_launches, pointwise

    fake = None
    if args.fake_comm:
        fake = fake_comm.install("local")
    elif args.rehearse:
        fake = fake_comm.install("rehearse", link_gbps=args.link_gbps, peer_skew_us=args.peer_skew_us,
                                 norm_gbps_per_cta=args.norm_gbps_per_cta)
    if fake is not None:
        print(fake.describe(), flush=True)
    meta = dict(run_meta(dev), world_size=dist.get_world_size(), dims=args.dims, layers=args.layers,
                mode=args.mode + {"": "", "fake-comm": " fake-comm", "rehearse": f" rehearse@{args.link_gbps:g}"}[
                    fake_mode] + (f" interleaved x{args.rounds}" if args.rounds > 1 else "")
                + (" merged" if args.merged else "") + (" no-merge-projections" if args.no_merge_projections else "")
                + (f" hf:{args.hf}" if args.hf else ""))
    rows = []
    mode = None if args.mode == "default" else args.mode
    dynamic = True if args.dynamic else False

    def tokens_for(t, dynamic):
        x = torch.randint(0, 32000, (1, t), device=dev, generator=torch.Generator(device=dev).manual_seed(t))
        if dynamic:
            torch._dynamo.mark_dynamic(x, 1)
        return x

    name = args.csv_name or {"": "split_", "fake-comm": "split_fake_", "rehearse": "split_rehearsal_"}[
        fake_mode] + (f"hf_{args.hf}_" if args.hf else "") + args.dims + ("_merged" if args.merged else "") + ("_nomp" if args.no_merge_projections else "")
    path = os.path.join(args.out, name + ".csv")
    sweep_ts = {int(v) for v in args.sweep.split(",") if v}
    ts = [int(v) for v in args.tokens.split(",")]
    failed: list[str] = []
    prof_rows: list[dict] = []
    check = PointCheck(fake)

    def options_for(t, kind, design, offset, ctas):
        return {"comm_ctas": int(ctas) if ctas else args.comm_ctas, "split": kind == "split", "mode": args.mode,
                "merge_projections": not args.no_merge_projections,
                **({"kernel": design} if design else {}), **({"split_at": t // 2 + int(offset)} if offset else {})}

    def skipped(variant, t, e):
        """A variant that would time something else: end the run, or (--keep-going) list it."""
        if not args.keep_going:
            raise e
        failed.append(f"{variant} T={t}: {e}")
        print(f"SKIPPED {variant} from T={t} on: {e}", flush=True)

    def split_point(kind):
        """(the split point the last compile chose, its description); ("-", "") unsplit."""
        if kind != "split":
            return "-", ""
        text = weave_compile.explain().graphs[-1].split.describe()
        return (text.split(" at ")[1].split(" (")[0].split(":")[0] if " at " in text else "unsplit"), text

    def projections_merged(kind):
        """A split variant of separate projections that stayed separate (merge_projections on, the
        default) would be timed under the wrong name: an error naming why they did."""
        if kind != "split" or args.no_merge_projections or args.merged:
            return
        graph = weave_compile.explain().graphs[-1]
        if args.hf:  # a tp_plan model's DTensor projections stay separate (docs/split.md): say so
            if rank == 0:
                print(f"  {graph.projections}", flush=True)
            return
        if graph.split is None or not graph.split.applied:
            return
        text = graph.projections
        if rank == 0:
            print(f"  {text}", flush=True)
        if not text.startswith("projections merged: ") or "projections merged: none" in text:
            raise RuntimeError(f"merge_projections: {text or 'the merge pass did not run'}")

    def interleaved(t):
        """Every variant compiled for ``t`` first, then timed in ``--rounds`` rounds, the order
        reversed every other round: drift of the GPU's speed during the run (4-9% between runs,
        docs/performance.md) falls on every variant alike instead of on their ratio."""
        torch._dynamo.reset()
        x, live = tokens_for(t, False), []
        for variant in variants:
            kind, design, offset, ctas = parse_variant(variant)
            design = design or ("ce" if fake is not None else "")
            _, model = build(args.dims, args.layers, kind != "nocomm", dev, args.merged, args.hf)
            weave_compile.reset()
            c = (torch.compile(model, mode=mode, dynamic=False) if kind in ("default", "nocomm") else
                 torch.compile(model, backend="tokenweave", dynamic=False,
                               options=options_for(t, kind, design, offset, ctas)))
            check.start()
            try:
                with torch.no_grad():
                    counts = compiled_launches(c, x)
                    if not counts:  # another variant's cached graph answered: it would be timed twice
                        raise RuntimeError(f"{variant}: its first call generated no code")
                    ran = check.sites(variant, design, True)
                    projections_merged(kind)
            except RuntimeError as e:
                skipped(variant, t, e)
                continue
            live.append((variant, c, counts, ran, split_point(kind)[0]))
        times = {v[0]: [] for v in live}
        for r in range(args.rounds):
            for variant, c, *_ in (live if r % 2 == 0 else live[::-1]):
                check.start()
                with torch.no_grad():
                    times[variant].append(Timer(args.repeats, warmup=3, graph=False)(lambda: c(x), args.iters))
                check.no_fallback(variant)
        for variant, c, counts, ran, at in live:
            ms = statistics.median(times[variant]) / 1e3 / args.layers
            spread = (max(times[variant]) - min(times[variant])) / statistics.median(times[variant])
            rows.append({**meta, "T": t, "variant": variant, "split_at": at, "ms_per_layer": f"{ms:.4f}",
                         "kernels": sum(counts.values()), "pointwise_kernels": pointwise(counts), "design": ran})
            if rank == 0:
                print(f"{variant:12s} T={t:6d} split_at={at}: {ms:.4f} ms/layer (rounds spread "
                      f"{100 * spread:.1f}%), {sum(counts.values())} kernels ({pointwise(counts)} pointwise) per "
                      f"forward, design {ran}", flush=True)
                write_csv(path, rows, COLUMNS)
        live.clear()
        torch.cuda.empty_cache()

    if args.rounds > 1:
        if dynamic or sweep_ts or args.profile:
            raise SystemExit("--rounds times static graphs at --tokens: without --dynamic, --sweep or --profile")
        for t in ts:
            faulthandler.dump_traceback_later(args.watchdog_s * len(variants), exit=True)
            interleaved(t)
            faulthandler.cancel_dump_traceback_later()
        variants = []  # timed above
    for variant in variants:
        kind, design, offset, ctas = parse_variant(variant)
        design = design or ("ce" if fake is not None else "")
        d, model = build(args.dims, args.layers, kind != "nocomm", dev, args.merged, args.hf)
        c = None
        torch._dynamo.reset()
        weave_compile.reset()
        if kind in ("default", "nocomm"):
            c = torch.compile(model, mode=mode, dynamic=dynamic)
        counts, fresh = {}, True
        for t in ts:
            if offset and t not in sweep_ts:
                continue
            if kind not in ("default", "nocomm"):
                if offset or not dynamic:  # a static graph per T (and per forced split point)
                    torch._dynamo.reset()
                opts = options_for(t, kind, design, offset, ctas)
                if t == ts[0] or offset or not dynamic:
                    c = torch.compile(model, backend="tokenweave", dynamic=dynamic, options=opts)
                    fresh = True
            elif not dynamic:
                fresh = True  # Dynamo recompiles the static graph for this T
            x = tokens_for(t, dynamic)
            check.start()
            faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
            try:
                with torch.no_grad():
                    was_fresh = fresh
                    if fresh:  # the compiling call: count the kernels it generated
                        counts, fresh = compiled_launches(c, x), False
                    ran = check.sites(variant, design, was_fresh)
                    if was_fresh:
                        projections_merged(kind)
                    ms = Timer(args.repeats, warmup=3, graph=False)(lambda: c(x), args.iters) / 1e3 / args.layers
                check.no_fallback(variant)
            except RuntimeError as e:
                skipped(variant, t, e)
                break
            finally:
                faulthandler.cancel_dump_traceback_later()
            at, text = split_point(kind)
            if text and rank == 0:
                print("  ", text[:300], flush=True)
            rows.append({**meta, "T": t, "variant": variant, "split_at": at, "ms_per_layer": f"{ms:.4f}",
                         "kernels": sum(counts.values()), "pointwise_kernels": pointwise(counts), "design": ran})
            if rank == 0:
                print(f"{variant:12s} T={t:6d} split_at={at}: {ms:.4f} ms/layer, {sum(counts.values())} kernels "
                      f"({pointwise(counts)} pointwise) per forward, design {ran}", flush=True)
                write_csv(path, rows, COLUMNS)  # after every point: a timeout keeps what was measured
            if args.profile:
                with torch.no_grad():
                    prof = kernel_timeline.profile_once(lambda: c(x), top=12)
                top = prof.pop("top")
                per_layer = {k: round(v / args.layers, 1) if k.endswith("_us") else v for k, v in prof.items()}
                prof_rows.append({**rows[-1], **per_layer})
                if rank == 0:
                    print("   profile per layer: " + ", ".join(f"{k} {v}" for k, v in per_layer.items()), flush=True)
                    for kname_kind, kname, us, n in top:  # per forward, for the log (not `kind`: the T loop reads it)
                        print(f"     {kname_kind:9s} {us:9.1f} us {n:4d}x {kname[:150]}", flush=True)
                    write_csv(os.path.join(args.out, name + "_profile.csv"), prof_rows,
                              COLUMNS + kernel_timeline.COLUMNS)
        c = model = None
        torch.cuda.empty_cache()
    if rank == 0:
        print("wrote", path)
        summarize(rows, fake_mode or "2 GPUs")
        try:
            plot(rows, os.path.join(args.out, name + ".png"))
        except Exception as e:  # the CSV is the result; a missing matplotlib is not fatal
            print("plot skipped:", e)
    fake_comm.uninstall()
    dist.destroy_process_group()
    if failed:
        raise SystemExit("variants not timed (they would have timed something else):\n  "
                         + "\n  ".join(failed))


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    meta = rows[0]
    base_name = "default" if any(r["variant"] == "default" for r in rows) else "nocomm"
    base = {int(r["T"]): float(r["ms_per_layer"]) for r in rows if r["variant"] == base_name}
    for variant in dict.fromkeys(r["variant"] for r in rows if ":" not in r["variant"]):
        pts = sorted((int(r["T"]), float(r["ms_per_layer"])) for r in rows if r["variant"] == variant)
        if pts and base:
            ax.plot([p[0] for p in pts], [p[1] / base[p[0]] for p in pts], "o-", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (batch 1, prefill)")
    ax.set_ylabel(f"latency / {base_name}" + (" (torch.compile, NCCL)" if base_name == "default" else ""))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    for t in sorted({int(r["T"]) for r in rows if ":" in r["variant"]}):
        pts = sorted((int(r["split_at"]), float(r["ms_per_layer"])) for r in rows
                     if int(r["T"]) == t and (r["variant"] == "split" or r["variant"].startswith("split:"))
                     and r["split_at"].isdigit())
        bx.plot([p[0] / t for p in pts], [p[1] for p in pts], "o-", label=f"T={t}")
        for r in rows:
            if int(r["T"]) == t and r["variant"] == "split" and r["split_at"].isdigit():
                bx.plot(int(r["split_at"]) / t, float(r["ms_per_layer"]), "k*", markersize=12)
    bx.set_xlabel("split point / T (star: smart split)")
    bx.set_ylabel("ms per layer")
    if bx.lines:
        bx.legend(fontsize=8)
    else:
        bx.text(0.5, 0.5, "no split-point sweep in this run", ha="center", va="center", transform=bx.transAxes)
    bx.grid(alpha=0.3)
    ax = bx
    ax.set_title(f"TP=2 Llama-{meta['dims']} dims, {meta['layers']} layers, {meta['gpu']}, mode={meta['mode']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
