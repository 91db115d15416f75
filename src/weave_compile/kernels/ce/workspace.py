"""The ``ce`` workspace: one symmetric allocation per (group, dtypes, H), its regions, its cache.

Layout (every rank the same): the ``abort`` word (int32, set by a watchdog that released this
rank's waits: the add+norm kernel then writes NaN; 16-byte aligned, as the kernel's variants
loaded at compile time assume) and ``flags`` int32 ``[2, N]`` (row ``RS`` and row ``AG``), then ``recv`` ``[N-1, C, H]`` (input dtype: slot ``slot_of(p, r)`` holds peer ``p``'s
partial sums of rank ``r``'s rows), ``out`` ``[C, H]`` (this rank's normed rows) and ``res``
``[C, H]`` (its residual rows); ``C`` is the capacity in rows per rank, a multiple of 256 (so every
slot starts 16-byte aligned and the add+norm kernel's slot stride is the same Triton
specialization at every capacity).
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from weave_compile.rows import group_size

from ..registry import Workspaces

log = logging.getLogger(__name__)

RS, AG = 0, 1  # rows of the flags array
_ALIGN = 256  # byte alignment of each region inside the allocation
_CAPACITY_ROUND_ROWS = 256
_FLAGS_AT = 16  # byte offset of the flags after the abort word
_EMULATED_IDS = itertools.count()


class CeCapacityError(RuntimeError):
    """The workspace is too small and cannot grow now (inside CUDA-graph capture)."""


class CeAbortedError(RuntimeError):
    """A wait of this group timed out (:mod:`.watchdog`): its ``ce`` calls can no longer run."""


@dataclass(eq=False)
class CeRegions:
    """One rank's regions, as some process addresses them (its own, or peer-mapped)."""

    flags: torch.Tensor  # int32 [2, N]
    recv: torch.Tensor   # [N-1, C, H] input dtype
    out: torch.Tensor    # [C, H] output dtype
    res: torch.Tensor    # [C, H] residual dtype
    abort: Optional[torch.Tensor] = None  # int32 [1]


@dataclass(eq=False)
class CeWorkspace:
    """What one rank needs for a call: every rank's regions (``regions[rank]`` is its own).

    ``mark`` (set by :meth:`.watchdog.Watchdog.watch`): the host-mapped word the calls' progress
    marks go to; None: not watched (no marks, no abort check). ``failed``: why the workspace can
    no longer run (a timed-out wait), or None. ``calls``: programs built on it (numbers the marks)."""

    rank: int
    world_size: int
    capacity: int  # rows per rank
    hidden: int
    dtypes: tuple  # (input, output, residual)
    regions: list
    buffer: Optional[torch.Tensor] = None
    handle: Any = None  # keeps the symmetric allocation mapped
    group_name: str = ""
    emulated: bool = False
    mark: Any = None
    failed: Optional[str] = None
    calls: int = 0


def slot_of(sender: int, receiver: int) -> int:
    """Which of ``receiver``'s N-1 recv slots holds ``sender``'s partials."""
    return sender if sender < receiver else sender - 1


def _round_up(n: int, q: int) -> int:
    return (n + q - 1) // q * q


