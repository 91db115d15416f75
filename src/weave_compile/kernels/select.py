"""Which symmetric-memory kernel a group can run, and whether a hidden size / dtype fits.

Called at compile time by the fused-op pass (through ``select_kernel`` of the op module), so
it decides what the compiled graph contains: it is part of the pass manager's cache key.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .common import HAS_TRITON, MAX_HIDDEN, MAX_WORLD_SIZE, SUPPORTED_DTYPES, vector_width
from .workspace import _ensure_group_enabled, _symm_mem

#: The product's symmetric-memory kernels (the fused op's ``kernel`` argument), best first.
SYMM_KERNELS = ("multimem", "p2p")

_PROBES: dict[tuple, Any] = {}


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


def select_symm_variant(group_name: str, device, dtype: torch.dtype, hidden: int, *,
                        handle: Any = None) -> tuple[Optional[str], str]:
    """``(kernel or None, reason)``, the kernel one of :data:`SYMM_KERNELS`.

    ``multimem`` only if the handle has a non-zero ``multicast_ptr`` (PyTorch created a
    multicast object, i.e. NVLink SHARP is enabled for this group); else ``p2p`` when
    symmetric memory works for the group (rendezvous succeeded: every peer is mapped);
    else None.  Without ``handle`` this rendezvous-es a small probe buffer, which is
    collective: call it on every rank of the group (e.g. at model init)."""
    if not HAS_TRITON:
        return None, "triton is not available"
    if dtype not in SUPPORTED_DTYPES:
        return None, f"dtype {dtype} not supported (bf16, fp16, fp32 only)"
    why = check_hidden(int(hidden), [dtype])
    if why:
        return None, why
    if handle is None:
        try:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None, "torch.distributed is not initialized"
            dev = torch.device(device)
            if dev.type != "cuda":
                return None, f"device {dev} is not CUDA"
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            handle = _probe_handle(group_name, dev)
        except Exception as e:
            return None, f"symmetric memory unavailable for group {group_name}: {e}"
    world_size = int(getattr(handle, "world_size", 0) or 0)
    if world_size < 1:
        return None, "symmetric-memory handle reports no ranks"
    if world_size > MAX_WORLD_SIZE:
        return None, f"world size {world_size} > {MAX_WORLD_SIZE}"
    bptrs = getattr(handle, "buffer_ptrs", None)
    if bptrs is not None and (len(bptrs) != world_size or not all(int(p) for p in bptrs)):
        return None, "peer buffers are not all mapped (no P2P access)"
    mc = int(getattr(handle, "multicast_ptr", 0) or 0)
    if mc != 0:
        return "multimem", f"multicast_ptr=0x{mc:x}: NVLink multicast available"
    return "p2p", "no multicast object (multicast_ptr=0); peer-to-peer loads/stores"
