"""What each communication design costs the other half's GEMMs, on ONE GPU (emulated ranks).

    python benchmarks/bench_interference.py --out benchmarks/results              # the full grid
    python benchmarks/bench_interference.py --dims 8b --tp 2 --rows 2048 --designs p2p,ce

Under the token split one half's fused communication runs beside the other half's GEMMs, so a
design is judged by what it costs those GEMMs, not by its own speed alone. Here:

* **the GEMMs**: every GEMM of one decoder layer's shard (QKV, O, gate+up, down; Llama-3-8B or
  70B dims; TP=2 or TP=8 shards) over ``rows`` token rows, repeated until one pass lasts
  ``--gemm-ms``, captured in one CUDA graph and replayed on a normal-priority stream;
* **beside them**: one design's calls over ``rows`` tokens of the model's hidden size (both
  emulated ranks, each on its own stream, bf16, sharded residual in and out: what a split layer
  runs), captured in a second CUDA graph replayed on a high-priority stream (TokenWeave's comm
  stream priority) and looped long enough to cover the GEMM graph;
* ``slowdown`` = GEMM graph time beside the design / alone (medians of ``--repeats``, the alone
  and overlapped replays taken in turn, so that clock drift over the run falls on both alike);
  ``comm_with_gemm_us`` = one call's time when a shorter loop of calls runs entirely inside the
  GEMM graph, ``comm_alone_us`` = one call's time alone.

Designs: ``p2p@C`` (the push kernel, C CTAs per rank), ``p2p_barriers@C`` (the same launch with
every data phase left out: residency and barrier polling only), ``p2p_lowprio@C`` (its loop on a
normal-priority stream), ``ce@C`` (copy engines + stream-memory flags + the C-CTA add+norm),
``oneshot`` (where its size limit admits the message), and stand-ins with no communication
(``standin:spin@K``: a kernel resident on K SMs for the whole loop; ``standin:train@K:L``: a train of
L-microsecond kernels on K SMs, L = 100 unless given; ``standin:stream@K``: a streaming-copy kernel
resident on K SMs; ``standin:copy``: device-to-device copy-engine copies, back to back).

Reading a resident stand-in: cuBLAS's persistent GEMMs launch one CTA per SM and each CTA owns
a fixed set of tiles, so the CTAs whose SMs a resident kernel holds start only when it ends: a
kernel resident beyond the GEMMs (the loop covers 1.3x their time) delays them until its end.
What a design costs therefore grows with how long each of its kernels holds its SMs, more than
with how many SMs it holds (compare ``standin:train@16:10/100/1000``).

What this does not model: both emulated ranks run on this GPU, so a design's SM work and HBM
traffic here are both ranks' (twice one GPU's share across two GPUs) and "peer" accesses are local
HBM, not NVLink. TP=8 rows change only the GEMM shapes: the communication is emulated at 2 ranks
(8 emulated ranks of a barrier kernel at 32 CTAs cannot all be resident). Writes
``interference.csv`` and ``interference.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, meta as run_meta, write_csv  # noqa: E402  (keeps NVLink multicast off)

import torch  # noqa: E402

COLUMNS = ["gpu", "design", "ctas", "dims", "tp", "rows", "gemm_reps", "gemm_alone_us", "gemm_with_comm_us", "slowdown",
           "comm_alone_us", "comm_with_gemm_us", "comm_calls", "torch", "triton", "git_commit", "date"]
DIMS = {"8b": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128),
        "70b": dict(hidden=8192, inter=28672, heads=64, kv_heads=8, head_dim=128)}
DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------- the GEMMs


def layer_gemm_shapes(dims: str, tp: int) -> list[tuple[str, int, int]]:
    """``(name, K, N)`` of every GEMM of one decoder layer's TP shard."""
    d = DIMS[dims]
    qkv = (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"] // tp
    return [("qkv", d["hidden"], qkv), ("o", d["heads"] * d["head_dim"] // tp, d["hidden"]),
            ("gate_up", d["hidden"], 2 * d["inter"] // tp), ("down", d["inter"] // tp, d["hidden"])]


class GemmGraph:
    """The layer's GEMMs over ``rows`` rows, ``reps`` times, in one CUDA graph."""

    def __init__(self, dims: str, tp: int, rows: int, target_ms: float, dev):
        shapes = layer_gemm_shapes(dims, tp)
        self.ops = []
        for _, k, n in shapes:
            a = torch.randn(rows, k, device=dev, dtype=DTYPE)
            w = (torch.randn(n, k, device=dev, dtype=DTYPE) * k ** -0.5)
            self.ops.append((a, w.t(), torch.empty(rows, n, device=dev, dtype=DTYPE)))  # x @ W.T, as F.linear
        one = self._time_eager()
        self.reps = max(2, math.ceil(target_ms * 1e3 / one))
        self.graph = capture(self._run_once, self.reps, torch.cuda.Stream(dev))

    def _run_once(self) -> None:
        for a, wt, out in self.ops:
            torch.mm(a, wt, out=out)

    def _time_eager(self) -> float:
        for _ in range(3):
            self._run_once()
        g = capture(self._run_once, 10, torch.cuda.Stream())
        return replay_us(g, torch.cuda.current_stream(), 3) / 10


# ----------------------------------------------------------------------------- timing helpers


def capture(fn: Callable[[], None], n: int, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``n`` calls of ``fn`` captured on ``stream``."""
    g = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return g


def _timed(*launches: tuple) -> list[float]:
    """Replay each ``(graph, stream)`` at once, in the given order; each one's time in us."""
    torch.cuda.synchronize()
    evs = []
    for g, s in launches:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            a.record()
            g.replay()
            b.record()
        evs.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in evs]


def replay_us(g: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, repeats: int) -> float:
    """Median time of one replay of ``g`` on ``stream``, alone (the first replay uploads the graph)."""
    return statistics.median([_timed((g, stream))[0] for _ in range(repeats + 1)][1:])


def gemm_alone_and_beside(gemm: tuple, comm: tuple, repeats: int) -> tuple[float, float]:
    """Median GEMM-graph time alone and with ``comm`` replayed beside it (enqueued first), the
    two measured in turn so that a drift of the clocks over the run falls on both alike."""
    alone, beside = [], []
    for i in range(repeats + 1):
        a = _timed(gemm)[0]
        b = _timed(comm, gemm)[1]
        if i:
            alone.append(a)
            beside.append(b)
    return statistics.median(alone), statistics.median(beside)


def comm_beside(gemm: tuple, comm: tuple, repeats: int) -> float:
    """Median time of ``comm`` replayed while the GEMM graph (enqueued first) runs."""
    return statistics.median([_timed(gemm, comm)[1] for _ in range(repeats + 1)][1:])


# ----------------------------------------------------------------------------- designs


@dataclass
class Design:
    """One unit of work beside the GEMMs: ``enqueue(n)`` puts ``n`` units on the current stream."""

    name: str
    ctas: int
    enqueue: Callable[[int], None]
    low_priority: bool = False
    resident: bool = False  # one launch whatever n (its length grows with n)


def _emulated_inputs(world: int, rows: int, hidden: int, dev):
    S = math.ceil(rows / world)
    xs = [torch.randn(rows, hidden, device=dev, dtype=DTYPE) for _ in range(world)]
    res = [torch.randn(S, hidden, device=dev, dtype=DTYPE) for _ in range(world)]
    weight = torch.randn(hidden, device=dev, dtype=DTYPE)
    return xs, res, weight


def p2p_design(rows: int, hidden: int, ctas: int, dev, *, phases: int = 7, low_priority: bool = False,
               label: str = "p2p") -> Design:
    from weave_compile.testing.emulated_ranks import EmulatedRanks, push_allreduce_rmsnorm

    ranks = EmulatedRanks.create(2, hidden, rows, dtype=DTYPE, device=dev)
    xs, res, weight = _emulated_inputs(2, rows, hidden, dev)
    kw = dict(residual_in_sharded=True, residual_out_sharded=True, comm_ctas=ctas, phases=phases)
    outs = push_allreduce_rmsnorm(ranks, xs, res, None, weight, **kw)  # compiles, runs once
    torch.cuda.synchronize()

    def enqueue(n: int) -> None:
        for _ in range(n):
            push_allreduce_rmsnorm(ranks, xs, res, None, weight, outputs=outs, **kw)

    d = Design(label, ctas, enqueue, low_priority=low_priority)
    d.check = ranks.barrier_state  # (timeouts, stuck pad slots): a run with either is not valid
    return d


def _on_both_ranks(streams, call):
    """``enqueue(n)``: n times, each emulated rank's ``call(rank)`` on its own stream, both
    started after the current stream's work and joined back into it (the ranks run together)."""
    def enqueue(n: int) -> None:
        cur = torch.cuda.current_stream()
        for _ in range(n):
            for r, stream in enumerate(streams):
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    call(r)
            for stream in streams:
                cur.wait_stream(stream)

    return enqueue


def ce_design(rows: int, hidden: int, ctas: int, dev) -> Design:
    from weave_compile.kernels.ce import copy_engine as ce
    from weave_compile.kernels.spec import FusedSpec, Rows

    wss = ce.emulated_workspaces(2, math.ceil(rows / 2), hidden, (DTYPE,) * 3, device=dev, poison=False)
    xs, res, weight = _emulated_inputs(2, rows, hidden, dev)
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    spec = FusedSpec(DTYPE, DTYPE, residual_in_sharded=True, residual_out_sharded=True, comm_ctas=ctas)
    rank_rows = [Rows.of(xs[r], res[r], weight=weight) for r in range(2)]
    for r in range(2):  # load every kernel before any stream waits on a peer
        ce.preload(ce.ce_call(wss[r], rank_rows[r], spec, run=False)[2])

    return Design("ce", ctas, _on_both_ranks(streams, lambda r: ce.ce_call(wss[r], rank_rows[r], spec)))


def oneshot_design(rows: int, hidden: int, ctas: int, dev) -> Optional[Design]:
    from weave_compile.kernels.oneshot import ONESHOT_MAX_BYTES
    from weave_compile.kernels.oneshot.kernel import launch
    from weave_compile.kernels.oneshot.workspace import layout, workspace_from_buffers
    from weave_compile.kernels.spec import FusedSpec, Rows

    if rows * hidden * DTYPE.itemsize > ONESHOT_MAX_BYTES:
        print(f"  oneshot skipped: T*H*b = {rows * hidden * DTYPE.itemsize} B > {ONESHOT_MAX_BYTES} B", flush=True)
        return None
    S = math.ceil(rows / 2)
    lay = layout(S * 2, 2, hidden, DTYPE, DTYPE)
    bufs = [torch.empty(lay.total, dtype=torch.uint8, device=dev) for _ in range(2)]
    wss = [workspace_from_buffers(bufs, r, hidden=hidden, in_dtype=DTYPE, res_dtype=DTYPE, capacity=S * 2)
           for r in range(2)]
    xs, res, weight = _emulated_inputs(2, rows, hidden, dev)
    spec = FusedSpec(DTYPE, DTYPE, residual_in_sharded=True, residual_out_sharded=True, comm_ctas=ctas)
    rank_rows = [Rows.of(xs[r], res[r], weight=weight) for r in range(2)]
    outs = [(torch.empty(rows, hidden, device=dev, dtype=DTYPE), torch.empty(S, hidden, device=dev, dtype=DTYPE))
            for _ in range(2)]
    streams = [torch.cuda.Stream(dev) for _ in range(2)]
    torch.cuda.synchronize()

    return Design("oneshot", ctas, _on_both_ranks(streams, lambda r: launch(wss[r], rank_rows[r], spec, *outs[r])))


# Stand-ins: no communication, only the footprint the question is about.

def _standin_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def spin_kernel(ns):
        t0 = _now()
        t = t0
        while t - t0 < ns:
            t = _now()

    @triton.jit
    def stream_kernel(src, dst, n_rows, passes, H: tl.constexpr, BR: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, H)
        for _ in range(passes):
            for r0 in range(pid * BR, n_rows, nprog * BR):
                rows = r0 + tl.arange(0, BR)
                m = rows[:, None] < n_rows
                v = tl.load(src + rows[:, None] * H + cols[None, :], mask=m)
                tl.store(dst + rows[:, None] * H + cols[None, :], v, mask=m)

    return spin_kernel, stream_kernel


UNIT_US = 100.0  # one stand-in unit: 100 us of its footprint


def standin_design(kind: str, sms: int, dev, unit_us: float = UNIT_US) -> Design:
    spin_kernel, stream_kernel = _standin_kernels()
    if kind == "spin":  # resident on `sms` SMs for the whole loop: one launch, n units long
        def enqueue(n: int) -> None:
            spin_kernel[(sms,)](int(n * UNIT_US * 1e3))
        return Design(f"standin:spin@{sms}", sms, enqueue, resident=True)
    if kind == "train":  # kernels of unit_us each, back to back on `sms` SMs
        def enqueue(n: int) -> None:
            for _ in range(n):
                spin_kernel[(sms,)](int(unit_us * 1e3))
        return Design(f"standin:train{int(unit_us)}us@{sms}", sms, enqueue)
    if kind == "stream":  # a streaming copy resident on `sms` SMs
        H, rows = 4096, 4096  # 32 MB read + 32 MB written per pass
        src = torch.randn(rows, H, device=dev, dtype=DTYPE)
        dst = torch.empty_like(src)
        stream_kernel[(sms,)](src, dst, rows, 1, H=H, BR=2, num_warps=8)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        stream_kernel[(sms,)](src, dst, rows, 4, H=H, BR=2, num_warps=8)
        e.record()
        e.synchronize()
        per_pass_us = s.elapsed_time(e) * 1e3 / 4

        def enqueue(n: int) -> None:
            stream_kernel[(sms,)](src, dst, rows, max(1, round(n * UNIT_US / per_pass_us)), H=H, BR=2, num_warps=8)
        return Design(f"standin:stream@{sms}", sms, enqueue, resident=True)
    if kind == "copy":  # copy engines: device-to-device copies, no SM
        src = torch.randn(32 << 20, device=dev, dtype=DTYPE)  # 64 MB
        dst = torch.empty_like(src)

        def enqueue(n: int) -> None:
            for _ in range(n):
                dst.copy_(src)
        return Design("standin:copy", 0, enqueue)
    raise ValueError(f"unknown stand-in {kind!r}")


def make_design(spec: str, rows: int, hidden: int, dev) -> Optional[Design]:
    name, _, ctas = spec.partition("@")
    ctas, _, length = ctas.partition(":")
    c = int(ctas) if ctas else 8
    if name == "p2p":
        return p2p_design(rows, hidden, c, dev)
    if name == "p2p_barriers":
        return p2p_design(rows, hidden, c, dev, phases=0, label="p2p_barriers")
    if name == "p2p_lowprio":
        return p2p_design(rows, hidden, c, dev, low_priority=True, label="p2p_lowprio")
    if name == "ce":
        return ce_design(rows, hidden, c, dev)
    if name == "oneshot":
        return oneshot_design(rows, hidden, c if ctas else 32, dev)
    if name.startswith("standin:"):
        return standin_design(name.split(":", 1)[1], c, dev, float(length) if length else UNIT_US)
    raise ValueError(f"unknown design {spec!r}")


# ----------------------------------------------------------------------------- one point


def measure(design: Design, gemm: GemmGraph, gemm_alone: float, repeats: int, dev) -> dict:
    """One point. ``gemm_alone`` (measured once per shape) only sizes the loops; the slowdown is
    against alone times measured in turn with the overlapped ones."""
    hi = torch.cuda.Stream(dev, priority=-1)
    lo = torch.cuda.Stream(dev)
    comm_stream = lo if design.low_priority else hi
    compute = torch.cuda.Stream(dev)
    # One unit alone (enough units to time well).
    probe_n = 4
    g = capture(lambda: design.enqueue(probe_n), 1, comm_stream)
    unit = replay_us(g, comm_stream, repeats) / probe_n
    del g
    # Slowdown: a loop of units covering the whole GEMM graph.
    n_cover = math.ceil(1.3 * gemm_alone / unit) + 1
    cover = capture(lambda: design.enqueue(n_cover), 1, comm_stream)
    alone, gemm_with = gemm_alone_and_beside((gemm.graph, compute), (cover, comm_stream), repeats)
    del cover
    # The design's own time beside the GEMMs: a loop short enough to run inside the GEMM graph.
    n_inside = math.floor(0.6 * gemm_alone / unit)
    comm_with = float("nan")
    if n_inside >= 1:
        inside = capture(lambda: design.enqueue(n_inside), 1, comm_stream)
        comm_with = comm_beside((gemm.graph, compute), (inside, comm_stream), repeats) / n_inside
        del inside
    if hasattr(design, "check"):
        timeouts, stuck = design.check()
        if timeouts or stuck:
            raise RuntimeError(f"{design.name}@{design.ctas}: {timeouts} barrier timeouts, {stuck} pad slots set")
    return dict(gemm_alone_us=round(alone, 1), gemm_with_comm_us=round(gemm_with, 1),
                slowdown=round(gemm_with / alone, 4), comm_alone_us=round(unit, 2),
                comm_with_gemm_us=round(comm_with, 2) if comm_with == comm_with else "", comm_calls=n_cover)


def _compile_p2p(job: tuple) -> str:
    """Compile (into Triton's on-disk cache) the push kernel one ``p2p*`` point launches."""
    rows, hidden, ctas, phases = job
    from weave_compile.kernels.p2p import launch
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    dev = torch.device("cuda", 0)
    ranks = EmulatedRanks.create(2, hidden, rows, dtype=DTYPE, device=dev)
    xs, res, weight = _emulated_inputs(2, rows, hidden, dev)
    S = math.ceil(rows / 2)
    spec = FusedSpec(DTYPE, DTYPE, group_name="emulated", residual_in_sharded=True, residual_out_sharded=True,
                     comm_ctas=ctas)
    meta = launch.push_meta(hidden, S, ctas, 2, DTYPE.itemsize, DTYPE.itemsize, None)
    out = (torch.empty(rows, hidden, device=dev, dtype=DTYPE), torch.empty(S, hidden, device=dev, dtype=DTYPE))
    for ws in ranks.workspaces:
        launch.launch_push(ws, Rows(xs[ws.rank], res[ws.rank], None, weight), spec, *out, meta=meta,
                           phases=phases, compile_only=True)
    return f"{rows}x{hidden}@{ctas}/{phases}"


def precompile(specs: list[str], rows_list: list[int], hiddens: list[int], workers: int) -> None:
    """Compile every push-kernel variant the run will launch, ``workers`` processes at a time
    (ptxas on the unrolled kernel takes seconds per variant; the timed run then loads them)."""
    import multiprocessing as mp

    jobs = set()
    for spec in specs:
        name, _, ctas = spec.partition("@")
        if name.startswith("p2p"):
            for rows in rows_list:
                for hidden in hiddens:
                    jobs.add((rows, hidden, int(ctas.partition(":")[0] or 8), 0 if name == "p2p_barriers" else 7))
    if not jobs:
        return
    with mp.get_context("spawn").Pool(workers) as pool:
        for done in pool.imap_unordered(_compile_p2p, sorted(jobs)):
            print("  compiled", done, flush=True)


def default_designs(ctas: list[int]) -> list[str]:
    out = [f"p2p@{c}" for c in ctas] + [f"ce@{c}" for c in ctas] + ["oneshot"]
    out += ["p2p_barriers@8", "p2p_lowprio@8"]
    out += ["standin:train@1:5",  # control: 5 us kernels on one SM should cost nothing
            "standin:spin@4", "standin:spin@16", "standin:train@16:10", "standin:train@4", "standin:train@16",
            "standin:train@16:1000", "standin:stream@4", "standin:stream@16", "standin:copy"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--dims", default="8b,70b")
    ap.add_argument("--tp", default="2,8")
    ap.add_argument("--rows", default="512,1024,2048,4096,8192")
    ap.add_argument("--ctas", default="2,4,8,16,32", help="CTA counts of p2p and ce")
    ap.add_argument("--designs", default="", help="comma list (default: every design and stand-in)")
    ap.add_argument("--gemm-ms", type=float, default=3.0, help="length of one GEMM graph replay")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--csv-name", default="interference.csv")
    ap.add_argument("--plot-only", metavar="CSV", help="redraw the PNG of a written CSV, measure nothing")
    ap.add_argument("--precompile", type=int, default=0, help="processes that compile the push kernel's "
                    "variants before timing (0: compile when first launched)")
    args = ap.parse_args()
    if args.plot_only:
        import csv

        with open(args.plot_only) as f:
            plot(list(csv.DictReader(f)), os.path.splitext(args.plot_only)[0] + ".png")
        return
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ctas = [int(c) for c in args.ctas.split(",")]
    specs = [s for s in args.designs.split(",") if s] or default_designs(ctas)
    path = os.path.join(args.out, args.csv_name)
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.precompile:
        precompile(specs, rows_list, sorted({DIMS[d]["hidden"] for d in args.dims.split(",")}), args.precompile)
    m = run_meta(dev)
    rows_out: list[dict] = []
    for dims in args.dims.split(","):
        hidden = DIMS[dims]["hidden"]
        for tp in [int(t) for t in args.tp.split(",")]:
            for rows in rows_list:
                gemm = GemmGraph(dims, tp, rows, args.gemm_ms, dev)
                alone = replay_us(gemm.graph, torch.cuda.Stream(dev), args.repeats)
                print(f"{dims} tp={tp} rows={rows}: GEMMs alone {alone:.0f} us ({gemm.reps} layer passes)",
                      flush=True)
                for spec in specs:
                    try:
                        design = make_design(spec, rows, hidden, dev)
                        if design is None:
                            continue
                        r = measure(design, gemm, alone, args.repeats, dev)
                    except Exception as e:  # one failed point must not lose the others
                        print(f"  {spec}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    row = dict(m, design=design.name, ctas=design.ctas, dims=dims, tp=tp, rows=rows,
                               gemm_reps=gemm.reps, **r)
                    rows_out.append(row)
                    write_csv(path, rows_out, COLUMNS)
                    print(f"  {design.name:>18}@{design.ctas:<2} slowdown {r['slowdown']:.3f}  "
                          f"alone {r['comm_alone_us']} us  beside {r['comm_with_gemm_us']} us", flush=True)
                    del design
                    torch.cuda.empty_cache()
                del gemm
    print("wrote", path)
    try:
        plot(rows_out, os.path.splitext(path)[0] + ".png")
    except Exception as e:  # the CSV is the result
        print("plot skipped:", e)


#: What the plot shows: each design at its fewest and most CTAs, and the stand-ins that tell the
#: reasons apart (the CSV has every point).
PLOTTED = ("p2p@2", "p2p@32", "ce@2", "ce@32", "p2p_barriers@8", "standin:train5us@1@1",
           "standin:train100us@16@16", "standin:train1000us@16@16", "standin:spin@16@16", "standin:copy@0")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dims"], int(r["tp"])) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False, sharey=True)
    for ax, (dims, tp) in zip(axes[0], panels):
        sel = [r for r in rows if (r["dims"], int(r["tp"])) == (dims, tp)]
        for label in PLOTTED:
            pts = sorted((int(r["rows"]), float(r["slowdown"])) for r in sel
                         if f"{r['design']}@{r['ctas']}" == label)
            if pts:
                style = "--" if label.startswith("standin") else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", markersize=3, label=label)
        ax.axhline(1.03, color="k", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_title(f"Llama-{dims} dims, TP={tp} shard GEMMs", fontsize=9)
        ax.set_xlabel("rows of the other half")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GEMM time beside / alone")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(f"{rows[0]['gpu']}, 2 ranks emulated on one GPU: what a design beside them costs the GEMMs "
                 "(dotted: 1.03)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


if __name__ == "__main__":
    main()
