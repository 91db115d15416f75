"""benchmarks/fake_group.py: the fused op's collectives as the fake group's all_reduce gives them to
plain Inductor (its input is the sum), against the float64 oracle with one rank's partials; on CPU
the add+norm runs its torch path."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.kernels.spec import FusedSpec, Rows
from weave_compile.testing.numerics import rel_err

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import fake_group  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("T,sharded_in,sharded_out", [(7, False, False), (7, False, True), (1, True, True),
                                                      (2, False, True)])
def test_identity_run_is_the_site_as_written_under_the_fake_all_reduce(group, seed, T, sharded_in,  # noqa: F811
                                                                       sharded_out):
    H = 48
    g = torch.Generator().manual_seed(seed)
    x, res, w = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g), torch.randn(H, generator=g)
    S = math.ceil(T / 2)
    spec = FusedSpec(residual_dtype=torch.float32, out_dtype=torch.float32, eps=1e-6, group_name=group,
                     residual_in_sharded=sharded_in, residual_out_sharded=sharded_out)
    normed, res_out = fake_group.identity_run(Rows(x, res[:S] if sharded_in else res, None, w), spec)
    want_n, want_r = allreduce_add_rmsnorm_ref([x], res, None, w, eps=1e-6)  # one partial: x is the sum
    assert rel_err(normed, want_n) < 1e-5
    if sharded_out:
        assert res_out.shape == (S, H) and rel_err(res_out[:min(S, T)], want_r[:min(S, T)]) < 1e-5
        assert not res_out[T:].any()
    else:
        assert rel_err(res_out, want_r) < 1e-5


def test_a_sharded_residual_beyond_rank_0s_rows_is_refused(group):  # noqa: F811
    spec = FusedSpec(residual_dtype=torch.float32, out_dtype=torch.float32, eps=1e-6, group_name=group,
                     residual_in_sharded=True, residual_out_sharded=True)
    with pytest.raises(fake_group.OutsideIdentityMode, match="rank 0's 2 of 3 rows"):
        fake_group.identity_run(Rows(torch.randn(3, 8), torch.randn(2, 8), None, None), spec)


def test_identity_collectives_swaps_the_gpu_fallback_for_the_block():
    from weave_compile.kernels import registry

    before = registry.get("nccl")
    with fake_group.identity_collectives():
        assert registry.get("nccl").run is fake_group.identity_run
        assert registry.get("nccl").gpu_fallback and registry.get("nccl").check is before.check
    assert registry.get("nccl") is before


def test_written_collectives_write_every_row_and_leave_with_the_block(group, seed):  # noqa: F811
    """The fake group writes no row of a reduce-scatter's or all-gather's output; GEMMs that read
    such rows run faster on what the allocator hands out (zeros) than on real values."""
    from weave_compile.rows import all_gather_rows, reduce_scatter_rows

    g = torch.Generator().manual_seed(seed)
    shard, full = torch.randn(3, 8, generator=g), torch.randn(6, 8, generator=g)
    name = "_c10d_functional::all_gather_into_tensor"
    with fake_group.written_collectives():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
        assert torch.equal(all_gather_rows(shard, group, 2), torch.cat([shard, shard]))  # rank 0's rows, twice
        assert torch.equal(reduce_scatter_rows(full, group, 2), full[:3])  # rank 0's rows: its partial is the sum
        # batch_invariant's all-to-all: every peer's block of rank 0's slice is rank 0's own block
        out = torch.ops._c10d_functional.all_to_all_single(full, [3, 3], [3, 3], group)
        assert torch.equal(torch.ops._c10d_functional.wait_tensor(out), torch.cat([full[:3], full[:3]]))
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")  # torch's own kernel again


@pytest.mark.parametrize("dtype,H,word", [(torch.uint8, 4100, torch.int32), (torch.float8_e4m3fn, 4096, torch.int64),
                                          (torch.bfloat16, 4096, torch.int64), (torch.uint8, 33, torch.uint8),
                                          (torch.float32, 1, torch.float32), (torch.bfloat16, 3, torch.bfloat16)])
def test_the_written_gather_copies_words_and_gives_rank_0s_bytes(group, seed, dtype, H, word):  # noqa: F811
    """The gather's stand-in goes with the bytes it writes (fake_group.as_words): fp8 codes and
    bf16 rows copied as the widest words their rows divide into, every byte rank 0's."""
    from weave_compile.rows import all_gather_rows

    g = torch.Generator().manual_seed(seed)
    shard = torch.randint(0, 256, (3, H * dtype.itemsize), dtype=torch.uint8, generator=g).view(dtype)
    assert fake_group.as_words(shard).dtype == word
    assert fake_group.as_words(shard.t()).dtype == dtype  # not contiguous: as it is
    with fake_group.written_collectives():
        out = all_gather_rows(shard, group, 2)
    assert out.dtype == dtype and out.shape == (6, H)
    assert torch.equal(out.view(torch.uint8), torch.cat([shard, shard]).view(torch.uint8))


@pytest.mark.parametrize("T", [7, 8])
def test_the_gpu_fallback_on_the_fake_group_returns_real_rows_only(group, seed, T):  # noqa: F811
    """``nccl`` (reduce-scatter, add+norm, all-gather) under written collectives: rank 0's rows are
    the site as written for its partials, the peer's rows a copy of them: no row left unwritten."""
    from weave_compile.kernels import registry

    H = 16
    g = torch.Generator().manual_seed(seed)
    x, res, w = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g), torch.randn(H, generator=g)
    spec = FusedSpec(residual_dtype=torch.float32, out_dtype=torch.float32, eps=1e-6, group_name=group,
                     residual_in_sharded=False, residual_out_sharded=False)
    with fake_group.written_collectives():
        normed, res_out = registry.get("nccl").run(Rows(x, res, None, w), spec)
    S = math.ceil(T / 2)
    want_n, want_r = allreduce_add_rmsnorm_ref([x], res, None, w, eps=1e-6)
    assert rel_err(normed[:S], want_n[:S]) < 1e-5 and rel_err(res_out[:S], want_r[:S]) < 1e-5
    assert torch.equal(normed[S:], normed[:T - S]) and torch.equal(res_out[S:], res_out[:T - S])
