"""The one-shot kernel's buffers: three slots per rank, poisoned with the sentinel, and their cache.

Layout and protocol: :mod:`.kernel`. Allocating or growing is collective (symmetric allocation,
poison, rendezvous, barrier) and never happens during CUDA-graph capture.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from weave_compile.rows import group_size

from ..registry import Workspaces
from ..shared.workspace import SymmCapacityError, _ensure_group_enabled

log = logging.getLogger(__name__)

NUM_SLOTS = 3
_REGION_ALIGN = 256
_STATE_WORDS = 8  # [0] call counter, [1] CTA ticket, [2:5] rows per slot, [5] spin timeouts
_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
#: The negative-zero bit pattern, as the signed integer of the dtype's width.
SENTINEL = {torch.bfloat16: -(1 << 15), torch.float16: -(1 << 15), torch.float32: -(1 << 31)}


def sentinel_tensor(dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor of ``dtype`` holding the sentinel bit pattern (-0.0)."""
    return torch.tensor([SENTINEL[dtype]], dtype=_INT_OF[dtype]).view(dtype)


@dataclass(frozen=True)
class Layout:
    """Byte layout of one rank's buffer: ``NUM_SLOTS`` x (N source regions + 1 residual region)."""

    capacity: int
    src_bytes: int
    res_off: int
    slot_bytes: int

    @property
    def total(self) -> int:
        return NUM_SLOTS * self.slot_bytes


def _align(n: int) -> int:
    return -(-n // _REGION_ALIGN) * _REGION_ALIGN


def layout(capacity: int, world_size: int, hidden: int, in_dtype: torch.dtype, res_dtype: torch.dtype) -> Layout:
    src = _align(capacity * hidden * in_dtype.itemsize)
    res_off = world_size * src
    return Layout(capacity, src, res_off, res_off + _align(capacity * hidden * res_dtype.itemsize))


@dataclass(eq=False)
class OneShotWorkspace:
    """One rank's view of a one-shot workspace: every rank's buffer address and its own state."""

    rank: int
    world_size: int
    hidden: int
    in_dtype: torch.dtype
    res_dtype: torch.dtype  # the residual *input*'s dtype (pushed when it is sharded)
    layout: Layout
    ptr_table: torch.Tensor  # int64 [N]
    state: torch.Tensor  # int32 [8]
    buffer: torch.Tensor  # this rank's buffer (kept alive)
    handle: Any = None

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    def timeouts(self) -> int:
        """Spin-limit trips so far (synchronizes the device)."""
        return int(self.state[5].item())


def poison_(buffer: torch.Tensor, lay: Layout, world_size: int, hidden: int, in_dtype: torch.dtype,
            res_dtype: torch.dtype) -> None:
    """Fill every data region of a uint8 buffer with the sentinel ("not yet written")."""
    for s in range(NUM_SLOTS):
        base = s * lay.slot_bytes
        xs = buffer[base:base + world_size * lay.src_bytes].view(in_dtype)
        xs.copy_(sentinel_tensor(in_dtype).to(buffer.device).expand_as(xs))
        n = lay.capacity * hidden * res_dtype.itemsize
        rs = buffer[base + lay.res_off:base + lay.res_off + n].view(res_dtype)
        rs.copy_(sentinel_tensor(res_dtype).to(buffer.device).expand_as(rs))


def workspace_from_buffers(buffers: list[torch.Tensor], rank: int, *, hidden: int, in_dtype: torch.dtype,
                           res_dtype: torch.dtype, capacity: int, poison: bool = True) -> OneShotWorkspace:
    """A workspace over ordinary uint8 buffers, one per rank (emulated ranks in tests).

    ``buffers[p]`` must be at least :func:`layout`'s ``total`` bytes; rank ``rank`` poisons its own
    one (the caller must make every rank's poisoning complete before any rank's first call)."""
    n = len(buffers)
    lay = layout(capacity, n, hidden, in_dtype, res_dtype)
    own = buffers[rank]
    if own.numel() < lay.total:
        raise ValueError(f"buffer of {own.numel()} bytes < {lay.total} needed")
    if poison:
        poison_(own, lay, n, hidden, in_dtype, res_dtype)
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=own.device)
    state = torch.zeros(_STATE_WORDS, dtype=torch.int32, device=own.device)
    return OneShotWorkspace(rank, n, hidden, in_dtype, res_dtype, lay, table, state, own)


