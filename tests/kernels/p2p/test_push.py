"""Tests for kernels/p2p/push.py on ONE GPU: the push kernel over emulated ranks.

Every rank's buffers are ordinary allocations and every rank's launch runs on its own stream
(``weave_compile.testing.emulated_ranks``), so the kernel's real barriers, peer stores and
pointer tables run on one device.  Outputs are NaN-poisoned before every launch and compared
with the float64 oracle; awkward T and H; bf16/fp16/fp32; sharded and full residuals; 1000
back-to-back calls; CUDA-graph capture and replay with new data.  A spin limit turns a barrier
that never completes into a failure (the status word), not a hang.  The 2-GPU tests of the
real symmetric-memory path are in test_launch.py; the CPU interpreter run of this driver is in
tests/testing/test_emulated_ranks.py. The LayerNorm variant runs here in every add+norm loop kind,
forced, with 2 and 3 ranks (its CPU interpreter test: test_push_layernorm.py); the fp8 epilogue
against its own normed rows quantized, bit for bit (its CPU interpreter test: test_push_fp8.py).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tests.kernels import _layernorm_cases as lc  # noqa: E402
from tests.kernels._symm_cases import (DTYPES, NO_RESIDUAL, check_outputs, eps_args, make_case,  # noqa: E402
                                       make_inputs, reference, rows_ref, shard_rows, sharding)
from weave_compile.kernels.shared.common import ENV_SPIN_LIMIT, HAS_TRITON  # noqa: E402
from weave_compile.testing.emulated_ranks import EmulatedRanks, push_allreduce_rmsnorm  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")]
os.environ.setdefault(ENV_SPIN_LIMIT, str(1 << 22))  # a hung barrier fails instead of hanging
WORLD = 2


def _cases():
    cs = []
    Ts = (1, 3, 257, 4099)
    # every (dtype, H) pair, T and residual form rotating; H=5120 is the non-power-of-two size
    for dt in ("bf16", "fp16", "fp32"):
        for H in (2048, 4096, 8192, 5120):
            k = len(cs)
            cs.append(make_case(Ts[k % 4], H, dt, res=("full", "shard_both")[k % 2], seed=k + 1))
    # every T with both residual forms at the Llama-8B size
    for T in Ts:
        for res in ("full", "shard_in", "shard_out", "shard_both", "first"):
            cs.append(make_case(T, 4096, "bf16", res=res, seed=len(cs) + 1))
    cs += [
        make_case(257, 4096, "bf16", res_dtype="fp32", mid="bf16", seed=101),  # HF Llama
        # eps a device tensor (torch.compile(dynamic=True)): one case per add+norm loop
        make_case(257, 4096, "bf16", res_dtype="fp32", mid="bf16", seed=111, eps_tensor=True),
        make_case(4099, 8192, "fp32", out_dtype="bf16", seed=112, eps_tensor=True),
        make_case(3, 2048, "bf16", res="shard_both", seed=113, eps_tensor=True),
        make_case(257, 4096, "bf16", woff=1.0, bias=True, seed=102),  # Gemma, with a bias
        make_case(4099, 8192, "fp32", out_dtype="bf16", weight=False, seed=103),
        make_case(4099, 4096, "bf16", ctas=2, seed=104),
        make_case(4099, 4096, "bf16", ctas=32, seed=105),
        # no bias: the residual shard's rows past T are zero without the kernel's select (every
        # input of theirs loads as 0); T odd, so the last shard has such a row
        make_case(4099, 4096, "bf16", res="shard_both", bias=False, seed=106),
        make_case(3, 8192, "bf16", res="shard_out", bias=False, seed=107),
    ]
    return cs


def _run_case(ranks, c, outputs=None):
    xs, residual, bias, weight = make_inputs(c, WORLD, "cuda")
    in_sh, out_sh = sharding(c)
    res_in = [None if residual is None else (shard_rows(residual, WORLD, r) if in_sh else residual)
              for r in range(WORLD)]
    outs = push_allreduce_rmsnorm(
        ranks, xs, res_in, bias, weight, residual_out_sharded=out_sh, residual_in_sharded=in_sh,
        comm_ctas=c["ctas"], mid_dtype=DTYPES[c["mid"]] if c["mid"] else None,
        weight_offset=c["woff"], outputs=outputs, **eps_args(c, "cuda"))
    torch.cuda.synchronize()
    return outs, reference(c, xs, residual, bias, weight)


def _ranks_for(c, max_tokens=None):
    dt = DTYPES[c["dtype"]]
    rdt = DTYPES[c["res_dtype"]] if c["res_dtype"] else dt
    return EmulatedRanks.create(WORLD, c["H"], max_tokens or c["T"], dtype=dt,
                                out_dtype=DTYPES[c["out_dtype"]] if c["out_dtype"] else dt,
                                residual_dtype=rdt if c["res"] not in NO_RESIDUAL else dt)


def _poisoned(ranks, c):
    T, H = c["T"], c["H"]
    S = math.ceil(T / WORLD)
    ws = ranks.workspaces[0]
    rows = S if sharding(c)[1] else T
    return [(torch.full((T, H), float("nan"), dtype=ws.out_dtype, device="cuda"),
             torch.full((rows, H), float("nan"), dtype=ws.res_dtype, device="cuda"))
            for _ in range(WORLD)]


@pytest.mark.parametrize("c", _cases(), ids=lambda c: " ".join(
    f"{k}={c[k]}" for k in ("T", "H", "dtype", "res", "ctas", "mid", "res_dtype", "out_dtype", "woff", "eps_tensor")
    if c[k] not in (None, 0.0, False)))
def test_push_matches_float64_oracle(c):
    ranks = _ranks_for(c)
    outs, (ref_n, ref_r) = _run_case(ranks, c, outputs=_poisoned(ranks, c))
    for r, (normed, res_out) in enumerate(outs):
        ok, en, er, msg = check_outputs(c, WORLD, r, normed, res_out, ref_n, ref_r)
        assert ok, f"rank {r}: {msg}"
    assert ranks.barrier_state() == (0, 0), "barrier timeouts / signal pads not reset"


@pytest.mark.parametrize("ring", [False, True], ids=["fresh", "ring"])
def test_push_1000_back_to_back_calls(ring):
    """ring: the outputs alternate ring slots 1 and 2 (each checked before its slot comes back)."""
    H, Ts = 4096, (512, 77, 1)
    ranks = EmulatedRanks.create(WORLD, H, max(Ts), dtype=torch.bfloat16)
    weight = torch.randn(H, device="cuda").bfloat16()
    bad = []
    for i in range(1000):
        T = Ts[i % len(Ts)]
        c = make_case(T, H, "bf16", bias=False, seed=10_000 + i)
        xs, residual, _, _ = make_inputs(c, WORLD, "cuda")
        outs = push_allreduce_rmsnorm(ranks, xs, [residual] * WORLD, None, weight,
                                      out_slot=1 + i % 2 if ring else -1)
        if i % 100 == 0 or i == 999:
            torch.cuda.synchronize()
            ref_n, ref_r = rows_ref(xs, residual, None, weight)
            for r, (n, ro) in enumerate(outs):
                ok, _, _, msg = check_outputs(c, WORLD, r, n, ro, ref_n, ref_r)
                if not ok:
                    bad.append((i, r, msg))
    torch.cuda.synchronize()
    assert not bad, bad[:5]
    assert ranks.barrier_state() == (0, 0)


@pytest.mark.parametrize("eps", ["float", "tensor"])
@pytest.mark.parametrize("ring", [False, True], ids=["fresh", "ring"])
def test_push_cuda_graph_replays_with_new_data(ring, eps):
    """ring: the captured launch leaves its output in ring slot 1. eps="tensor": eps is a 0-d
    device tensor given a new value before each replay, which the replay must read."""
    H, T = 4096, 300
    slot = 1 if ring else -1
    ranks = EmulatedRanks.create(WORLD, H, T, dtype=torch.bfloat16)
    c0 = make_case(T, H, "bf16", bias=False, seed=777)
    xs, residual, _, weight = make_inputs(c0, WORLD, "cuda")
    x_static = [x.clone() for x in xs]
    r_static = residual.clone()
    eps_t = torch.tensor(0.5, dtype=torch.float64, device="cuda")
    eps_kw = dict(eps=0.0, eps_tensor=eps_t) if eps == "tensor" else {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernel outside capture
        outs = push_allreduce_rmsnorm(ranks, x_static, [r_static] * WORLD, None, weight, out_slot=slot, **eps_kw)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = push_allreduce_rmsnorm(ranks, x_static, [r_static] * WORLD, None, weight, outputs=outs,
                                      out_slot=slot, **eps_kw)
    for k in range(5):
        c = make_case(T, H, "bf16", bias=False, seed=900 + k)
        xs, residual, _, _ = make_inputs(c, WORLD, "cuda")
        for xst, x in zip(x_static, xs):
            xst.copy_(x)
        r_static.copy_(residual)
        eps_t.fill_(0.25 * (k + 1))  # of the order of the rows' mean square: it moves every output
        for n, ro in outs:
            n.fill_(float("nan"))
            ro.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref_n, ref_r = rows_ref(xs, residual, None, weight, eps=eps_t.item() if eps == "tensor" else 1e-6)
        for r, (n, ro) in enumerate(outs):
            ok, _, _, msg = check_outputs(c, WORLD, r, n, ro, ref_n, ref_r)
            assert ok, f"replay {k} rank {r}: {msg}"
        # eager launches between replays keep the pads in step
        eager = push_allreduce_rmsnorm(ranks, xs, [residual] * WORLD, None, weight, **eps_kw)
        torch.cuda.synchronize()
        assert check_outputs(c, WORLD, 0, *eager[0], ref_n, ref_r)[0]
    assert ranks.barrier_state() == (0, 0)


@pytest.mark.parametrize("c", [make_case(4099, 4096, "bf16", res="shard_both", seed=201),
                               make_case(257, 5120, "bf16", res_dtype="fp32", mid="bf16", seed=202),
                               make_case(3, 2048, "fp16", res="full", seed=203),
                               make_case(1000, 8192, "fp32", out_dtype="bf16", ctas=8, seed=204)],
                         ids=lambda c: f"T={c['T']} H={c['H']} {c['dtype']} {c['res']}")
def test_push_output_left_in_the_ring(c):
    """out_slot: the normed output is the ring slot itself, equal to the oracle, with the other
    slots (staging slot 0 included) untouched; a launch on the other slot leaves it intact."""
    ranks = _ranks_for(c, max_tokens=c["T"] + 64)  # peers' slots start elsewhere than global rows
    xs, residual, bias, weight = make_inputs(c, WORLD, "cuda")
    in_sh, out_sh = sharding(c)
    res_in = [None if residual is None else (shard_rows(residual, WORLD, r) if in_sh else residual)
              for r in range(WORLD)]
    kw = dict(residual_out_sharded=out_sh, residual_in_sharded=in_sh, comm_ctas=c["ctas"],
              mid_dtype=DTYPES[c["mid"]] if c["mid"] else None, weight_offset=c["woff"], eps=1e-6)
    outs = push_allreduce_rmsnorm(ranks, xs, res_in, bias, weight, out_slot=1, **kw)
    torch.cuda.synchronize()
    ref_n, ref_r = reference(c, xs, residual, bias, weight)
    for r, (normed, res_out) in enumerate(outs):
        ring = ranks.workspaces[r].out_ring
        assert normed.data_ptr() == ring[1].data_ptr()
        assert torch.isnan(ring[0]).all() and torch.isnan(ring[2]).all(), f"rank {r}: stray ring stores"
        ok, _, _, msg = check_outputs(c, WORLD, r, normed, res_out, ref_n, ref_r)
        assert ok, f"rank {r}: {msg}"
    kept = [n.clone() for n, _ in outs]
    c2 = dict(c, seed=c["seed"] + 1000)
    xs2, residual2, _, _ = make_inputs(c2, WORLD, "cuda")
    res_in2 = [None if residual2 is None else (shard_rows(residual2, WORLD, r) if in_sh else residual2)
               for r in range(WORLD)]
    outs2 = push_allreduce_rmsnorm(ranks, xs2, res_in2, bias, weight, out_slot=2, **kw)
    torch.cuda.synchronize()
    ref_n2, ref_r2 = reference(c2, xs2, residual2, bias, weight)
    for r, ((n1, _), (n2, ro2)) in enumerate(zip(outs, outs2)):
        assert torch.equal(n1, kept[r]), f"rank {r}: the slot-2 launch changed slot 1"
        assert check_outputs(c2, WORLD, r, n2, ro2, ref_n2, ref_r2)[0]
    assert ranks.barrier_state() == (0, 0)


def _layernorm_cases():
    """(world, case, loop kind, out_slot): every loop kind, forced, at every model H (bf16, T odd: the last
    shard has a row past T), options rotating; 3 ranks (T=257: not divisible by 3); fp32; the ring."""
    runs = []
    options = [dict(res="full", bias=True), dict(res="shard_both", weight=False),
               dict(res="shard_in", norm_bias=False, res_dtype="fp32", mid="bf16"), dict(res="first", woff=1.0)]
    for H in (2048, 4096, 5120, 8192):
        for k, kind in enumerate(("default", "pipelined", "prefetch", "rowwise")):
            runs.append((2, lc.ln_case(4099, H, "bf16", ctas=16, **options[(k + H // 1024) % 4]), kind, -1))
    for kind in ("default", "pipelined", "prefetch", "rowwise"):
        runs.append((3, lc.ln_case(257, 4096, "bf16", res="shard_both", ctas=8), kind, -1))
    runs += [
        (2, lc.ln_case(1000, 4096, "fp32", res="shard_out", ctas=8), "default", -1),
        (2, lc.ln_case(1000, 8192, "fp32", out_dtype="bf16", weight=False, eps_tensor=True, ctas=8), "default", -1),
        (2, lc.ln_case(3, 4096, "bf16", res="none", ctas=32), "default", -1),  # decode: a CTA per row or none
        (2, lc.ln_case(4099, 4096, "bf16", res="shard_both"), "default", 1),  # the ring, one warp per row
        (2, lc.ln_case(257, 8192, "bf16", norm_bias=False), "default", 2),  # the ring, the prefetched tile
        (2, lc.ln_case(4099, 4096, "bf16", norm="rmsnorm", offset=0.0), "default", -1),  # RMSNorm + norm bias
    ]
    return runs


@pytest.mark.parametrize("world,c,kind,out_slot", _layernorm_cases(), ids=lambda v: (
    lc.case_name(v) if isinstance(v, dict) else str(v)))
def test_push_layernorm_matches_float64_oracle(world, c, kind, out_slot, seed):
    """The LayerNorm variant (IS_LAYERNORM, HAS_NORM_BIAS) on concurrent emulated ranks with real barriers:
    fresh rows with a common offset, outputs NaN-poisoned, the float64 oracle's LayerNorm of the kernel's
    own residual (``tests/kernels/_layernorm_cases.check``, which RMSNorm would fail)."""
    c = dict(c, seed=seed % 10**6)
    inputs = lc.make_inputs(c, world, "cuda")
    ranks = lc.ranks_for(c, world, "cuda", extra_rows=64)
    outs = lc.run_push(ranks, c, inputs, meta=lc.meta_for(c, world, kind, interp=False), out_slot=out_slot,
                       device="cuda")
    torch.cuda.synchronize()
    errs = lc.check(c, world, outs, inputs) + (lc.ring_errors(ranks, outs, out_slot) if out_slot >= 0 else [])
    assert not errs, errs
    assert ranks.barrier_state() == (0, 0), "barrier timeouts / signal pads not reset"


def test_emulated_grids_must_fit_the_gpu():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ranks = EmulatedRanks.create(WORLD, 64, 8, dtype=torch.bfloat16)
    ranks.check_coresident(sms // WORLD)
    with pytest.raises(ValueError, match="resident"):
        ranks.check_coresident(sms // WORLD + 1)


@pytest.mark.parametrize("N", [3, 4])
@pytest.mark.parametrize("H", [4096, 8192])
def test_push_batch_invariant_rows_on_the_gpu(N, H, seed):
    """``batch_invariant`` on concurrent emulated ranks: one row whose partials cancel in part
    (``tests/kernels/_batch_invariant_cases.py``) run alone and at positions owned by every rank in
    calls of 2..4099 rows on 1, 8 and 32 CTAs, full and sharded residual: its normed and residual rows
    bitwise the same (the rank-order sum on one-row pipelined tiles), the residual the rank-order fp32
    sum rounded once. Without the option the default shapes (the prefetched tile, the peers added as a
    tree after the owner's own partial) give some owner other bits: the check discriminates."""
    from tests.kernels import _batch_invariant_cases as bic

    bf = torch.bfloat16
    ranks = EmulatedRanks.create(N, H, 4099, dtype=bf)
    parts, res_row = bic.row_partials(seed, N, H, "cuda")
    weight = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed))).to(bf).cuda()

    def row(T, pos, ctas, sharded, invariant):
        S = math.ceil(T / N)
        xs, residual = bic.batch_with_row(parts, res_row, T, pos, seed + T + pos, "cuda")
        padded = torch.nn.functional.pad(residual, (0, 0, 0, S * N - T))
        res_in = [padded[r * S:(r + 1) * S] if sharded else residual for r in range(N)]
        outs = push_allreduce_rmsnorm(ranks, xs, res_in, None, weight, residual_in_sharded=sharded,
                                      residual_out_sharded=sharded, comm_ctas=ctas, batch_invariant=invariant)
        torch.cuda.synchronize()
        for normed, _ in outs[1:]:
            assert bic.same_bits(normed, outs[0][0]), "the ranks gathered other rows"
        owner, j = pos // S, pos % S
        return outs[0][0][pos], (outs[owner][1][j] if sharded else outs[0][1][pos])

    placements = [(T, pos, ctas) for T, pos in ((2, 1), (N - 1, N - 2), (5, 4), (257, 128), (257, 256),
                                                (4099, 0), (4099, 2050), (4099, 4098))
                  for ctas in (1, 8, 32)]
    for sharded in (False, True):
        n1, r1 = row(1, 0, 1, sharded, True)
        assert bic.same_bits(r1, bic.rank_order_residual(parts, res_row).to(bf)), "not the rank-order fp32 sum"
        for T, pos, ctas in placements:
            n, r = row(T, pos, ctas, sharded, True)
            assert bic.same_bits(n, n1) and bic.same_bits(r, r1), (T, pos, bic.owner(T, pos, N), ctas, sharded)
    assert ranks.barrier_state() == (0, 0), "barrier timeouts / signal pads not reset"
    alone = row(1, 0, 8, False, False)
    differ = [not (bic.same_bits(n, alone[0]) and bic.same_bits(r, alone[1]))
              for n, r in (row(T, pos, 8, False, False) for T, pos in ((9, 8), (9, 4), (4099, 4098), (4099, 2050)))]
    assert any(differ), "without the option no owner shows in the bits: this test would prove nothing"


