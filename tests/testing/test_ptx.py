"""Tests for testing/ptx.py: every kernel compiles for sm_90 with Triton's bundled ptxas (no GPU).

multimem PTX has ``multimem.ld_reduce``/``multimem.st`` (and is never launched: this is its
only check), the p2p kernels have neither; the push kernel's accesses are 16-byte vectors and
its row loops are software-pipelined (asynchronous copies into shared memory).
"""

import re

import pytest
import torch

from weave_compile.kernels.shared.common import HAS_TRITON
from weave_compile.testing.ptx import compile_variant_ptx

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@requires_triton
@pytest.mark.parametrize("kernel", ["push", "pull", "pull_multimem"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_ptx_compiles_for_sm90(kernel, dtype):
    asm = compile_variant_ptx(kernel, DTYPES[dtype], 4096, return_all=True)
    ptx = asm["ptx"]
    assert ".target sm_90" in ptx
    assert len(asm["cubin"]) > 0  # ptxas accepted it (inline multimem asm included)
    has_ld, has_st = "multimem.ld_reduce" in ptx, "multimem.st" in ptx
    if kernel == "pull_multimem":
        assert has_ld and has_st
        suffix = {"bf16": "acc::f32.v4.bf16x2", "fp16": "acc::f32.v4.f16x2", "fp32": "v4.f32"}
        assert f"multimem.ld_reduce.relaxed.sys.global.add.{suffix[dtype]}" in ptx
    elif kernel == "pull":
        assert not has_ld and not has_st
        assert "ld.global.cg.v4" in ptx  # 16-byte peer loads
    else:  # push: 16-byte loads and stores only, no scalar element accesses
        assert not has_ld and not has_st
        assert "st.global.v4.b32" in ptx and "ld.global.v4.b32" in ptx
        assert not re.search(r"(ld|st)\.global\.b(16|32)\b", ptx)
    # the signal-pad barrier: system fence + relaxed increments to peers, acquire reads
    # of our own pad; all predicated on one thread
    assert "fence.acq_rel.sys" in ptx
    # (newer LLVM emits the result-less form as ``red``: the same relaxed system-scope add)
    assert re.search(r"(atom|red)\.global\.sys\.relaxed\.add\.[us]32", ptx)
    # (LLVM turns the idempotent acquire add of 0 into an acquire load)
    assert "ld.global.sys.acquire.b32" in ptx or "atom.global.sys.acquire.add.u32" in ptx


@requires_triton
def test_push_reading_eps_from_a_tensor_compiles_for_sm90():
    """EPS_PTR: eps loaded from a float64 device tensor and converted once; the float form has no
    such conversion. Only the push kernel takes it."""
    with_ptr = compile_variant_ptx("push", torch.bfloat16, 4096, eps_ptr=True)
    assert "cvt.rn.f32.f64" in with_ptr
    assert "cvt.rn.f32.f64" not in compile_variant_ptx("push", torch.bfloat16, 4096)
    with pytest.raises(ValueError, match="only the push kernel"):
        compile_variant_ptx("pull", torch.bfloat16, 4096, eps_ptr=True)


@requires_triton
@pytest.mark.parametrize("kernel", ["push", "pull", "pull_multimem"])
@pytest.mark.parametrize("kw", [
    dict(dtype=torch.bfloat16, hidden=5120, residual_in_sharded=True, residual_out_sharded=True),
    dict(dtype=torch.bfloat16, hidden=2048, residual_dtype=torch.float32,
         mid_dtype=torch.bfloat16),
    dict(dtype=torch.float32, hidden=8192, out_dtype=torch.bfloat16, has_bias=False,
         has_residual=False, has_weight=False),
    dict(dtype=torch.float16, hidden=16384, world_size=4, spin_limit=1 << 20),
], ids=["sharded-5120", "fp32res-mid", "fp32in-bf16out-bare", "fp16-16384-w4-spin"])
def test_ptx_compiles_flag_variants(kernel, kw):
    kw = dict(kw)
    ptx = compile_variant_ptx(kernel, kw.pop("dtype"), kw.pop("hidden"), **kw)
    assert ("multimem.ld_reduce" in ptx) == (kernel == "pull_multimem")


@requires_triton
@pytest.mark.parametrize("hidden,dtype", [(4096, torch.bfloat16), (5120, torch.float32)])
def test_push_output_in_the_ring_compiles_with_vector_stores_and_no_gather(hidden, dtype):
    """OUT_IN_REGION: the peers' stores go to a run-time ring row, still 16-byte vectors; the
    gather phase's copy of the normed rows is gone (fewer global loads than the copying mode)."""
    # One launch shape for both (forced, the prefetch loop's), so the load counts compare.
    ring = compile_variant_ptx("push", dtype, hidden, residual_in_sharded=True, residual_out_sharded=True,
                               out_in_region=True, num_warps=16)
    copying = compile_variant_ptx("push", dtype, hidden, residual_in_sharded=True, residual_out_sharded=True,
                                  num_warps=16)
    default_ring = compile_variant_ptx("push", dtype, hidden, residual_in_sharded=True,
                                       residual_out_sharded=True, out_in_region=True)
    assert "st.global.v4.b32" in default_ring and "multimem" not in default_ring
    assert "st.global.v4.b32" in ring and not re.search(r"(ld|st)\.global\.b(16|32)\b", ring)
    assert "multimem" not in ring
    loads = [len(re.findall(r"ld\.global(\.\w+)*\.v4", p)) for p in (ring, copying)]
    assert loads[0] < loads[1], loads


@requires_triton
def test_compile_rejects_bad_args():
    with pytest.raises(ValueError):
        compile_variant_ptx("nccl", torch.bfloat16, 4096)
    with pytest.raises(ValueError):
        compile_variant_ptx("push", torch.bfloat16, 4100)


@requires_triton
def test_push_kernel_keeps_the_next_tile_in_registers_or_in_a_pipeline():
    """Several tiles in flight per CTA.  The default launches keep them in registers (H=4096: one
    warp per row, chunks loaded ahead; H=8192: the add+norm's next tile prefetched): no cp.async
    staging, shared memory only for the row reductions; with the warp count forced, the tl.range
    pipeline stages its loads with cp.async."""
    for hidden in (4096, 8192):
        asm = compile_variant_ptx("push", torch.bfloat16, hidden, return_all=True)
        assert "cp.async" not in asm["ptx"] and asm["shared"] < 4096, (hidden, asm["shared"])
    piped = compile_variant_ptx("push", torch.bfloat16, 4096, num_warps=16, return_all=True)
    assert "cp.async" in piped["ptx"] and piped["shared"] > 32 * 1024
    v1 = compile_variant_ptx("pull", torch.bfloat16, 4096)
    assert "cp.async" not in v1


def _ptxas_spills(ptx: str) -> list[tuple[int, int]]:
    """(spill store bytes, spill load bytes) per function, from Triton's bundled ptxas -v."""
    import os
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton's bundled ptxas not found")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    found = [(int(a), int(b)) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                                   out.stdout + out.stderr)]
    assert found, (out.stdout + out.stderr)[-2000:]
    return found


@requires_triton
@pytest.mark.parametrize("world,hidden,dtype,ring", [
    (2, 4096, torch.bfloat16, False), (2, 4096, torch.bfloat16, True), (2, 8192, torch.bfloat16, False),
    (3, 4096, torch.bfloat16, True), (8, 4096, torch.bfloat16, False), (2, 4096, torch.float32, False)])
def test_default_push_shapes_do_not_spill(world, hidden, dtype, ring):
    """The register models (common.prefetch_fits, shapes.rowwise_fits with its chunks ahead) pick
    shapes ptxas fits without spilling: shapes over the register file measured 10-20x slower
    (one H200, docs/performance.md)."""
    ptx = compile_variant_ptx("push", dtype, hidden, world_size=world, out_in_region=ring,
                              rows_per_rank=(1 << 20) // world, comm_ctas=8)
    assert all(s == (0, 0) for s in _ptxas_spills(ptx))


@requires_triton
@pytest.mark.parametrize("world,hidden,dtype,ring,full", [
    (2, 2048, torch.bfloat16, True, True), (2, 4096, torch.bfloat16, False, True),
    (2, 4096, torch.bfloat16, False, False), (2, 4096, torch.bfloat16, True, True),
    (2, 5120, torch.bfloat16, False, True), (2, 8192, torch.bfloat16, False, True),
    (3, 4096, torch.bfloat16, True, True), (8, 4096, torch.bfloat16, False, True),
    (2, 4096, torch.float32, False, True)])
def test_default_push_shapes_do_not_spill_with_layernorm(world, hidden, dtype, ring, full):
    """The LayerNorm variant (IS_LAYERNORM: a second pass over the row held in registers; HAS_NORM_BIAS:
    one more parameter row) at the launcher's default shapes, which were chosen for RMSNorm (one warp per
    row at 2 ranks and H <= 4096 with its chunks 7 ahead, the prefetched tile elsewhere): ptxas fits them
    without spilling. ``full``: with the norm bias, a mid dtype and sharded residuals on top of the bias,
    weight and residual (the most registers); else the LayerNorm alone."""
    extra = dict(has_norm_bias=True, mid_dtype=torch.bfloat16, residual_in_sharded=True,
                 residual_out_sharded=True) if full else {}
    ptx = compile_variant_ptx("push", dtype, hidden, world_size=world, out_in_region=ring,
                              rows_per_rank=(1 << 20) // world, comm_ctas=8, norm="layernorm", **extra)
    assert all(s == (0, 0) for s in _ptxas_spills(ptx))


@requires_triton
@pytest.mark.parametrize("kernel", ["push", "pull", "pull_multimem"])
def test_layernorm_variant_compiles_only_where_asked(kernel):
    """The keywords reach the kernel: the LayerNorm compiles to other code than the RMSNorm with the same
    parameters, a norm bias adds one pointer parameter (the push kernel, and the pull kernel with peer
    loads or multimem instructions)."""
    rms = compile_variant_ptx(kernel, torch.bfloat16, 8192)
    ln = compile_variant_ptx(kernel, torch.bfloat16, 8192, norm="layernorm")
    ln_nb = compile_variant_ptx(kernel, torch.bfloat16, 8192, norm="layernorm", has_norm_bias=True)
    params = [len(re.findall(r"^\s*\.param\b", p, re.M)) for p in (rms, ln, ln_nb)]
    assert params[0] == params[1] and params[2] == params[1] + 1, params
    assert rms != ln and ln != ln_nb
    assert all(("multimem.ld_reduce" in p) == (kernel == "pull_multimem") for p in (rms, ln, ln_nb))


#: The multimem pull kernel's LayerNorm variant, (H, rows per rank, extra keywords): the launcher's shapes at
#: 32 CTAs (the default), one-row tiles up to 32 shard rows, two from 64, r_max (4 rows at H=4096, 2 at 8192)
#: beyond. ``full``: the norm bias, a mid dtype and sharded residuals on top of the bias, weight and residual.
_FULL_LN = dict(has_norm_bias=True, mid_dtype=torch.bfloat16, residual_in_sharded=True, residual_out_sharded=True)


@requires_triton
@pytest.mark.parametrize("hidden,rows_per_rank,full", [
    (4096, 1, True), (4096, 32, False), (4096, 64, True), (4096, 1 << 19, False),
    (8192, 1, False), (8192, 32, True)],
    ids=["4096-1row-full", "4096-1row", "4096-2rows-full", "4096-4rows", "8192-1row", "8192-1row-full"])
def test_multimem_layernorm_variant_compiles_for_sm90_without_spilling(hidden, rows_per_rank, full):
    """``multimem``'s LayerNorm variant (USE_MULTIMEM, IS_LAYERNORM: the second pass over the tile in
    registers; HAS_NORM_BIAS where ``full``) compiles for sm_90 at the launcher's default shapes, with the
    multimem instructions, and fits the registers without spilling. It never runs (no multicast in this
    project): this is its check. Not listed, because they spill: H=8192's 2-row tiles (from 64 shard rows
    on; the RMSNorm kernel spills there too) and H=4096's 4-row tiles with a norm bias (docs/kernels.md)."""
    extra = _FULL_LN if full else {}
    asm = compile_variant_ptx("pull_multimem", torch.bfloat16, hidden, norm="layernorm", rows_per_rank=rows_per_rank,
                              return_all=True, **extra)
    ptx = asm["ptx"]
    assert ".target sm_90" in ptx and len(asm["cubin"]) > 0
    assert "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2" in ptx
    assert "multimem.st.relaxed.sys.global.v4.bf16x2" in ptx
    assert all(s == (0, 0) for s in _ptxas_spills(ptx))


@requires_triton
@pytest.mark.parametrize("world,hidden,dtype,rows", [
    (2, 4096, torch.bfloat16, 1), (3, 4096, torch.bfloat16, 1 << 19), (4, 8192, torch.bfloat16, 1 << 18),
    (3, 8192, torch.float32, 7), (8, 4096, torch.bfloat16, 1 << 17)])
def test_push_rank_order_variant_compiles_without_spilling(world, hidden, dtype, rows):
    """``batch_invariant``'s push kernel (RANK_ORDER: a pointer select per rank, the pipelined loop on
    one-row tiles) compiles for sm_90 without spilling, to other code than the default's at the same
    rows per rank, and the same code at every rows per rank (one shape)."""
    ptx = compile_variant_ptx("push", dtype, hidden, world_size=world, rows_per_rank=rows, comm_ctas=8,
                              residual_in_sharded=True, residual_out_sharded=True, batch_invariant=True)
    assert all(s == (0, 0) for s in _ptxas_spills(ptx))
    assert ptx != compile_variant_ptx("push", dtype, hidden, world_size=world, rows_per_rank=rows, comm_ctas=8,
                                      residual_in_sharded=True, residual_out_sharded=True)
    assert ptx == compile_variant_ptx("push", dtype, hidden, world_size=world, rows_per_rank=rows * 3 + 5,
                                      comm_ctas=32, residual_in_sharded=True, residual_out_sharded=True,
                                      batch_invariant=True)
    with pytest.raises(ValueError, match="only the push kernel"):
        compile_variant_ptx("pull", dtype, hidden, batch_invariant=True)
