"""The float64 oracle, checked by hand and against the contract's cast order."""

import math

import pytest
import torch

from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref


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
    # The norm reads the rounded residual: the same as normalizing that residual alone.
    alone, _ = allreduce_add_rmsnorm_ref([r], None, None, w, eps=1e-6, mid_dtype=torch.bfloat16)
    assert torch.equal(normed, alone)
    # mid_dtype rounds before the weight (an extra rounding step, visible in float32 output).
    with_mid, _ = allreduce_add_rmsnorm_ref([r], None, None, w, out_dtype=torch.float32, mid_dtype=torch.bfloat16)
    without, _ = allreduce_add_rmsnorm_ref([r], None, None, w, out_dtype=torch.float32)
    assert not torch.equal(with_mid, without)
    assert ((with_mid - without).abs() <= without.abs() * 2 ** -7 + 1e-6).all()  # by at most a bf16 rounding
    n32, r32 = allreduce_add_rmsnorm_ref(xs, res, None, w, residual_dtype=torch.float32, out_dtype=torch.float32)
    assert n32.dtype == r32.dtype == torch.float32 and not torch.equal(r32, r.float())


def test_oracle_needs_partials():
    with pytest.raises(ValueError, match="one tensor per rank"):
        allreduce_add_rmsnorm_ref([])
