"""The host path the symmetric-memory barrier kernels (``p2p``, ``multimem``) share.

:func:`run_on_workspace` checks the rows against what the kernels take, finds (or grows) the
cached workspace of the group, channel and dtypes (:mod:`.workspace`), handles ``T = 0`` and
hands one rank's launch to the implementation's launcher. :func:`reserve_for_site` is their
compile-time reservation.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch

from ..spec import FusedSpec, Rows
from .common import HAS_TRITON, SUPPORTED_DTYPES, interpreting
from .probe import check_hidden
from .workspace import SymmCapacityError, SymmWorkspace, get_workspace, reserve

#: Rows reserved at compile time at least: a later, larger T grows the workspace at run time.
MIN_RESERVED_ROWS = 8192

Launch = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def check_rows(rows: Rows, spec: FusedSpec) -> None:
    """Raise ValueError naming what the kernels cannot take (the shapes that need the world size:
    :func:`check_residual`)."""
    x = rows.x
    if x.dim() != 2 or not (x.is_cuda or interpreting()):
        raise ValueError("x must be a 2-D CUDA tensor [T, H]")
    H = x.shape[1]
    why = check_hidden(H, [x.dtype, spec.out_dtype, spec.residual_dtype])
    if why:
        raise ValueError(why)
    if spec.mid_dtype is not None and spec.mid_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"mid_dtype {spec.mid_dtype} not supported")
    for name, t in (("bias", rows.bias), ("weight", rows.weight)):
        if t is not None and (t.dim() != 1 or t.shape[0] != H):
            raise ValueError(f"{name} must have shape [{H}]")


def kernel_eps(rows: Rows, spec: FusedSpec) -> Union[float, torch.Tensor]:
    """eps as the symmetric-memory kernels take it: a float, or ``rows.eps_tensor``, which they load
    on ``x``'s device (``EPS_PTR``). Raises ValueError for a tensor they cannot load there."""
    e = rows.eps_tensor
    if e is None:
        return float(spec.eps)
    x = rows.x
    if e.dim() != 0 or e.device != x.device or not e.dtype.is_floating_point:
        raise ValueError(f"eps_tensor must be a 0-d floating-point tensor on {x.device}, got "
                         f"shape {tuple(e.shape)} {e.dtype} on {e.device}")
    return e


def check_residual(rows: Rows, spec: FusedSpec, world_size: int) -> None:
    """The residual is [T, H], or this rank's [ceil(T / N), H] shard when it comes sharded."""
    T, H = rows.x.shape
    if rows.residual is not None and T > 0:
        exp = (math.ceil(T / world_size), H) if spec.residual_in_sharded else (T, H)
        if tuple(rows.residual.shape) != exp:
            raise ValueError(f"residual must have shape {exp}, got {tuple(rows.residual.shape)}")


def contiguous_inputs(rows: Rows) -> tuple:
    """``(residual, bias, weight)`` with unit column stride and contiguous vectors."""
    residual = rows.residual
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    return (residual, rows.bias.contiguous() if rows.bias is not None else None,
            rows.weight.contiguous() if rows.weight is not None else None)


def run_on_workspace(rows: Rows, spec: FusedSpec, launch: Launch, *, ring: bool = False, channel: int = 0,
                     **launch_kw) -> tuple[torch.Tensor, ...]:
    """One rank's call: ``launch(ws, rows, spec, **launch_kw)`` on the group's cached workspace.

    Collective: every rank must call it with the same shapes, flags, ``comm_ctas`` and
    ``channel``; two launches that may run concurrently need different channels. ``ring``: the
    workspace needs the output ring (``spec.out_slot`` >= 0). Raises :class:`SymmCapacityError`
    if the workspace is too small during CUDA-graph capture (reserve first)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not available")
    check_rows(rows, spec)
    x = rows.x
    T, H = x.shape
    ws: Optional[SymmWorkspace] = get_workspace(
        spec.group_name, x.dtype, H, max(T, 1), out_dtype=spec.out_dtype, residual_dtype=spec.residual_dtype,
        channel=channel, device=x.device, ring=ring)
    if ws is None:
        raise SymmCapacityError(
            f"no symmetric workspace with room for {T} tokens (H={H}, channel={channel}) "
            "while capturing a CUDA graph; call reserve() before capture")
    if T == 0:
        S = math.ceil(T / ws.world_size)
        outs = (torch.empty((0, H), dtype=spec.out_dtype if spec.quant is None else spec.quant.dtype,
                            device=x.device),
                torch.empty((S, H) if spec.residual_out_sharded else (0, H), dtype=spec.residual_dtype,
                            device=x.device))
        if spec.quant is not None:  # the row scales third (empty for a static scale)
            outs += (torch.empty((0, 1) if spec.quant.kind == "row" else (0,), device=x.device),)
        return outs
    check_residual(rows, spec, ws.world_size)
    return launch(ws, rows, spec, **launch_kw)


def reserve_for_site(site, ring: bool = False) -> SymmWorkspace:
    """Allocate the site's workspace at compile time (collective; outside any CUDA-graph pool:
    allocated at run time it would land in the pool of cudagraph trees' warm-up, which rejects
    live allocations it does not own): room for the site's size hint, at least
    :data:`MIN_RESERVED_ROWS` rows."""
    rows = max(site.size_hint or MIN_RESERVED_ROWS, MIN_RESERVED_ROWS)
    return reserve(site.group_name, site.dtype, site.hidden, rows, out_dtype=site.out_dtype,
                   residual_dtype=site.residual_dtype, device=site.device, ring=ring)
