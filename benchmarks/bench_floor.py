"""The floor: is any path of the backend slower than plain torch.compile? ms per layer on one GPU.

    python benchmarks/bench_floor.py --smoke                         # first: tiny dims, ~1-2 min
    python benchmarks/bench_floor.py --dims 8b --decode --ops        # 8B: every arch, every T
    python benchmarks/bench_floor.py --dims 70b --keep benchmarks/results/floor.csv
    torchrun --nproc-per-node 2 benchmarks/bench_floor.py --comm nccl --dims 8b   # two GPUs

One GPU, PyTorch's fake process group (``fake_group.init``: backend "fake", world size 2, this
process is rank 0 and holds rank 0's shard; collectives move nothing, and the reduce-scatters and
all-gathers of forced designs write rank 0's rows into every row of their outputs, so GEMMs read
real values: ``fake_group.written_collectives``), CUDA graphs
(``mode="reduce-overhead"``). Models: Hugging Face causal LMs with random weights, sharded by their
own ``tp_plan`` (``weave_compile.testing.hf``), ``model.model`` called on ``[1, T]`` token ids
(prefill shape, no cache), ``--layers`` decoder layers at Llama-3-8B or 70B dims. The default
architectures cover every site form the passes rewrite: ``llama`` (all_reduce -> +residual ->
RMSNorm), ``granite`` (the sum scaled by the residual multiplier), ``gemma2`` (offset weight
``(1 + w)``, sandwich norms: all_reduce -> norm -> +residual), ``llama_bias`` (a row-parallel bias
added after the all_reduce; Qwen2's biases are on q/k/v, column-parallel, so its sites are plain
ones: ``--archs qwen2`` runs it too), ``mixtral`` (the experts' all_reduce after their weighted
sum) and ``starcoder2`` (LayerNorm: all_reduce -> +bias -> +residual -> ``nn.LayerNorm`` with its
bias, at Llama's dims; the LayerNorm row of the floor, which judges LayerNorm sites with the rest).

Variants, each timed against ``default`` (plain Inductor, the same model, its all_reduce as
written) on the same model in the same rounds:

* ``default``     ``torch.compile(mode="reduce-overhead")``
* ``nccl``, ``reference``, ``ce``   ``backend="tokenweave"`` with that ``kernel`` forced:
  every fused site must run it (checked; anything else stops the variant). ``ce`` runs its local
  program (``benchmarks/fake_comm.py`` "local": the add+norm kernel and local copies, no transfer).
  ``reference``/``ce`` only on ``--impl-archs`` (default llama): they are not what a user gets.
* ``auto``        ``kernel="auto", autotune=False`` (the shipped rules); on the fake group no
  symmetric-memory design can run and none is measured across GPUs, so every site gets the GPU
  fallback's choice: ``nccl`` or the site as written (``kernels/auto.py``).
* ``autotune``    ``kernel="auto"`` with the defaults (``autotune=True``): what a user gets. At compile
  time the graph's sites are timed on this GPU, ``nccl`` against the site as written, per token
  bucket (``kernels/measured``; on the fake group the symmetric-memory designs cannot run and the
  oracle check is skipped: its collectives move nothing). A choice cached under Inductor's cache
  directory by an earlier run is reused (``--compile-time`` starts from empty caches).
* ``fallback``    ``kernel="multimem"`` forced where it cannot run (no multicast here): the GPU
  fallback of a forced design, the same choice as ``auto`` here (``--fallback-archs``, default llama).
* ``inductor_again`` (only where ``--variants`` names it) plain Inductor compiled a second time
  (:func:`second_inductor`), timed beside ``auto``: the control for a site left as written, whose
  program is plain Inductor's (how far two compiled instances of one program read apart).

``code_vs_default``: whether Inductor generated the same program for the variant as for ``default``
at that T (``weave_compile.testing.inductor_code``: the wrapper and every kernel, comments naming
cache paths or FX nodes aside): ``same``, ``same but comments``, ``differs: N lines`` (``--code-diffs
DIR`` writes the diffs), empty where the variant compiled nothing at that T (a dynamic compile made
at an earlier T). Where a site is left as written the program should be plain Inductor's; then a
ratio away from 1.00 is what two CUDA-graph instances of one program read apart (the
``inductor_again`` control measures it), not a cost of the backend.

``kernel`` in the CSV is what ran, from ``explain()``: the implementation(s) of the fused sites and
``as written`` for sites left alone. The choice ``auto`` and ``fallback`` make depends on T (the
floor: ``nccl`` where it was measured at least 2% faster, else as written), so T is compiled per
bucket of T with one decision: ``T=1`` static (decode; Dynamo specializes size 1 anyway), the
others ``mark_dynamic(min=, max=)`` over the bucket (the pass reads the range). Every variant is
compiled alike, ``dynamic=False`` with the same marks (the implementations' phase: one range for
every T above 1), so that a variant differs from ``default`` by its backend alone:
``dynamic=True`` would also turn each norm's eps (and a model's other float attributes) into graph
inputs, a different program for plain Inductor with its own speed (docs/performance.md, section
8). ``--static`` compiles every variant for each T. ``--floor measured`` (default): per dims, every
architecture's implementations are timed first, the floor table is made from those rows by
``make_auto_table.floor_table`` (the function that makes the committed one from floor.csv) and
installed in this process, then ``auto`` and ``fallback`` are compiled and timed on it beside a
fresh ``default``: the rows show the choice the committed table will make once regenerated from
this CSV. ``--floor committed`` times them on ``kernels/auto_table.py`` as it is (one pass).

Timing: per T, every variant's first calls (compile, CUDA-graph recording), then ``--rounds``
rounds (default: one per variant) of warm-up + ``--repeats`` x ``--iters`` back-to-back calls, the
order rotated every round so that each variant takes each place once (:func:`in_round`), after
~200 ms of untimed calls of every variant (:func:`spin_up`). ``ms_per_layer``: the variant's median
per forward / ``--layers`` (the embedding and the final norm amortized in); ``ratio_vs_default``:
the median over rounds of the variant's time over default's in the same round (the GPU's speed
drifts during a run); ``spread``: (max - min) / median of the variant's times over the rounds.

``--compile-time`` (with ``--dims``): the first compile of Llama at those dims, ``default`` against
``autotune``, compiled and run at the first T above 1 of ``--tokens`` marked dynamic over the
others (as the model rows compile), each ``--repeats`` times (the two alternate going first)
**cold** (a fresh Inductor cache directory and Inductor's in-memory caches emptied: Inductor,
Triton and the measured choice start empty) and then **cached** (Dynamo reset, the same
directory: Inductor's FX graph cache and the measured choice's disk cache serve it); rows of
scope ``compile``, seconds of the first call (compile, recording, one replay) in ``compile_s`` and
the ratio to default's median in ``ratio_vs_default``. Targets: cold at most 1.3x, cached at most
1.05x.

``--decode`` (README's Hugging Face form): ``generate()`` with a static cache and
``CompileConfig(backend="tokenweave", options={"mode": "reduce-overhead"})``, batch 1, greedy, on
Llama at ``--decode-dims``, against the same model compiled by plain Inductor (``reduce-overhead``).
Tokens must be equal: the lm_head is replicated (its all_gather would leave half the logits
undefined on the fake group) and the fused op's collectives behave as the fake group's all_reduce
does for plain Inductor (``fake_group.identity_collectives``: what that proves and what not is
said there). Variants ``default``, ``auto`` (at T=1: the floor's choice) and ``nccl`` (forced, the
fused op at every site), one model each (the same weights). ``ms_per_step`` is a decode step
(``generate`` of 40 new tokens minus 8, per token: host work of ``generate`` included, as a user
sees it), timed as the prefill points are: ``--rounds`` rounds of ``--repeats`` timings, the
variants interleaved, the order rotated every round; median and spread. Where the median comes
out <= 0 (timing noise above the 32 steps between the two runs: seen on a loaded CPU, never a GPU)
the row leaves the time empty and says so; on a GPU that fails the run.

``--ops``: the local part of the designs ``auto`` would take on two GPUs, where the harness can:
one call of the op alone at the same T and H, ``p2p`` and ``ce`` over 2 ranks emulated on this GPU
(both ranks' traffic on one GPU's HBM, peers' rows local: an upper bound of one GPU's share, no
NVLink), ``nccl``'s add+norm on its half of the rows, and Inductor's compiled add+RMSNorm on all
rows (the local work of a site as written). What only two GPUs settle: the wire (NCCL's all_reduce
against reduce-scatter + all-gather, p2p's NVLink stores, ce's copy-engine transfers and flags),
hence every choice between them; ``--comm nccl`` under torchrun runs the model variants there.

Output: ``<out>/floor.csv`` (``floor_smoke.csv`` with ``--smoke``), written after every point, and a
PNG of each variant's ratio to default per T, one panel per dims. ``--keep CSV``: rows of an earlier
run for points (dims, arch, T) this run does not measure stay in the file (run 8B and 70B as two
commands, or add a T).
Budget flags: ``--archs``, ``--dims``, ``--tokens``, ``--variants``, ``--layers``, ``--rounds``.
A point that hangs ends the run after ``--watchdog-s`` with every thread's stack.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import faulthandler
import logging
import math
import os
import shutil
import statistics
import sys
import time
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import Timer, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from weave_compile.testing import inductor_code  # noqa: E402

COLUMNS = ["gpu", "comm", "world_size", "scope", "arch", "dims", "hidden", "layers", "T", "variant", "kernel",
           "ms_per_layer", "ratio_vs_default", "spread", "code_vs_default", "ms_per_step", "tokens_equal", "source_hash",
           "compile_s", "note",
           "torch", "triton", "git_commit", "date"]
ARCHS = ("llama", "granite", "gemma2", "llama_bias", "mixtral", "starcoder2")
TOKENS = (1, 16, 128, 512, 1024, 4096, 8192, 16384)
IMPLEMENTATIONS = ("nccl", "reference", "ce")  # forced designs that can run on the fake group
VARIANTS = ("default",) + IMPLEMENTATIONS + ("auto", "autotune", "fallback")
#: the variants that choose (the floor's rows): timed beside a fresh default after the implementations
CHOOSING = ("auto", "autotune", "fallback")
UNAVAILABLE = "multimem"  # forced by ``fallback``: no multicast on these machines, nor on a fake group
#: plain Inductor compiled a second time, timed beside auto: what two compiles of one graph differ by
CONTROL = "inductor_again"
AS_WRITTEN = "as written"
#: --smoke: small dims of every arch (hf.make_config overrides over the "tiny" preset)
SMOKE = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
             vocab_size=4096, max_position_embeddings=4096)
HIDDEN = {"8b": 4096, "70b": 8192, "smoke": SMOKE["hidden_size"]}

log = logging.getLogger("bench_floor")


class VariantError(RuntimeError):
    """A variant would time something other than its name says."""


# ----------------------------------------------------------------------------- models


class Decoder(torch.nn.Module):
    """A causal LM's decoder stack called on token ids, prefill-shaped (no cache); one per variant,
    the weights shared (Dynamo keeps one cache entry per wrapper and backend)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.decoder = lm.model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids=ids, use_cache=False).last_hidden_state


