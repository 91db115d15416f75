"""Tests for kernels/symm_mem_allreduce_rmsnorm.py (fused all-reduce + RMSNorm).

CPU (run everywhere; need triton where noted):
  * both variants compile to PTX + cubin for sm_90 with Triton's bundled ptxas;
    multimem PTX has ``multimem.ld_reduce``/``multimem.st``, p2p PTX has neither;
  * variant selection against fake symmetric-memory handles;
  * the float64 reference against a direct fp32 formula;
  * a multi-process simulation that runs the public launcher and the real p2p kernel
    under Triton's CPU interpreter (``TRITON_INTERPRET=1``), one process per rank, peer
    buffers and signal pads in shared memory (a CPU stand-in for the symmetric
    workspace): checks the math, sharding, masking, the zero-copy input path and that
    the signal pads pair up and reset themselves across back-to-back launches; plus a
    bit-exact round trip of the multimem addressing/pack/unpack helpers with plain
    loads standing in for the multimem instructions.

GPU (``-m gpu``, need >= 2 CUDA devices; never runs the multimem variant):
  correctness matrix, 1000 back-to-back calls, CUDA graph capture + replay.  Each test
  runs this file as a script in a subprocess that spawns 2 ranks (NCCL + symmetric
  memory) and is killed after a timeout.

Script mode:
  python tests/kernels/test_symm_mem_allreduce_rmsnorm.py --gpu-smoke      # quick subset
  python tests/kernels/test_symm_mem_allreduce_rmsnorm.py --gpu-suite all  # everything
  TRITON_INTERPRET=1 python tests/kernels/test_symm_mem_allreduce_rmsnorm.py --interp-sim
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import pytest
import torch

THIS_FILE = os.path.abspath(__file__)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))


def _import_kernel_module():
    # The package must be installed (pip install -e .): kernels/ installs as weave_compile.kernels.
    from weave_compile.kernels import symm_mem_allreduce_rmsnorm

    return symm_mem_allreduce_rmsnorm


mod = _import_kernel_module()
requires_triton = pytest.mark.skipif(not mod._HAS_TRITON, reason="triton not installed")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DT_NAME = {v: k for k, v in DTYPES.items()}


# ======================================================================================
# Shared case machinery (CPU simulation and GPU runs)
# ======================================================================================


def make_case(T, H, dtype="bf16", *, res="full", bias=True, weight=True, mid=None, woff=0.0,
              res_dtype=None, out_dtype=None, ctas=16, channel=0, seed=0):
    """res: 'none' | 'full' | 'shard_in' | 'shard_out' | 'shard_both'."""
    return dict(T=T, H=H, dtype=dtype, res=res, bias=bias, weight=weight, mid=mid, woff=woff,
                res_dtype=res_dtype, out_dtype=out_dtype, ctas=ctas, channel=channel, seed=seed)


def case_name(c) -> str:
    parts = [f"T={c['T']}", f"H={c['H']}", c["dtype"], f"res={c['res']}"]
    if not c["bias"]:
        parts.append("nobias")
    if not c["weight"]:
        parts.append("noweight")
    for k in ("mid", "res_dtype", "out_dtype"):
        if c[k]:
            parts.append(f"{k}={c[k]}")
    if c["woff"]:
        parts.append(f"woff={c['woff']}")
    parts.append(f"ctas={c['ctas']}")
    if c["channel"]:
        parts.append(f"ch={c['channel']}")
    return " ".join(parts)


def make_inputs(c, world, device):
    """Identical on every rank (same seed): all ranks' x, full residual, bias, weight."""
    g = torch.Generator(device=device).manual_seed(int(c["seed"]))
    T, H = c["T"], c["H"]
    dt = DTYPES[c["dtype"]]
    rdt = DTYPES[c["res_dtype"]] if c["res_dtype"] else dt

    def rnd(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    xs = [rnd(T, H, dtype=dt) for _ in range(world)]
    residual = rnd(T, H, dtype=rdt) if c["res"] != "none" else None
    bias = rnd(H, dtype=dt, scale=0.5) if c["bias"] else None
    weight = rnd(H, dtype=dt) if c["weight"] else None
    return xs, residual, bias, weight


def shard_rows(t, world, rank):
    """This rank's [S, H] shard of a [T, H] tensor, rows beyond T zero."""
    T, H = t.shape
    S = math.ceil(T / world)
    out = torch.zeros(S, H, dtype=t.dtype, device=t.device)
    lo, hi = rank * S, min(T, (rank + 1) * S)
    if hi > lo:
        out[: hi - lo] = t[lo:hi]
    return out


def kernel_kwargs(c):
    return dict(
        eps=1e-6,
        residual_dtype=DTYPES[c["res_dtype"]] if c["res_dtype"] else None,
        out_dtype=DTYPES[c["out_dtype"]] if c["out_dtype"] else None,
        mid_dtype=DTYPES[c["mid"]] if c["mid"] else None,
        weight_offset=c["woff"],
        residual_in_sharded=c["res"] in ("shard_in", "shard_both"),
        residual_out_sharded=c["res"] in ("shard_out", "shard_both"),
        num_ctas=c["ctas"],
        channel=c["channel"],
    )


def reference(c, xs, residual, bias, weight):
    kw = kernel_kwargs(c)
    dt = xs[0].dtype
    return mod.allreduce_rmsnorm_rows_ref(
        xs, residual, bias, weight, eps=kw["eps"],
        residual_dtype=kw["residual_dtype"] or (residual.dtype if residual is not None else dt),
        out_dtype=kw["out_dtype"] or dt, mid_dtype=kw["mid_dtype"],
        weight_offset=kw["weight_offset"])


def _tol(dtype):
    return (1e-4, 1e-4) if dtype == torch.float32 else (1.5e-2, 1.5e-2)


def _excess(a, b):
    """max(|a-b| - rtol*|b| - atol) <= 0 means close; also returns max |a-b|."""
    rtol, atol = _tol(b.dtype)
    a64, b64 = a.double(), b.double()
    if a64.numel() == 0:
        return 0.0, -1.0
    diff = (a64 - b64).abs()
    excess = (diff - rtol * b64.abs() - atol).max().item()
    if not torch.isfinite(a64).all():
        excess = float("inf")
    return diff.max().item(), excess


def check_outputs(c, world, rank, normed, res_out, ref_n, ref_r):
    """Returns (ok, err_normed, err_residual, message)."""
    T, H = c["T"], c["H"]
    S = math.ceil(T / world)
    msgs = []
    if tuple(normed.shape) != (T, H) or normed.dtype != ref_n.dtype:
        msgs.append(f"normed shape/dtype {tuple(normed.shape)}/{normed.dtype}")
        return False, float("nan"), float("nan"), "; ".join(msgs)
    en, xn = _excess(normed, ref_n)
    if xn > 0:
        msgs.append(f"normed mismatch (max err {en:.3g})")
    if c["res"] in ("shard_out", "shard_both"):
        if tuple(res_out.shape) != (S, H):
            return False, en, float("nan"), f"residual shard shape {tuple(res_out.shape)}"
        lo, hi = rank * S, min(T, (rank + 1) * S)
        n = max(0, hi - lo)
        er, xr = _excess(res_out[:n], ref_r[lo:hi])
        if n < S and not torch.equal(res_out[n:], torch.zeros_like(res_out[n:])):
            msgs.append("residual shard rows beyond T not zero")
    else:
        if tuple(res_out.shape) != (T, H):
            return False, en, float("nan"), f"residual shape {tuple(res_out.shape)}"
        er, xr = _excess(res_out, ref_r)
    if xr > 0:
        msgs.append(f"residual mismatch (max err {er:.3g})")
    if res_out.dtype != ref_r.dtype:
        msgs.append(f"residual dtype {res_out.dtype} != {ref_r.dtype}")
    return not msgs, en, er, "; ".join(msgs)


def spawn_ranks(fn, world, args, timeout):
    """torch.multiprocessing spawn with a deadline: kill our children when it passes."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world,) + tuple(args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + timeout
    while not ctx.join(timeout=2.0):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout} s")


def run_script(args, timeout, env=None):
    """Run this file as a script in its own session; kill the whole session on timeout."""
    proc = subprocess.Popen([sys.executable, THIS_FILE] + list(args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


# ======================================================================================
# CPU tests
# ======================================================================================


@requires_triton
@pytest.mark.parametrize("variant", ["p2p", "p2p_pull", "multimem"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_ptx_compiles_for_sm90(variant, dtype):
    asm = mod.compile_variant_ptx(variant, DTYPES[dtype], 4096, return_all=True)
    ptx = asm["ptx"]
    assert ".target sm_90" in ptx
    assert len(asm["cubin"]) > 0  # ptxas accepted it (inline multimem asm included)
    has_ld, has_st = "multimem.ld_reduce" in ptx, "multimem.st" in ptx
    if variant == "multimem":
        assert has_ld and has_st
        suffix = {"bf16": "acc::f32.v4.bf16x2", "fp16": "acc::f32.v4.f16x2", "fp32": "v4.f32"}
        assert f"multimem.ld_reduce.relaxed.sys.global.add.{suffix[dtype]}" in ptx
    elif variant == "p2p_pull":
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
@pytest.mark.parametrize("variant", ["p2p", "p2p_pull", "multimem"])
@pytest.mark.parametrize("kw", [
    dict(dtype=torch.bfloat16, hidden=5120, residual_in_sharded=True, residual_out_sharded=True),
    dict(dtype=torch.bfloat16, hidden=2048, residual_dtype=torch.float32,
         mid_dtype=torch.bfloat16),
    dict(dtype=torch.float32, hidden=8192, out_dtype=torch.bfloat16, has_bias=False,
         has_residual=False, has_weight=False),
    dict(dtype=torch.float16, hidden=16384, world_size=4, spin_limit=1 << 20),
], ids=["sharded-5120", "fp32res-mid", "fp32in-bf16out-bare", "fp16-16384-w4-spin"])
def test_ptx_compiles_flag_variants(variant, kw):
    kw = dict(kw)
    ptx = mod.compile_variant_ptx(variant, kw.pop("dtype"), kw.pop("hidden"), **kw)
    assert ("multimem.ld_reduce" in ptx) == (variant == "multimem")


@requires_triton
def test_compile_rejects_bad_args():
    with pytest.raises(ValueError):
        mod.compile_variant_ptx("nccl", torch.bfloat16, 4096)
    with pytest.raises(ValueError):
        mod.compile_variant_ptx("p2p", torch.bfloat16, 4100)


def _fake_handle(mc=0, world=2, ptrs=None):
    return SimpleNamespace(multicast_ptr=mc, world_size=world, rank=0,
                           buffer_ptrs=ptrs if ptrs is not None else [0x1000 * (i + 1)
                                                                      for i in range(world)])


@requires_triton
def test_select_p2p_without_multicast():
    v, why = mod.select_symm_variant("g", "cpu", torch.bfloat16, 4096, handle=_fake_handle(0))
    assert v == "p2p", why


@requires_triton
def test_select_multimem_only_with_multicast():
    v, why = mod.select_symm_variant("g", "cpu", torch.bfloat16, 4096,
                                     handle=_fake_handle(0x7F0000000000))
    assert v == "multimem", why
    for dt in (torch.float16, torch.float32):
        assert mod.select_symm_variant("g", "cpu", dt, 8192,
                                       handle=_fake_handle(0x7F0000000000))[0] == "multimem"


@requires_triton
@pytest.mark.parametrize("dtype,hidden", [
    (torch.bfloat16, 4100),  # not a multiple of 8
    (torch.float16, 4092),  # multiple of 4 only
    (torch.float32, 4098),  # not a multiple of 4
    (torch.bfloat16, 32768),  # row does not fit in registers
    (torch.bfloat16, 0),
])
def test_select_rejects_bad_hidden(dtype, hidden):
    for mc in (0, 0x7F0000000000):
        v, why = mod.select_symm_variant("g", "cpu", dtype, hidden, handle=_fake_handle(mc))
        assert v is None and "hidden" in why


@requires_triton
def test_select_fp32_vector_width_is_4():
    assert mod.vector_width(torch.float32) == 4 and mod.vector_width(torch.bfloat16) == 8
    v, why = mod.select_symm_variant("g", "cpu", torch.float32, 4100, handle=_fake_handle(0))
    assert v == "p2p", why


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_select_rejects_bad_dtype(dtype):
    v, why = mod.select_symm_variant("g", "cpu", dtype, 4096, handle=_fake_handle(0x7F00))
    assert v is None and "dtype" in why


@requires_triton
def test_select_rejects_unmapped_peers_and_big_worlds():
    v, why = mod.select_symm_variant("g", "cpu", torch.bfloat16, 4096,
                                     handle=_fake_handle(0, 2, [0x1000, 0]))
    assert v is None and "P2P" in why
    v, why = mod.select_symm_variant("g", "cpu", torch.bfloat16, 4096,
                                     handle=_fake_handle(0, 16))
    assert v is None and "world size" in why


def test_select_without_distributed_is_none():
    if not mod._HAS_TRITON:
        pytest.skip("triton not installed")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised")
    v, why = mod.select_symm_variant("g", "cuda", torch.bfloat16, 4096)
    assert v is None and why


def test_launch_meta_is_rank_independent_and_covers_rows():
    for H in (64, 2048, 4096, 5120, 8192, 16384):
        for S in (1, 3, 4, 64, 500, 2048, 8192):
            for ctas in (1, 2, 4, 8, 16, 32):
                m = mod._launch_meta(H, S, ctas)
                assert 1 <= m.grid <= ctas
                assert m.block_rows & (m.block_rows - 1) == 0 and 1 <= m.block_rows <= 8
                assert m.grid * m.block_rows >= min(S, ctas * m.block_rows)
                assert m.block_h >= H and m.block_h & (m.block_h - 1) == 0
                # every shard row is visited exactly once by the grid-stride loop
                seen = sorted(i0 + k for pid in range(m.grid)
                              for i0 in range(pid * m.block_rows, S, m.grid * m.block_rows)
                              for k in range(m.block_rows) if i0 + k < S)
                assert seen == list(range(S))


def test_signal_pad_budget():
    for world in (1, 2, 4, 8):
        def end(ch):
            return (mod.pad_offset_for(ch, world) + mod._MAX_CTAS * world) * 4

        assert end(0) <= 2048  # older PyTorch's fixed 2048-byte pad: channel 0 fits
        assert end(1) <= 9216 and end(7) <= 9216  # newer default (32 * 72 * 4 bytes)
        # above PyTorch's own slots (block * N + rank, up to 32 blocks); no overlap
        assert mod.pad_offset_for(0, world) >= 32 * world
        assert mod.pad_offset_for(1, world) >= mod.pad_offset_for(0, world) + 32 * world


def _direct_fp32(xs, residual, bias, weight, eps, residual_dtype, out_dtype, mid_dtype,
                 weight_offset):
    """The op as a model would write it (fp32, HF style)."""
    h = torch.stack([x.float() for x in xs]).sum(0)
    if bias is not None:
        h = h + bias.float()
    if residual is not None:
        h = h + residual.float()
    res = h.to(residual_dtype)
    hf = res.float()
    var = hf.pow(2).mean(-1, keepdim=True)
    y = hf * torch.rsqrt(var + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).float()
    if weight is not None:
        y = (weight.float() + weight_offset) * y
    return y.to(out_dtype), res


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("res", ["full", "none"])
@pytest.mark.parametrize("extras", ["plain", "mid", "gemma", "fp32res", "nobias"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_reference_matches_direct_formula(dtype, res, extras, world):
    c = make_case(37, 96, dtype, res=res, bias=extras != "nobias",
                  mid="bf16" if extras == "mid" else None,
                  woff=1.0 if extras == "gemma" else 0.0,
                  res_dtype="fp32" if extras == "fp32res" else None, seed=world * 7 + 1)
    xs, residual, bias, weight = make_inputs(c, world, "cpu")
    ref_n, ref_r = reference(c, xs, residual, bias, weight)
    kw = kernel_kwargs(c)
    dt = DTYPES[dtype]
    rdt = kw["residual_dtype"] or (residual.dtype if residual is not None else dt)
    d_n, d_r = _direct_fp32(xs, residual, bias, weight, kw["eps"], rdt, kw["out_dtype"] or dt,
                            kw["mid_dtype"], kw["weight_offset"])
    assert ref_n.dtype == d_n.dtype and ref_r.dtype == d_r.dtype == rdt
    assert ref_n.shape == (37, 96) and ref_r.shape == (37, 96)
    tol_r = 1e-5 if rdt == torch.float32 else 1e-2
    torch.testing.assert_close(ref_r.double(), d_r.double(), rtol=tol_r, atol=tol_r)
    tol_n = 1e-4 if (ref_n.dtype == torch.float32 and not kw["mid_dtype"]) else 2e-2
    torch.testing.assert_close(ref_n.double(), d_n.double(), rtol=tol_n, atol=tol_n)


def test_reference_semantics_small_exact():
    # hand-checkable: two ranks, one row, H=4, fp32 everywhere
    xs = [torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[1.0, 0.0, -1.0, 0.0]])]
    res = torch.tensor([[0.0, 0.0, 0.0, 4.0]])
    bias = torch.tensor([1.0, 1.0, 1.0, 1.0])
    w = torch.tensor([1.0, 2.0, 0.5, 0.0])
    n, r = mod.allreduce_rmsnorm_rows_ref(xs, res, bias, w, eps=0.0, weight_offset=1.0)
    assert torch.equal(r, torch.tensor([[3.0, 3.0, 3.0, 9.0]]))
    rms = math.sqrt((9 + 9 + 9 + 81) / 4)
    expect = torch.tensor([[3 / rms * 2, 3 / rms * 3, 3 / rms * 1.5, 9 / rms * 1]])
    torch.testing.assert_close(n, expect)


@requires_triton
@pytest.mark.parametrize("world", [2, 3])
def test_kernel_in_cpu_interpreter(world):
    """Runs the real p2p kernel under TRITON_INTERPRET=1, one process per rank, and the
    multimem pack/unpack/addressing helpers with plain loads standing in for multimem."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    rc, out = run_script(["--interp-sim", "--world", str(world)], timeout=900, env=env)
    assert rc == 0, out[-8000:]
    assert "INTERP-SIM OK" in out, out[-8000:]


# ======================================================================================
# CPU interpreter simulation (script mode: --interp-sim)
# ======================================================================================

SIM_CASES = [
    make_case(7, 64, "bf16", seed=1),
    make_case(1, 64, "fp32", res="none", bias=False, seed=2),  # T < world
    make_case(37, 32, "fp16", res="shard_both", mid="bf16", woff=1.0, ctas=4, seed=3),
    make_case(40, 48, "fp32", out_dtype="bf16", res_dtype="fp32", res="shard_in", ctas=3,
              channel=1, seed=4),  # non-pow2 H, mixed dtypes, channel 1
    make_case(23, 64, "bf16", res="shard_out", weight=False, ctas=2, seed=5),
    make_case(64, 16, "bf16", res_dtype="fp32", mid="bf16", ctas=2, seed=6),  # 8 rows / CTA
]
SIM_REPEATS = 2  # every case twice in a row with fresh data: pads must reset


def _sim_worker(rank, world, pools, status, barrier, failures):
    torch.set_num_threads(1)
    m = mod
    assert os.environ.get("TRITON_INTERPRET") == "1"
    pin, pout, pres, pads = pools
    for ci, c0 in enumerate(SIM_CASES * SIM_REPEATS):
        c = dict(c0, seed=c0["seed"] * 1000 + ci)
        T, H = c["T"], c["H"]
        S = math.ceil(T / world)
        cap = S * world
        xs, residual, bias, weight = make_inputs(c, world, "cpu")
        kw = kernel_kwargs(c)
        dt = xs[0].dtype
        odt = kw["out_dtype"] or dt
        rdt = kw["residual_dtype"] or (residual.dtype if residual is not None else dt)

        def region(pool, dtype):
            n = cap * H * torch.empty((), dtype=dtype).element_size()
            return pool[:n].view(dtype).view(cap, H)

        inp = [region(pin[p], dt) for p in range(world)]
        out = [region(pout[p], odt) for p in range(world)]
        res = [region(pres[p], rdt) for p in range(world)]
        # Only touch our own buffers, and only between our own launches.
        inp[rank][T:].fill_(float("nan"))
        out[rank].fill_(float("nan"))
        res[rank].fill_(float("nan"))
        table = ([t.data_ptr() for t in inp] + [t.data_ptr() for t in out] +
                 [t.data_ptr() for t in res] + [p.data_ptr() for p in pads] + [0, 0, 0])
        ws = m.SymmWorkspace(
            group_name="sim", device=torch.device("cpu"), in_dtype=dt, out_dtype=odt,
            res_dtype=rdt, hidden=H, channel=c["channel"], capacity=cap, rank=rank,
            world_size=world, buffer=pin[rank], handle=None, inp=inp[rank], out=out[rank],
            res=res[rank], ptr_table=torch.tensor(table, dtype=torch.int64),
            status=status[rank], multicast_ptr=0,
            pad_offset=m.pad_offset_for(c["channel"], world))
        m.get_workspace = lambda *a, **k: ws  # the CPU stand-in for the symmetric buffers
        res_in = None
        if residual is not None:
            res_in = shard_rows(residual, world, rank) if kw["residual_in_sharded"] else residual
        x = xs[rank]
        # Odd launches: the pull kernel with the zero-copy input path (x already is the
        # symmetric input buffer); even launches: the push kernel.
        variant = "p2p_pull" if ci % 2 else "p2p"
        if ci % 2:
            ws.inp[:T].copy_(x)
            x = ws.inp[:T]
        normed, res_out = m.fused_allreduce_rmsnorm_symm(
            x, res_in, bias, weight, group_name="sim", variant=variant, **kw)
        ref_n, ref_r = reference(c, xs, residual, bias, weight)
        ok, en, er, msg = check_outputs(c, world, rank, normed, res_out, ref_n, ref_r)
        print(f"[rank {rank}] {variant:8s} {case_name(c):60s} {'ok' if ok else 'FAIL'} "
              f"err_n={en:.2e} err_r={er:.2e} {msg}", flush=True)
        if not ok:
            failures[rank] += 1
    barrier.wait()  # everybody is done: no signal can be in flight any more
    if int(status[rank].item()) != 0:
        print(f"[rank {rank}] barrier timeouts: {int(status[rank].item())}", flush=True)
        failures[rank] += 1
    if int(pads[rank].abs().sum().item()) != 0:
        nz = torch.nonzero(pads[rank]).flatten().tolist()
        print(f"[rank {rank}] signal pad not reset: slots {nz}", flush=True)
        failures[rank] += 1


if mod._HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mm_emulation_kernel(src_addr, dst_addr, VALS, num_rows, DTYPE: tl.constexpr,
                             HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr, VEC: tl.constexpr):
        """The multimem path with plain 32-bit loads/stores standing in for
        ``multimem.ld_reduce`` / ``multimem.st`` (one rank): addressing, predication,
        unpack and pack.  Runs under TRITON_INTERPRET=1."""
        rows = tl.arange(0, BLOCK_ROWS).to(tl.int64)
        row_ok = rows < num_rows
        addr, pred = mod._mm_vec_addr(src_addr, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        ok = pred != 0
        u0 = tl.load((addr + 0).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        u1 = tl.load((addr + 4).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        u2 = tl.load((addr + 8).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        u3 = tl.load((addr + 12).to(tl.pointer_type(tl.uint32)), mask=ok, other=0)
        vals = mod._mm_unpack(u0, u1, u2, u3, DTYPE, BLOCK_H, BLOCK_ROWS, VEC)
        r = tl.arange(0, BLOCK_ROWS)
        c = tl.arange(0, BLOCK_H)
        tl.store(VALS + r[:, None] * BLOCK_H + c[None, :], vals)
        w0, w1, w2, w3 = mod._mm_pack(vals.to(DTYPE), DTYPE, BLOCK_H, BLOCK_ROWS, VEC)
        daddr, _ = mod._mm_vec_addr(dst_addr, rows, row_ok, HIDDEN, BLOCK_H, VEC)
        tl.store((daddr + 0).to(tl.pointer_type(tl.uint32)), w0, mask=ok)
        tl.store((daddr + 4).to(tl.pointer_type(tl.uint32)), w1, mask=ok)
        tl.store((daddr + 8).to(tl.pointer_type(tl.uint32)), w2, mask=ok)
        tl.store((daddr + 12).to(tl.pointer_type(tl.uint32)), w3, mask=ok)


def interp_multimem_packing_check() -> int:
    """Bit-exact round trip of the multimem helpers for every dtype, incl. masking."""
    fails = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        vec = mod.vector_width(dt)
        for hidden, block_rows, num_rows in ((40, 4, 3), (64, 2, 2), (8 * vec, 1, 1)):
            block_h = mod._next_pow2(hidden)
            src = torch.randn(block_rows, hidden).to(dt)
            dst = torch.full((block_rows, hidden), -7.0, dtype=dt)
            vals = torch.full((block_rows, block_h), float("nan"))
            _mm_emulation_kernel[(1,)](src.data_ptr(), dst.data_ptr(), vals, num_rows,
                                       DTYPE=mod._tl_dtype(dt), HIDDEN=hidden,
                                       BLOCK_H=block_h, BLOCK_ROWS=block_rows, VEC=vec)
            want = torch.zeros(block_rows, block_h)
            want[:num_rows, :hidden] = src[:num_rows].float()
            ok = torch.equal(vals, want)
            ok &= torch.equal(dst[:num_rows].view(torch.uint8), src[:num_rows].view(torch.uint8))
            ok &= bool((dst[num_rows:] == -7.0).all())
            print(f"multimem pack/unpack {DT_NAME[dt]} H={hidden} rows={num_rows}/{block_rows}: "
                  f"{'ok' if ok else 'FAIL'}")
            fails += not ok
    return fails


def interp_sim_main(world: int) -> int:
    import torch.multiprocessing as mp

    os.environ.setdefault(mod._ENV_SPIN_LIMIT, str(1 << 22))
    max_bytes = max(math.ceil(c["T"] / world) * world * c["H"] * 4 for c in SIM_CASES)
    pools = tuple([torch.zeros(max_bytes, dtype=torch.uint8).share_memory_()
                   for _ in range(world)] for _ in range(3))
    pads = [torch.zeros(4096, dtype=torch.int32).share_memory_() for _ in range(world)]
    status = [torch.zeros(1, dtype=torch.int32).share_memory_() for _ in range(world)]
    failures = torch.zeros(world, dtype=torch.int64).share_memory_()
    barrier = mp.get_context("spawn").Barrier(world)
    t0 = time.time()
    pack_fails = interp_multimem_packing_check()
    spawn_ranks(_sim_worker, world, (pools + (pads,), status, barrier, failures), timeout=800)
    nfail = int(failures.sum().item()) + pack_fails
    print(f"world={world}: {len(SIM_CASES) * SIM_REPEATS} launches per rank, "
          f"{nfail} failures, {time.time() - t0:.1f} s")
    if nfail == 0:
        print("INTERP-SIM OK")
    return 0 if nfail == 0 else 1


# ======================================================================================
# GPU tests (2 ranks, NCCL + symmetric memory, p2p variant only)
# ======================================================================================

_two_gpus = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
    reason="needs >= 2 CUDA GPUs")


def gpu_matrix_cases(smoke=False):
    if smoke:
        cs = [make_case(T, 4096, "bf16", seed=T) for T in (1, 7, 1000, 4096)]
        cs += [make_case(16384, 8192, "fp16", res="shard_both", seed=11),
               make_case(128, 2048, "fp32", seed=12),
               make_case(128, 4096, "bf16", res_dtype="fp32", mid="bf16", woff=1.0, seed=13),
               make_case(1000, 4096, "bf16", res="shard_out", ctas=32, channel=1, seed=14)]
        return cs
    cs = []
    for dt in ("bf16", "fp16", "fp32"):
        for H in (2048, 4096, 8192):
            for T in (1, 7, 128, 1000, 4096, 16384):
                cs.append(make_case(T, H, dt, seed=len(cs) + 1))
    for T in (7, 1000):
        for res in ("shard_in", "shard_out", "shard_both", "none"):
            cs.append(make_case(T, 4096, "bf16", res=res, seed=len(cs) + 1))
    cs += [
        make_case(128, 4096, "bf16", bias=False, weight=False, seed=101),
        make_case(128, 4096, "bf16", res_dtype="fp32", mid="bf16", seed=102),  # HF Llama
        make_case(1000, 4096, "bf16", woff=1.0, seed=103),  # Gemma
        make_case(1000, 8192, "fp32", out_dtype="bf16", seed=104),
        make_case(4096, 4096, "bf16", ctas=2, seed=105),
        make_case(4096, 4096, "bf16", ctas=32, channel=1, seed=106),
        make_case(333, 5120, "bf16", res="shard_both", ctas=8, seed=107),  # non-pow2 H
    ]
    return cs


def _gpu_setup(rank, world, port):
    # Our test processes never need NVLink multicast: make sure torch does not create it.
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault(mod._ENV_SPIN_LIMIT, str(1 << 26))
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    group_name = dist.group.WORLD.group_name
    variant, reason = mod.select_symm_variant(group_name, dev, torch.bfloat16, 4096)
    return dist, dev, group_name, variant, reason


def _run_gpu_case(c, world, rank, dev, group_name, rows):
    xs, residual, bias, weight = make_inputs(c, world, dev)
    kw = kernel_kwargs(c)
    dt = xs[0].dtype
    ws = mod.reserve(group_name, dt, c["H"], c["T"], out_dtype=kw["out_dtype"] or dt,
                     residual_dtype=kw["residual_dtype"] or (
                         residual.dtype if residual is not None else dt),
                     channel=c["channel"], device=dev)
    ws.out.fill_(float("nan"))  # poison: every row must be rewritten
    ws.res.fill_(float("nan"))
    ws.inp[c["T"]:].fill_(float("nan"))  # padded rows must never be read
    res_in = residual
    if residual is not None and kw["residual_in_sharded"]:
        res_in = shard_rows(residual, world, rank)
    t0 = time.time()
    normed, res_out = mod.fused_allreduce_rmsnorm_symm(
        xs[rank], res_in, bias, weight, group_name=group_name, variant="p2p", **kw)
    torch.cuda.synchronize()
    dt_ms = (time.time() - t0) * 1e3
    ref_n, ref_r = reference(c, xs, residual, bias, weight)
    ok, en, er, msg = check_outputs(c, world, rank, normed, res_out, ref_n, ref_r)
    timeouts = ws.check_status()
    if timeouts:
        ok, msg = False, msg + f"; {timeouts} barrier timeouts"
    rows.append(dict(case=case_name(c), ok=ok, err_n=en, err_r=er, ms=dt_ms, msg=msg))
    del xs, residual, ref_n, ref_r, normed, res_out


def _suite_back_to_back(world, rank, dev, group_name, rows, n_calls=1000):
    H, Ts = 4096, (512, 77, 1)
    dt = torch.bfloat16
    mod.reserve(group_name, dt, H, max(Ts), device=dev)
    # The same weight on every rank (as in a real TP model): seeded, not per-rank random.
    weight = torch.randn(H, device=dev, generator=torch.Generator(device=dev).manual_seed(H)).to(dt)
    bad, checked, worst = 0, 0, 0.0
    t0 = time.time()
    for i in range(n_calls):
        T = Ts[i % len(Ts)]
        check = i % 100 == 0 or i == n_calls - 1
        c = make_case(T, H, "bf16", bias=False, seed=10_000 + i)
        if check:
            xs, residual, _, _ = make_inputs(c, world, dev)
            x = xs[rank]
        else:  # fresh data, only our own (cheap); values are not checked
            g = torch.Generator(device=dev).manual_seed(rank * 1_000_003 + i)
            x = torch.randn(T, H, generator=g, device=dev).to(dt)
            residual = torch.randn(T, H, generator=g, device=dev).to(dt)
        normed, res_out = mod.fused_allreduce_rmsnorm_symm(
            x, residual, None, weight, eps=1e-6, group_name=group_name, variant="p2p")
        if check:
            ref_n, ref_r = mod.allreduce_rmsnorm_rows_ref(xs, residual, None, weight, eps=1e-6)
            ok, en, er, msg = check_outputs(c, world, rank, normed, res_out, ref_n, ref_r)
            checked += 1
            worst = max(worst, en, er)
            bad += not ok
    torch.cuda.synchronize()
    ws = mod.get_workspace(group_name, dt, H, max(Ts), device=dev)
    timeouts = ws.check_status()
    rows.append(dict(case=f"{n_calls} back-to-back calls (T cycling {Ts})",
                     ok=bad == 0 and timeouts == 0, err_n=worst, err_r=worst,
                     ms=(time.time() - t0) * 1e3,
                     msg=f"{checked} checked, {bad} bad, {timeouts} timeouts"))


def _suite_cuda_graph(world, rank, dev, group_name, rows, replays=5):
    H, T = 4096, 300
    dt = torch.bfloat16
    mod.reserve(group_name, dt, H, 1024, device=dev)
    c0 = make_case(T, H, "bf16", bias=False, seed=777)
    xs, residual, _, weight = make_inputs(c0, world, dev)
    x_static, r_static = xs[rank].clone(), residual.clone()
    kw = dict(eps=1e-6, group_name=group_name, variant="p2p")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compiles and loads the kernel outside capture
        mod.fused_allreduce_rmsnorm_symm(x_static, r_static, None, weight, **kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        n_out, r_out = mod.fused_allreduce_rmsnorm_symm(x_static, r_static, None, weight, **kw)
    bad, worst = 0, 0.0
    t0 = time.time()
    for k in range(replays):
        c = make_case(T, H, "bf16", bias=False, seed=900 + k)
        xs, residual, _, _ = make_inputs(c, world, dev)
        x_static.copy_(xs[rank])
        r_static.copy_(residual)
        g.replay()
        ref_n, ref_r = mod.allreduce_rmsnorm_rows_ref(xs, residual, None, weight, eps=1e-6)
        ok, en, er, msg = check_outputs(c, world, rank, n_out, r_out, ref_n, ref_r)
        bad += not ok
        worst = max(worst, en, er)
        # eager launches on the same channel between replays keep the pads in step
        ce = make_case(41, H, "bf16", bias=False, seed=950 + k)
        xe, re_, _, _ = make_inputs(ce, world, dev)
        ne, rre = mod.fused_allreduce_rmsnorm_symm(xe[rank], re_, None, weight, **kw)
        ref_ne, ref_re = mod.allreduce_rmsnorm_rows_ref(xe, re_, None, weight, eps=1e-6)
        ok2, en2, er2, _ = check_outputs(ce, world, rank, ne, rre, ref_ne, ref_re)
        bad += not ok2
    # capture with a workspace that is too small must refuse, not overflow
    refused = False
    too_many = mod.get_workspace(group_name, dt, H, T, device=dev).capacity + world
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g2):
            big = torch.empty(too_many, H, dtype=dt, device=dev)
            try:
                mod.fused_allreduce_rmsnorm_symm(big, None, None, weight, **kw)
            except mod.SymmCapacityError:
                refused = True
    except Exception as e:  # capture may also be invalidated; only the refusal matters
        rows.append(dict(case="capture overflow check", ok=refused, err_n=0, err_r=0, ms=0,
                         msg=f"capture raised {type(e).__name__}"))
    torch.cuda.synchronize()
    timeouts = mod.get_workspace(group_name, dt, H, T, device=dev).check_status()
    rows.append(dict(case=f"CUDA graph: {replays} replays + eager interleaved", ok=bad == 0 and
                     timeouts == 0 and refused, err_n=worst, err_r=worst,
                     ms=(time.time() - t0) * 1e3,
                     msg=f"{bad} bad, {timeouts} timeouts, overflow refused={refused}"))


def _gpu_worker(rank, world, port, suite, out_dir):
    rows, info = [], {}
    try:
        dist, dev, group_name, variant, reason = _gpu_setup(rank, world, port)
        info = dict(variant=variant, reason=reason, gpu=torch.cuda.get_device_name(dev),
                    torch=torch.__version__)
        if variant is None:
            rows.append(dict(case="select_symm_variant", ok=False, err_n=0, err_r=0, ms=0,
                             msg=reason))
        else:
            if variant == "multimem":
                # Never run multimem on shared machines: p2p only, and say so.
                info["note"] = "multicast present: multimem NOT exercised (policy)"
            else:
                rows.append(dict(case="select_symm_variant -> p2p", ok=variant == "p2p",
                                 err_n=0, err_r=0, ms=0, msg=reason))
            if suite in ("smoke", "matrix", "all"):
                for c in gpu_matrix_cases(smoke=suite == "smoke"):
                    _run_gpu_case(c, world, rank, dev, group_name, rows)
            if suite in ("smoke", "b2b", "all"):
                _suite_back_to_back(world, rank, dev, group_name, rows,
                                    n_calls=200 if suite == "smoke" else 1000)
            if suite in ("smoke", "graph", "all"):
                _suite_cuda_graph(world, rank, dev, group_name, rows)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # record, then fail the rank
        import traceback

        rows.append(dict(case="exception", ok=False, err_n=0, err_r=0, ms=0,
                         msg=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        raise
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(dict(info=info, rows=rows), f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_main(suite: str, timeout: float) -> int:
    world = 2
    if torch.cuda.device_count() < world:
        print(f"need {world} GPUs, found {torch.cuda.device_count()}")
        return 2
    # Inherited by the rank processes before they import torch: they never need NVLink
    # multicast, so torch must not create multicast objects there.
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    out_dir = tempfile.mkdtemp(prefix="symm_arn_")
    t0 = time.time()
    err = None
    try:
        spawn_ranks(_gpu_worker, world, (_free_port(), suite, out_dir), timeout=timeout)
    except Exception as e:
        err = e
    results = []
    for r in range(world):
        p = os.path.join(out_dir, f"rank{r}.json")
        results.append(json.load(open(p)) if os.path.exists(p) else dict(info={}, rows=[]))
    info = results[0]["info"]
    print(f"# symm all-reduce+RMSNorm GPU suite '{suite}': {info.get('gpu')} x{world}, "
          f"torch {info.get('torch')}, variant {info.get('variant')} ({info.get('reason')})")
    if info.get("note"):
        print(f"# NOTE: {info['note']}")
    print(f"{'case':70s} {'rank0':5s} {'rank1':5s} {'err_normed':>10s} {'err_resid':>10s} "
          f"{'ms':>8s}")
    all_ok = err is None
    n = max(len(res["rows"]) for res in results)
    for i in range(n):
        rs = [res["rows"][i] if i < len(res["rows"]) else None for res in results]
        base = next(r for r in rs if r is not None)
        oks = ["ok" if (r and r["ok"]) else "FAIL" for r in rs]
        all_ok &= all(o == "ok" for o in oks)
        print(f"{base['case'][:70]:70s} {oks[0]:5s} {oks[1]:5s} {base['err_n']:10.2e} "
              f"{base['err_r']:10.2e} {base['ms']:8.1f}")
        for r in rs:
            if r is not None and not r["ok"] and r["msg"]:
                print(f"    -> {r['msg']}")
    if err is not None:
        print(f"# ERROR: {type(err).__name__}: {err}")
    print(f"# {'PASS' if all_ok else 'FAIL'} in {time.time() - t0:.1f} s")
    return 0 if all_ok else 1


@pytest.mark.gpu
@_two_gpus
@pytest.mark.parametrize("suite", ["matrix", "b2b", "graph"])
def test_gpu_two_ranks(suite):
    rc, out = run_script(["--gpu-suite", suite, "--timeout", "300"], timeout=330)
    print(out)
    assert rc == 0, out[-8000:]
    assert "# PASS" in out


# ======================================================================================
# Script entry point
# ======================================================================================

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-smoke", action="store_true", help="quick 2-GPU subset")
    ap.add_argument("--gpu-suite", choices=["smoke", "matrix", "b2b", "graph", "all"])
    ap.add_argument("--interp-sim", action="store_true",
                    help="CPU simulation under TRITON_INTERPRET=1")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    if a.interp_sim:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("set TRITON_INTERPRET=1 for --interp-sim")
        sys.exit(interp_sim_main(a.world))
    if a.gpu_smoke or a.gpu_suite:
        sys.exit(gpu_main("smoke" if a.gpu_smoke else a.gpu_suite, a.timeout))
    ap.print_help()
