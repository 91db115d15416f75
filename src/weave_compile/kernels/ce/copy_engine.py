"""The ``ce`` design: copy-engine transfers, stream-memory-op flags, a few-CTA add+norm.

What
----
Same contract as every fused-op kernel (``ops/allreduce_rmsnorm.py``: ``S = ceil(T/N)`` rows per
rank, rank ``r`` owns rows ``[r*S, (r+1)*S)``, sharded residual in/out, dtypes, weight offset, mid
dtype; here ``scale`` is supported too). Every cross-rank byte moves by ``cudaMemcpyAsync`` between
buffers of one symmetric allocation (torch ``copy_`` between peer-mapped views: copy engines, no
SM); readiness is signalled with ``cuStreamWriteValue32`` into the peer's flag words and awaited with
``cuStreamWaitValue32`` on our own (the stream waits, no SM spins); the only SM work is the local
add+norm of this rank's rows (:mod:`weave_compile.kernels.shared.addnorm`, ``comm_ctas`` CTAs).

Why: an SM-based collective that overlaps the other token half's GEMMs takes their SMs twice, once
to move bytes and once to spin on a barrier while the peer is late (docs/performance.md).
Here both cost zero SMs; what is left on SMs is a streaming pass on local HBM.

Modules: :mod:`.workspace` (the symmetric allocation and its regions ``flags``, ``abort``,
``recv``, ``out``, ``res``), :mod:`.program` (the ops of one call, enqueueing, preloading),
:mod:`.watchdog` (bounded waits), :mod:`.memops` (the driver calls); this module holds the
protocol, the call and the emulated-rank entry, and re-exports the names the others use.

Protocol of one call on rank ``r`` (all ops on the current stream, in this order)
---------------------------------------------------------------------------------
1. for each peer ``p``: copy ``x[p's rows]`` into ``p.recv[slot_of(r, p)]``            (push, CE)
2. for each peer ``p``: write 1 to ``p.flags[RS][r]``                              ("my push is in")
3. for each peer ``p``: wait ``r.flags[RS][p] >= 1``, then write 0 to it                 (consume)
4. add+norm kernel: ``x[r's rows] + sum(r.recv) (+...)`` -> ``r.out``, residual -> ``r.res`` or the
   sharded residual output
5. for each peer ``p``: write 1 to ``p.flags[AG][r]``                          ("my rows are ready")
6. for each peer ``p``: wait ``r.flags[AG][p] >= 1``, then write 0 to it
7. for every rank ``p`` (itself included): copy ``p.out`` (and ``p.res``) into the outputs  (pull, CE)

Why it is race-free. Every flag word has one writer of 1 (the peer it names) and one writer of 0
(its owner, right after its wait saw the 1). A write-value op without ``NO_MEMORY_BARRIER`` is
preceded by a memory fence, and stream order completes every earlier copy or kernel before it, so
a peer that sees the flag sees the data written before it.
* 4 reads ``r.recv`` only after every peer's push (3); a peer's next push into ``r.recv`` (its step
  1 of call e+1) follows its step 6 of call e, which waits for ``r``'s step 5, after 4.
* 7 reads ``p.out`` only after ``p``'s step 5 (6), i.e. after ``p``'s kernel; ``p``'s next kernel
  (call e+1, step 4) follows its step 3, which waits for ``r``'s step 2 of call e+1, after ``r``'s
  pulls (7 of call e).
* A reset can't erase the next signal: the peer's next write of ``r.flags[RS][p]`` (call e+1, 2)
  follows its step 6 of call e, which waits for ``r``'s step 5, issued after ``r``'s reset in 3
  (fenced); likewise the next ``AG`` write (e+1, 5) follows the peer's step 3 of e+1, which waits
  for ``r``'s step 2 of e+1, after ``r``'s reset in 6.

Why replay-safe. ``cuStreamWaitValue32`` takes its value as an immediate, baked into a captured
graph, so a monotonic epoch would replay the same number and pass on the previous replay's value.
Flags that their owner resets after use need no per-call value: after every call every flag is 0
again, on every rank, so a graph of any number of calls replays the same protocol. No kernel and no
host step touches a flag between calls.

Deadlock freedom. With CUDA's lazy module loading (the default since CUDA 12.2) a kernel's first
launch loads its module, and the load may synchronize the context: the host waits for every stream
of the GPU. Across processes that only delays: a rank enqueues a whole call, its signals before
its waits, so every wait its streams are blocked on needs only signals that the peers enqueue
themselves, after the same calls. (The all-gather signal follows the reduce-scatter wait, which
needs the peer's reduce-scatter signal, enqueued before any of the peer's waits.) Any first-time
load on a rank (the add+norm kernel, a cuBLAS kernel on the compute stream) therefore waits at
most until its peers catch up. Still, every add+norm variant a compiled site can launch is
compiled and loaded at reservation time (:func:`.program.preload_site`, from the registry entry's
``reserve``): no compile or load in the middle of a call, nor in CUDA-graph capture, and a token
count never makes a new variant (the row counts are not specialized). In ONE process with
emulated ranks, a host that blocks after rank 0's waits are enqueued and before rank 1's signals
are deadlocks: :func:`emulated_run` enqueues the ranks' programs interleaved so that every wait's
signal is enqueued first (:func:`.program.issue_order`), after allocating every output and
loading every kernel. That order also survives two ranks' streams sharing one hardware queue.

Assumptions. Every rank issues the same sequence of calls on one workspace, one at a time (the
split schedule runs its starts in order on one comm stream). Stream waits have no timeout: a
peer that never signals is caught by the watchdog (:mod:`.watchdog`, ``WEAVE_CE_TIMEOUT_S``,
default 600 s), which logs the error, poisons the outputs with NaN, releases the stream and makes
the next call raise. Not measured yet: a flag write into a peer GPU's memory (only same-GPU
emulation has run).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional, Sequence

import torch

from ..shared import addnorm
from ..shared.common import SUPPORTED_DTYPES
from ..spec import FusedSpec, Rows
from . import memops
from .memops import unavailable_reason
from .program import (Copy, Mark, Norm, Op, Reset, Signal, Wait, build_program, execute, issue_order, preload,
                      preload_site)
from .workspace import (AG, RS, CeAbortedError, CeCapacityError, CeRegions, CeWorkspace, carve, emulated_workspaces,
                        get_workspace, layout_bytes, raise_if_failed, reserve, slot_of)

log = logging.getLogger(__name__)

__all__ = ["AG", "RS", "CeAbortedError", "CeCapacityError", "CeRegions", "CeWorkspace", "Copy", "Mark", "Norm", "Op",
           "Reset", "Signal", "Wait", "allocate_outputs", "allocate_scales", "build_program", "carve", "ce_call",
           "check_args",
           "emulated_run", "emulated_workspaces", "execute", "get_workspace", "issue_order", "layout_bytes",
           "preload", "preload_site", "reserve", "run_ce", "slot_of", "stream_wait", "stream_write",
           "unavailable_reason"]


def stream_write(stream: torch.cuda.Stream, ptr: int, value: int) -> None:
    """Enqueue ``*ptr = value`` (32 bit, preceded by a memory fence) on ``stream``; no SM."""
    memops.write(stream, ptr, value)


def stream_wait(stream: torch.cuda.Stream, ptr: int, value: int) -> None:
    """Make ``stream`` wait until ``*ptr >= value`` (32 bit, unsigned compare); no SM."""
    memops.wait(stream, ptr, value)


def allocate_outputs(ws: CeWorkspace, num_tokens: int, residual_out_sharded: bool, device, quant=None):
    _, out_dt, res_dt = ws.dtypes
    S = math.ceil(num_tokens / ws.world_size)
    normed = torch.empty((num_tokens, ws.hidden), dtype=out_dt if quant is None else quant.dtype, device=device)
    res_rows = S if residual_out_sharded else num_tokens
    return normed, torch.empty((res_rows, ws.hidden), dtype=res_dt, device=device)


def check_args(ws: CeWorkspace, rows: Rows, spec: FusedSpec) -> None:
    """Clear errors for shapes the program cannot take (never a silently wrong number)."""
    x = rows.x
    T, H = x.shape
    S = math.ceil(T / ws.world_size)
    if H != ws.hidden or x.dtype != ws.dtypes[0]:
        raise ValueError(f"ce: x is [{T}, {H}] {x.dtype}, workspace is H={ws.hidden} {ws.dtypes[0]}")
    if S > ws.capacity:
        raise CeCapacityError(f"ce: {T} tokens need {S} rows per rank, workspace holds {ws.capacity}")
    if rows.residual is not None:
        exp = (S, H) if spec.residual_in_sharded else (T, H)
        if tuple(rows.residual.shape) != exp:
            raise ValueError(f"ce: residual must have shape {exp}, got {tuple(rows.residual.shape)}")
    for name, t in (("bias", rows.bias), ("weight", rows.weight), ("norm_bias", rows.norm_bias)):
        if t is not None and tuple(t.shape) != (H,):
            raise ValueError(f"ce: {name} must have shape [{H}], got {tuple(t.shape)}")


def allocate_scales(spec: FusedSpec, num_tokens: int, device) -> torch.Tensor:
    """The op's third output for ``spec``: a per-row fp8 epilogue's ``[T, 1]`` fp32 row scales,
    else an empty tensor (a static scale, or no epilogue)."""
    row = spec.quant is not None and spec.quant.kind == "row"
    return torch.empty((num_tokens, 1) if row else (0,), dtype=torch.float32, device=device)


def ce_call(ws: CeWorkspace, rows: Rows, spec: FusedSpec, *, config: Optional[addnorm.LaunchConfig] = None,
            run: bool = True, scales: Optional[torch.Tensor] = None):
    """One rank's call on a prepared workspace: returns ``(normed, residual_out)`` (and the program).
    With an fp8 epilogue (``spec.quant``) ``normed`` is the fp8 rows and a per-row scale's outputs
    go to ``scales`` (``[T, 1]`` fp32, the caller's: :func:`allocate_scales`).

    With ``run`` the program is enqueued on the current CUDA stream (on an emulated workspace its
    kernels are loaded first); without, the caller runs it (the CPU simulation, :func:`emulated_run`).
    Several emulated ranks' calls in one process go through :func:`emulated_run`: one rank's call
    at a time can deadlock (module doc). Raises :class:`CeAbortedError` once a wait of the group
    timed out."""
    raise_if_failed(ws)
    x = rows.x if rows.x.is_contiguous() else rows.x.contiguous()
    residual = rows.residual
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows = dataclasses.replace(rows, x=x, residual=residual)
    check_args(ws, rows, spec)
    normed, residual_out = allocate_outputs(ws, x.shape[0], spec.residual_out_sharded, x.device, spec.quant)
    if spec.quant is not None and spec.quant.kind == "row" and (scales is None or scales.shape != (x.shape[0], 1)):
        raise ValueError(f"ce: a per-row fp8 epilogue needs scales [{x.shape[0]}, 1] fp32 (allocate_scales)")
    prog = build_program(ws, rows, spec, normed, residual_out, config=config, scales=scales)
    if run:
        if ws.emulated:
            preload(prog)
        execute(prog)
    return normed, residual_out, prog


def emulated_run(wss: Sequence[CeWorkspace], rows: Sequence[Rows], spec: FusedSpec,
                 streams: Sequence[torch.cuda.Stream], *, config: Optional[addnorm.LaunchConfig] = None,
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every emulated rank's call, rank ``r``'s on ``streams[r]`` (forked from the current stream
    and joined back into it); returns each rank's ``(normed, residual_out)``. Capturable.

    Safe by construction (module doc, "Deadlock freedom"): every output is allocated, every program
    built and every kernel loaded before anything is enqueued, then the programs are enqueued in
    :func:`.program.issue_order`. With an fp8 epilogue each rank's ``(codes, residual_out, scales)``."""
    if not (len(wss) == len(rows) == len(streams)) or len({id(s) for s in streams}) != len(streams):
        raise ValueError("emulated_run: one workspace, one Rows and one distinct stream per rank")
    for ws in wss:
        raise_if_failed(ws)
    main = torch.cuda.current_stream()
    outs, progs = [], []
    for ws, r, s in zip(wss, rows, streams):
        s.wait_stream(main)  # first: under capture this joins the rank's stream to it
        with torch.cuda.stream(s):
            scales = allocate_scales(spec, r.x.shape[0], r.x.device)
            normed, residual_out, prog = ce_call(ws, r, spec, config=config, run=False, scales=scales)
        outs.append((normed, residual_out) if spec.quant is None else (normed, residual_out, scales))
        progs.append(prog)
    for prog in progs:
        preload(prog)
    for rank, ops in issue_order(progs):
        execute(ops, streams[rank])
    for s in streams:
        main.wait_stream(s)
    return outs


def run_ce(rows: Rows, spec: FusedSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's ``ce`` run on rows [T, H] (CUDA): collective, every rank calls it alike."""
    x = rows.x
    dtypes = (x.dtype, spec.out_dtype, spec.residual_dtype)
    for dt in dtypes:
        if dt not in SUPPORTED_DTYPES:
            raise ValueError(f"ce: dtype {dt} not supported ({SUPPORTED_DTYPES})")
    ws = get_workspace(spec.group_name, x.device, x.shape[-1], dtypes, x.shape[0])
    with torch.cuda.device(x.device):
        scales = allocate_scales(spec, x.shape[0], x.device)
        normed, residual_out, _ = ce_call(ws, rows, spec, scales=scales)
    return (normed, residual_out) if spec.quant is None else (normed, residual_out, scales)