_WORKSPACES: dict[tuple, OneShotWorkspace] = {}
#: Replaced workspaces, kept alive for the process (see get_workspace); with growth of at least
#: 1.5x what is kept stays below about twice the final capacity.
_RETIRED: list[OneShotWorkspace] = []


def _drop(keys) -> None:
    for key in keys:
        _WORKSPACES.pop(key, None)


#: The table ``oneshot`` reserves in, as the measured choice frees a loser's entries.
WORKSPACES = Workspaces(lambda: frozenset(_WORKSPACES), _drop)


def _allocate(group_name: str, device: torch.device, hidden: int, in_dtype: torch.dtype, res_dtype: torch.dtype,
              capacity: int) -> OneShotWorkspace:
    """Collective: symmetric allocation, poison, rendezvous, then a barrier so that no peer can
    push before this rank's poison has landed."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    import torch.distributed.distributed_c10d as c10d

    _ensure_group_enabled(group_name)
    pg = c10d._resolve_process_group(group_name)
    n = pg.size()
    lay = layout(capacity, n, hidden, in_dtype, res_dtype)
    with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(device):
        buf = symm_mem.empty(lay.total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group_name)
        rank = int(handle.rank)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        offset = buf.data_ptr() - ptrs[rank]  # the tensor may sit inside the allocation
        if offset < 0 or offset % 16:
            raise RuntimeError(f"unexpected symmetric tensor offset {offset}")
        poison_(buf, lay, n, hidden, in_dtype, res_dtype)
        table = torch.tensor([p + offset for p in ptrs], dtype=torch.int64, device=device)
        state = torch.zeros(_STATE_WORDS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
    dist.barrier(group=pg)
    log.info("oneshot workspace group=%s rank=%d/%d H=%d %s/%s capacity=%d rows (%.1f MiB)",
             group_name, rank, n, hidden, in_dtype, res_dtype, capacity, lay.total / 2**20)
    return OneShotWorkspace(rank, n, hidden, in_dtype, res_dtype, lay, table, state, buf, handle)


def get_workspace(group_name: str, in_dtype: torch.dtype, res_dtype: torch.dtype, hidden: int,
                  num_tokens: int, device: torch.device) -> Optional[OneShotWorkspace]:
    """The cached workspace with room for ``num_tokens`` (padded to S*N) rows; grows outside
    capture (collective), returns None during capture when it is missing or too small."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(group_name), in_dtype, res_dtype, int(hidden), device.index)
    ws = _WORKSPACES.get(key)
    capturing = torch.cuda.is_current_stream_capturing()
    if ws is not None:
        padded = -(-num_tokens // ws.world_size) * ws.world_size
        if padded <= ws.capacity:
            return ws
    if capturing:
        return None
    n = group_size(group_name)
    capacity = -(-max(1, num_tokens) // (64 * n)) * 64 * n
    if ws is not None:
        # Geometric growth (few replaced workspaces), and the replaced one kept alive: a captured
        # graph may point at it, and (growth is host-side, not a device barrier) a launch on it
        # may still be running here or on a peer, which writes into our old slots.
        capacity = max(capacity, -(-math.ceil(ws.capacity * 1.5) // (64 * n)) * 64 * n)
        _RETIRED.append(ws)
    from ..shared.outside_pool import run_outside_graph_pool

    # A run-time growth may happen inside cudagraph trees' warm-up: keep it out of the graph pool.
    _WORKSPACES[key] = run_outside_graph_pool(
        lambda: _allocate(group_name, device, hidden, in_dtype, res_dtype, capacity), device)
    return _WORKSPACES[key]


def reserve_rows(hidden: int, dtype: torch.dtype, num_tokens: int, max_bytes: int) -> int:
    """Rows to reserve at compile time: this graph's, and at least every T whose message
    ``T * H * itemsize`` is below ``max_bytes`` (``auto``'s crossover: every T it would send here)."""
    return max(num_tokens, min(4096, max_bytes // (hidden * dtype.itemsize)))


def reserve(group_name: str, in_dtype: torch.dtype, res_dtype: torch.dtype, hidden: int, max_tokens: int,
            device: torch.device) -> OneShotWorkspace:
    """Allocate (collectively) before CUDA-graph capture."""
    if torch.cuda.is_current_stream_capturing():
        raise SymmCapacityError("oneshot reserve() must be called outside CUDA graph capture")
    ws = get_workspace(group_name, in_dtype, res_dtype, hidden, max_tokens, device)
    assert ws is not None
    return ws
