"""The symmetric workspace: buffers, pointer table and signal-pad range of one group and channel.

One ``symm_mem.empty`` uint8 allocation and one ``rendezvous`` per (group, dtypes, hidden,
channel); three row-major regions ``inp``/``out``/``res`` carved out of it, and a device
*pointer table* the kernels read every peer's addresses from (layout: :func:`build_ptr_table`).
Allocating or growing is collective; it never happens during CUDA-graph capture (callers get
None, or :class:`SymmCapacityError`, and fall back; :func:`reserve` first).  A replaced
workspace is kept alive: a captured graph or an enqueued launch may still use it.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..registry import Workspaces
from .common import MAX_CTAS, MAX_WORLD_SIZE, OUT_RING_SLOTS
from .sync import pad_offset_for

logger = logging.getLogger(__name__)

_CAPACITY_ROUND_ROWS = 256  # workspaces grow in multiples of 256 * world_size rows
_REGION_ALIGN = 256  # byte alignment of the regions carved out of one symm buffer


def build_ptr_table(regions: list, pads: list, multicast: tuple = (0, 0, 0),
                    device: Any = None) -> torch.Tensor:
    """The kernels' int64 pointer table: ``regions`` is ``[in_ptrs, out_ptrs, res_ptrs]`` (one
    address per rank each), ``pads`` every rank's signal pad, ``multicast`` the multicast
    addresses of the three regions (0 without a multicast object).  Layout ``[4N + 3]``:
    in[N], out[N], res[N], pad[N], mc_in, mc_out, mc_res.  The emulated ranks of
    ``weave_compile.testing.emulated_ranks`` build theirs with this function too."""
    table = [int(p) for ptrs in regions for p in ptrs] + [int(p) for p in pads]
    table += [int(m) for m in multicast]
    return torch.tensor(table, dtype=torch.int64, device=device)


def region_bytes(capacity: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one [capacity, hidden] region, rounded up to the region alignment."""
    n = capacity * hidden * dtype.itemsize
    return math.ceil(n / _REGION_ALIGN) * _REGION_ALIGN


class SymmCapacityError(RuntimeError):
    """The workspace is too small and cannot grow now (CUDA graph capture)."""


@dataclass(eq=False)
class SymmWorkspace:
    """Symmetric buffers of one (group, dtypes, hidden, channel), capacity in rows.

    One ``symm_mem.empty`` uint8 allocation, one ``rendezvous``; three row-major regions
    ``inp`` [cap, H] (x dtype), ``out`` [cap, H] (out dtype), ``res`` [cap, H] (residual
    dtype; used only when the residual output is all-gathered).  The output region is slot 0
    of ``out_ring`` [slots, cap, H]; a workspace asked for the ring (``ring=True``) has
    OUT_RING_SLOTS of them, where the push kernel may leave its normed output
    (:func:`ring_output`); others have one, so the ring costs memory only where it is used.
    ``ptr_table`` holds, for
    every rank, the peer-mapped addresses of the three regions and of its signal pad,
    followed by the multicast addresses (0 when there is no multicast object)."""

    group_name: str
    device: torch.device
    in_dtype: torch.dtype
    out_dtype: torch.dtype
    res_dtype: torch.dtype
    hidden: int
    channel: int
    capacity: int
    rank: int
    world_size: int
    buffer: torch.Tensor
    handle: Any
    inp: torch.Tensor
    out: torch.Tensor
    res: torch.Tensor
    ptr_table: torch.Tensor
    status: torch.Tensor
    multicast_ptr: int
    pad_offset: int
    out_ring: Optional[torch.Tensor] = None  # [slots, cap, H]; ``out`` is its slot 0

    def check_status(self) -> int:
        """Number of barrier timeouts recorded so far (synchronises the device)."""
        return int(self.status.item())


_WORKSPACES: dict[tuple, SymmWorkspace] = {}
# Workspaces replaced (grown, or given the ring) while a captured CUDA graph or an enqueued
# launch, here or on a peer, may still use them: kept for the rest of the process.
_RETIRED: list[SymmWorkspace] = []


def _drop(keys) -> None:
    for key in keys:
        _WORKSPACES.pop(key, None)


#: The table ``p2p`` and ``multimem`` reserve in, as the measured choice frees a loser's entries.
WORKSPACES = Workspaces(lambda: frozenset(_WORKSPACES), _drop)


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def _ensure_group_enabled(group_name: str) -> None:
    """Older PyTorch needs ``enable_symm_mem_for_group``; newer deprecates it (no-op)."""
    symm_mem = _symm_mem()
    try:
        enabled = symm_mem.is_symm_mem_enabled_for_group(group_name)
    except Exception:
        enabled = False
    if not enabled and hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


