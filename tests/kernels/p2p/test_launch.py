"""Tests for kernels/p2p/launch.py: launch shapes, and the launchers on simulated and real ranks.

CPU (need triton):
  * launch shapes are rank independent and visit every shard row once;
  * a multi-process simulation that runs the direct call and the real push kernel (and the
    pull kernel through ``weave_compile.testing.ptx.p2p_pull``, with the zero-copy input path)
    under Triton's CPU interpreter (``TRITON_INTERPRET=1``), one process per rank, peer
    buffers and signal pads in shared memory (a CPU stand-in for the symmetric workspace):
    checks the math, sharding, masking, and that the signal pads pair up and reset
    themselves across back-to-back launches; then the pull kernel's LayerNorm variant (the
    ``multimem`` kernel's, with peer loads and stores) on LayerNorm cases, every rank's
    outputs checked against the float64 oracle by ``tests/kernels/_layernorm_cases.py``.

GPU (``-m gpu``, need >= 2 CUDA devices; never runs the multimem kernel):
  correctness matrix, 1000 back-to-back calls, CUDA graph capture + replay.  Each test runs
  this file as a script in a subprocess that spawns 2 ranks (NCCL + symmetric memory) and is
  killed after a timeout.  One-GPU tests of the push kernel (emulated ranks): test_push.py.

Script mode:
  python tests/kernels/p2p/test_launch.py --gpu-smoke      # quick subset
  python tests/kernels/p2p/test_launch.py --gpu-suite all  # everything
  TRITON_INTERPRET=1 python tests/kernels/p2p/test_launch.py --interp-sim
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time

import pytest
import torch

THIS_FILE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))))  # script mode

from tests.kernels import _layernorm_cases as lc  # noqa: E402
from tests.kernels._symm_cases import (case_name, check_outputs, eps_args, kernel_kwargs,  # noqa: E402
                                       make_case, make_inputs, reference, rows_ref, run_script, shard_rows,
                                       sharding, spawn_ranks)
from weave_compile import kernels  # noqa: E402
from weave_compile.kernels.p2p import launch  # noqa: E402
from weave_compile.kernels.shared import probe, symm_call, workspace  # noqa: E402
from weave_compile.kernels.shared.common import ENV_SPIN_LIMIT, HAS_TRITON  # noqa: E402
from weave_compile.kernels.shared.shapes import launch_meta  # noqa: E402
from weave_compile.kernels.shared.sync import pad_offset_for  # noqa: E402
from weave_compile.kernels.shared.workspace import build_ptr_table  # noqa: E402
from weave_compile.kernels.spec import FusedSpec, Rows  # noqa: E402
from weave_compile.testing.emulated_ranks import interpreter_compat  # noqa: E402
from weave_compile.testing.ptx import p2p_pull  # noqa: E402

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def test_launch_meta_is_rank_independent_and_covers_rows():
    for H in (64, 2048, 4096, 5120, 8192, 16384):
        for S in (1, 3, 4, 64, 500, 2048, 8192):
            for ctas in (1, 2, 4, 8, 16, 32):
                m = launch_meta(H, S, ctas)
                assert 1 <= m.grid <= ctas
                assert m.block_rows & (m.block_rows - 1) == 0 and 1 <= m.block_rows <= 8
                assert m.grid * m.block_rows >= min(S, ctas * m.block_rows)
                assert m.block_h >= H and m.block_h & (m.block_h - 1) == 0
                # every shard row is visited exactly once by the grid-stride loop
                seen = sorted(i0 + k for pid in range(m.grid)
                              for i0 in range(pid * m.block_rows, S, m.grid * m.block_rows)
                              for k in range(m.block_rows) if i0 + k < S)
                assert seen == list(range(S))


def test_push_meta_is_rank_independent_fits_and_covers_rows():
    for H in (64, 2048, 4096, 5120, 8192, 16384):
        for S in (1, 3, 4, 64, 500, 2048, 8192):
            for ctas in (1, 2, 4, 8, 16, 32):
                for world, nbytes, meta in ((2, 2, launch.push_meta), (3, 2, launch.push_meta),
                                            (8, 4, launch.push_meta), (8, 2, launch.push_meta),
                                            (2, 2, launch.pipelined_meta)):
                    m = meta(H, S, ctas, world, nbytes, nbytes)
                    assert m == meta(H, S, ctas, world, nbytes, nbytes)
                    if m.norm_prefetch:  # two tiles of every input fit the registers (the model)
                        e = m.block_rows * m.block_h // (32 * m.num_warps)
                        inputs = 1 + launch.next_pow2(world - 1) + 1
                        assert 1 <= e <= 32 and m.num_warps in (1, 2, 4, 8, 16, 32)
                        assert 2 * inputs * e * nbytes / 4 + 2 * e + 40 <= min(255, 2048 // m.num_warps)
                    if m.norm_chunk:  # one warp per row: only where the kept row fits (the model)
                        assert world == 2 and nbytes == 2 and 2048 <= H and H * nbytes <= 8192
                        assert math.ceil(S / ctas) >= launch.ROWWISE_WARPS  # no idle warps
                        assert m.block_rows * m.norm_unroll == m.num_warps == launch.ROWWISE_WARPS
                        assert (m.norm_chunk, m.norm_depth) == (launch.ROWWISE_CHUNK, launch.PUSH_ROWWISE_DEPTH)
                    assert 1 <= m.grid <= ctas and m.block_h >= H
                    for n in (m.block_rows, m.copy_unroll, m.norm_unroll):
                        assert 1 <= n <= 8 and n & (n - 1) == 0  # tl.arange needs powers of 2
                    assert 1 <= m.norm_stages <= 3
                    # the staged loads of one add+norm iteration fit the shared-memory budget
                    tile = m.block_rows * m.block_h
                    assert m.norm_stages == 1 or m.norm_stages * tile * (world * nbytes + nbytes) <= 160 * 1024
                    # every shard row is visited exactly once by every unrolled grid-stride
                    # loop, and by the same CTA whatever the unrolling (the barriers pair CTAs)
                    owner = {}
                    for unroll in (1, m.copy_unroll, m.norm_unroll):
                        step = m.grid * m.block_rows
                        seen = {}
                        for pid in range(m.grid):
                            for j0 in range(pid * m.block_rows, S, step * unroll):
                                for u in range(unroll):
                                    for i in range(m.block_rows):
                                        j = j0 + u * step + i
                                        if j < S:
                                            assert j not in seen
                                            seen[j] = pid
                        assert sorted(seen) == list(range(S))
                        assert owner.setdefault("pid", seen) == seen
    # the shape measured fastest at H=4096, bf16, 2 ranks, 8 and 32 CTAs (one H200,
    # docs/performance.md): 2-row copy tiles, 4 of them (64 KB) in flight per copy iteration; the add+norm
    # one warp per row over groups of 8 rows (the same rows of the CTA as the copy tiles), with
    # and without the output left in the ring; at 8192 (the kept row does not fit) the
    # register-prefetched [1, H] tile over 16 warps
    m = launch.push_meta(4096, 4096, 8, 2, 2, 2)
    assert (m.grid, m.block_rows, m.copy_unroll, m.num_warps, m.norm_unroll, m.norm_chunk) == (8, 2, 4, 8, 4, 256)
    assert launch.push_meta(4096, 4096, 8, 3, 2, 2).norm_chunk == 0  # 2 partials: not measured well
    assert launch.push_meta(4096, 4096, 8, 2, 2, 4).norm_chunk == 0  # fp32 residual: does not fit
    assert launch.push_meta(4096, 16, 8, 2, 2, 2).norm_chunk == 0  # 2 rows per CTA: warps would idle
    m = launch.push_meta(8192, 4096, 32, 2, 2, 2)
    assert (m.block_rows, m.num_warps, m.norm_prefetch, m.norm_chunk) == (1, 16, True, 0)
    p = launch.pipelined_meta(4096, 4096, 8, 2, 2, 2)  # where no prefetched tile fits
    assert (p.grid, p.block_rows, p.copy_unroll, p.norm_stages, p.norm_prefetch) == (8, 2, 4, 3, False)
    # a forced warp count keeps the pipelined loop (its shape is what the warps were tuned for)
    assert not launch.push_meta(4096, 4096, 8, 2, 2, 2, num_warps=16).norm_prefetch
    v1 = launch_meta(4096, 4096, 8)  # the pull kernel's shape (benchmarks' first push shape, push_v1_meta)
    assert (v1.block_rows, v1.copy_unroll, v1.copy_stages, v1.norm_stages) == (4, 1, 1, 1)


@requires_triton
def test_push_launcher_picks_64_bit_indices_exactly_where_an_offset_can_reach_2_pow_31(monkeypatch):
    """The launch's index width (the kernel stubbed: nothing runs, so the extents may be huge):
    the regions' rows (up to the ring slot the launch writes) and every tensor's extent count."""
    import dataclasses

    from weave_compile.kernels.shared.workspace import ring_output
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    seen = []

    class _Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw["IDX64"])

    monkeypatch.setattr(launch, "push_allreduce_rmsnorm_kernel", _Stub())
    H, T = 64, 6
    ws = EmulatedRanks.create(2, H, T, dtype=torch.bfloat16, device="cpu").workspaces[0]

    def idx64(ws, x=None, out_slot=-1):
        x = torch.randn(T, H).bfloat16() if x is None else x
        normed = ring_output(ws, out_slot, T) if out_slot >= 0 else torch.empty(T, H).bfloat16()
        spec = FusedSpec(residual_dtype=torch.bfloat16, out_dtype=torch.bfloat16, comm_ctas=2, out_slot=out_slot)
        launch.launch_push(ws, Rows(x), spec, normed, torch.empty(T, H).bfloat16())
        return seen.pop()

    assert idx64(ws) is False and idx64(ws, out_slot=2) is False
    rows = 2 ** 31 // H  # capacity x H == 2**31: a region offset can reach it
    assert idx64(dataclasses.replace(ws, capacity=rows)) is True
    # a third of that: the regions fit, the ring's third slot does not
    big = dataclasses.replace(ws, capacity=rows // 3 + 1)
    assert idx64(big) is False and idx64(big, out_slot=1) is False and idx64(big, out_slot=2) is True
    # one tensor whose rows span 2**31 elements (a strided view, never allocated)
    wide = torch.empty(0, dtype=torch.bfloat16, device="meta").as_strided((T, H), (2 ** 31 // (T - 1), 1))
    assert idx64(ws, x=wide) is True


@requires_triton
def test_public_launcher_rejects_bad_arguments(monkeypatch):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="unknown kernel"):  # the pull hook is no product kernel
        kernels.get("p2p_pull")
    with pytest.raises(ValueError, match="CUDA"):
        launch.allreduce_rmsnorm(x, group_name="g")
    with pytest.raises(ValueError, match="comm_ctas"):
        FusedSpec.for_rows(x, comm_ctas=33)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors are allowed there
    spec = FusedSpec.for_rows(x)
    with pytest.raises(ValueError, match="residual must have shape"):
        symm_call.check_residual(Rows(x, torch.randn(3, 64)), spec, world_size=2)
    with pytest.raises(ValueError, match="weight must have shape"):
        symm_call.check_rows(Rows(x, weight=torch.randn(65)), spec)
    with pytest.raises(ValueError, match="vector width"):
        symm_call.check_rows(Rows(torch.randn(4, 66)), FusedSpec.for_rows(torch.randn(4, 66)))


@requires_triton
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_kernel_in_cpu_interpreter(world):
    """Runs the real push and pull kernels under TRITON_INTERPRET=1, one process per rank (the pull
    kernel's LayerNorm variant included)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    rc, out = run_script(THIS_FILE, ["--interp-sim", "--world", str(world)], timeout=900, env=env)
    assert rc == 0, out[-8000:]
    assert "INTERP-SIM OK" in out, out[-8000:]


# ======================================================================================
# CPU interpreter simulation (script mode: --interp-sim)
# ======================================================================================

SIM_CASES = [
    make_case(7, 64, "bf16", seed=1, eps_tensor=True),  # the push kernel reads eps from a tensor
    make_case(1, 64, "fp32", res="none", bias=False, seed=2),  # T < world
    make_case(37, 32, "fp16", res="shard_both", mid="bf16", woff=1.0, ctas=4, seed=3),
    make_case(40, 48, "fp32", out_dtype="bf16", res_dtype="fp32", res="shard_in", ctas=3,
              channel=1, seed=4),  # non-pow2 H, mixed dtypes, channel 1
    make_case(23, 64, "bf16", res="shard_out", weight=False, ctas=2, seed=5),
    make_case(64, 16, "bf16", res_dtype="fp32", mid="bf16", ctas=2, seed=6),  # 8 rows / CTA
    make_case(24, 64, "bf16", res="first", ctas=2, seed=7),  # no residual in, this rank's rows out
]
SIM_REPEATS = 2  # every case twice in a row with fresh data: pads must reset

#: The pull kernel's LayerNorm variant (``p2p_pull``: the ``multimem`` kernel with peer loads and stores),
#: after the cases above (2- and 4-row tiles at 2 ranks): weight and norm bias with a pre-norm bias, the norm bias
#: alone (sharded residuals), neither (fp32 in, mixed dtypes), the weight alone (no residual in, a mid dtype
#: and Gemma's 1 + w), T < ranks, and RMSNorm with a norm bias (``HAS_NORM_BIAS`` alone). eps as a number:
#: the pull kernel reads it on the host.
SIM_LN_CASES = [
    lc.ln_case(7, 40, "bf16", bias=True, seed=1),
    lc.ln_case(13, 40, "bf16", res="shard_both", weight=False, seed=2),
    lc.ln_case(10, 40, "fp32", res_dtype="fp32", out_dtype="bf16", res="shard_out", weight=False, norm_bias=False,
               ctas=3, seed=3),
    lc.ln_case(9, 48, "bf16", res="first", norm_bias=False, mid="bf16", woff=1.0, seed=4),
    lc.ln_case(1, 40, "bf16", seed=5),
    lc.ln_case(8, 40, "bf16", norm="rmsnorm", offset=0.0, seed=6),
]


def _sim_workspace(rank, world, pools, status, T, H, channel, dt, odt, rdt):
    """This rank's workspace over the shared pools for one launch, its own regions poisoned; the launchers'
    ``get_workspace`` answers it."""
    pin, pout, pres, pads = pools
    cap = math.ceil(T / world) * world

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
    table = build_ptr_table([[t.data_ptr() for t in bufs] for bufs in (inp, out, res)],
                            [p.data_ptr() for p in pads])
    ws = workspace.SymmWorkspace(
        group_name="sim", device=torch.device("cpu"), in_dtype=dt, out_dtype=odt,
        res_dtype=rdt, hidden=H, channel=channel, capacity=cap, rank=rank,
        world_size=world, buffer=pin[rank], handle=None, inp=inp[rank], out=out[rank],
        res=res[rank], ptr_table=table,
        status=status[rank], multicast_ptr=0,
        pad_offset=pad_offset_for(channel, world))
    symm_call.get_workspace = lambda *a, **k: ws  # the CPU stand-in for the symmetric buffers
    return ws


def _sim_layernorm(rank, world, pools, status, ln_outs):
    """This rank's pull launches of :data:`SIM_LN_CASES`, its outputs copied into ``ln_outs[case][rank]``
    (shared memory: the parent checks every rank's together)."""
    for ci, c in enumerate(SIM_LN_CASES):
        xs, residual, bias, weight, nb = lc.make_inputs(c, world, "cpu")
        dt, rdt, odt = lc.dtypes(c)
        _sim_workspace(rank, world, pools, status, c["T"], c["H"], c["channel"], dt, odt, rdt)
        res_in = lc.rank_residual(c, world, rank, residual)
        if res_in is not None and sharding(c)[0]:  # NaN in the shard's rows past T: the kernel must not read them
            S = math.ceil(c["T"] / world)
            res_in[max(0, min(S, c["T"] - rank * S)):] = float("nan")
        normed, res_out = p2p_pull(xs[rank], res_in, bias, weight, norm_bias=nb, group_name="sim",
                                   residual_dtype=rdt, out_dtype=odt, comm_ctas=c["ctas"], channel=c["channel"],
                                   **lc.spec_kwargs(c, "cpu"))
        ln_outs[ci][rank][0].copy_(normed)
        ln_outs[ci][rank][1].copy_(res_out)
        print(f"[rank {rank}] p2p_pull {lc.case_name(c):70s} done", flush=True)


def _sim_worker(rank, world, pools, status, barrier, failures, ln_outs):
    torch.set_num_threads(1)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    interpreter_compat()
    pads = pools[3]
    for ci, c0 in enumerate(SIM_CASES * SIM_REPEATS):
        c = dict(c0, seed=c0["seed"] * 1000 + ci)
        T, H = c["T"], c["H"]
        xs, residual, bias, weight = make_inputs(c, world, "cpu")
        kw = kernel_kwargs(c)
        dt = xs[0].dtype
        odt = kw["out_dtype"] or dt
        rdt = kw["residual_dtype"] or (residual.dtype if residual is not None else dt)
        ws = _sim_workspace(rank, world, pools, status, T, H, c["channel"], dt, odt, rdt)
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
        call = p2p_pull if ci % 2 else launch.allreduce_rmsnorm
        if variant == "p2p":  # the launcher takes eps as a tensor (the benchmark's pull launcher does not)
            kw.update(eps_args(c, "cpu"))
        normed, res_out = call(x, res_in, bias, weight, group_name="sim", **kw)
        ref_n, ref_r = reference(c, xs, residual, bias, weight)
        ok, en, er, msg = check_outputs(c, world, rank, normed, res_out, ref_n, ref_r)
        print(f"[rank {rank}] {variant:8s} {case_name(c):60s} {'ok' if ok else 'FAIL'} "
              f"err_n={en:.2e} err_r={er:.2e} {msg}", flush=True)
        if not ok:
            failures[rank] += 1
    _sim_layernorm(rank, world, pools, status, ln_outs)
    barrier.wait()  # everybody is done: no signal can be in flight any more
    if int(status[rank].item()) != 0:
        print(f"[rank {rank}] barrier timeouts: {int(status[rank].item())}", flush=True)
        failures[rank] += 1
    if int(pads[rank].abs().sum().item()) != 0:
        nz = torch.nonzero(pads[rank]).flatten().tolist()
        print(f"[rank {rank}] signal pad not reset: slots {nz}", flush=True)
        failures[rank] += 1


def interp_sim_main(world: int) -> int:
    import torch.multiprocessing as mp

    os.environ.setdefault(ENV_SPIN_LIMIT, str(1 << 22))
    max_bytes = max(math.ceil(c["T"] / world) * world * c["H"] * 4 for c in SIM_CASES + SIM_LN_CASES)
    pools = tuple([torch.zeros(max_bytes, dtype=torch.uint8).share_memory_()
                   for _ in range(world)] for _ in range(3))
    pads = [torch.zeros(4096, dtype=torch.int32).share_memory_() for _ in range(world)]
    status = [torch.zeros(1, dtype=torch.int32).share_memory_() for _ in range(world)]
    failures = torch.zeros(world, dtype=torch.int64).share_memory_()
    barrier = mp.get_context("spawn").Barrier(world)
    ln_outs = [[tuple(t.share_memory_() for t in outs) for outs in lc.poisoned_outputs(c, world, "cpu")]
               for c in SIM_LN_CASES]
    t0 = time.time()
    spawn_ranks(_sim_worker, world, (pools + (pads,), status, barrier, failures, ln_outs), timeout=800)
    nfail = int(failures.sum().item())
    for c, outs in zip(SIM_LN_CASES, ln_outs):
        errs = lc.check(c, world, outs, lc.make_inputs(c, world, "cpu"))
        print(f"p2p_pull {lc.case_name(c):70s} {'ok' if not errs else 'FAIL ' + '; '.join(errs)}", flush=True)
        nfail += bool(errs)
    print(f"world={world}: {len(SIM_CASES) * SIM_REPEATS + len(SIM_LN_CASES)} launches per rank, "
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
        for res in ("shard_in", "shard_out", "shard_both", "none", "first"):
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
    os.environ.setdefault(ENV_SPIN_LIMIT, str(1 << 26))
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    group_name = dist.group.WORLD.group_name
    p = probe.probe(group_name, dev, torch.bfloat16, 4096)
    variant = "multimem" if p.multicast else "p2p" if p.mapped else None
    return dist, dev, group_name, variant, p.reason


def _run_gpu_case(c, world, rank, dev, group_name, rows):
    xs, residual, bias, weight = make_inputs(c, world, dev)
    kw = kernel_kwargs(c)
    dt = xs[0].dtype
    ws = workspace.reserve(group_name, dt, c["H"], c["T"], out_dtype=kw["out_dtype"] or dt,
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
    normed, res_out = launch.allreduce_rmsnorm(xs[rank], res_in, bias, weight, group_name=group_name, **kw)
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
    workspace.reserve(group_name, dt, H, max(Ts), device=dev)
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
        normed, res_out = launch.allreduce_rmsnorm(x, residual, None, weight, eps=1e-6, group_name=group_name)
        if check:
            ref_n, ref_r = rows_ref(xs, residual, None, weight, eps=1e-6)
            ok, en, er, msg = check_outputs(c, world, rank, normed, res_out, ref_n, ref_r)
            checked += 1
            worst = max(worst, en, er)
            bad += not ok
    torch.cuda.synchronize()
    ws = workspace.get_workspace(group_name, dt, H, max(Ts), device=dev)
    timeouts = ws.check_status()
    rows.append(dict(case=f"{n_calls} back-to-back calls (T cycling {Ts})",
                     ok=bad == 0 and timeouts == 0, err_n=worst, err_r=worst,
                     ms=(time.time() - t0) * 1e3,
                     msg=f"{checked} checked, {bad} bad, {timeouts} timeouts"))


def _suite_cuda_graph(world, rank, dev, group_name, rows, replays=5):
    H, T = 4096, 300
    dt = torch.bfloat16
    workspace.reserve(group_name, dt, H, 1024, device=dev)
    c0 = make_case(T, H, "bf16", bias=False, seed=777)
    xs, residual, _, weight = make_inputs(c0, world, dev)
    x_static, r_static = xs[rank].clone(), residual.clone()
    kw = dict(eps=1e-6, group_name=group_name)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compiles and loads the kernel outside capture
        launch.allreduce_rmsnorm(x_static, r_static, None, weight, **kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        n_out, r_out = launch.allreduce_rmsnorm(x_static, r_static, None, weight, **kw)
    bad, worst = 0, 0.0
    t0 = time.time()
    for k in range(replays):
        c = make_case(T, H, "bf16", bias=False, seed=900 + k)
        xs, residual, _, _ = make_inputs(c, world, dev)
        x_static.copy_(xs[rank])
        r_static.copy_(residual)
        g.replay()
        ref_n, ref_r = rows_ref(xs, residual, None, weight, eps=1e-6)
        ok, en, er, msg = check_outputs(c, world, rank, n_out, r_out, ref_n, ref_r)
        bad += not ok
        worst = max(worst, en, er)
        # eager launches on the same channel between replays keep the pads in step
        ce = make_case(41, H, "bf16", bias=False, seed=950 + k)
        xe, re_, _, _ = make_inputs(ce, world, dev)
        ne, rre = launch.allreduce_rmsnorm(xe[rank], re_, None, weight, **kw)
        ref_ne, ref_re = rows_ref(xe, re_, None, weight, eps=1e-6)
        ok2, en2, er2, _ = check_outputs(ce, world, rank, ne, rre, ref_ne, ref_re)
        bad += not ok2
    # capture with a workspace that is too small must refuse, not overflow
    refused = False
    too_many = workspace.get_workspace(group_name, dt, H, T, device=dev).capacity + world
    g2 = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g2):
            big = torch.empty(too_many, H, dtype=dt, device=dev)
            try:
                launch.allreduce_rmsnorm(big, None, None, weight, **kw)
            except workspace.SymmCapacityError:
                refused = True
    except Exception as e:  # capture may also be invalidated; only the refusal matters
        rows.append(dict(case="capture overflow check", ok=refused, err_n=0, err_r=0, ms=0,
                         msg=f"capture raised {type(e).__name__}"))
    torch.cuda.synchronize()
    timeouts = workspace.get_workspace(group_name, dt, H, T, device=dev).check_status()
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
            rows.append(dict(case="symmetric-memory probe", ok=False, err_n=0, err_r=0, ms=0,
                             msg=reason))
        else:
            if variant == "multimem":
                # Never run multimem on shared machines: p2p only, and say so.
                info["note"] = "multicast present: multimem NOT exercised (policy)"
            else:
                rows.append(dict(case="symmetric-memory probe -> p2p", ok=variant == "p2p",
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
    rc, out = run_script(THIS_FILE, ["--gpu-suite", suite, "--timeout", "300"], timeout=330)
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
