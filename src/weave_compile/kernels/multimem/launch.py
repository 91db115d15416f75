"""The pull kernel's launcher: stage ``x`` into the symmetric input buffer, launch, copy out.

:func:`pull_on` is one rank's launch on a workspace. With ``use_multimem`` the reduce-scatter
is ``multimem.ld_reduce`` and the all-gather ``multimem.st`` through the multicast address, which
exists only where PyTorch made a multicast object (checked here: never a multimem instruction
without one); without, the same kernel with plain peer loads and stores (a measurement and
test hook, ``weave_compile.testing.ptx.p2p_pull``). ``spec.norm`` picks RMSNorm or LayerNorm and
``rows.norm_bias`` is a LayerNorm's bias after the weight: the kernel's LayerNorm variant, whose
keywords (:func:`weave_compile.kernels.shared.shapes.layernorm_constexprs`) an RMSNorm without a norm
bias does not get, so its kernel compiles as before.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from ..shared.common import interpreting, spin_limit, vector_width
from ..shared.shapes import LaunchMeta, launch_meta, layernorm_constexprs, norm_constexprs
from ..shared.symm_call import contiguous_inputs
from ..shared.workspace import SymmWorkspace
from ..spec import FusedSpec, Rows
from .pull import pull_allreduce_rmsnorm_kernel


def pull_constexprs(use_multimem: bool, **kw) -> dict:
    c = norm_constexprs(**kw)
    return dict(c, IN_VEC=vector_width(kw["in_dtype"]), OUT_VEC=vector_width(kw["out_dtype"]),
                RES_VEC=vector_width(kw["res_dtype"]), USE_MULTIMEM=bool(use_multimem))


def launch_pull(ws: SymmWorkspace, rows: Rows, spec: FusedSpec, residual_out: Optional[torch.Tensor], *,
                use_multimem: bool, num_warps: Optional[int] = None) -> LaunchMeta:
    """Launch the pull kernel on ``ws`` (x already staged in ``ws.inp``); ``residual_out``
    given = sharded residual output [S, H]."""
    num_tokens = rows.x.shape[0]
    N, H = ws.world_size, ws.hidden
    S = math.ceil(num_tokens / N)
    dummy = ws.ptr_table  # any valid tensor for absent pointer arguments (never read)
    residual, bias, weight = contiguous_inputs(rows)
    norm_bias = rows.norm_bias
    if norm_bias is not None:
        if norm_bias.numel() != H:
            raise ValueError(f"norm_bias must have {H} elements, got shape {tuple(norm_bias.shape)}")
        norm_bias = norm_bias.reshape(H).contiguous()
    meta = launch_meta(H, S, spec.comm_ctas, num_warps)
    consts = pull_constexprs(
        use_multimem, world_size=N, hidden=H, block_h=meta.block_h, block_rows=meta.block_rows,
        in_dtype=ws.in_dtype, out_dtype=ws.out_dtype, res_dtype=ws.res_dtype, mid_dtype=spec.mid_dtype,
        has_bias=bias is not None, has_residual=residual is not None,
        has_weight=weight is not None, residual_in_sharded=spec.residual_in_sharded,
        residual_out_sharded=residual_out is not None, spin=spin_limit(), interp=interpreting())
    pull_allreduce_rmsnorm_kernel[(meta.grid,)](
        ws.ptr_table, residual if residual is not None else dummy,
        bias if bias is not None else dummy, weight if weight is not None else dummy,
        residual_out if residual_out is not None else dummy, ws.status,
        num_tokens, S, ws.rank, ws.pad_offset,
        residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0,
        float(spec.eps), float(spec.weight_offset), num_warps=meta.num_warps, num_stages=1, **consts,
        **layernorm_constexprs(spec.norm, norm_bias))
    return meta


def pull_on(ws: SymmWorkspace, rows: Rows, spec: FusedSpec, *, use_multimem: bool = True,
            num_warps: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's pull launch on ``ws`` (``rows.x`` [T, H], T >= 1): fresh outputs."""
    if use_multimem and not ws.multicast_ptr:
        # Hard safety rule: never issue multimem instructions without a multicast object.
        raise RuntimeError("multimem kernel requested but the symmetric-memory handle has "
                           "no multicast_ptr")
    x = rows.x
    T, H = x.shape
    res_shard = (torch.empty((math.ceil(T / ws.world_size), H), dtype=ws.res_dtype, device=x.device)
                 if spec.residual_out_sharded else None)
    # Stage x into the symmetric input buffer unless it already is it.
    if not (x.data_ptr() == ws.inp.data_ptr() and x.stride() == (H, 1)):
        ws.inp[:T].copy_(x)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        launch_pull(ws, rows, spec, res_shard, use_multimem=use_multimem, num_warps=num_warps)
    # Copies, not views: the next launch on this channel overwrites the buffers.
    return ws.out[:T].clone(), res_shard if res_shard is not None else ws.res[:T].clone()
