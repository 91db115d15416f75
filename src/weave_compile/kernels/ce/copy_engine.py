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

Layout (one symmetric allocation per (group, dtypes, H), every rank the same)
-------------------------------------------------------------------------
``flags`` int32 ``[2, N]`` (row ``RS`` and row ``AG``), then ``recv`` ``[N-1, C, H]`` (input dtype:
slot ``slot_of(p, r)`` holds peer ``p``'s partial sums of rank ``r``'s rows), ``out`` ``[C, H]``
(this rank's normed rows) and ``res`` ``[C, H]`` (its residual rows, read by peers only when the
residual is gathered); ``C`` is the capacity in rows per rank.

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

Assumptions. Every rank issues the same sequence of calls on one workspace, one at a time (the
split schedule runs its starts in order on one comm stream). A peer that never arrives blocks the
stream forever (as NCCL would): stream waits have no timeout. Not measured yet: a flag write into a
peer GPU's memory (only same-GPU emulation has run, DESIGN.md section 6).
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from weave_compile.rows import group_size, rows_of_rank

from ..shared import addnorm
from ..shared.common import SUPPORTED_DTYPES
from ..spec import FusedSpec, Rows

log = logging.getLogger(__name__)

RS, AG = 0, 1  # rows of the flags array
_ALIGN = 256  # byte alignment of each region inside the allocation
_CAPACITY_ROUND_ROWS = 256


class CeCapacityError(RuntimeError):
    """The workspace is too small and cannot grow now (inside CUDA-graph capture)."""


# ----------------------------------------------------------------------------- stream memory ops


@functools.lru_cache(maxsize=1)
def _driver():
    from cuda.bindings import driver as cu  # cuda-python

    return cu


def unavailable_reason() -> Optional[str]:
    """Why the copy-engine design cannot run in this process (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not addnorm.HAS_TRITON:
        return "triton is not installed (the add+norm kernel is a Triton kernel)"
    try:
        _driver()
    except Exception as e:
        return f"cuda-python is not installed (stream memory operations need it: {type(e).__name__}: {e})"
    return None


def _check(result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    cu = _driver()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


def stream_write(stream: torch.cuda.Stream, ptr: int, value: int) -> None:
    """Enqueue ``*ptr = value`` (32 bit, preceded by a memory fence) on ``stream``; no SM."""
    cu = _driver()
    _check(cu.cuStreamWriteValue32(cu.CUstream(stream.cuda_stream), cu.CUdeviceptr(ptr), value,
                                   cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32")


def stream_wait(stream: torch.cuda.Stream, ptr: int, value: int) -> None:
    """Make ``stream`` wait until ``*ptr >= value`` (32 bit, unsigned compare); no SM."""
    cu = _driver()
    _check(cu.cuStreamWaitValue32(cu.CUstream(stream.cuda_stream), cu.CUdeviceptr(ptr), value,
                                  cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32")


# ----------------------------------------------------------------------------- workspace


@dataclass(eq=False)
class CeRegions:
    """One rank's regions, as some process addresses them (its own, or peer-mapped)."""

    flags: torch.Tensor  # int32 [2, N]
    recv: torch.Tensor   # [N-1, C, H] input dtype
    out: torch.Tensor    # [C, H] output dtype
    res: torch.Tensor    # [C, H] residual dtype


@dataclass(eq=False)
class CeWorkspace:
    """What one rank needs for a call: every rank's regions (``regions[rank]`` is its own)."""

    rank: int
    world_size: int
    capacity: int  # rows per rank
    hidden: int
    dtypes: tuple  # (input, output, residual)
    regions: list
    buffer: Optional[torch.Tensor] = None
    handle: Any = None  # keeps the symmetric allocation mapped


def slot_of(sender: int, receiver: int) -> int:
    """Which of ``receiver``'s N-1 recv slots holds ``sender``'s partials."""
    return sender if sender < receiver else sender - 1


def _round_up(n: int, q: int) -> int:
    return (n + q - 1) // q * q


def layout_bytes(world_size: int, capacity: int, hidden: int, dtypes: tuple) -> tuple[list[int], int]:
    """Byte offsets of (flags, recv, out, res) and the allocation's size."""
    in_dt, out_dt, res_dt = dtypes
    sizes = [2 * world_size * 4,
             max(1, world_size - 1) * capacity * hidden * in_dt.itemsize,
             capacity * hidden * out_dt.itemsize,
             capacity * hidden * res_dt.itemsize]
    offsets, off = [], 0
    for s in sizes:
        offsets.append(off)
        off += _round_up(s, _ALIGN)
    return offsets, off