def layout_bytes(world_size: int, capacity: int, hidden: int, dtypes: tuple) -> tuple[list[int], int]:
    """Byte offsets of (abort + flags, recv, out, res) and the allocation's size."""
    in_dt, out_dt, res_dt = dtypes
    sizes = [_FLAGS_AT + 2 * world_size * 4,
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

    return CeRegions(flags=view(o_flags + _FLAGS_AT, torch.int32, (2, world_size)),
                     recv=view(o_recv, in_dt, (max(1, world_size - 1), capacity, hidden)),
                     out=view(o_out, out_dt, (capacity, hidden)),
                     res=view(o_res, res_dt, (capacity, hidden)),
                     abort=view(o_flags, torch.int32, (1,)))


def quant_views(region: CeRegions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [C, H], row scales fp32 [C, 1])`` of an fp8 epilogue, carved from the bytes of
    ``region.out`` (``[C, H]`` of a 16- or 32-bit output dtype: 2CH bytes or more, and the codes
    and scales need CH + 4C; C a multiple of 256 keeps the scales 4-byte aligned): the rows a rank
    quantizes and its peers pull are these, so the workspace's layout is the same with or without
    the epilogue."""
    C, H = region.out.shape
    raw = region.out.view(torch.uint8).reshape(-1)
    return raw[:C * H].view(C, H), raw[C * H:C * H + 4 * C].view(torch.float32).view(C, 1)


def emulated_workspaces(world_size: int, capacity: int, hidden: int, dtypes: tuple,
                        device: Union[str, torch.device] = "cpu", poison: bool = True) -> list[CeWorkspace]:
    """N ranks' workspaces in one process, from ordinary allocations (tests, 1-GPU benchmarks).

    Rank ``p``'s regions are one tensor shared by every rank's workspace, as peer mappings would be;
    data regions are filled with NaN (poison) so a read before a write shows, flags with 0. Run
    calls on them with :func:`.copy_engine.emulated_run` (safe against deadlocks by construction)."""
    _, total = layout_bytes(world_size, capacity, hidden, dtypes)
    regions = []
    for _ in range(world_size):
        reg = carve(torch.empty(total, dtype=torch.uint8, device=device), world_size, capacity, hidden, dtypes)
        reg.flags.zero_()
        reg.abort.zero_()
        if poison:
            for t in (reg.recv, reg.out, reg.res):
                t.fill_(float("nan"))
        regions.append(reg)
    group = f"emulated:{next(_EMULATED_IDS)}"
    return [CeWorkspace(rank=r, world_size=world_size, capacity=capacity, hidden=hidden, dtypes=tuple(dtypes),
                        regions=regions, group_name=group, emulated=True) for r in range(world_size)]


def raise_if_failed(ws: CeWorkspace) -> None:
    if ws.failed is not None:
        raise CeAbortedError(ws.failed)


_WORKSPACES: dict[tuple, CeWorkspace] = {}
#: Replaced workspaces, kept alive for the process (see get_workspace); with growth of at least
#: 1.5x what is kept stays below about twice the final capacity.
_RETIRED: list[CeWorkspace] = []


def _drop(keys) -> None:
    from . import watchdog

    for key in keys:
        ws = _WORKSPACES.pop(key, None)
        if ws is not None:
            watchdog.unwatch_default(ws)


#: The table ``ce`` reserves in, as the measured choice frees a loser's entries (and stops
#: watching them).
WORKSPACES = Workspaces(lambda: frozenset(_WORKSPACES), _drop)


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
        regions[rank].abort.zero_()
        torch.cuda.synchronize(device)
    # No peer may signal into our flags before they are zeroed.
    dist.barrier(group=pg)
    log.info("ce workspace group=%s rank=%d/%d H=%d dtypes=%s capacity=%d rows/rank (%.1f MiB)",
             group_name, rank, world_size, hidden, dtypes, capacity, total / 2**20)
    return CeWorkspace(rank=rank, world_size=world_size, capacity=capacity, hidden=hidden, dtypes=tuple(dtypes),
                       regions=regions, buffer=buf, handle=handle, group_name=str(group_name))


def get_workspace(group_name: str, device: torch.device, hidden: int, dtypes: tuple, num_tokens: int) -> CeWorkspace:
    """The cached workspace with room for ``num_tokens``; grows (collectively) outside graph capture.

    A new workspace is watched by the process's watchdog (:func:`.watchdog.watch_default`) unless
    ``WEAVE_CE_TIMEOUT_S`` is 0. A workspace whose wait timed out raises :class:`CeAbortedError`."""
    key = (str(group_name), device.index, int(hidden), tuple(dtypes))
    ws = _WORKSPACES.get(key)
    if ws is not None:
        raise_if_failed(ws)  # (before any growth: a rendezvous with a dead peer would hang)
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
    from ..shared import outside_pool
    from .watchdog import watch_default

    # Growing at run time can happen inside cudagraph trees' warm-up (a symbolic T above the
    # compile-time reservation); allocated there, the workspace's tensors (and the watchdog's
    # buffers) would fail the pool check.
    capacity = _round_up(per_rank, _CAPACITY_ROUND_ROWS)

    def make() -> CeWorkspace:
        ws = _allocate(group_name, device, hidden, dtypes, capacity)
        watch_default(ws)
        return ws

    new = outside_pool.run_outside_graph_pool(make, device)
    _WORKSPACES[key] = new
    return new


def reserve(group_name: str, device: torch.device, hidden: int, dtypes: tuple, max_tokens: int) -> CeWorkspace:
    """Allocate (collectively) room for ``max_tokens`` before any CUDA-graph capture."""
    if torch.cuda.is_current_stream_capturing():
        raise CeCapacityError("ce reserve() must be called outside CUDA-graph capture")
    return get_workspace(group_name, device, hidden, dtypes, max_tokens)