def _fp8_cases():
    """(world, case, loop kind, epilogue form index): model H, T past a multiple of the ranks, the
    residual forms, RMSNorm and LayerNorm, each tile loop; 2 and 3 ranks; the rank-order loop."""
    return [
        (2, lc.ln_case(4099, 4096, "bf16", norm="rmsnorm", offset=0.0, norm_bias=False, ctas=16), "default", 0),
        (2, lc.ln_case(4099, 8192, "bf16", res="shard_both", norm="rmsnorm", offset=0.0, norm_bias=False, ctas=16),
         "pipelined", 1),
        (2, lc.ln_case(257, 4096, "bf16", res="shard_both", ctas=8), "prefetch", 2),  # LayerNorm
        (3, lc.ln_case(257, 5120, "bf16", res="first", norm="rmsnorm", offset=0.0, norm_bias=False, ctas=8),
         "default", 3),
        (2, lc.ln_case(1000, 4096, "fp32", res="shard_in", out_dtype="bf16", norm="rmsnorm", offset=0.0,
                       norm_bias=False, ctas=8), "default", 4),
        (2, lc.ln_case(3, 4096, "bf16", norm="rmsnorm", offset=0.0, norm_bias=False, ctas=32), "default", 5),  # decode
    ]


@pytest.mark.parametrize("world,c,kind,form", _fp8_cases(), ids=lambda v: (
    lc.case_name(v) if isinstance(v, dict) else str(v)))