def carve(buf: torch.Tensor, world_size: int, capacity: int, hidden: int, dtypes: tuple) -> CeRegions:
    """The regions of one rank inside ``buf`` (a uint8 tensor of :func:`layout_bytes` bytes)."""
    in_dt, out_dt, res_dt = dtypes
    (o_flags, o_recv, o_out, o_res), total = layout_bytes(world_size, capacity, hidden, dtypes)
    if buf.numel() < total:
        raise ValueError(f"buffer of {buf.numel()} bytes, layout needs {total}")

    def view(off, dt, shape):
        n = math.prod(shape) * dt.itemsize
        return buf[off:off + n].view(dt).view(shape)

    return CeRegions(flags=view(o_flags, torch.int32, (2, world_size)),
                     recv=view(o_recv, in_dt, (max(1, world_size - 1), capacity, hidden)),
                     out=view(o_out, out_dt, (capacity, hidden)),
                     res=view(o_res, res_dt, (capacity, hidden)))


def emulated_workspaces(world_size: int, capacity: int, hidden: int, dtypes: tuple,
                        device: Union[str, torch.device] = "cpu", poison: bool = True) -> list[CeWorkspace]:
    """N ranks' workspaces in one process, from ordinary allocations (tests, 1-GPU benchmarks).

    Rank ``p``'s regions are one tensor shared by every rank's workspace, as peer mappings would be;
    data regions are filled with NaN (poison) so a read before a write shows, flags with 0."""
    _, total = layout_bytes(world_size, capacity, hidden, dtypes)
    regions = []
    for _ in range(world_size):
        reg = carve(torch.empty(total, dtype=torch.uint8, device=device), world_size, capacity, hidden, dtypes)
        reg.flags.zero_()
        if poison:
            for t in (reg.recv, reg.out, reg.res):
                t.fill_(float("nan"))
        regions.append(reg)
    return [CeWorkspace(rank=r, world_size=world_size, capacity=capacity, hidden=hidden, dtypes=tuple(dtypes),
                        regions=regions) for r in range(world_size)]


_WORKSPACES: dict[tuple, CeWorkspace] = {}
#: Replaced workspaces, kept alive for the process (see get_workspace); with growth of at least
#: 1.5x what is kept stays below about twice the final capacity.
_RETIRED: list[CeWorkspace] = []


