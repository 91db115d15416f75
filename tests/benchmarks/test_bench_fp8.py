"""benchmarks/bench_fp8.py on CPU (the fake group, its collectives written; the timing needs a GPU):
its epilogue check passes on the op's own rows, and the variants it times compute the same codes
and scales (the quant outside the op against the op's epilogue)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_fp8  # noqa: E402
import fake_group  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("T", [1, 37])
def test_the_timed_variants_agree_and_the_check_passes(group, T):  # noqa: F811
    import weave_compile.ops  # noqa: F401

    with fake_group.written_collectives():
        run, inputs = bench_fp8.runners(T, 64, 2, group, torch.device("cpu"))
        assert bench_fp8.codes_off(*inputs, group) < 0.01
        (q_out, s_out), res_out = run["op_then_quant"]()
        q_in, res_in, s_in = run["epilogue"]()
    assert q_in.dtype == q_out.dtype == bench_fp8.FP8 and q_in.shape == q_out.shape == (T, 64)
    assert torch.equal(res_in, res_out)
    assert torch.allclose(s_in, s_out, rtol=2e-7, atol=0)
    assert (q_in.float() != q_out.float()).float().mean() < 0.01  # one step off on a rounding boundary at most


def test_each_rank_times_its_own_residual_shard(group):  # noqa: F811
    """Under ``--real`` every rank draws the same residual and takes its own rows of it (padded to
    whole shards), and its own partial sums."""
    import weave_compile.ops  # noqa: F401

    T, H, world = 5, 16, 2
    with fake_group.written_collectives():
        shards = [bench_fp8.runners(T, H, world, group, torch.device("cpu"), rank)[1] for rank in range(world)]
    x0, s0, _ = shards[0]
    x1, s1, _ = shards[1]
    assert s0.shape == s1.shape == (3, H) and not torch.equal(x0, x1)
    full = torch.randn(T, H, generator=torch.Generator().manual_seed(T * 7 + H)).to(torch.bfloat16)
    assert torch.equal(torch.cat([s0, s1])[:T], full) and torch.all(s1[2:] == 0)
