"""Timing one signature's candidates on the site's own group: checked first, then rotated rounds.

Candidates are the registered implementations that can run at the site and the site **as
written**: the collective (all_reduce, or a sequence-parallel site's reduce-scatter and
all-gather) with the add and RMSNorm (or LayerNorm) around it, compiled the way the graph is compiled
(:func:`written_runner`: Inductor, or ``aot_eager``), so what is timed is the code plain
``torch.compile`` would run there.

**The check.** Before a design is timed, its outputs are compared with the float64 oracle of the
op's contract (``kernels/reference.py``) on seeded random inputs: every rank builds every rank's
partial sums from the seed, so each rank checks its own outputs against the oracle without a
collective. A design that is wrong on any rank never competes (:func:`check`).

**The timing.** Each rank times every candidate in ``rounds`` rounds, the candidates' order
rotated by one each round (what runs first after a barrier, or after another design, pays for it
in turn), a device barrier on the group before each block (no rank starts a block while a peer
still runs the last one), each block many calls: under ``mode="reduce-overhead"`` the calls are
captured in one CUDA graph and the block replays it (the graph runs them so), otherwise they are
launched one by one. The block's length is agreed (the largest calibration of any rank), so every
rank runs the same collectives. A rank's statistic per candidate is the median over rounds of the
time per call, and its spread the interquartile range over the median; :mod:`.choice` settles
them across ranks.

On the fake process group (one process, collectives that move nothing) the oracle check cannot
hold and is skipped (the report says so); the timings are then the local parts only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
import types
from typing import Any, Callable, Optional

import torch

from ...quant import QuantSpec, dequantize, quantize_ref, quantize_rows
from ...rows import norm_rows, rows_of_rank, rows_per_rank
from .signature import Signature, dtype_of

log = logging.getLogger(__name__)

#: The candidate that is the site as written (not an implementation).
AS_WRITTEN = "as written"
#: Rounds per candidate; the first round is discarded as warm-up of the rotation.
ROUNDS = 9
#: How long one timed block should last (us): long enough that the timer and the barrier's tail
#: are noise, short enough that a symbolic site's buckets time in a second or two.
BLOCK_US = 1500.0
MAX_CALLS_PER_BLOCK = 200
#: Largest token count the oracle check builds every rank's partial sums for (the check runs the
#: same code at a smaller count where the timed one is larger).
CHECK_MAX_TOKENS = 1024
#: The check's tolerance: relative norm error of the outputs against the float64 oracle, and of
#: any one row (a design that gets one row wrong fails), per output dtype.
CHECK_REL_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
#: An fp8 epilogue's rows, dequantized, against the oracle's rows quantized in float64: a code one
#: step off (where the normed row's rounding moved a value across a rounding boundary) is 6-25% of
#: that value (e4m3: 3 mantissa bits, e5m2: 2); a few percent of codes off stays well inside this,
#: a wrong scale or row is far outside it.
QUANT_REL_TOL = 6e-2


@dataclasses.dataclass(frozen=True)
class Stat:
    """One rank's timing of one candidate at one bucket: the median over rounds of the time per
    call (us) and the spread (interquartile range over the median)."""

    median_us: float
    spread: float

    def to_json(self) -> list:
        return [round(self.median_us, 4), round(self.spread, 5)]

    @classmethod
    def from_json(cls, v) -> "Stat":
        return cls(float(v[0]), float(v[1]))


def stat_of(samples: list[float]) -> Stat:
    s = sorted(samples)
    n = len(s)

    def q(p: float) -> float:
        i = (n - 1) * p
        lo, hi = math.floor(i), math.ceil(i)
        return s[lo] + (s[hi] - s[lo]) * (i - lo)

    med = q(0.5)
    return Stat(med, (q(0.75) - q(0.25)) / med if med > 0 else 0.0)


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    """One rank's tensors for a call at one token count, and (for the check) every rank's partial sums."""

    x: torch.Tensor  # this rank's partial sums [T, H] (a sequence-parallel site: the reduce-scatter's input)
    residual_full: Optional[torch.Tensor]  # [T, H]: the oracle's
    residual: Optional[torch.Tensor]  # what the op reads: full, or this rank's [S, H] shard
    bias: Optional[torch.Tensor]
    weight: Optional[torch.Tensor]
    scale: Optional[torch.Tensor]
    eps_tensor: Optional[torch.Tensor]
    partials: Optional[list[torch.Tensor]] = None  # every rank's x, for the oracle (the check only)
    norm_bias: Optional[torch.Tensor] = None  # a LayerNorm's bias, after the weight
    #: a split half's: the operands of the GEMMs the other half runs beside its op (timing only)
    gemms: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    quant_scale: Optional[torch.Tensor] = None  # a static fp8 epilogue's scale (0-d fp32)


EPS = 1e-6


def make_inputs(sig: Signature, num_tokens: int, group_rank: int, device: torch.device, seed: int,
                all_ranks: bool) -> Inputs:
    """Real random inputs (never zeros, never stale memory: a GEMM beside or after them runs faster on
    those). ``all_ranks``: build every rank's partial sums from ``seed`` on the host (the check);
    otherwise only this rank's, on the device (timing)."""
    H, N = sig.hidden, sig.world_size
    dt = dtype_of(sig.dtype)

    def randn(*shape, dtype, gen_seed):
        if all_ranks:
            g = torch.Generator().manual_seed(gen_seed)
            return torch.randn(*shape, generator=g).to(dtype).to(device)
        g = torch.Generator(device=device).manual_seed(gen_seed)
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    partials = None
    if all_ranks:
        partials = [randn(num_tokens, H, dtype=dt, gen_seed=seed * 64 + r) for r in range(N)]
        x = partials[group_rank]
    else:
        x = randn(num_tokens, H, dtype=dt, gen_seed=seed * 64 + group_rank)
    residual_full = residual = None
    if sig.residual_in is not None:
        residual_full = randn(num_tokens, H, dtype=dtype_of(sig.residual_in), gen_seed=seed * 64 + 63)
        residual = residual_full
        if sig.residual_in_sharded:
            S = rows_per_rank(num_tokens, N)
            n = rows_of_rank(num_tokens, S, group_rank)
            shard = residual_full.new_zeros((S, H))
            shard[:n] = residual_full[group_rank * S:group_rank * S + n]
            residual = shard
    bias = randn(H, dtype=dtype_of(sig.bias), gen_seed=seed * 64 + 62) if sig.bias else None
    weight = (randn(H, dtype=dtype_of(sig.weight), gen_seed=seed * 64 + 61) + (0.0 if sig.weight_offset else 1.0)
              ) if sig.weight else None
    if weight is not None:
        weight = weight.to(dtype_of(sig.weight))
    scale = torch.tensor(1.7, dtype=dtype_of(sig.scale), device=device) if sig.scale else None
    eps_tensor = torch.tensor(EPS, dtype=torch.float32, device=device) if sig.eps_on_device else None
    norm_bias = randn(H, dtype=dtype_of(sig.norm_bias), gen_seed=seed * 64 + 60) if sig.norm_bias else None
    gemms = () if all_ranks else tuple(
        _gemm_operands(num_tokens if g[0] is None else g[0], g[1], g[2], g[3:] == ("fp8",), dt, randn,
                       seed * 64 + 58 - 2 * i) for i, g in enumerate(sig.beside))
    quant = QuantSpec.decode(sig.quant) if sig.quant else None
    # A static scale that puts the rows' largest values near the format's top (what calibration gives).
    quant_scale = torch.tensor(4.0 / quant.fp8_max, dtype=torch.float32, device=device) \
        if quant is not None and quant.kind == "static" else None
    return Inputs(x, residual_full, residual, bias, weight, scale, eps_tensor, partials, norm_bias, gemms, quant_scale)