def _signal_pad_bytes(handle) -> int:
    size = getattr(handle, "signal_pad_size", None)
    if not size:
        try:
            size = _symm_mem().get_signal_pad_size()
        except Exception:
            size = 0
    return int(size)


def _ws_key(group_name, in_dtype, out_dtype, res_dtype, hidden, channel, device):
    return (str(group_name), in_dtype, out_dtype, res_dtype, int(hidden), int(channel),
            int(device.index if device.index is not None else torch.cuda.current_device()))


def _round_capacity(padded_rows: int, world_size: int) -> int:
    q = _CAPACITY_ROUND_ROWS * world_size
    return max(q, math.ceil(padded_rows / q) * q)


def _allocate_workspace(group_name, device, in_dtype, out_dtype, res_dtype, hidden, channel,
                        capacity, out_slots: int = 1) -> SymmWorkspace:
    """Collective: every rank of ``group_name`` must call it with the same arguments."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    symm_mem = _symm_mem()
    _ensure_group_enabled(group_name)

    off_in, off_out = 0, region_bytes(capacity, hidden, in_dtype)
    off_res = off_out + out_slots * region_bytes(capacity, hidden, out_dtype)
    total = off_res + region_bytes(capacity, hidden, res_dtype)
    # Normal (non-inference) tensors: copy_ into them must work inside and outside
    # torch.inference_mode().
    with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(device):
        buf = symm_mem.empty(total, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group_name)
        world_size = int(handle.world_size)
        rank = int(handle.rank)
        if world_size > MAX_WORLD_SIZE:
            raise RuntimeError(f"world size {world_size} > {MAX_WORLD_SIZE} not supported")

        # buffer_ptrs point at the allocation's data start; the tensor may sit at an
        # offset inside it (PyTorch's symmetric MemPool).  Compute it from our own
        # mapping (version independent) and cross-check with handle.offset if present.
        bptrs = [int(p) for p in handle.buffer_ptrs]
        base_off = buf.data_ptr() - bptrs[rank]
        h_off = getattr(handle, "offset", None)
        if base_off < 0 or base_off % 16:
            raise RuntimeError(f"unexpected symmetric tensor offset {base_off}")
        if h_off is not None and int(h_off) != base_off:
            logger.warning("symm handle offset %s != computed %s; using computed",
                           h_off, base_off)
        offs: Optional[list] = None
        try:  # The offset must be the same on every rank (symmetric allocation).
            pg = c10d._resolve_process_group(group_name)
            offs = [None] * world_size
            dist.all_gather_object(offs, base_off, group=pg)
        except Exception as e:  # pragma: no cover - best effort check
            logger.warning("could not cross-check symmetric buffer offsets: %s", e)
            offs = None
        if offs is not None and len(set(offs)) != 1:
            raise RuntimeError(f"symmetric buffer offsets differ across ranks: {offs}")

        # multicast_ptr is the multicast address of the rendezvous'd tensor itself
        # (PyTorch adds the handle's offset), i.e. of ``buf``'s first byte.
        mc = int(getattr(handle, "multicast_ptr", 0) or 0)
        mc_base = mc
        offs3 = (off_in, off_out, off_res)
        ptr_table = build_ptr_table([[b + base_off + off for b in bptrs] for off in offs3],
                                    list(handle.signal_pad_ptrs),
                                    tuple(mc_base + off if mc else 0 for off in offs3), device)
        status = torch.zeros(1, dtype=torch.int32, device=device)

        pad_off = pad_offset_for(channel, world_size)
        need = (pad_off + MAX_CTAS * world_size) * 4
        have = _signal_pad_bytes(handle)
        if have and need > have:
            raise RuntimeError(
                f"signal pad too small for channel {channel}: need {need} bytes, have "
                f"{have}; call torch.distributed._symmetric_memory.set_signal_pad_size("
                f"{need}) before any symmetric allocation, or use a lower channel")

        def _view(off, dt):
            n = capacity * hidden * torch.empty((), dtype=dt).element_size()
            return buf[off:off + n].view(dt).view(capacity, hidden)

        ws = SymmWorkspace(
            group_name=str(group_name), device=device, in_dtype=in_dtype, out_dtype=out_dtype,
            res_dtype=res_dtype, hidden=hidden, channel=channel, capacity=capacity, rank=rank,
            world_size=world_size, buffer=buf, handle=handle, inp=_view(off_in, in_dtype),
            out=_view(off_out, out_dtype), res=_view(off_res, res_dtype), ptr_table=ptr_table,
            status=status, multicast_ptr=mc_base, pad_offset=pad_off)
        # capacity is a multiple of 256 rows: the ring's regions are contiguous, unpadded.
        n_out = out_slots * capacity * hidden * out_dtype.itemsize
        ws.out_ring = buf[off_out:off_out + n_out].view(out_dtype).view(out_slots, capacity, hidden)
    logger.info("symm workspace group=%s rank=%d/%d H=%d dtypes=%s/%s/%s channel=%d "
                "capacity=%d rows, %d output slot(s) (%.1f MiB) multicast=%s", group_name, rank,
                world_size, hidden, in_dtype, out_dtype, res_dtype, channel, capacity, out_slots,
                total / 2**20, bool(mc))
    return ws


def ring_output(ws: SymmWorkspace, slot: int, num_tokens: int) -> torch.Tensor:
    """[T, H] view of ring slot ``slot`` of this rank's output region (``0 <= slot <
    OUT_RING_SLOTS``): where the push kernel leaves a normed output in place."""
    if ws.out_ring is None or not 0 <= slot < ws.out_ring.shape[0]:
        raise ValueError(f"output ring slot {slot} out of range for this workspace "
                         f"({0 if ws.out_ring is None else ws.out_ring.shape[0]} slots; ring=True "
                         "allocates OUT_RING_SLOTS)")
    return ws.out_ring[slot, :num_tokens]


def get_workspace(group_name: str, dtype: torch.dtype, hidden: int, num_tokens: int, *,
                  out_dtype: Optional[torch.dtype] = None,
                  residual_dtype: Optional[torch.dtype] = None, channel: int = 0,
                  device: Optional[torch.device] = None, ring: bool = False) -> Optional[SymmWorkspace]:
    """The cached workspace with room for ``num_tokens`` rows (padded to S*N), and the output
    ring if ``ring`` (a workspace without it is replaced by one with it, as for growth).

    Allocating or growing is collective (rendezvous): all ranks must call this with the
    same arguments, which they do when they run the same model step.  Never grows while
    the current stream is capturing a CUDA graph: returns None instead (callers fall
    back; call :func:`reserve` before capture)."""
    out_dtype = out_dtype or dtype
    residual_dtype = residual_dtype or dtype
    device = torch.device(device) if device is not None else torch.device(
        "cuda", torch.cuda.current_device())
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = _ws_key(group_name, dtype, out_dtype, residual_dtype, hidden, channel, device)
    ws = _WORKSPACES.get(key)
    capturing = torch.cuda.is_current_stream_capturing()
    slots = OUT_RING_SLOTS if ring else 1
    if ws is not None:
        s = math.ceil(num_tokens / ws.world_size)
        if s * ws.world_size <= ws.capacity and ws.out_ring.shape[0] >= slots:
            return ws
        slots = max(slots, ws.out_ring.shape[0])  # never drop a ring it already had
    if capturing:
        logger.warning("symm workspace for %s (H=%d, %d tokens, channel %d) missing or too "
                       "small during CUDA graph capture; call reserve() before capturing",
                       group_name, hidden, num_tokens, channel)
        return None
    world_size = ws.world_size if ws is not None else _group_size(group_name)
    capacity = _round_capacity(math.ceil(max(1, num_tokens) / world_size) * world_size,
                               world_size)
    if ws is not None:
        if capacity > ws.capacity:  # geometric growth: few retired workspaces
            capacity = max(capacity, _round_capacity(math.ceil(ws.capacity * 1.5), world_size))
        else:
            capacity = ws.capacity  # never shrink (replaced for the ring alone)
        # Keep the old buffers alive: a captured graph may still point at them, and (growth is
        # host-side, not a device barrier) a launch on them may still be running here or on a
        # peer, which pushes into our old regions.
        _RETIRED.append(ws)
    from .outside_pool import run_outside_graph_pool

    # Growing at run time can happen inside cudagraph trees' warm-up (a symbolic T above the
    # compile-time reservation); allocated there, the workspace's tensors fail the pool check.
    new = run_outside_graph_pool(lambda: _allocate_workspace(
        group_name, device, dtype, out_dtype, residual_dtype, hidden, channel, capacity, slots),
        device)
    _WORKSPACES[key] = new
    return new


def _group_size(group_name: str) -> int:
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(group_name).size()


def reserve(group_name: str, dtype: torch.dtype, hidden: int, max_tokens: int, *,
            out_dtype: Optional[torch.dtype] = None,
            residual_dtype: Optional[torch.dtype] = None, channel: int = 0,
            device: Optional[torch.device] = None, ring: bool = False) -> SymmWorkspace:
    """Pre-allocate (collectively) a workspace for up to ``max_tokens`` rows (and the output
    ring if ``ring``); call it before CUDA graph capture."""
    if torch.cuda.is_current_stream_capturing():
        raise SymmCapacityError("reserve() must be called outside CUDA graph capture")
    ws = get_workspace(group_name, dtype, hidden, max_tokens, out_dtype=out_dtype,
                       residual_dtype=residual_dtype, channel=channel, device=device, ring=ring)
    assert ws is not None
    return ws
