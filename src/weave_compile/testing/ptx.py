"""Measurement and verification hooks of the symmetric-memory kernels (not the product path).

* :func:`compile_variant_ptx`: compile a kernel for ``cuda:sm_<arch>`` without a GPU (the pull
  kernel with ``multimem`` instructions is verified this way only: it is never launched in this
  project);
* :func:`p2p_pull`: the pull kernel without multicast (peer loads instead of
  ``multimem.ld_reduce``), kept to compare against the push kernel in tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from weave_compile.kernels.multimem.launch import pull_constexprs, pull_on
from weave_compile.kernels.multimem.pull import pull_allreduce_rmsnorm_kernel
from weave_compile.kernels.p2p import launch as p2p_launch
from weave_compile.kernels.p2p.push import push_allreduce_rmsnorm_kernel
from weave_compile.kernels.shared import common, workspace
from weave_compile.kernels.shared.probe import check_hidden
from weave_compile.kernels.shared.shapes import launch_meta, layernorm_constexprs
from weave_compile.kernels.shared.symm_call import run_on_workspace
from weave_compile.kernels.spec import FusedSpec, Rows

#: What :func:`compile_variant_ptx` compiles: the push kernel, the pull kernel with peer loads and
#: stores, the pull kernel with ``multimem`` instructions.
PTX_KERNELS = ("push", "pull", "pull_multimem")


def p2p_pull(x: torch.Tensor, residual=None, bias=None, weight=None, *, norm_bias=None, channel: int = 0,
             num_warps: Optional[int] = None, **spec_kw):
    """The pull kernel with plain peer loads and stores (no multicast) on the group's cached
    workspace; the keywords of :func:`weave_compile.kernels.p2p.launch.allreduce_rmsnorm` (``norm`` and
    ``norm_bias`` included: the kernel's LayerNorm variant) but ``eps_tensor`` (the pull kernel reads eps
    on the host)."""
    if not common.HAS_TRITON:
        raise RuntimeError("triton is not available")
    spec = FusedSpec.for_rows(x, residual, **spec_kw)
    return run_on_workspace(Rows(x, residual, bias, weight, norm_bias=norm_bias), spec,
                            functools.partial(pull_on, use_multimem=False),
                            channel=channel, num_warps=num_warps)


def compile_variant_ptx(kernel: str, dtype: torch.dtype, hidden: int,
                        num_warps: Optional[int] = None, *, world_size: int = 2,
                        out_dtype: Optional[torch.dtype] = None,
                        residual_dtype: Optional[torch.dtype] = None,
                        mid_dtype: Optional[torch.dtype] = None, has_bias: bool = True,
                        has_residual: bool = True, has_weight: bool = True,
                        residual_in_sharded: bool = False,
                        residual_out_sharded: bool = False, block_rows: Optional[int] = None,
                        spin_limit: int = 0, arch: int = 90, return_all: bool = False,
                        rows_per_rank: int = 1 << 20, comm_ctas: int = common.DEFAULT_COMM_CTAS,
                        out_in_region: bool = False, eps_ptr: bool = False, norm: str = "rmsnorm",
                        has_norm_bias: bool = False, batch_invariant: bool = False):
    """Compile ``kernel`` (one of :data:`PTX_KERNELS`) for ``cuda:sm_<arch>`` and return its PTX.

    Uses Triton's ``ASTSource`` + ``triton.compile(target=GPUTarget("cuda", arch, 32))``;
    Triton's bundled ptxas also assembles the cubin, so a successful return means the inline
    PTX (multimem) is accepted by ptxas for that architecture.  The launch shape is the one
    the launcher would pick for ``rows_per_rank`` and ``comm_ctas``; ``out_in_region`` (push) is
    the mode that leaves the normed output in the ring, ``eps_ptr`` (push) the one reading eps from
    a float64 device tensor (``torch.compile(dynamic=True)``), ``norm="layernorm"`` and
    ``has_norm_bias`` (push and both pull kernels) their LayerNorm variant (``IS_LAYERNORM``,
    ``HAS_NORM_BIAS``; RMSNorm without a norm bias compiles the kernel without either keyword, as the
    launchers do),
    ``batch_invariant`` (push) its rank-order variant (``RANK_ORDER`` on
    :func:`weave_compile.kernels.p2p.launch.invariant_meta`'s shape; without it no keyword).  With
    ``return_all`` the whole ``asm`` dict (ttir, ttgir, llir, ptx, cubin) is returned."""
    if not common.HAS_TRITON:
        raise RuntimeError("triton is not available")
    if kernel not in PTX_KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {PTX_KERNELS}")
    if batch_invariant and kernel != "push":
        raise ValueError(f"batch_invariant: only the push kernel has a rank-order variant, not {kernel!r}")
    if eps_ptr and kernel != "push":
        raise ValueError(f"eps_ptr: only the push kernel reads eps from a tensor, not {kernel!r}")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out_dtype = out_dtype or dtype
    residual_dtype = residual_dtype or dtype
    why = check_hidden(hidden, [dtype, out_dtype, residual_dtype])
    if why:
        raise ValueError(why)
    flags = dict(world_size=world_size, hidden=hidden, in_dtype=dtype, out_dtype=out_dtype,
                 res_dtype=residual_dtype, mid_dtype=mid_dtype, has_bias=has_bias,
                 has_residual=has_residual, has_weight=has_weight,
                 residual_in_sharded=residual_in_sharded,
                 residual_out_sharded=residual_out_sharded, spin=spin_limit)
    sig = common.sig_dtype
    runtime_sig = {
        "PTR_TABLE": "*i64", "RESIDUAL": sig(residual_dtype), "BIAS": sig(dtype),
        "WEIGHT": sig(dtype), "RESIDUAL_OUT": sig(residual_dtype), "STATUS": "*i32",
        "num_tokens": "i32", "rows_per_rank": "i32", "rank": "i32", "pad_offset": "i32",
        "stride_res_row": "i32", "stride_res_out_row": "i32", "eps": "fp32",
        "weight_offset": "fp32",
    }
    aligned = ["PTR_TABLE", "RESIDUAL", "BIAS", "WEIGHT", "RESIDUAL_OUT", "STATUS",
               "stride_res_row", "stride_res_out_row"]
    if kernel == "push":
        fn = push_allreduce_rmsnorm_kernel
        meta = p2p_launch.push_meta(hidden, rows_per_rank, comm_ctas, world_size, dtype.itemsize,
                                residual_dtype.itemsize, num_warps, batch_invariant)
        if block_rows is not None:
            meta = dataclasses.replace(meta, block_rows=int(block_rows))
        # the index width the launcher would pick for T = N x rows_per_rank rows: the
        # workspace it would allocate for them, up to the last ring slot where asked
        capacity = workspace._round_capacity(world_size * rows_per_rank, world_size)
        extent = capacity * hidden * (common.OUT_RING_SLOTS if out_in_region else 1)
        consts = dict(p2p_launch.push_constexprs(meta, **flags), PHASES=7, SYNC=True,
                      OUT_IN_REGION=bool(out_in_region), IDX64=common.needs_int64(extent),
                      EPS_PTR=bool(eps_ptr))
        if batch_invariant:
            consts["RANK_ORDER"] = True
        if eps_ptr:
            runtime_sig["eps"] = "*fp64"
        # out_ring_row is not declared 16-divisible: the stores must vectorize regardless
        runtime_sig.update(X=sig(dtype), NORMED=sig(out_dtype), slot_rows="i32",
                           stride_x_row="i32", stride_out_row="i32", out_ring_row="i32")
        aligned += ["X", "NORMED", "stride_x_row", "stride_out_row"]
    else:
        fn = pull_allreduce_rmsnorm_kernel
        meta = launch_meta(hidden, rows_per_rank, comm_ctas, num_warps)
        consts = pull_constexprs(kernel == "pull_multimem", block_h=meta.block_h,
                                 block_rows=int(block_rows or meta.block_rows), **flags)
    # The launchers' LayerNorm keywords (none for RMSNorm without a norm bias); the NORM_BIAS row is a
    # run-time pointer where there is one.
    consts.update(layernorm_constexprs(norm, None))
    if has_norm_bias:
        consts["HAS_NORM_BIAS"] = True
        runtime_sig["NORM_BIAS"] = sig(dtype)
        aligned.append("NORM_BIAS")
    # A constexpr not given takes its default, as at a launch (not None: `QUANT > 0` must hold 0).
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    signature = {name: (runtime_sig[name] if name in runtime_sig else "constexpr")
                 for name in fn.arg_names}
    # What the JIT would specialise at launch: 16-byte aligned pointers and strides.
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    compiled = common.triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": meta.num_warps, "num_stages": 1})
    if return_all:
        return dict(compiled.asm, shared=compiled.metadata.shared)
    return compiled.asm["ptx"]

