"""The push kernel (``p2p``) with ``batch_invariant``: a row's outputs are bitwise the same whatever the call.

Under ``TRITON_INTERPRET=1`` (a subprocess running this file as a script) the kernel runs on 2-4 emulated
ranks (``weave_compile.testing.emulated_ranks``: one phase of every rank at a time), outputs NaN-poisoned.
One row whose partials cancel in part (``tests/kernels/_batch_invariant_cases.py``) is run alone and at
positions owned by every rank in calls of other T (below the rank count, not divisible by it) and CTA
counts, with a full and a sharded residual: its normed and residual rows must be bitwise equal, every
rank's gathered rows the same, and its residual the rank-order fp32 sum rounded once. Without the option
the same row differs at 3 ranks (each rank adds its own partial first, then the peers from rank + 1 on,
and the default shapes add the peers as a tree): the check discriminates. A hypothesis property (slow)
draws T, position, CTA count, residual layout and rank count. In-process: the invariant launch shape
does not move with T or the CTA count, the launcher passes ``RANK_ORDER`` only with the option, and a
shape that cannot keep it is refused. The GPU runs (concurrent ranks, real barriers, H=4096/8192):
tests/kernels/p2p/test_push.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import pytest
import torch

THIS_FILE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE)))))  # script mode

from tests.kernels import _batch_invariant_cases as bic  # noqa: E402
from tests.kernels._symm_cases import run_script  # noqa: E402
from weave_compile.kernels.shared.common import HAS_TRITON  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
H = 40
BF16 = torch.bfloat16


def push_rows(world, xs, residual, weight, *, invariant: bool, sharded: bool, ctas: int):
    """Every emulated rank's push launch: rank 0's normed rows and the full residual (the shards joined
    where it stays sharded; its dtype ``residual``'s); every rank must have gathered the same rows."""
    from weave_compile.testing.emulated_ranks import EmulatedRanks, push_allreduce_rmsnorm

    T = xs[0].shape[0]
    S = math.ceil(T / world)
    rdt = residual.dtype
    # room for more rows than T: the peers' slots then start elsewhere than the global rows
    ranks = EmulatedRanks.create(world, H, T + 2 * world, dtype=BF16, residual_dtype=rdt, device="cpu")
    padded = torch.nn.functional.pad(residual, (0, 0, 0, S * world - T))
    res_in = [padded[r * S:(r + 1) * S] if sharded else residual for r in range(world)]
    outputs = [(torch.full((T, H), float("nan"), dtype=BF16), torch.full((S if sharded else T, H), float("nan"),
                                                                           dtype=rdt)) for _ in range(world)]
    outs = push_allreduce_rmsnorm(ranks, xs, res_in, None, weight, residual_in_sharded=sharded,
                                  residual_out_sharded=sharded, comm_ctas=ctas, outputs=outputs,
                                  batch_invariant=invariant)
    for r, (normed, res) in enumerate(outs[1:], 1):
        assert bic.same_bits(normed, outs[0][0]), f"rank {r} gathered other normed rows than rank 0"
        if not sharded:
            assert bic.same_bits(res, outs[0][1]), f"rank {r} gathered another residual than rank 0"
    res = torch.cat([o[1][:max(0, min(S, T - r * S))] for r, o in enumerate(outs)]) if sharded else outs[0][1]
    return outs[0][0], res


def same_as_alone(world, row_seed, T, pos, ctas, sharded, others, weight, invariant) -> tuple[bool, list[str]]:
    """Whether the row gives the same bits at ``pos`` of a T-row call on ``ctas`` CTAs as alone on one
    CTA; and what else is wrong (with the option: the row's fp32 residual in the same call, fp32
    residual in and out, not the rank-order fp32 sum)."""
    parts, res_row = bic.row_partials(row_seed, world, H)
    errs = []
    n1, r1 = push_rows(world, [p[None] for p in parts], res_row[None], weight, invariant=invariant,
                       sharded=sharded, ctas=1)
    xs, residual = bic.batch_with_row(parts, res_row, T, pos, others)
    normed, res = push_rows(world, xs, residual, weight, invariant=invariant, sharded=sharded, ctas=ctas)
    if invariant:
        _, res32 = push_rows(world, xs, residual.float(), weight, invariant=True, sharded=sharded, ctas=ctas)
        if not torch.equal(res32[pos], bic.rank_order_residual(parts, res_row)):
            errs.append("the fp32 residual is not the rank-order fp32 sum")
    return bic.same_bits(normed[pos], n1[0]) and bic.same_bits(res[pos], r1[0]), errs


def _weight(seed):
    return (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed))).to(BF16)


def _invariant(world: int, seed: int) -> int:
    return bic.check_placements(world, seed, same_as_alone, _weight(seed), "PUSH-INVARIANT OK")


def _discriminate(seed: int) -> int:
    """At 3 ranks without the option some owner's order shows in the bits; with it none does."""
    torch.set_num_threads(1)
    weight = torch.ones(H, dtype=BF16)
    differ = []
    for k in range(3):
        for T, pos, ctas in ((9, 8, 2), (9, 4, 1)):  # owners 2 and 1
            same, _ = same_as_alone(3, seed + k, T, pos, ctas, False, seed + 100 + k, weight, False)
            differ.append(not same)
            same_inv, errs = same_as_alone(3, seed + k, T, pos, ctas, False, seed + 100 + k, weight, True)
            assert same_inv and not errs, (k, T, pos, errs)
    print("differ without the option:", differ)
    if not any(differ):
        print("the check cannot tell the orders apart: the invariance test would prove nothing")
        return 1
    print("PUSH-DISCRIMINATES OK")
    return 0


