"""The float64 oracle, checked by hand and against the contract's cast order."""

import math

import pytest
import torch

from weave_compile.ops.reference import allreduce_add_rmsnorm_ref, norm_rows, rows_per_rank


def test_oracle_small_case_by_hand():
    xs = [torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[1.0, 0.0, -1.0, 0.0]])]
    res = torch.tensor([[0.0, 0.0, 0.0, 4.0]])
    bias = torch.tensor([1.0, 1.0, 1.0, 1.0])
    w = torch.tensor([1.0, 2.0, 0.5, 0.0])
    normed, r = allreduce_add_rmsnorm_ref(xs, res, bias, w, eps=0.0, weight_offset=1.0, scale=torch.tensor(0.5))
    # (x0 + x1) * 0.5 + bias + res = [2, 2, 2, 7]
    assert torch.equal(r, torch.tensor([[2.0, 2.0, 2.0, 7.0]]))
    rms = math.sqrt((4 + 4 + 4 + 49) / 4)
    torch.testing.assert_close(normed, torch.tensor([[2 / rms * 2, 2 / rms * 3, 2 / rms * 1.5, 7 / rms * 1]]))


def test_oracle_rounds_where_the_contract_rounds(seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(5, 64, generator=g).bfloat16() for _ in range(3)]
    res = torch.randn(5, 64, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    normed, r = allreduce_add_rmsnorm_ref(xs, res, None, w, eps=1e-6, mid_dtype=torch.bfloat16)
    assert normed.dtype == torch.bfloat16 and r.dtype == torch.bfloat16  # defaults: the inputs' dtypes
    exact = sum(x.double() for x in xs) + res.double()
    assert torch.equal(r, exact.bfloat16())
    # The norm reads the rounded residual, casts to mid before the weight: the contract's order.
    rd = r.double()
    y = (rd * torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().double() * w.double()
    assert torch.equal(normed, y.bfloat16())
    n32, r32 = allreduce_add_rmsnorm_ref(xs, res, None, w, residual_dtype=torch.float32, out_dtype=torch.float32)
    assert n32.dtype == r32.dtype == torch.float32 and not torch.equal(r32, r.float())


def test_norm_rows_follows_the_same_order_in_float32(seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(7, 32, generator=g).bfloat16()
    w = torch.randn(32, generator=g)
    ref, _ = allreduce_add_rmsnorm_ref([r], None, None, w, eps=1e-5, weight_offset=1.0, out_dtype=torch.float32,
                                       mid_dtype=torch.bfloat16)
    got = norm_rows(r, w, 1e-5, torch.float32, torch.bfloat16, 1.0)
    # Only the mid cast may round differently (fp32 vs fp64 before it): one bf16 ulp at most.
    assert ((got - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()


def test_oracle_needs_partials():
    with pytest.raises(ValueError, match="one tensor per rank"):
        allreduce_add_rmsnorm_ref([])


@pytest.mark.parametrize("t,n,want", [(1, 2, 1), (7, 2, 4), (8, 4, 2), (9, 8, 2)])
def test_rows_per_rank_is_ceil(t, n, want):
    assert rows_per_rank(t, n) == want
