"""The row bookkeeping and the RMSNorm of reduced rows (weave_compile/rows.py)."""

import pytest
import torch

from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.rows import norm_rows, rows_of_rank, rows_per_rank


def test_norm_rows_follows_the_same_order_in_float32(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(7, 32, generator=g).bfloat16()
    w = torch.randn(32, generator=g)
    ref, _ = allreduce_add_rmsnorm_ref([r], None, None, w, eps=1e-5, weight_offset=1.0, out_dtype=torch.float32,
                                       mid_dtype=torch.bfloat16)
    got = norm_rows(r, w, 1e-5, torch.float32, torch.bfloat16, 1.0)
    # Only the mid cast may round differently (fp32 vs fp64 before it): one bf16 ulp at most.
    assert ((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.parametrize("t,n,want", [(1, 2, 1), (7, 2, 4), (8, 4, 2), (9, 8, 2)])
def test_rows_per_rank_is_ceil(t, n, want):
    assert rows_per_rank(t, n) == want


@pytest.mark.parametrize("t,n", [(1, 2), (7, 2), (8, 4), (9, 8), (5, 4)])
def test_rows_of_rank_count_the_real_rows_of_each_shard(t, n):
    s = rows_per_rank(t, n)
    counts = [rows_of_rank(t, s, r) for r in range(n)]
    assert sum(counts) == t and all(0 <= c <= s for c in counts)
    assert counts == sorted(counts, reverse=True)  # padding only at the end


def test_group_size_rank_follows_groups_created_again_under_the_same_name():
    """Group names restart at "0" after destroy_process_group: the answer must be the new group's."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from weave_compile.rows import group_size_rank

    seen = []
    for world, rank in ((2, 0), (4, 1)):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            name = dist.group.WORLD.group_name
            seen.append((name, group_size_rank(name)))
        finally:
            dist.destroy_process_group()
    assert seen[0][0] == seen[1][0], seen  # the premise: the same name twice
    assert [v for _, v in seen] == [(2, 0), (4, 1)], seen
