"""What symmetric memory can do for a group, and whether a hidden size / dtype fits the kernels.

Called at compile time by the capability checks of the implementations that need symmetric
memory (so it decides what the compiled graph contains: it is part of the pass manager's cache
key). :func:`probe` rendezvous-es a small buffer on first use per (group, device), which is
collective: every rank compiles the same graphs, so every rank gets here together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .common import HAS_TRITON, MAX_HIDDEN, MAX_WORLD_SIZE, SUPPORTED_DTYPES, vector_width
from .workspace import _ensure_group_enabled, _symm_mem

_PROBES: dict[tuple, Any] = {}


@dataclasses.dataclass(frozen=True)
class SymmProbe:
    """``mapped``: symmetric memory works for the group (rendezvous succeeded, every peer's buffer
    is mapped: peer-to-peer loads and stores); ``multicast``: PyTorch also made a multicast object
    (``multicast_ptr != 0``: NVLink SHARP); ``reason``: what was found, or why not."""

    mapped: bool
    multicast: bool
    reason: str


def check_hidden(hidden: int, dtypes) -> Optional[str]:
    """None if ``hidden`` is usable with all of ``dtypes``, else the reason.

    16-byte vectors: the hidden size must be divisible by the vector width of every dtype
    involved (so each row starts 16-byte aligned and ``multimem ... .v4`` ops apply), and a
    whole row (``next_pow2(H)``) lives in registers."""
    if hidden <= 0 or hidden > MAX_HIDDEN:
        return f"hidden size {hidden} outside (0, {MAX_HIDDEN}] (a row must fit in registers)"
    for dt in dtypes:
        if dt not in SUPPORTED_DTYPES:
            return f"dtype {dt} not supported (bf16, fp16, fp32 only)"
        vw = vector_width(dt)
        if hidden % vw:
            return f"hidden size {hidden} not divisible by the {dt} vector width {vw} (16 bytes)"
    return None


def _probe_handle(group_name: str, device: torch.device):
    """A small cached symmetric buffer's handle (collective on first use)."""
    key = (str(group_name), device.index)
    if key not in _PROBES:
        symm_mem = _symm_mem()
        _ensure_group_enabled(group_name)
        with torch.inference_mode(False), torch.cuda.device(device):
            t = symm_mem.empty(4096, dtype=torch.uint8, device=device)
            _PROBES[key] = (t, symm_mem.rendezvous(t, group_name))
    return _PROBES[key][1]


def _no(reason: str) -> SymmProbe:
    return SymmProbe(False, False, reason)


#: Why a fake process group (``init_process_group("fake")``: one process, collectives that move
#: nothing) gets no symmetric memory. Its store implements no keys, so a rendezvous would fail
#: inside PyTorch with an internal assert ("... please report a bug to PyTorch. Not implemented.").
FAKE_GROUP = "the fake process group has no symmetric memory (one process; its collectives move nothing)"


def _backend(group_name: str) -> str:
    """The backend name of the process group ``group_name`` ("" where it cannot be resolved)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return str(dist.get_backend(_resolve_process_group(group_name)))
    except Exception:  # noqa: BLE001 - an unresolvable group is probed, and its error reported, as before
        return ""


def _short(e: Exception) -> str:
    """The first line of ``e``; of a PyTorch internal assert, only what failed, without the text
    asking to report a bug (the failure is the group's capability, reported as a reason)."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    if "INTERNAL ASSERT FAILED" in text:
        detail = text.rsplit("please report a bug to PyTorch.", 1)[-1].strip().rstrip(".")
        return f"PyTorch's setup failed inside ({detail or type(e).__name__})"
    return text


def probe(group_name: str, device, dtype: torch.dtype, hidden: int, *, handle: Any = None) -> SymmProbe:
    """What symmetric memory gives ``group_name`` for rows of ``hidden`` ``dtype`` elements.

    Without ``handle`` this rendezvous-es a small probe buffer, which is collective: call it on
    every rank of the group (e.g. at model init)."""
    if not HAS_TRITON:
        return _no("triton is not available")
    if dtype not in SUPPORTED_DTYPES:
        return _no(f"dtype {dtype} not supported (bf16, fp16, fp32 only)")
    why = check_hidden(int(hidden), [dtype])
    if why:
        return _no(why)
    if handle is None:
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return _no("torch.distributed is not initialized")
            if _backend(group_name) == "fake":
                return _no(FAKE_GROUP)
            dev = torch.device(device)
            if dev.type != "cuda":
                return _no(f"device {dev} is not CUDA")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            handle = _probe_handle(group_name, dev)
        except Exception as e:
            return _no(f"symmetric memory unavailable for group {group_name}: {_short(e)}")
    world_size = int(getattr(handle, "world_size", 0) or 0)
    if world_size < 1:
        return _no("symmetric-memory handle reports no ranks")
    if world_size > MAX_WORLD_SIZE:
        return _no(f"world size {world_size} > {MAX_WORLD_SIZE}")
    bptrs = getattr(handle, "buffer_ptrs", None)
    if bptrs is not None and (len(bptrs) != world_size or not all(int(p) for p in bptrs)):
        return _no("peer buffers are not all mapped (no P2P access)")
    mc = int(getattr(handle, "multicast_ptr", 0) or 0)
    if mc != 0:
        return SymmProbe(True, True, f"multicast_ptr=0x{mc:x}: NVLink multicast available")
    return SymmProbe(True, False, "no multicast object (multicast_ptr=0); peer-to-peer loads/stores")


def probe_site(site) -> SymmProbe:
    """:func:`probe` for a fused site (a :class:`weave_compile.kernels.registry.Site`): its
    tensors on CUDA, and every dtype it stores (the residual and normed outputs) fitting too."""
    if site.device.type != "cuda":
        return _no(f"{site.device.type} tensors: symmetric memory needs CUDA")
    p = probe(site.group_name, site.device, site.dtype, site.hidden)
    why = check_hidden(site.hidden, (site.residual_dtype, site.out_dtype)) if p.mapped else None
    return _no(why) if why else p
