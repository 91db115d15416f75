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
