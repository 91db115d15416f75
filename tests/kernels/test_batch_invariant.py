"""``batch_invariant``: a row's outputs of the fused op are bitwise the same whatever else is in the
call. Property tests (hypothesis, the same seeded examples on every gloo rank, every rank taking
the same branch) of every implementation that claims it and runs on CPU ranks (``reference``;
``nccl``, whose add+norm takes its torch path there):
one row, whose partial sums, residual and position are drawn, is run in calls of T rows (odd
counts, counts below the rank count, counts not divisible by it), at 2-4 ranks, with a full or
sharded residual, and its normed row and residual row must equal, bit for bit, those of the same
row run alone (without the option the same property fails at 3 ranks: gloo's reduce-scatter adds
a row's partials in an order that depends on the rank that owns it). Also: the sum is the
rank-order fp32 sum, as accurate against the float64 oracle as the contract asks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

H = 48
TIMEOUT = 600


def _row(seed: int, rank: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's partial sum on ``rank`` and its residual (every rank builds the same residual),
    scaled so that the partial sums cancel in part: the order of their sum shows in the bits."""
    g = torch.Generator().manual_seed(seed * 16 + rank)
    x = (torch.randn(H, generator=g) * (1 + 1000 * (rank % 2))).to(dtype)
    r = torch.randn(H, generator=torch.Generator().manual_seed(seed * 16 + 15)).to(dtype)
    return x, r


def _run(impl, x, residual, weight, group_name, world, rank, sharded: bool, dtype):
    """The op's rows of a call: normed [T, H] and the full residual out [T, H] (gathered by hand
    where the op returns this rank's shard, so every rank compares every row)."""
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.rows import all_gather_rows, pad_rows, rows_per_rank

    T = x.shape[0]
    S = rows_per_rank(T, world)
    res_in = pad_rows(residual, S * world)[rank * S:(rank + 1) * S] if sharded else residual
    spec = FusedSpec(residual_dtype=dtype, out_dtype=dtype, group_name=group_name, residual_in_sharded=sharded,
                     residual_out_sharded=sharded, batch_invariant=True)
    normed, res = impl.run(Rows.of(x, res_in, None, weight, None, None), spec)
    if sharded:
        res = all_gather_rows(res, group_name, world)[:T]
    return normed, res


def _property(rank, world, seed, examples, name, dtype_name):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis import strategies as st

    from weave_compile.kernels import registry

    impl = registry.get(name)
    dtype = getattr(torch, dtype_name)
    group_name = dist.group.WORLD.group_name
    weight = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed))).to(dtype)
    checked = []

    @hyp_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(row_seed=st.integers(0, 2**20), T=st.one_of(st.integers(1, world + 1), st.integers(1, 4096)),
           where=st.floats(0, 1), sharded=st.booleans(), others=st.integers(0, 2**20))
    def prop(row_seed, T, where, sharded, others):
        p = min(T - 1, int(where * T))
        g = torch.Generator().manual_seed(others * 16 + rank)
        x = torch.randn(T, H, generator=g).to(dtype)
        residual = torch.randn(T, H, generator=torch.Generator().manual_seed(others * 16 + 15)).to(dtype)
        x[p], residual[p] = _row(row_seed, rank, dtype)
        alone_x, alone_r = _row(row_seed, rank, dtype)
        normed, res = _run(impl, x, residual, weight, group_name, world, rank, sharded, dtype)
        n1, r1 = _run(impl, alone_x[None], alone_r[None], weight, group_name, world, rank, sharded, dtype)
        same = torch.equal(normed[p], n1[0]) and torch.equal(res[p], r1[0])
        ok = torch.tensor([1.0 if same else 0.0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank takes the same branch
        checked.append(T)
        assert ok.item() == 1.0, (f"T={T} row {p} (owner rank {p // -(-T // world)}), sharded={sharded}: "
                                  f"{'differs from the row alone' if not same else 'failed on another rank'}")

    prop()
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name,dtype", [("reference", "bfloat16"), ("reference", "float32"), ("nccl", "bfloat16")])
def test_rows_are_bitwise_the_same_whatever_the_batch(world, name, dtype):
    seed = random.randrange(2**31)
    runs = assert_ranks_ok(run_ranks(_property, world, args=(seed, 25, name, dtype), timeout=TIMEOUT))
    ts = runs[0]
    assert len(ts) >= 25, f"seed={seed}: only {len(ts)} examples ran"
    assert any(t < world for t in ts) and any(t % world for t in ts), (seed, ts)  # the awkward counts came up


def _order(rank, world):
    """The same rows summed with and without the option: with it, the sum is the rank-order fp32
    sum rounded once (computed here by hand); the row's error against float64 stays the
    contract's (the option changes the order, not the accuracy)."""
    from weave_compile.kernels import registry
    from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref

    impl = registry.get("reference")
    T = 7
    parts = [torch.randn(T, H, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16) for r in range(world)]
    residual = torch.randn(T, H, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)
    weight = torch.ones(H, dtype=torch.bfloat16)
    normed, res = _run(impl, parts[rank], residual, weight, dist.group.WORLD.group_name, world, rank, False,
                       torch.bfloat16)
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    want_res = (acc + residual.float()).to(torch.bfloat16)
    ref_n, ref_r = allreduce_add_rmsnorm_ref(parts, residual, None, weight)
    err = ((normed.double() - ref_n.double()).norm() / ref_n.double().norm()).item()
    return {"res_equal": torch.equal(res, want_res), "err": err}


def test_the_sum_is_in_rank_order_in_fp32_and_as_accurate():
    for run in assert_ranks_ok(run_ranks(_order, 3, timeout=TIMEOUT)):
        assert run["res_equal"] and run["err"] < 1e-2, run