def test_push_fp8_epilogue_equals_its_normed_rows_quantized(world, c, kind, form, seed):
    """The fp8 epilogue on concurrent emulated ranks with real barriers: every rank's codes and row
    scales equal ``quant.quantize_rows`` of the normed rows the same launch shape gives without it,
    bit for bit, the residual unchanged, the codes within the float64 oracle's rounding boundaries
    (``test_push_fp8.run_case``, the interpreter test's check)."""
    from tests.kernels.p2p.test_push_fp8 import run_case
    from tests.kernels.shared._addnorm_cases import quant_forms

    errs = run_case(c, world, kind, list(quant_forms().items())[form], seed % 10**6, device="cuda")
    assert not errs, errs


def test_push_fp8_epilogue_batch_invariant_rows():
    """``batch_invariant``'s rank-order loop with the epilogue, 2 and 3 ranks: the same check."""
    from tests.kernels.p2p.test_push_fp8 import run_case
    from tests.kernels.shared._addnorm_cases import quant_forms

    c = lc.ln_case(1000, 4096, "bf16", res="shard_both", norm="rmsnorm", offset=0.0, norm_bias=False, ctas=8)
    for world in (2, 3):
        errs = run_case(c, world, "default", list(quant_forms().items())[0], 7, invariant=True, device="cuda")
        assert not errs, (world, errs)