def build(arch: str, dims: str, layers: int, dev: torch.device, dtype=torch.bfloat16, tp: bool = True):
    import hf_models as hf

    if dims == "smoke":
        return hf.build_model(arch, "tiny", layers=layers, tp=tp, seed=0, dtype=dtype, device=dev, **SMOKE)
    return hf.build_model(arch, dims, layers=layers, tp=tp, seed=0, dtype=dtype, device=dev)


def token_ids(t: int, vocab: int, dev: torch.device, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randint(0, vocab, (batch, t), generator=g).to(dev)


# ----------------------------------------------------------------------------- what ran


class Watch(logging.Handler):
    """Run-time fallbacks of the fused op (it logs a warning once per kind)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.fallbacks: list[str] = []
        logging.getLogger("weave_compile.ops.allreduce_rmsnorm").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "fell back" in record.getMessage():
            self.fallbacks.append(record.getMessage())


def site_label(sites) -> str:
    """What the sites of a compile ran: their implementations, and ``as written`` for the others."""
    counts = collections.Counter(s.kernel if s.fused else AS_WRITTEN for s in sites)
    return "+".join(k if len(counts) == 1 else f"{k} x{n}" for k, n in sorted(counts.items())) or "-"


def check_sites(variant: str, sites, expect: Optional[str]) -> None:
    """Forced implementations: every fused site runs it, no site was left as written by the fallback."""
    if expect is None:
        return
    fused = [s for s in sites if s.fused]
    if not fused:
        raise VariantError(f"{variant}: no site fused ({[s.reason[:120] for s in sites][:3]})")
    other = sorted({s.kernel for s in fused if s.kernel != expect})
    if other:
        why = next(s.kernel_reason for s in fused if s.kernel != expect)
        raise VariantError(f"{variant}: sites run {other}, not {expect}: {why[:300]}")
    left = [s.reason for s in sites if not s.fused and s.reason.startswith("left as written")]
    if left:
        raise VariantError(f"{variant}: sites left as written by the fallback: {left[0][:300]}")


# ----------------------------------------------------------------------------- timing


def timer(repeats: int) -> Callable[[Callable, int], float]:
    """Median per-call microseconds of ``fn`` over ``iters`` back-to-back calls: CUDA events
    (common.Timer; the compiled model replays its own CUDA graphs), or wall time on CPU (dry runs)."""
    if torch.cuda.is_available():
        return Timer(repeats, warmup=2, graph=False)

    def cpu(fn, iters):
        fn()
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - start) * 1e6 / iters)
        return statistics.median(out)

    return cpu


class Run:
    """The run's options, device, rows and CSV."""

    def __init__(self, args, dev: torch.device, fake):
        import weave_compile

        self.args, self.dev, self.fake = args, dev, fake
        self.rows: list[dict] = []
        self.kept: list[dict] = []
        self.failed: list[str] = []
        self.watch = Watch()
        self.time = timer(args.repeats)
        self.meta = dict(run_meta(dev if dev.type == "cuda" else None), comm=args.comm,
                         world_size=dist.get_world_size())
        self.rank = dist.get_rank()
        self.path = os.path.join(args.out, args.csv or ("floor_smoke.csv" if args.smoke else "floor.csv"))
        self.pkg = os.path.dirname(weave_compile.__file__)
        self._hash: dict[str, str] = {}

    def source_hash(self, label: str) -> str:
        """The fingerprint of the one design that ran (make_auto_table.DESIGN_SOURCES), "" for the
        plain graph or a mix of designs."""
        import make_auto_table

        designs = make_auto_table.designs_of(label) & set(make_auto_table.DESIGNS)
        if len(designs) != 1:
            return ""
        design = designs.pop()
        if design not in self._hash:
            self._hash[design] = make_auto_table.source_fingerprint(design, self.pkg)
        return self._hash[design]

    def write(self) -> None:
        if self.rank == 0:
            write_csv(self.path, self.kept + self.rows, COLUMNS)

    def skipped(self, what: str, e: BaseException) -> None:
        if not self.args.keep_going:
            raise e
        self.failed.append(f"{what}: {type(e).__name__}: {e}")
        print(f"SKIPPED {what}: {type(e).__name__}: {str(e)[:400]}", flush=True)


# ----------------------------------------------------------------------------- compiling the variants


def options_for(run: Run, kernel: str) -> dict:
    opts = {"kernel": kernel, "mode": run.args.mode}
    if run.dev.type != "cuda":
        opts = {"kernel": kernel, "compiler": "aot_eager"}  # dry run on CPU: the passes, no Inductor
    return opts


def compile_variant(run: Run, lm, variant: str):
    """The compiled callable of ``variant`` (compiling happens at its first calls)."""
    wrapper = Decoder(lm)  # one per variant: its own Dynamo cache entry, so its own compile
    # Every variant alike: static T unless the input is marked dynamic over its bucket (the module
    # doc). Not dynamic=True: it also makes each norm's eps a graph input, another program.
    if variant == CONTROL and run.dev.type == "cuda":
        return torch.compile(wrapper, backend=second_inductor(run.args.mode), dynamic=False)
    if variant in ("default", CONTROL):
        if run.dev.type != "cuda":
            return torch.compile(wrapper, backend="aot_eager", dynamic=False)
        return torch.compile(wrapper, mode=run.args.mode, dynamic=False)
    kernel = {"auto": "auto", "autotune": "auto", "fallback": UNAVAILABLE}.get(variant, variant)
    opts = options_for(run, kernel)
    if variant != "autotune":  # the shipped rules (forced designs ignore it)
        opts["autotune"] = False
    return torch.compile(wrapper, backend="tokenweave", dynamic=False, options=opts)


def second_inductor(mode: str):
    """Plain Inductor in ``mode`` as a backend equal to no other, so that Dynamo compiles the graph
    again: ``torch.compile(mode=...)``'s own backend object compares equal to any other with the
    same options, and Dynamo then serves the second wrapper from the first one's cache entry (one
    compiled callable, one CUDA graph per shape, timed twice). This one goes through Inductor as the
    backend's as-written graphs do (``compile_fx`` with the mode's options): Inductor's FX graph
    cache gives the same program, loaded again, recorded into its own CUDA graphs."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = dict(list_mode_options(mode))

    def inductor_again(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=patches or None)

    return inductor_again


def buckets(run: Run, hidden: int, tokens: list[int]) -> dict[int, Optional[tuple[int, int]]]:
    """Per T, the range of T with the same GPU-fallback decision it is compiled for (None: static)."""
    from weave_compile import kernels
    from weave_compile.kernels import auto

    def decide(t: int) -> bool:
        site = kernels.Site(device=torch.device("cuda", 0), dtype=torch.bfloat16, residual_dtype=torch.bfloat16,
                            out_dtype=torch.bfloat16, hidden=hidden, group_name="-",
                            world_size=dist.get_world_size(), num_tokens=t)
        return auto.floor_verdict(kernels.gpu_fallback().name, site)[0]

    out: dict[int, Optional[tuple[int, int]]] = {1: None} if 1 in tokens else {}
    run_: list[int] = []
    for t in sorted(t for t in tokens if t > 1) + [None]:
        if run_ and (t is None or decide(t) != decide(run_[0])):
            for u in run_:
                out[u] = (run_[0], run_[-1]) if len(run_) > 1 else None
            run_ = []
        if t is not None:
            run_.append(t)
    return out


def one_range(tokens: list[int]) -> dict[int, Optional[tuple[int, int]]]:
    """T=1 static, every other T in one range (a single token count above 1: static too)."""
    rest = sorted(t for t in tokens if t > 1)
    return {t: (rest[0], rest[-1]) if len(rest) > 1 and t > 1 else None for t in tokens}


def on_gpu_policy(run: Run) -> bool:
    """Whether the GPU policy applies (forced designs run themselves, nothing runs ``reference``
    unforced): on CUDA; off GPUs every design falls back to reference (a dry run checks plumbing)."""
    return run.dev.type == "cuda"


def first_calls(run: Run, variant: str, c, x: torch.Tensor) -> str:
    """``variant``'s first calls at this T (compile, warm-up, CUDA-graph recording), checked; what ran."""
    import weave_compile

    before = len(weave_compile.explain().graphs)
    calls = run.fake.calls if run.fake is not None else 0
    run.watch.fallbacks.clear()
    with torch.no_grad():
        for _ in range(3):  # reduce-overhead: warm-up, record, replay
            c(x)
    if run.dev.type == "cuda":
        torch.cuda.synchronize()
    if run.watch.fallbacks:
        raise VariantError(f"{variant}: a fused op fell back at run time: {run.watch.fallbacks[0]}")
    if variant in ("default", CONTROL):
        return variant
    graphs = weave_compile.explain().graphs[before:]
    label = getattr(c, "_floor_label", None)
    if graphs:
        sites = [s for g in graphs for s in g.sites]
        forced = variant in IMPLEMENTATIONS or variant in ("p2p", "oneshot")
        # Off GPUs every forced design falls back to reference (a dry run checks the plumbing only).
        check_sites(variant, sites, variant if forced and on_gpu_policy(run) else None)
        label = site_label(sites)
        if on_gpu_policy(run) and not forced and "reference" in label:
            raise VariantError(f"{variant}: a site runs the eager reference chain on the GPU: {label}")
        c._floor_label = label
        if any(g.as_written for g in graphs):
            raise VariantError(f"{variant}: graphs run as written (ranks disagreed): {graphs[0].as_written[:200]}")
    if variant == "ce" and run.fake is not None and run.fake.calls == calls:
        raise VariantError("ce: the fake ce entry was never called")
    return label or "?"


def code_vs_default(run: Run, point: str, codes: dict[str, list[str]]) -> dict[str, str]:
    """Per variant compiled at this point, whether Inductor generated the same program as for
    ``default`` (``inductor_code.compare``; "" where either compiled nothing here: a dynamic compile
    made at an earlier T). ``--code-diffs DIR``: each differing program's diff to ``DIR``."""
    base = codes.get("default", [])
    out = {v: inductor_code.compare(base, c) for v, c in codes.items() if v != "default"}
    if run.args.code_diffs and run.rank == 0:
        for v, verdict in out.items():
            if verdict.startswith("differs"):
                os.makedirs(run.args.code_diffs, exist_ok=True)
                with open(os.path.join(run.args.code_diffs, f"{point}_{v}.diff"), "w") as f:
                    f.write(inductor_code.diff(base, codes[v], ("default", v)) + "\n")
    return out


def rounds_for(args, variants: int) -> int:
    """``--rounds``, or as many rounds as there are variants (at least 3): each variant then takes
    each place in the order once (:func:`in_round`)."""
    return args.rounds or max(3, variants)


def in_round(order: list[str], r: int) -> list[str]:
    """The order of round ``r``: rotated by ``r``, so that over ``len(order)`` rounds every variant
    is timed first, second, ... once. Reversing every other round instead leaves the middle
    variants in the middle, and with an odd number of rounds puts the first variant first more
    often than the last: a place in the order that costs time (the first timing after the Python
    work between rounds) would then be charged to one variant."""
    k = r % len(order)
    return order[k:] + order[:k]


def spin_up(run: Run, live: dict, x_for: Callable[[str], torch.Tensor], ms: float = 200.0) -> None:
    """Untimed calls of every variant, ~``ms`` in all, before the first round: the GPU idles while
    the variants compile and record (its clocks drop), and the first timings after that would be
    slower for whichever variant comes first."""
    deadline = time.perf_counter() + ms / 1e3
    with torch.no_grad():
        while True:
            for v, c in live.items():
                c(x_for(v))
            if run.dev.type == "cuda":
                torch.cuda.synchronize()
            if time.perf_counter() >= deadline:
                return


def time_point(run: Run, arch: str, dims: str, t: int, live: dict, x_for: Callable[[str], torch.Tensor],
               labels: dict, same: Optional[dict] = None) -> None:
    """Time ``live`` (variant -> compiled) at ``t`` in rounds; a row per variant."""
    args = run.args
    times = {v: [] for v in live}
    order = list(live)
    # Calls per timing: up to --iters, fewer where one call is long (~25 ms of calls per timing).
    start = time.perf_counter()
    with torch.no_grad():
        live["default"](x_for("default"))
    if run.dev.type == "cuda":
        torch.cuda.synchronize()
    iters = max(2, min(args.iters, math.ceil(25.0 / max(1e-3, (time.perf_counter() - start) * 1e3))))
    spin_up(run, live, x_for)
    for r in range(rounds_for(args, len(order))):
        for v in in_round(order, r):
            c, x = live[v], x_for(v)
            run.watch.fallbacks.clear()
            with torch.no_grad():
                times[v].append(run.time(lambda: c(x), iters))
            if run.watch.fallbacks:
                raise VariantError(f"{v}: a fused op fell back at run time: {run.watch.fallbacks[0]}")
    for v in order:
        us = statistics.median(times[v])
        ms = us / 1e3 / args.layers
        # Paired: the variant's time over default's in the same round (the GPU's speed drifts).
        ratio = (statistics.median(a / b for a, b in zip(times[v], times["default"]))
                 if "default" in times else None)
        spread = (max(times[v]) - min(times[v])) / us
        run.rows.append({**run.meta, "scope": "model", "arch": arch, "dims": dims, "hidden": HIDDEN[dims],
                         "layers": args.layers, "T": t, "variant": v, "kernel": labels[v], "ms_per_layer": f"{ms:.4f}",
                         "ratio_vs_default": f"{ratio:.4f}" if ratio else "", "spread": f"{spread:.3f}",
                         "code_vs_default": (same or {}).get(v, ""),
                         "ms_per_step": "", "tokens_equal": "", "source_hash": run.source_hash(labels[v]),
                         "note": ("static: compiled for this T" if args.static
                                  else "T marked dynamic over its bucket, every variant alike")})
        if run.rank == 0:
            print(f"{arch:10s} {dims:4s} T={t:6d} {v:10s} {ms:8.4f} ms/layer"
                  + (f"  {ratio:.3f}x default" if ratio else "") + f"  spread {100 * spread:.1f}%  [{labels[v]}]",
                  flush=True)
    run.write()


def measure(run: Run, arch: str, dims: str, variants: list[str], tokens: list[int],
            bucket_of: Optional[dict] = None) -> None:
    """Build ``arch`` at ``dims``, compile ``variants``, and time them at every T."""
    import weave_compile

    args = run.args
    if bucket_of is None:  # one decision for every T: T=1 static, the others one range
        bucket_of = {} if args.static else one_range(tokens)
    torch._dynamo.reset()
    weave_compile.reset()
    start = time.monotonic()
    try:
        lm = build(arch, dims, args.layers, run.dev)
    except (RuntimeError, torch.OutOfMemoryError) as e:  # e.g. a plan the installed transformers cannot apply
        run.skipped(f"{arch} {dims}: building the model", e)
        return
    vocab = lm.config.vocab_size
    compiled = {v: compile_variant(run, lm, v) for v in variants}
    if run.rank == 0:
        print(f"== {arch} {dims}: built in {time.monotonic() - start:.1f} s; variants {variants}", flush=True)
    dead: set = set()
    for t in tokens:
        base_x = token_ids(t, vocab, run.dev)
        inputs = {}
        for v in variants:
            x = base_x.clone()
            span = bucket_of.get(t)
            if span is not None:
                torch._dynamo.mark_dynamic(x, 1, min=span[0], max=span[1])
            inputs[v] = x
        live, labels, codes = {}, {}, {}
        faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
        try:
            for v in variants:
                if v in dead:
                    continue
                t0 = time.monotonic()
                try:
                    with inductor_code.captured() as codes[v]:
                        labels[v] = first_calls(run, v, compiled[v], inputs[v])
                except (VariantError, RuntimeError, torch.OutOfMemoryError) as e:
                    dead.add(v)
                    run.skipped(f"{arch} {dims} {v} from T={t} on", e)
                    continue
                live[v] = compiled[v]
                if run.rank == 0 and time.monotonic() - t0 > 2:
                    print(f"   {v} at T={t}: first calls {time.monotonic() - t0:.1f} s", flush=True)
            same = code_vs_default(run, f"{arch}_{dims}_T{t}", codes)
            if "default" in live and len(live) > 1:
                try:
                    time_point(run, arch, dims, t, live, inputs.__getitem__, labels, same)
                except (VariantError, RuntimeError, torch.OutOfMemoryError) as e:
                    run.skipped(f"{arch} {dims} T={t} timing", e)
        finally:
            faulthandler.cancel_dump_traceback_later()
    del compiled, lm
    if run.dev.type == "cuda":
        torch.cuda.empty_cache()
    if run.rank == 0:
        print(f"== {arch} {dims}: {time.monotonic() - start:.1f} s", flush=True)


# ----------------------------------------------------------------------------- compile time


def fresh_inductor_cache(tag: str) -> str:
    """A new empty Inductor cache directory (Inductor's FX graph and kernel caches, Triton's, the
    measured choice's: all live under it) for what compiles next in this process, and Inductor's
    in-memory caches emptied (compiled Triton kernels and Python modules by source: a variant
    compiled after another would otherwise load the kernels they share from memory)."""
    import tempfile

    from torch._inductor import utils as inductor_utils

    clear = getattr(inductor_utils, "clear_caches", None) or getattr(inductor_utils, "clear_inductor_caches")
    clear()
    path = tempfile.mkdtemp(prefix=f"floor_{tag}_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")
    return path


def forget_compiles() -> None:
    """Dynamo's compiled code, the report and the measured choice's in-process answers: the next
    call compiles again, served by the caches on disk only."""
    import weave_compile
    from weave_compile.kernels import measured

    torch._dynamo.reset()
    weave_compile.reset()
    measured.forget()


def compile_time(run: Run, dims: str) -> None:
    """``--compile-time``: default against autotune, cold then cached (module doc); rows of scope
    ``compile``."""
    import weave_compile

    args = run.args
    arch = "llama"
    t = min((u for u in args.tokens if u > 1), default=16)
    span = one_range(args.tokens).get(t)  # the model rows' range
    lm = build(arch, dims, args.layers, run.dev)
    x = token_ids(t, lm.config.vocab_size, run.dev)
    seconds: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    labels: dict[str, str] = {}
    for r in range(args.repeats):
        for v in ("default", "autotune") if r % 2 == 0 else ("autotune", "default"):  # each goes first in turn
            path = fresh_inductor_cache(v)
            for state in ("cold", "cached"):
                forget_compiles()
                c = compile_variant(run, lm, v)
                xi = x.clone()
                if span is not None and not args.static:
                    torch._dynamo.mark_dynamic(xi, 1, min=span[0], max=span[1])
                start = time.perf_counter()
                labels[v] = first_calls(run, v, c, xi)
                seconds[(v, state)].append(time.perf_counter() - start)
                if v == "autotune" and run.rank == 0:
                    sources = sorted({m["source"] for g in weave_compile.explain().graphs for m in g.measured})
                    print(f"   autotune {state}: {seconds[(v, state)][-1]:.1f} s; {sources}", flush=True)
            del c
            forget_compiles()
            shutil.rmtree(path, ignore_errors=True)
    for state in ("cold", "cached"):
        base = statistics.median(seconds[("default", state)])
        for v in ("default", "autotune"):
            s_ = seconds[(v, state)]
            med = statistics.median(s_)
            run.rows.append({**run.meta, "scope": "compile", "arch": arch, "dims": dims, "hidden": HIDDEN[dims],
                             "layers": args.layers, "T": t, "variant": v, "kernel": labels[v],
                             "ratio_vs_default": f"{med / base:.4f}", "spread": f"{(max(s_) - min(s_)) / med:.3f}",
                             "compile_s": f"{med:.2f}",
                             "note": f"{state}: first call at T={t}" + (f" marked dynamic {span}" if span else "")
                             + f", median of {len(s_)}"})
            if run.rank == 0:
                print(f"compile {dims} {state:6s} {v:9s} {med:7.1f} s  {med / base:.3f}x default  [{labels[v]}]",
                      flush=True)
    run.write()
    del lm
    forget_compiles()


# ----------------------------------------------------------------------------- the floor in this process


def install_measured_floor(run: Run, dims: str) -> None:
    """The floor table made from this run's rows at ``dims``, as make_auto_table.py makes the
    committed one from floor.csv, installed for this process's auto."""
    import make_auto_table

    from weave_compile.kernels import auto, auto_table

    rows = [r for r in run.rows if r["dims"] == dims]
    table, source = make_auto_table.floor_table(rows, lambda design, row: True)  # this run's code
    auto_table.FLOOR = {**auto_table.FLOOR, **table}
    auto_table.FLOOR_SOURCE = f"this run: {source}"
    if run.rank == 0:
        print(f"floor measured at {dims}: {table} (tables digest {auto.tables_digest()})", flush=True)


# ----------------------------------------------------------------------------- decode


class StopAfter:
    """A stopping criterion: stop once ``n`` tokens are in the sequence (no shape changes: the static
    cache keeps the size of ``max_new_tokens``)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool,
                          device=input_ids.device)


def decode(run: Run, dims: str) -> None:
    """README's generate() form on the fake group: tokens vs plain Inductor, ms per decode step.

    One model per variant (the same seed: the same weights), each compiled by its own
    ``generate()`` (transformers keeps a compiled call per model), so that all stay compiled and
    recorded and the steps are timed interleaved in rounds, as the prefill points are."""
    import fake_group
    from transformers import CompileConfig, StoppingCriteriaList

    import weave_compile

    args = run.args
    torch._dynamo.reset()
    weave_compile.reset()
    prompt, long, short = 16, args.decode_tokens, 8
    gen = dict(do_sample=False, cache_implementation="static", max_new_tokens=long, pad_token_id=0)
    if run.dev.type == "cuda":
        configs = {"default": CompileConfig(backend="inductor", fullgraph=True, dynamic=False, mode="reduce-overhead")}
        tw = dict(backend="tokenweave", fullgraph=True, dynamic=False, mode=None)
        mode = {"mode": "reduce-overhead"}
    else:  # dry run: transformers compiles decode steps on GPUs only unless told
        configs = {"default": CompileConfig(backend="aot_eager", fullgraph=True, dynamic=False, mode=None)}
        tw = dict(backend="tokenweave", fullgraph=True, dynamic=False, mode=None)
        mode = {"compiler": "aot_eager"}
    configs["auto"] = CompileConfig(**tw, options={**mode, "kernel": "auto"})
    configs["nccl"] = CompileConfig(**tw, options={**mode, "kernel": "nccl"})
    for cc in configs.values():
        cc._compile_all_devices = True
    # On the fake group the fused op computes what the fake all_reduce gives plain Inductor (fake_group.py).
    identity = fake_group.identity_collectives if args.comm == "fake" else contextlib.nullcontext
    live, results = {}, {}
    with identity(), torch.no_grad():
        ids = None
        for variant, cc in configs.items():
            lm = build("llama", dims, args.layers, run.dev)
            if args.comm == "fake":  # sharded, its all_gather would leave half the logits undefined
                lm.lm_head = build("llama", dims, args.layers, run.dev, tp=False).lm_head
            if ids is None:
                ids = token_ids(prompt, lm.config.vocab_size, run.dev, batch=args.decode_batch)
            before = len(weave_compile.explain().graphs)
            dynamo_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            try:
                for n in (long, short):  # compiles, records; the short run's stop criterion too
                    lm.generate(ids, compile_config=cc, min_new_tokens=n, **gen)
                lm.generate(ids, compile_config=cc, min_new_tokens=short,
                            stopping_criteria=StoppingCriteriaList([StopAfter(prompt + short)]), **gen)
                graphs = weave_compile.explain().graphs[before:]
                sites = [s for g in graphs for s in g.sites]
                if torch._dynamo.utils.counters["stats"]["unique_graphs"] == dynamo_graphs or (
                        variant != "default" and not graphs):
                    raise VariantError("generate() compiled no graph (it would time eager)")
                if variant == "nccl" and on_gpu_policy(run):
                    check_sites(variant, sites, "nccl")
            except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the others still run
                run.skipped(f"decode {variant}", e)
                continue
            live[variant] = (lm, cc, "default" if variant == "default" else site_label(sites))
        warm = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        steps = {v: [] for v in live}
        order = list(live)
        stop = StoppingCriteriaList([StopAfter(prompt + short)])
        for r in range(rounds_for(args, len(order))):
            for v in in_round(order, r):
                lm, cc, _ = live[v]
                for _ in range(args.repeats):
                    t_long = _timed(run, lambda: lm.generate(ids, compile_config=cc, min_new_tokens=long, **gen))
                    t_short = _timed(run, lambda: lm.generate(ids, compile_config=cc, min_new_tokens=short,
                                                              stopping_criteria=stop, **gen))
                    steps[v].append((t_long - t_short) / (long - short))
        for v, (lm, cc, label) in live.items():
            out = lm.generate(ids, compile_config=cc, min_new_tokens=long, return_dict_in_generate=True,
                              output_logits=True, **gen)
            logits = torch.stack([s.float().cpu() for s in out.logits], 1)  # [B, steps, vocab]
            results[v] = (out.sequences[:, prompt:].cpu(), steps[v], label, logits)
    if torch._dynamo.utils.counters["stats"]["unique_graphs"] != warm:
        run.failed.append("decode: generate() compiled again while timed (a recompile per step?)")
        return
    ref = results.get("default")
    base = statistics.median(ref[1]) if ref is not None else None
    for variant, (tokens, step_list, label, logits) in results.items():
        step_ms = statistics.median(step_list)
        # A step is the difference of two generate() timings: where the timing noise exceeds the
        # (long - short) steps between them the median can come out <= 0, which is no time at all.
        resolved = step_ms > 0
        equal = "" if ref is None else str(bool(torch.equal(tokens, ref[0])))
        why = "" if equal != "False" else "; " + first_difference(tokens, logits, ref[0], ref[3])
        if not resolved:
            why += (f"; step time not resolved: generate() of {long} new tokens was not slower than of {short} "
                    f"(median difference {step_ms:.4f} ms a step: timing noise above {long - short} steps)")
        ratio = f"{step_ms / base:.4f}" if resolved and base is not None and base > 0 else ""
        spread = f"{(max(step_list) - min(step_list)) / step_ms:.3f}" if resolved else ""
        run.rows.append({**run.meta, "scope": "decode", "arch": "llama", "dims": dims, "hidden": HIDDEN[dims],
                         "layers": args.layers, "T": args.decode_batch, "variant": variant, "kernel": label,
                         "ms_per_layer": f"{step_ms / args.layers:.4f}" if resolved else "",
                         "ratio_vs_default": ratio, "spread": spread,
                         "ms_per_step": f"{step_ms:.4f}" if resolved else "", "tokens_equal": equal,
                         "source_hash": run.source_hash(label),
                         "note": f"generate(), static cache, batch {args.decode_batch}, {long} new tokens, "
                                 f"{rounds_for(args, len(results))} rounds x {args.repeats}"
                                 + ("; identity collectives (fake_group.py)" if args.comm == "fake" else "") + why})
        if run.rank == 0:
            print(f"decode {variant:8s} {step_ms:8.3f} ms/step  spread {spread or '-'}  "
                  f"tokens equal to default: {equal or '-'}  [{label}]" + why, flush=True)
        if not resolved and run.dev.type == "cuda":  # on a GPU the difference is many times the noise
            run.failed.append(f"decode {variant}: step time not resolved ({step_ms:.4f} ms)")
        if equal == "False":
            run.failed.append(f"decode {variant}: tokens differ from plain Inductor's")
    run.write()


def first_difference(tokens: torch.Tensor, logits: torch.Tensor, ref_tokens: torch.Tensor,
                     ref_logits: torch.Tensor) -> str:
    """Where two greedy decodes part (tokens ``[B, steps]``, logits ``[B, steps, vocab]``), and
    whether it was a near tie: plain Inductor's margin between its token and the other's there,
    against the largest logit difference of the steps both saw the same prefix (a margin inside
    that difference is a rounding flip; one well outside it is a wrong result)."""
    diff = (tokens != ref_tokens).any(0).nonzero()
    if not len(diff):
        return "tokens equal"
    k = int(diff[0])
    b = int((tokens[:, k] != ref_tokens[:, k]).nonzero()[0])
    before = (logits[:, :k + 1] - ref_logits[:, :k + 1]).abs().max().item()  # step k's inputs are the same too
    margin = (ref_logits[b, k, ref_tokens[b, k]] - ref_logits[b, k, tokens[b, k]]).item()
    return (f"first differs at new token {k} (batch row {b}): plain Inductor's margin for its token there "
            f"{margin:.4f}, the largest logit difference up to there {before:.4f}"
            f" ({'a near tie' if margin <= before else 'NOT a near tie'})")


def _timed(run: Run, fn) -> float:
    if run.dev.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if run.dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


# ----------------------------------------------------------------------------- the op alone


def ops(run: Run, dims: str, tokens: list[int]) -> None:
    """The local part of each design at (T, H): one op call alone (module doc)."""
    from weave_compile.kernels.ce import copy_engine as ce
    from weave_compile.kernels.shared import addnorm
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.testing.emulated_ranks import EmulatedRanks, push_allreduce_rmsnorm

    if run.dev.type != "cuda":
        print("ops: CUDA only (emulated ranks, Triton kernels): skipped", flush=True)
        return
    H, N, dt = HIDDEN[dims], 2, torch.bfloat16
    eps = 1e-5

    @torch.compile(dynamic=True)
    def plain(x, residual, weight):
        h = (x + residual).float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dt) * weight

    for t in [t for t in tokens if t >= N]:
        S = math.ceil(t / N)
        g = torch.Generator(device=run.dev).manual_seed(t)
        xs = [torch.randn(t, H, device=run.dev, generator=g).to(dt) for _ in range(N)]
        res_sh = [torch.randn(S, H, device=run.dev, generator=g).to(dt) for _ in range(N)]
        full_res = torch.randn(t, H, device=run.dev, generator=g).to(dt)
        weight = torch.randn(H, device=run.dev, generator=g).to(dt)
        normed, res_out = torch.empty(S, H, device=run.dev, dtype=dt), torch.empty(S, H, device=run.dev, dtype=dt)
        spec = FusedSpec(residual_dtype=dt, out_dtype=dt, eps=eps, residual_in_sharded=True,
                         residual_out_sharded=True, comm_ctas=run.args.comm_ctas)
        cases: dict[str, tuple[Callable, str]] = {
            "plain:add+norm": (lambda: plain(xs[0], full_res, weight), "Inductor's add+RMSNorm on all T rows"),
            "nccl:add+norm": (lambda: addnorm.add_rmsnorm_rows(
                xs[0][:S], None, res_sh[0], None, weight, None, normed, res_out, n_valid=S, eps=eps, mid_dtype=None,
                weight_offset=0.0, num_ctas=addnorm.ctas_for(spec)), "its add+norm on this rank's T/2 rows"),
        }
        try:
            pr = EmulatedRanks.create(N, H, t, dtype=dt, device=run.dev)
            outs = push_allreduce_rmsnorm(pr, xs, res_sh, None, weight, residual_in_sharded=True,
                                          residual_out_sharded=True, comm_ctas=spec.comm_ctas)
            cases["p2p:emulated"] = (lambda: push_allreduce_rmsnorm(
                pr, xs, res_sh, None, weight, residual_in_sharded=True, residual_out_sharded=True,
                comm_ctas=spec.comm_ctas, outputs=outs), "whole op, 2 ranks emulated on this GPU")
        except Exception as e:  # noqa: BLE001 - reported, the other designs still run
            run.skipped(f"ops p2p T={t}", e)
        if ce.unavailable_reason() is None:
            wss = ce.emulated_workspaces(N, S, H, (dt, dt, dt), device=run.dev, poison=False)
            streams = [torch.cuda.Stream() for _ in range(N)]
            rank_rows = [Rows(xs[r], res_sh[r], None, weight) for r in range(N)]
            cases["ce:emulated"] = (lambda: ce.emulated_run(wss, rank_rows, spec, streams),
                                    "whole op, 2 ranks emulated on this GPU")
        else:
            print(f"ops ce: {ce.unavailable_reason()}", flush=True)
        times = {}
        for name, (fn, _) in cases.items():
            try:
                times[name] = Timer(run.args.repeats, warmup=3, graph=True)(fn, max(run.args.iters, 10))
            except Exception as e:  # noqa: BLE001
                run.skipped(f"ops {name} T={t}", e)
        base = times.get("plain:add+norm")
        for name, us in times.items():
            design = name.split(":")[0]
            run.rows.append({**run.meta, "scope": "op", "arch": "-", "dims": dims, "hidden": H, "layers": "",
                             "T": t, "variant": name, "kernel": design if design != "plain" else "default",
                             "ms_per_layer": f"{us / 1e3:.4f}", "ratio_vs_default": f"{us / base:.4f}" if base else "",
                             "spread": "", "ms_per_step": "", "tokens_equal": "",
                             "source_hash": run.source_hash(design), "note": cases[name][1]})
            if run.rank == 0:
                print(f"op T={t:6d} H={H} {name:16s} {us:9.1f} us" + (f"  {us / base:.2f}x plain" if base else ""),
                      flush=True)
        run.write()


# ----------------------------------------------------------------------------- plot


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = [r for r in rows if r["scope"] == "model" and r["ratio_vs_default"]]
    dims = sorted({r["dims"] for r in model}) or ["-"]
    colors = {"auto": "tab:blue", "autotune": "tab:cyan", "fallback": "tab:orange", "nccl": "tab:green",
              "reference": "tab:red", "ce": "tab:purple"}
    fig, axes = plt.subplots(1, len(dims), figsize=(6.5 * len(dims), 4.5), squeeze=False)
    for ax, d in zip(axes[0], dims):
        at = [r for r in model if r["dims"] == d]
        archs = sorted({r["arch"] for r in at})
        # The control as a band: plain Inductor against itself, lowest to highest over the archs.
        again = collections.defaultdict(list)
        for r in at:
            if r["variant"] == CONTROL:
                again[int(r["T"])].append(float(r["ratio_vs_default"]))
        if again:
            ts = sorted(again)
            ax.fill_between(ts, [min(again[t]) for t in ts], [max(again[t]) for t in ts], color="0.85",
                            label=f"{CONTROL} (plain Inductor vs itself), range over archs")
        # Each variant: every arch's point, and the median over archs as a line.
        for v in [v for v in colors if any(r["variant"] == v for r in at)]:
            by_t = collections.defaultdict(list)
            for r in at:
                if r["variant"] == v:
                    by_t[int(r["T"])].append(float(r["ratio_vs_default"]))
            ts = sorted(by_t)
            ax.scatter([t for t in ts for _ in by_t[t]], [x for t in ts for x in by_t[t]], s=9, color=colors[v],
                       alpha=0.45)
            ax.plot(ts, [statistics.median(by_t[t]) for t in ts], "-" if v in CHOOSING else ":",
                    color=colors[v], label=f"{v}: median over archs (dots: each arch)")
        ax.text(0.01, 0.01, "archs: " + ", ".join(archs), transform=ax.transAxes, fontsize=6, va="bottom")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (tokens, batch 1, prefill shape)")
        ax.set_ylabel("ms per layer / plain Inductor's")
        ax.set_title(f"{d} dims", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    meta = rows[0]
    # --keep merges runs of several commits, and of several GPUs: name each
    commits = ", ".join(sorted({r["git_commit"] for r in model}))
    gpus = ", ".join(sorted({r["gpu"] for r in model}))
    fig.suptitle(f"floor: {gpus}, {meta['comm']} group of {meta['world_size']}, commits {commits}, "
                 f"torch {meta['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


# ----------------------------------------------------------------------------- main


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="small dims, llama, T=64, every part: catch errors "
                    "(writes floor_smoke.csv)")
    ap.add_argument("--comm", choices=("fake", "nccl"), default="fake",
                    help="fake: one GPU, fake process group (default); nccl: under torchrun, 2 GPUs")
    ap.add_argument("--dims", help="comma list of 8b, 70b (default both; '' for none: --decode alone)")
    ap.add_argument("--archs", help=f"comma list of weave_compile.testing.hf.ARCHS (default {','.join(ARCHS)})")
    ap.add_argument("--tokens", help=f"comma list (default {','.join(map(str, TOKENS))})")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of {', '.join(VARIANTS)} (and p2p, oneshot with --comm nccl)")
    ap.add_argument("--impl-archs", default="llama", help="archs that also time reference and ce ('all': every one)")
    ap.add_argument("--fallback-archs", default="llama", help="archs that also time fallback ('all': every one)")
    ap.add_argument("--floor", choices=("measured", "committed"), default="measured",
                    help="auto/fallback on the floor measured by this run (default) or on kernels/auto_table.py")
    ap.add_argument("--layers", type=int, help="decoder layers (default 2)")
    ap.add_argument("--mode", default="reduce-overhead")
    ap.add_argument("--static", action="store_true",
                    help="compile every variant (plain Inductor too) for each T, none with dynamic shapes")
    ap.add_argument("--comm-ctas", type=int, default=32, help="--ops: CTAs of the designs' kernels")
    ap.add_argument("--rounds", type=int, help="default: one per variant timed together (at least 3)")
    ap.add_argument("--iters", type=int, help="calls per timing, at most (default 5; fewer where a call is long)")
    ap.add_argument("--repeats", type=int, help="timings per round (default 3)")
    ap.add_argument("--decode", action="store_true", help="also the generate() decode check and its step time")
    ap.add_argument("--decode-dims", default="8b")
    ap.add_argument("--decode-batch", type=int, default=1)
    ap.add_argument("--decode-tokens", type=int, help="new tokens of the long generate() (>= 16; default 40)")
    ap.add_argument("--compile-time", action="store_true",
                    help="only the first compile's seconds, default vs autotune, cold and cached (Llama at --dims)")
    ap.add_argument("--ops", action="store_true", help="also the op alone on emulated ranks (the designs' local part)")
    ap.add_argument("--code-diffs", default="",
                    help="folder for the diff of each variant's Inductor code that differs from default's")
    ap.add_argument("--keep", default="", help="CSV of an earlier run: its rows of points (dims, arch, T) not measured now stay")
    ap.add_argument("--keep-going", action="store_true", default=True,
                    help="a variant that fails is listed and skipped, the others still run (default)")
    ap.add_argument("--stop-on-error", dest="keep_going", action="store_false")
    ap.add_argument("--watchdog-s", type=float, default=420.0, help="end the run when one T of one arch takes longer")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--csv", default="", help="the CSV's file name in --out (default floor.csv; floor_smoke.csv "
                    "with --smoke); the PNG takes its name")
    args = ap.parse_args(argv)
    defaults = dict(dims="8b,70b", archs=",".join(ARCHS), tokens=",".join(map(str, TOKENS)), layers=2, rounds=0,
                    iters=5, repeats=3, decode_tokens=40)
    if args.smoke:  # what is not given explicitly
        defaults.update(dims="smoke", archs="llama", tokens="64", layers=1, rounds=1, iters=2, repeats=2,
                        decode_tokens=16)
        args.decode_dims, args.decode, args.ops = "smoke", True, True
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dims = [d for d in args.dims.split(",") if d]
    args.archs = [a for a in args.archs.split(",") if a]
    args.tokens = sorted({int(t) for t in args.tokens.split(",") if t})
    args.variants = [v for v in args.variants.split(",") if v]
    for d in args.dims + ([args.decode_dims] if args.decode else []):
        if d not in HIDDEN:
            ap.error(f"--dims: {d!r} is not one of 8b, 70b")
    import hf_models as hf

    bad = [a for a in args.archs if a not in hf.ARCHS]
    if bad:
        ap.error(f"--archs: {bad} not in {sorted(hf.ARCHS)}")
    allowed = set(VARIANTS) | {CONTROL} | ({"p2p", "oneshot"} if args.comm == "nccl" else set())
    if set(args.variants) - allowed or "default" not in args.variants:
        ap.error(f"--variants: {sorted(set(args.variants) - allowed) or 'default missing'}; allowed: {sorted(allowed)}")
    if args.comm == "nccl" and args.floor == "measured":
        args.floor = "committed"  # the floor is the local part: measured on the fake group only
    if args.decode and args.decode_tokens < 16:
        ap.error("--decode-tokens must be >= 16")
    return args


def variants_for(args, arch: str, phase: str) -> list[str]:
    """The variants timed for ``arch`` in ``phase`` ("impl": implementations, "auto": the choices, "all")."""
    impl_all = args.impl_archs == "all" or arch in args.impl_archs.split(",")
    fb_all = args.fallback_archs == "all" or arch in args.fallback_archs.split(",")
    out = []
    for v in args.variants:
        if v in ("reference", "ce", "p2p", "oneshot") and not impl_all:
            continue
        if v == "fallback" and not fb_all:
            continue
        if phase == "impl" and v in CHOOSING + (CONTROL,):
            continue
        if phase == "auto" and v not in ("default", CONTROL) + CHOOSING:
            continue
        out.append(v)
    return out


def setup(args) -> torch.device:
    if args.comm == "nccl":
        dist.init_process_group("nccl")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        torch.cuda.set_device(dev)
        return dev
    import fake_group

    return fake_group.init(2)


def keep_row(args, row: dict) -> bool:
    """Whether a row of ``--keep``'s CSV stays: what this run does not measure again."""
    scope = row.get("scope")
    if scope == "model":  # a point (dims, arch, T) is measured as a whole: its variants share a default
        return not (row.get("dims") in args.dims and row.get("arch") in args.archs
                    and row.get("T", "").isdigit() and int(row["T"]) in args.tokens)
    if scope == "op":
        return not (args.ops and row.get("dims") in args.dims)
    if scope == "decode":
        return not args.decode
    if scope == "compile":
        return not (args.compile_time and row.get("dims") in args.dims)
    return False


def measure_all(run: Run, args) -> None:
    """Decode first (a few compiles: not starved by a time limit), then per dims: the
    implementations, the floor they make, auto and fallback on it, the op alone."""
    if args.decode:
        decode(run, args.decode_dims)
    if args.compile_time:
        for dims in args.dims:
            compile_time(run, dims)
        return
    for dims in args.dims:
        if args.floor == "measured":
            for arch in args.archs:
                measure(run, arch, dims, variants_for(args, arch, "impl"), args.tokens)
            install_measured_floor(run, dims)
            phase = "auto"
        else:
            phase = "all"
        bucket_of = None if args.static else buckets(run, HIDDEN[dims], args.tokens)
        if run.rank == 0 and bucket_of is not None:
            print(f"every variant compiled per T bucket at {dims}: {bucket_of}", flush=True)
        for arch in args.archs:
            vs = variants_for(args, arch, phase)
            if len(vs) > 1:
                measure(run, arch, dims, vs, args.tokens, bucket_of)
        if args.ops:
            ops(run, dims, args.tokens)


def main(argv=None) -> None:
    args = parse(argv)
    dev = setup(args)
    logging.basicConfig(level=logging.WARNING)
    for name in ("recompile_limit", "cache_size_limit"):  # one code object, many variants and buckets
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    import fake_comm

    fake = fake_comm.install("local") if args.comm == "fake" and dev.type == "cuda" else None
    run = Run(args, dev, fake)
    if args.keep and os.path.exists(args.keep):
        with open(args.keep) as f:
            run.kept = [{c: r.get(c, "") for c in COLUMNS} for r in csv.DictReader(f) if keep_row(args, r)]
    if run.rank == 0:
        print(f"floor: {run.meta['gpu']}, {args.comm} group of {run.meta['world_size']}, commit "
              f"{run.meta['git_commit']}, dims {args.dims}, archs {args.archs}, T {args.tokens}, "
              f"{args.layers} layers, {args.rounds or 'one per variant (at least 3)'} rounds; {fake.describe() if fake else 'no fake ce'}", flush=True)
    start = time.monotonic()
    try:
        measure_all(run, args)
    except KeyboardInterrupt:  # a time limit's SIGINT: every point measured so far is in the CSV
        print("interrupted: the CSV holds every point measured so far", flush=True)
        run.failed.append("interrupted before the end")
    finally:
        run.write()
        if fake is not None:
            fake_comm.uninstall()
    if run.rank == 0:
        print(f"wrote {run.path} ({len(run.rows)} rows, {time.monotonic() - start:.0f} s)", flush=True)
        summarize(run.rows)
        try:
            plot(run.kept + run.rows, run.path[:-4] + ".png")
        except Exception as e:  # noqa: BLE001 - the CSV is the result
            print("plot skipped:", e)
    dist.destroy_process_group()
    if run.failed:
        raise SystemExit("not timed (they would have timed something else, or failed):\n  " + "\n  ".join(run.failed))


def summarize(rows: list[dict]) -> None:
    """The targets: auto and fallback at <= 1.00x plain Inductor at every T and arch; autotune
    within the control's scatter (plain Inductor against itself) at every point; the compile-time
    ratios. The misses are listed."""
    model = [r for r in rows if r["scope"] == "model" and r["ratio_vs_default"]]
    control = {(r["arch"], r["dims"], r["T"]): float(r["ratio_vs_default"]) for r in model if r["variant"] == CONTROL}
    scatter = max((abs(v - 1.0) for v in control.values()), default=0.0)
    for variants, bound, what in ((("auto", "fallback"), 1.0, "1.00x plain Inductor"),
                                  (("autotune",), 1.0 + scatter,
                                   f"the control's scatter ({1.0 + scatter:.3f}x plain Inductor)")):
        at = [r for r in model if r["variant"] in variants]
        if not at:
            continue
        miss = [r for r in at if float(r["ratio_vs_default"]) > bound]
        print(f"summary: {len(at) - len(miss)} of {len(at)} {'/'.join(variants)} points within {what}")
        for r in miss:
            again = control.get((r["arch"], r["dims"], r["T"]))
            print(f"  over: {r['arch']} {r['dims']} T={r['T']} {r['variant']} {r['ratio_vs_default']}x "
                  f"(spread {r['spread']}) [{r['kernel']}]"
                  + (f" program: {r['code_vs_default']} as default's" if r.get("code_vs_default") else "")
                  + (f"; {CONTROL} {again:.4f}x" if again is not None else ""))
    if control:
        off = sorted(abs(v - 1.0) for v in control.values())
        print(f"{CONTROL} (plain Inductor against itself) at {len(off)} points: |ratio - 1| "
              f"median {statistics.median(off):.3f}, max {off[-1]:.3f}")
    for r in rows:
        if r["scope"] == "compile" and r["variant"] == "autotune" and r["ratio_vs_default"]:
            target = 1.3 if r["note"].startswith("cold") else 1.05
            verdict = "met" if float(r["ratio_vs_default"]) <= target else "MISSED"
            print(f"compile time {r['dims']} {r['note']}: autotune {r['compile_s']} s, "
                  f"{r['ratio_vs_default']}x default (target <= {target}x: {verdict}) [{r['kernel']}]")


if __name__ == "__main__":
    main()
