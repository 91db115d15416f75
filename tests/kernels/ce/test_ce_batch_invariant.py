"""``ce`` with ``batch_invariant``: a row's outputs are bitwise the same whatever else is in the call.

The CPU simulation of ce's programs (``test_copy_engine.simulate``: every rank's ops interleaved
in a random order the flag waits allow; the add+norm on its torch path) for 2-4 ranks: one row,
whose per-rank partial sums cancel in part (so the order of their sum shows in the bits), is run
alone and at a drawn position in calls of drawn T (below the rank count, not divisible by it,
odd), full or sharded residual; its normed and residual rows must be bitwise equal. Without the
option the same rows differ at 3 ranks (each rank adds its own partial first): the check
discriminates. The Triton kernel's rank-order sum runs under the interpreter
(``test_rank_order_in_the_triton_kernel``): the residual rows (fp32) equal the rank-order fp32
sum bit for bit for every owner, and a row's outputs do not change with T, its position or the
CTA count. The GPU's emulated ranks: ``test_copy_engine_gpu.py``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.kernels.ce.test_copy_engine import simulate
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.spec import FusedSpec, Rows

H = 40
BF16 = torch.bfloat16
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def row_partials(seed: int, world: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One row's partial sums per rank and its residual: rank 1's cancels rank 0's (2**20 times the
    others'), so the fp32 sum keeps the small partials only where the two big ones meet first (in
    rank order they do; a rank that adds its own small partial first loses it to rounding, far
    beyond a bf16 output's ulp)."""
    g = torch.Generator().manual_seed(seed)
    big = (torch.randn(H, generator=g) * 2.0 ** 20).to(BF16)
    parts = [big, -big] + [torch.randn(H, generator=g).to(BF16) for _ in range(world - 2)]
    return parts, torch.randn(H, generator=g).to(BF16)


def ce_rows(world: int, xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, *, invariant: bool,
            sharded: bool, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ce call on its partials ``xs[r]`` [T, H] through the simulated programs: rank 0's
    normed rows and the full residual (the shards joined where it stays sharded)."""
    T = xs[0].shape[0]
    S = -(-T // world)
    wss = ce.emulated_workspaces(world, S + 3, H, (BF16,) * 3)
    spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, comm_ctas=3, residual_in_sharded=sharded,
                     residual_out_sharded=sharded, batch_invariant=invariant)
    padded = torch.nn.functional.pad(residual, (0, 0, 0, S * world - T))
    outs, programs = [], []
    for r in range(world):
        res_in = padded[r * S:(r + 1) * S] if sharded else residual
        normed, res_out, prog = ce.ce_call(wss[r], Rows(xs[r], res_in, None, weight), spec, run=False)
        normed.fill_(float("nan"))
        res_out.fill_(float("nan"))
        outs.append((normed, res_out))
        programs.append(prog)
    simulate(programs, rng)
    for normed, _ in outs[1:]:  # every rank gathered the same rows
        assert torch.equal(normed.view(torch.int16), outs[0][0].view(torch.int16))
    res = torch.cat([o[1][:max(0, min(S, T - r * S))] for r, o in enumerate(outs)]) if sharded else outs[0][1]
    return outs[0][0], res


def _same_row(world, invariant, row_seed, T, p, sharded, others, weight, rng) -> bool:
    parts, res_row = row_partials(row_seed, world)
    g = torch.Generator().manual_seed(others)
    xs = [torch.randn(T, H, generator=g).to(BF16) for _ in range(world)]
    residual = torch.randn(T, H, generator=g).to(BF16)
    for r in range(world):
        xs[r][p] = parts[r]
    residual[p] = res_row
    normed, res = ce_rows(world, xs, residual, weight, invariant=invariant, sharded=sharded, rng=rng)
    n1, r1 = ce_rows(world, [x[None] for x in parts], res_row[None], weight, invariant=invariant, sharded=sharded,
                     rng=rng)
    return torch.equal(normed[p].view(torch.int16), n1[0].view(torch.int16)) and \
        torch.equal(res[p].view(torch.int16), r1[0].view(torch.int16))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_rows_outputs_do_not_depend_on_the_batch(world, seed):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis import strategies as st

    weight = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed))).to(BF16)
    rng = random.Random(seed)
    seen = []

    @hyp_seed(seed)
    @settings(max_examples=30, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(row_seed=st.integers(0, 2**20), T=st.one_of(st.integers(1, world + 1), st.integers(1, 40)),
           where=st.floats(0, 1), sharded=st.booleans(), others=st.integers(0, 2**20))
    def prop(row_seed, T, where, sharded, others):
        p = min(T - 1, int(where * T))
        seen.append(T)
        assert _same_row(world, True, row_seed, T, p, sharded, others, weight, rng), \
            f"T={T} row {p} (owner rank {p // -(-T // world)}), sharded={sharded}: differs from the row alone"

    prop()
    assert any(t < world for t in seen) and any(t % world for t in seen), seen


def test_without_the_option_the_owner_shows_in_the_bits(seed):
    """At 3 ranks each rank adds its own partial first: the row owned by rank 2 in a batch (rank 0
    alone) is summed in another order, and the cancelling partials make that visible."""
    weight = torch.ones(H, dtype=BF16)
    rng = random.Random(seed)
    differ = [not _same_row(3, False, seed + k, 9, 8, False, seed + 100 + k, weight, rng) for k in range(6)]
    assert any(differ), "the check cannot tell the orders apart: the invariance test would prove nothing"
    assert all(_same_row(3, True, seed + k, 9, 8, False, seed + 100 + k, weight, rng) for k in range(6))


_KERNEL = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from weave_compile.kernels.shared import addnorm

    assert addnorm.use_triton(torch.device("cpu")), "the interpreter is off"
    g = torch.Generator().manual_seed(int(sys.argv[2]))
    H, F32, BF = 40, torch.float32, torch.bfloat16
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF)

    def run(x, recv, res, own, T, ctas):
        normed = torch.full((T, H), float("nan"), dtype=F32)
        res_out = torch.full((T, H), float("nan"), dtype=F32)
        addnorm.add_rmsnorm_rows(x, recv, res, None, w, None, normed, res_out, n_valid=T, eps=1e-5, mid_dtype=None,
                                 weight_offset=0.0, num_ctas=ctas, rank_order=own)
        return normed, res_out

    for slots in (1, 2, 3):
        big = (torch.randn(1, H, generator=g) * 2.0 ** 20).to(BF)  # ranks 0 and 1 cancel (row_partials)
        parts = ([big, -big] + [torch.randn(1, H, generator=g).to(BF) for _ in range(slots - 1)])[:slots + 1]
        res = torch.randn(1, H, generator=g).to(F32)
        differs = False
        for own in range(slots + 1):
            recv = torch.stack([p for k, p in enumerate(parts) if k != own])
            want = parts[0].float()
            for p in parts[1:]:
                want = want + p.float()
            want = want + res
            normed, res_out = run(parts[own], recv, res, own, 1, 1)
            assert torch.equal(res_out, want), (slots, own, "not the rank-order fp32 sum")
            plain = torch.full((1, H), float("nan"), dtype=F32)
            addnorm.add_rmsnorm_rows(parts[own], recv, res, None, w, None, torch.empty(1, H, dtype=F32), plain,
                                     n_valid=1, eps=1e-5, mid_dtype=None, weight_offset=0.0, num_ctas=1)
            differs |= not torch.equal(plain, want)
            for T, pos, ctas in ((5, 3, 2), (17, 0, 3), (17, 16, 1)):  # the row among others, other launches
                x = torch.randn(T, H, generator=g).to(BF)
                rv = torch.randn(slots, T, H, generator=g).to(BF)
                rs = torch.randn(T, H, generator=g).to(F32)
                x[pos], rv[:, pos], rs[pos] = parts[own][0], recv[:, 0], res[0]
                n2, r2 = run(x, rv, rs, own, T, ctas)
                assert torch.equal(n2[pos], normed[0]) and torch.equal(r2[pos], res_out[0]), (slots, own, T, pos)
        if slots >= 2:
            assert differs, "without rank_order the owner's partial goes first: some owner must differ"
    print("ok")
""")


