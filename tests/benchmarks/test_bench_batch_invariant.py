"""benchmarks/bench_batch_invariant.py's row check on CPU (the fake group, its collectives written;
the timing needs a GPU): a row of this rank's slice of a T-row call against the row alone."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_batch_invariant  # noqa: E402
import fake_group  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("T", [1, 2, 7, 64])
def test_rows_of_the_invariant_reference_are_the_same_alone(group, T):  # noqa: F811
    import weave_compile.ops  # noqa: F401

    weight = (1 + 0.1 * torch.randn(32, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    with fake_group.written_collectives():
        assert bench_batch_invariant.row_check("reference", T, 32, 2, weight, group, torch.device("cpu"))


@pytest.mark.parametrize("T", [1, 7, 64])
def test_ce_rows_checked_through_its_add_norm_kernel(T):
    """The ``ce`` runner: the add+norm as ce's program launches it (the rank-order variant with the
    option), a row of a T-row call against the row alone (torch path on CPU)."""
    weight = (1 + 0.1 * torch.randn(32, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    assert bench_batch_invariant.row_check("ce", T, 32, 3, weight, "", torch.device("cpu"))
    x, recv, residual = bench_batch_invariant._ce_inputs(T, 32, 3, 0, torch.device("cpu"))
    assert recv.shape == (2, x.shape[0], 32) and residual.shape == x.shape == (-(-T // 3), 32)
    n0, r0 = bench_batch_invariant._ce_addnorm(x, recv, residual, weight, False)
    n1, r1 = bench_batch_invariant._ce_addnorm(x, recv, residual, weight, True)
    assert torch.allclose(r0.float(), r1.float(), rtol=1e-2, atol=1e-2)  # the same sum, another order