def _gemm_operands(m: int, k: int, n: int, fp8: bool, dt, randn, seed: int) -> tuple:
    """One GEMM beside a split half, real random operands: ``(a [m, k], b [k, n])`` for ``torch.mm``;
    for an fp8 GEMM ``(a, b, scale_a, scale_b)`` for ``torch._scaled_mm`` (e4m3fn, ``b``
    column-major as it requires, per-tensor fp32 scales)."""
    if not fp8:
        return randn(m, k, dtype=dt, gen_seed=seed), randn(k, n, dtype=dt, gen_seed=seed - 1) * k ** -0.5
    e4m3 = torch.float8_e4m3fn
    a = randn(m, k, dtype=torch.float32, gen_seed=seed).to(e4m3)
    b = randn(n, k, dtype=torch.float32, gen_seed=seed - 1).to(e4m3).t()
    one = torch.ones((), dtype=torch.float32, device=a.device)
    return a, b, one, one * k ** -0.5


def run_gemm(g: tuple) -> torch.Tensor:
    """One of :func:`_gemm_operands`' GEMMs."""
    if len(g) == 2:
        return torch.mm(*g)
    return torch._scaled_mm(g[0], g[1], g[2], g[3], out_dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- the runners


def fused_runner(design: str, sig: Signature, group_name: str, inp: Inputs) -> Callable[[], tuple]:
    """One call of the fused op with ``design`` on ``inp``: what the compiled graph calls at the site.
    A split half's op runs as the split schedule runs it: started (on the communication stream),
    the other half's GEMMs (``inp.gemms``) on the current stream beside it, then the wait; the
    time of the pair is what a design costs the split layer, its own time and what it slows the
    GEMMs by (docs/kernels.md)."""
    op = torch.ops.weave.allreduce_add_rmsnorm_start.default if sig.split else \
        torch.ops.weave.allreduce_add_rmsnorm.default
    wait = torch.ops.weave.comm_wait.default
    kwargs = dict(
        residual=inp.residual, bias=inp.bias, weight=inp.weight, eps=EPS, group_name=group_name,
        residual_dtype=dtype_of(sig.residual_dtype), out_dtype=dtype_of(sig.out_dtype),
        mid_dtype=dtype_of(sig.mid_dtype), weight_offset=sig.weight_offset,
        residual_in_sharded=sig.residual_in_sharded, residual_out_sharded=sig.residual_out_sharded,
        kernel=design, comm_ctas=sig.comm_ctas, scale=inp.scale, eps_tensor=inp.eps_tensor, norm=sig.norm,
        norm_bias=inp.norm_bias, batch_invariant=sig.batch_invariant,
        **(QuantSpec.decode(sig.quant).op_args() if sig.quant else {}), quant_scale=inp.quant_scale)

    def call():
        out = op(inp.x, **kwargs)
        if sig.split:
            for g in inp.gemms:
                run_gemm(g)
            wait(out[0], out[1], [inp.x], out[2])
        return out

    return call


def _written_chain(x, residual, bias, weight, scale, eps_tensor, norm_bias, quant_scale, *, group_name, world_size,
                   sequence_parallel, residual_dtype, out_dtype, mid_dtype, weight_offset, norm, quant):
    """The site as a model writes it (in torch ops, as Dynamo sees a TP layer's end); with ``quant``
    (a :class:`~weave_compile.quant.QuantSpec`) the normed rows quantized to fp8 after the norm
    (the scales third, as the fused op returns them)."""
    c10d = torch.ops._c10d_functional
    if sequence_parallel:
        y = c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", world_size, group_name))
    else:
        y = c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = residual + y
    res = y.to(residual_dtype)
    normed = norm_rows(res, weight, EPS if eps_tensor is None else eps_tensor, out_dtype, mid_dtype, weight_offset,
                       norm, norm_bias)
    if sequence_parallel:
        normed = c10d.wait_tensor(c10d.all_gather_into_tensor(normed.contiguous(), world_size, group_name))
    if quant is not None:
        q, scales = quantize_rows(normed, quant, quant_scale)
        return q, res, scales
    return normed, res


def written_runner(sig: Signature, group_name: str, compiler: str, mode: str) -> Callable[[Inputs], Callable[[], tuple]]:
    """The site as written, compiled once for the signature (its token count dynamic where the
    signature's is): ``runner(inputs)`` is one call on them.

    Compiled with ``compiler`` in ``mode``'s Inductor settings, without CUDA graphs (the block
    captures its own) and without the tokenweave passes (inside the graph's own compile they are
    installed in Inductor's config). A fresh code object per compile keeps Dynamo's per-code cache
    (and its recompile limit) out of it."""
    fn = types.FunctionType(_written_chain.__code__.replace(), _written_chain.__globals__, "tokenweave_as_written",
                            None, None)
    fn.__kwdefaults__ = dict(group_name=group_name, world_size=sig.world_size,
                             sequence_parallel=sig.sequence_parallel,
                             residual_dtype=dtype_of(sig.residual_dtype), out_dtype=dtype_of(sig.out_dtype),
                             mid_dtype=dtype_of(sig.mid_dtype), weight_offset=sig.weight_offset, norm=sig.norm,
                             quant=QuantSpec.decode(sig.quant) if sig.quant else None)
    patches: dict[str, Any] = {}
    if compiler == "inductor":
        if mode != "default":
            from torch._inductor import list_mode_options

            patches.update(list_mode_options(mode))
        patches.update({"triton.cudagraphs": False, "post_grad_custom_post_pass": None})
        compiled = torch.compile(fn, backend="inductor", options=patches, dynamic=False)
    else:
        compiled = torch.compile(fn, backend="aot_eager", dynamic=False)

    def bind(inp: Inputs) -> Callable[[], tuple]:
        if sig.tokens is None:
            for t in (inp.x, inp.residual if sig.sequence_parallel else inp.residual_full):
                if t is not None and t.shape[0] > 1:
                    torch._dynamo.mark_dynamic(t, 0)
        # A sequence-parallel site as written adds the model's own shard; an all_reduce site the whole.
        residual = inp.residual if sig.sequence_parallel else inp.residual_full
        args = (inp.x, residual, inp.bias, inp.weight, inp.scale, inp.eps_tensor, inp.norm_bias, inp.quant_scale)

        compiled_here = [False]

        def call():
            # The first call compiles (a nested compile: inside the context that keeps the outer
            # compile's state, ~0.4 ms of host work a call on this 2-core machine); later calls on
            # these same tensors reuse that code (no guard can fail) and are timed bare, as the
            # fused op's calls are, so the site as written pays nothing the designs do not.
            if not compiled_here[0]:
                with _outside_outer_compile():
                    out = compiled(*args)
                compiled_here[0] = True
                return out
            return compiled(*args)

        return call

    bind.release = lambda: _reset_code(fn)  # type: ignore[attr-defined]
    return bind


_measuring = threading.local()


def in_measurement() -> bool:
    """Whether this thread is compiling or running the site as written for a measurement (what an
    inspection of the user's compiled program leaves out: ``testing/inductor_code.py``)."""
    return getattr(_measuring, "depth", 0) > 0


@contextlib.contextmanager
def _outside_outer_compile():
    """A nested compile from inside the graph's own compile (the fuse pass runs in Inductor's
    post-grad passes): detached from the outer graph's tracing context."""
    import torch._guards

    _measuring.depth = getattr(_measuring, "depth", 0) + 1
    try:
        with torch._guards.tracing(None), _outer_compile_state_kept():
            yield
    finally:
        _measuring.depth -= 1


@contextlib.contextmanager
def _outer_compile_state_kept():
    """The outer compile's process-wide compile state as it was before a nested compile, and out
    of the nested compile's way. Two pieces, both seen on one H100 under torch 2.11 (every default
    compile with Inductor): Dynamo's chromium event stack (per thread), which torch 2.11 clears
    when a compile ends, so the graph's own compile then raised "No toplevel event active" logging
    its metrics (torch 2.13 restores the depth itself); and Inductor's Triton bundle (class state
    of ``TritonBundler``, open for the whole outer compile), whose ``begin_compile`` asserts that no
    bundle is open, so the nested compile raised ``AssertionError`` and nothing was measured."""
    try:
        from torch._dynamo.utils import get_chromium_event_logger

        events = get_chromium_event_logger()
        saved = (list(events.get_stack()), list(events.get_pt2_compile_substack()), dict(events.get_event_data()))
    except Exception:  # noqa: BLE001 - another torch's internals: nothing to keep
        events = saved = None
    try:
        from torch._inductor.triton_bundler import TritonBundler
    except ImportError:
        TritonBundler = None
    bundle = {k: getattr(TritonBundler, k) for k in _BUNDLE_STATE if hasattr(TritonBundler, k)} if TritonBundler else {}
    for k in bundle:
        setattr(TritonBundler, k, None)
    try:
        yield
    finally:
        for k, v in bundle.items():
            setattr(TritonBundler, k, v)
        if events is not None:
            stack, substack, data = events.get_stack(), events.get_pt2_compile_substack(), events.get_event_data()
            stack[:], substack[:] = saved[0], saved[1]
            data.clear()
            data.update(saved[2])


#: ``TritonBundler``'s class attributes that hold an open bundle (None when none is open).
_BUNDLE_STATE = ("_entries", "_static_autotuners", "_winners")


def _reset_code(fn) -> None:
    reset = getattr(torch._dynamo, "reset_code", None)
    if reset is not None:
        reset(fn.__code__)


# ----------------------------------------------------------------------------- the check


def check(design: str, sig: Signature, group_name: str, group_rank: int, device: torch.device, seed: int,
          written: Optional[Callable] = None) -> Optional[str]:
    """None if ``design`` (or the site as written with ``written``) matches the float64 oracle on
    this rank at the signature's smallest and (up to :data:`CHECK_MAX_TOKENS`) largest bucket, else
    what is wrong. Collective (the design communicates): every rank calls it alike."""
    from ..reference import allreduce_add_rmsnorm_ref

    counts = sorted({min(b, CHECK_MAX_TOKENS) for b in (sig.buckets()[0], sig.buckets()[-1])})
    problems = []
    # Every count runs on every rank, whatever an earlier one found: the calls are collective.
    for T in counts:
        inp = make_inputs(sig, T, group_rank, device, seed + T, all_ranks=True)
        run = written(inp) if written is not None else fused_runner(design, sig, group_name, inp)
        try:
            normed, res, *scales = run()
        except Exception as e:  # noqa: BLE001 - a design that raises here does not compete
            problems.append(f"T={T}: raised {type(e).__name__}: {e}")
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ref_n, ref_r = allreduce_add_rmsnorm_ref(
            inp.partials, inp.residual_full, inp.bias, inp.weight, eps=EPS, weight_offset=sig.weight_offset,
            scale=inp.scale, residual_dtype=dtype_of(sig.residual_dtype), out_dtype=dtype_of(sig.out_dtype),
            mid_dtype=dtype_of(sig.mid_dtype), norm=sig.norm, norm_bias=inp.norm_bias)
        S = rows_per_rank(T, sig.world_size)
        n = rows_of_rank(T, S, group_rank)
        if sig.sequence_parallel or sig.residual_out_sharded:
            ref_r, res = ref_r[group_rank * S:group_rank * S + n], res.reshape(-1, sig.hidden)[:n]
        if sig.quant:  # the fp8 rows as the values they stand for, against the oracle's rows quantized
            quant = QuantSpec.decode(sig.quant)
            normed = dequantize(normed.reshape(ref_n.shape), *(s.reshape(-1, 1) for s in scales), quant,
                                inp.quant_scale)
            ref_n = dequantize(*quantize_ref(ref_n, quant, inp.quant_scale), quant, inp.quant_scale)
        why = (_compare("normed", normed.reshape(ref_n.shape), ref_n, QUANT_REL_TOL if sig.quant else None)
               or _compare("residual", res.reshape(ref_r.shape), ref_r))
        if why:
            problems.append(f"T={T}: {why}")
    return problems[0] if problems else None


def _compare(what: str, out: torch.Tensor, ref: torch.Tensor, tol: Optional[float] = None) -> Optional[str]:
    tol = tol or CHECK_REL_TOL.get(ref.dtype, 1e-4)
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return f"{what} has non-finite values"
    err = (out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)
    rows = (out64 - ref64).norm(dim=-1) / ref64.norm(dim=-1).clamp_min(1e-30)
    worst = rows.max() if rows.numel() else torch.tensor(0.0)
    if err > tol or worst > 4 * tol:
        return f"{what} differs from the float64 oracle (relative error {err:.2e}, worst row {worst:.2e}; tolerance {tol})"
    return None


# ----------------------------------------------------------------------------- the timing


class Block:
    """``calls`` calls of one runner, replayable as one block (a CUDA graph under ``graphs``)."""

    def __init__(self, run: Callable[[], Any], calls: int, device: torch.device, graphs: bool):
        self.run, self.calls, self.device = run, calls, device
        self.graph = None
        if graphs and device.type == "cuda":
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    run()
            torch.cuda.current_stream(device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for _ in range(calls):
                    run()

    def time_us(self) -> float:
        """Time per call of one block, us."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            for _ in range(self.calls):
                self.run()
            return (time.perf_counter() - t0) * 1e6 / self.calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.calls):
                self.run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / self.calls


def calibrate(run: Callable[[], Any], device: torch.device, warmup: int = 3) -> float:
    """us per call of ``run`` once warm (one rank's; :func:`calls_per_block` agrees the block)."""
    for _ in range(warmup):
        run()
    return Block(run, 3, device, graphs=False).time_us()


def calls_per_block(us_per_call: float) -> int:
    return max(1, min(MAX_CALLS_PER_BLOCK, math.ceil(BLOCK_US / max(us_per_call, 1e-3))))


def time_rounds(blocks: dict[str, Block], barrier: Callable[[], None], rounds: int = ROUNDS) -> dict[str, Stat]:
    """Every block timed ``rounds`` times in rotated order, a barrier before each; per name its
    :class:`Stat` over the rounds after the first."""
    names = list(blocks)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            barrier()
            t = blocks[n].time_us()
            if r:
                samples[n].append(t)
    return {n: stat_of(v) for n, v in samples.items()}