def test_rank_order_in_the_triton_kernel(seed):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _KERNEL, _ROOT, str(seed)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_rank_order_arguments_are_checked():
    from weave_compile.kernels.shared import addnorm

    x = torch.randn(2, H, dtype=BF16)
    kw = dict(n_valid=2, eps=1e-5, mid_dtype=None, weight_offset=0.0, num_ctas=1)
    with pytest.raises(ValueError, match="rank_order 3 outside 0..1"):
        addnorm.add_rmsnorm_rows(x, x[None], None, None, None, None, torch.empty_like(x), torch.empty_like(x),
                                 rank_order=3, **kw)
    with pytest.raises(ValueError, match="pipelined row tile only"):
        addnorm.add_rmsnorm_rows(x, x[None], None, None, None, None, torch.empty_like(x), torch.empty_like(x),
                                 rank_order=0, config=addnorm.LaunchConfig(2, 1, 4, True), **kw)


@pytest.mark.parametrize("own,slots", [(0, 1), (1, 1), (2, 3)])
def test_the_rank_order_variant_compiles_for_sm90(own, slots):
    """The GPU compiler takes the rank-order loop (the interpreter is laxer: a constexpr reassigned
    per unrolled iteration ran there and failed to compile on an H100), without spills."""
    from tests.kernels.shared.test_addnorm import _ptxas_report
    from weave_compile.kernels.shared import addnorm

    pytest.importorskip("triton")
    Hk, rows = 4096, 16
    cfg = addnorm.launch_config(Hk, prefetch=False)
    tensors = (torch.empty(rows, Hk, dtype=BF16), torch.empty(slots, rows, Hk, dtype=BF16),
               torch.empty(rows, Hk, dtype=BF16), None, torch.empty(Hk, dtype=BF16), None, None,
               torch.empty(rows, Hk, dtype=BF16), torch.empty(rows, Hk, dtype=BF16))
    args, kw = addnorm.kernel_args(tensors, rows, rows, 1e-5, None, 0.0, cfg, slots, rank_order=own)
    assert kw["OWN"] == own
    report = _ptxas_report(args, kw)
    assert "Used" in report and " 0 bytes spill stores" in report, report