def _allocate(group_name: str, device: torch.device, hidden: int, dtypes: tuple, capacity: int) -> CeWorkspace:
    """Collective (rendezvous): every rank of the group calls it with the same arguments."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    world_size, rank = pg.size(), pg.rank()
    _, total = layout_bytes(world_size, capacity, hidden, dtypes)
    with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(device):
        buf = symm_mem.empty(total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group_name)
        # Peer views: get_buffer addresses the allocation from its base; our tensor may sit at an
        # offset inside it (PyTorch's symmetric pool), the same on every rank.
        base_off = buf.data_ptr() - int(handle.buffer_ptrs[rank])
        regions = []
        for p in range(world_size):
            if p == rank:
                peer = buf
            else:
                peer = handle.get_buffer(p, [base_off + total], torch.uint8, 0)[base_off:base_off + total]
            regions.append(carve(peer, world_size, capacity, hidden, dtypes))
        regions[rank].flags.zero_()
        torch.cuda.synchronize(device)
    # No peer may signal into our flags before they are zeroed.
    dist.barrier(group=pg)
    log.info("ce workspace group=%s rank=%d/%d H=%d dtypes=%s capacity=%d rows/rank (%.1f MiB)",
             group_name, rank, world_size, hidden, dtypes, capacity, total / 2**20)
    return CeWorkspace(rank=rank, world_size=world_size, capacity=capacity, hidden=hidden, dtypes=tuple(dtypes),
                       regions=regions, buffer=buf, handle=handle)


def get_workspace(group_name: str, device: torch.device, hidden: int, dtypes: tuple, num_tokens: int) -> CeWorkspace:
    """The cached workspace with room for ``num_tokens``; grows (collectively) outside graph capture."""
    key = (str(group_name), device.index, int(hidden), tuple(dtypes))
    ws = _WORKSPACES.get(key)
    capturing = torch.cuda.is_current_stream_capturing()
    world_size = ws.world_size if ws is not None else group_size(group_name)
    per_rank = math.ceil(max(1, num_tokens) / world_size)
    if ws is not None and per_rank <= ws.capacity:
        return ws
    if capturing:
        raise CeCapacityError(f"ce workspace for {group_name} (H={hidden}) has no room for {num_tokens} tokens "
                              "and cannot grow during CUDA-graph capture; call reserve() before capture")
    if ws is not None:
        # Geometric growth (few replaced workspaces), and the replaced one kept alive: a captured
        # graph may point at it, and a copy or flag write of an earlier call may still be in
        # flight here or from a peer into our old regions.
        per_rank = max(per_rank, math.ceil(ws.capacity * 1.5))
        _RETIRED.append(ws)
    new = _allocate(group_name, device, hidden, dtypes, _round_up(per_rank, _CAPACITY_ROUND_ROWS))
    _WORKSPACES[key] = new
    return new


def reserve(group_name: str, device: torch.device, hidden: int, dtypes: tuple, max_tokens: int) -> CeWorkspace:
    """Allocate (collectively) room for ``max_tokens`` before any CUDA-graph capture."""
    return get_workspace(group_name, device, hidden, dtypes, max_tokens)


# ----------------------------------------------------------------------------- the program


@dataclass(frozen=True, eq=False)
class Copy:
    dst: torch.Tensor
    src: torch.Tensor


@dataclass(frozen=True, eq=False)
class Signal:  # write 1 to a flag word of a peer
    flag: torch.Tensor
    peer: int


@dataclass(frozen=True, eq=False)
class Wait:  # wait until our flag word >= 1
    flag: torch.Tensor
    peer: int


@dataclass(frozen=True, eq=False)
class Reset:  # write 0 to our flag word
    flag: torch.Tensor
    peer: int


@dataclass(frozen=True, eq=False)
class Norm:
    kwargs: dict = field(hash=False)


Op = Union[Copy, Signal, Wait, Reset, Norm]


def build_program(ws: CeWorkspace, rows: Rows, spec: FusedSpec, normed: torch.Tensor, residual_out: torch.Tensor,
                  *, config: Optional[addnorm.LaunchConfig] = None) -> list[Op]:
    """The ops of one call on rank ``ws.rank`` (module docstring, steps 1-7), in stream order."""
    x, residual = rows.x, rows.residual
    N, r, T = ws.world_size, ws.rank, x.shape[0]
    S = math.ceil(T / N)
    me = ws.regions[r]
    peers = [p for p in range(N) if p != r]
    prog: list[Op] = []
    for p in peers:  # 1. push our partials of p's rows into p's slot for us
        n = rows_of_rank(T, S, p)
        if n:
            prog.append(Copy(ws.regions[p].recv[slot_of(r, p), :n], x[p * S:p * S + n]))
    prog += [Signal(ws.regions[p].flags[RS, r:r + 1], p) for p in peers]  # 2.
    for p in peers:  # 3.
        prog += [Wait(me.flags[RS, p:p + 1], p), Reset(me.flags[RS, p:p + 1], p)]
    n_mine = rows_of_rank(T, S, r)
    if residual is None:
        res_in = None
    elif spec.residual_in_sharded:
        res_in = residual
    else:
        res_in = residual[r * S:r * S + n_mine]
    prog.append(Norm(dict(  # 4.
        x=x[r * S:r * S + n_mine] if n_mine else x[:0], recv=me.recv[:N - 1] if N > 1 else None,
        residual=res_in, bias=rows.bias, weight=rows.weight,
        scale=None if rows.scale is None else rows.scale.reshape(1),
        normed=me.out, res_out=residual_out if spec.residual_out_sharded else me.res[:n_mine], n_valid=n_mine,
        eps=spec.eps, mid_dtype=spec.mid_dtype, weight_offset=spec.weight_offset, num_ctas=spec.comm_ctas,
        config=config)))
    prog += [Signal(ws.regions[p].flags[AG, r:r + 1], p) for p in peers]  # 5.
    for p in peers:  # 6.
        prog += [Wait(me.flags[AG, p:p + 1], p), Reset(me.flags[AG, p:p + 1], p)]
    for p in range(N):  # 7. pull every rank's rows (our own too: a local copy-engine copy)
        n = rows_of_rank(T, S, p)
        if n:
            prog.append(Copy(normed[p * S:p * S + n], ws.regions[p].out[:n]))
            if not spec.residual_out_sharded:
                prog.append(Copy(residual_out[p * S:p * S + n], ws.regions[p].res[:n]))
    return prog


def execute(prog: list[Op], stream: Optional[torch.cuda.Stream] = None) -> None:
    """Enqueue a program on ``stream`` (default: the current one). Capturable in a CUDA graph."""
    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for op in prog:
            if isinstance(op, Copy):
                op.dst.copy_(op.src)  # contiguous same-dtype rows: cudaMemcpyAsync, a copy engine
            elif isinstance(op, Signal):
                stream_write(stream, op.flag.data_ptr(), 1)
            elif isinstance(op, Wait):
                stream_wait(stream, op.flag.data_ptr(), 1)
            elif isinstance(op, Reset):
                stream_write(stream, op.flag.data_ptr(), 0)
            else:
                addnorm.add_rmsnorm_rows(**op.kwargs)


def preload(prog: list[Op]) -> None:
    """Compile and load every kernel ``prog`` launches, launching nothing.

    Why: with CUDA's lazy module loading (the default since CUDA 12.2) a kernel's first launch
    loads its code, and that load may synchronize the context.  When ranks are emulated in one
    process, rank 0's stream is already blocked in a wait-value for rank 1's signal when the host
    enqueues rank 1's program: a lazy load there waits for rank 0's stream, which waits for rank
    1's signal, which the blocked host never enqueues: a deadlock (measured on one H200: the host
    blocked in the first launch of a kernel after a wait-value was enqueued).  The emulation
    preloads every rank's program before it enqueues any.  Across processes each rank enqueues
    its own signals before its waits, so a lazy load only delays the host there."""
    for op in prog:
        if isinstance(op, Norm):
            addnorm.add_rmsnorm_rows(**op.kwargs, preload=True)


def allocate_outputs(ws: CeWorkspace, num_tokens: int, residual_out_sharded: bool, device):
    _, out_dt, res_dt = ws.dtypes
    S = math.ceil(num_tokens / ws.world_size)
    normed = torch.empty((num_tokens, ws.hidden), dtype=out_dt, device=device)
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
    for name, t in (("bias", rows.bias), ("weight", rows.weight)):
        if t is not None and tuple(t.shape) != (H,):
            raise ValueError(f"ce: {name} must have shape [{H}], got {tuple(t.shape)}")


def ce_call(ws: CeWorkspace, rows: Rows, spec: FusedSpec, *, config: Optional[addnorm.LaunchConfig] = None,
            run: bool = True):
    """One rank's call on a prepared workspace: returns ``(normed, residual_out)`` (and the program).

    With ``run`` the program is enqueued on the current CUDA stream; without, the caller runs it
    (the CPU simulation does). Shared by the distributed entry and the emulated-rank tests."""
    x = rows.x if rows.x.is_contiguous() else rows.x.contiguous()
    residual = rows.residual
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    rows = Rows(x, residual, rows.bias, rows.weight, rows.scale)
    check_args(ws, rows, spec)
    normed, residual_out = allocate_outputs(ws, x.shape[0], spec.residual_out_sharded, x.device)
    prog = build_program(ws, rows, spec, normed, residual_out, config=config)
    if run:
        execute(prog)
    return normed, residual_out, prog


def run_ce(rows: Rows, spec: FusedSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's ``ce`` run on rows [T, H] (CUDA): collective, every rank calls it alike."""
    x = rows.x
    dtypes = (x.dtype, spec.out_dtype, spec.residual_dtype)
    for dt in dtypes:
        if dt not in SUPPORTED_DTYPES:
            raise ValueError(f"ce: dtype {dt} not supported ({SUPPORTED_DTYPES})")
    ws = get_workspace(spec.group_name, x.device, x.shape[-1], dtypes, x.shape[0])
    with torch.cuda.device(x.device):
        normed, residual_out, _ = ce_call(ws, rows, spec)
    return normed, residual_out