def _property(examples: int, seed: int) -> int:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis import strategies as st

    torch.set_num_threads(1)
    weight = _weight(seed)

    @hyp_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(world=st.integers(2, 4), row_seed=st.integers(0, 2**20), T=st.integers(1, 40), where=st.floats(0, 1),
           ctas=st.integers(1, 4), sharded=st.booleans(), others=st.integers(0, 2**20))
    def prop(world, row_seed, T, where, ctas, sharded, others):
        pos = min(T - 1, int(where * T))
        same, errs = same_as_alone(world, row_seed, T, pos, ctas, sharded, others, weight, True)
        assert same and not errs, f"world={world} T={T} row {pos} ctas={ctas} sharded={sharded}: {errs or 'differs'}"

    prop()
    print("PUSH-INVARIANT PROPERTY OK")
    return 0


def _script(args, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1")
    rc, out = run_script(THIS_FILE, args, timeout=timeout, env=env)
    return rc, out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_push_rows_do_not_depend_on_the_batch_in_cpu_interpreter(world, seed):
    rc, out = _script(["--world", str(world), "--seed", str(seed % 10**6)])
    assert rc == 0 and "PUSH-INVARIANT OK" in out, out[-8000:]


def test_without_the_option_the_owner_shows_in_the_bits(seed):
    rc, out = _script(["--discriminate", "--seed", str(seed % 10**6)])
    assert rc == 0 and "PUSH-DISCRIMINATES OK" in out, out[-8000:]


@pytest.mark.slow
def test_push_invariance_property_in_cpu_interpreter(seed):
    rc, out = _script(["--property", "20", "--seed", str(seed % 10**6)])
    assert rc == 0 and "PUSH-INVARIANT PROPERTY OK" in out, out[-8000:]


def test_the_invariant_shape_does_not_move_with_t_or_the_cta_count():
    """One-row tiles, the pipelined add+norm loop and warps from H alone, at every T and CTA count;
    without the option the shapes do move (so the pinning is needed)."""
    from weave_compile.kernels.p2p import launch

    for H_, world, nbytes in ((4096, 2, 2), (4096, 3, 2), (8192, 4, 2), (2048, 2, 2), (1024, 3, 4), (40, 3, 2)):
        metas = [launch.push_meta(H_, S, ctas, world, nbytes, nbytes, None, True)
                 for S in (1, 2, 3, 7, 64, 513, 4096) for ctas in (1, 8, 32)]
        for m in metas:
            assert (m.block_rows, m.norm_unroll, m.norm_prefetch, m.norm_chunk) == (1, 1, False, 0), m
            assert m.num_warps == metas[0].num_warps and m.block_h == metas[0].block_h, (m, metas[0])
            launch.check_invariant_meta(m)
    plain = {(m.block_rows, m.norm_prefetch, m.norm_chunk) for m in
             (launch.push_meta(4096, S, 8, 2, 2, 2) for S in (1, 64, 4096))}
    assert len(plain) > 1, plain


def test_the_launcher_passes_rank_order_only_with_the_option(monkeypatch):
    """Without ``batch_invariant`` the launch has no ``RANK_ORDER`` keyword (the kernel and binary are the
    ones they were); with it ``RANK_ORDER=True`` on one-row pipelined tiles at every T. A given shape
    that cannot keep the option is refused. The kernel is stubbed: nothing runs."""
    from weave_compile.kernels.p2p import launch
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    seen = []

    class _Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(launch, "push_allreduce_rmsnorm_kernel", _Stub())
    ws = EmulatedRanks.create(3, H, 64, dtype=BF16, device="cpu").workspaces[0]
    for T in (1, 5, 64):
        for inv in (False, True):
            seen.clear()
            x = torch.randn(T, H).to(BF16)
            spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, comm_ctas=4, batch_invariant=inv)
            launch.launch_push(ws, Rows(x), spec, torch.empty(T, H, dtype=BF16), torch.empty(T, H, dtype=BF16))
            (kw,) = seen
            if inv:
                assert kw["RANK_ORDER"] is True and kw["BLOCK_ROWS"] == 1 and kw["NORM_UNROLL"] == 1, kw
                assert not kw["NORM_PREFETCH"] and kw["NORM_CHUNK"] == 0, kw
            else:
                assert "RANK_ORDER" not in kw, kw
    x = torch.randn(64, H).to(BF16)
    spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, comm_ctas=4, batch_invariant=True)
    for bad in (launch.push_meta(H, 22, 4, 3, 2, 2), launch.pipelined_meta(H, 22, 4, 3, 2, 2)):
        assert bad.norm_prefetch or bad.block_rows > 1, bad
        with pytest.raises(ValueError, match="batch_invariant runs the pipelined add.norm loop on one-row tiles"):
            launch.launch_push(ws, Rows(x), spec, torch.empty(64, H, dtype=BF16), torch.empty(64, H, dtype=BF16),
                               meta=bad)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--discriminate", action="store_true")
    ap.add_argument("--property", type=int, default=0)
    a = ap.parse_args()
    if a.property:
        sys.exit(_property(a.property, a.seed))
    sys.exit(_discriminate(a.seed) if a.discriminate else _invariant(a.world, a.seed))
