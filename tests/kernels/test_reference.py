"""The float64 oracle, checked by hand and against the contract's cast order."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.rows import norm_rows


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


# ----------------------------------------------------------------------------- LayerNorm


def test_oracle_layernorm_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    w, nb = torch.tensor([1.0, 2.0, 0.5, 1.0]), torch.tensor([0.0, 1.0, 0.0, -1.0])
    normed, r = allreduce_add_rmsnorm_ref([x], None, None, w, eps=0.0, norm="layernorm", norm_bias=nb)
    # mean 3, centred [-2, -1, 0, 3], variance 14 / 4
    std = math.sqrt(14 / 4)
    expected = torch.tensor([[-2 / std, -1 / std * 2 + 1, 0.0, 3 / std - 1]])
    assert torch.equal(r, x)
    torch.testing.assert_close(normed, expected)
    with pytest.raises(ValueError, match="norm must be"):
        allreduce_add_rmsnorm_ref([x], norm="batchnorm")


def test_the_reference_layernorm_takes_the_variance_of_the_centred_row():
    """Rows far from zero against their spread: E[x^2] - mean^2 in fp32 loses every digit there
    (an ulp of 1e8 is 8); the mean square of the centred row keeps them."""
    g = torch.Generator().manual_seed(0)
    res = 1e4 + torch.randn(6, 256, generator=g)
    got = norm_rows(res, None, 1e-5, torch.float32, None, 0.0, "layernorm")
    ref, _ = allreduce_add_rmsnorm_ref([res], None, None, None, eps=1e-5, norm="layernorm")
    assert (got - ref).abs().max() < 1e-2
    naive = (res - res.mean(-1, keepdim=True)) * torch.rsqrt(
        (res * res).mean(-1, keepdim=True) - res.mean(-1, keepdim=True) ** 2 + 1e-5)
    assert not (naive - ref).abs().max() < 1e-2  # what the test would catch


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 5), hidden=st.sampled_from([1, 2, 7, 64, 320]),
    offset=st.sampled_from([0.0, 3.0, -100.0, 1e3]), spread=st.sampled_from([1e-3, 1.0, 30.0]),
    out_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    res_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    weight=st.booleans(), norm_bias=st.booleans(), mid=st.booleans(),
    eps=st.sampled_from([1e-5, 1e-6, 0.1]), seed=st.integers(0, 2**16),
)
def test_reference_layernorm_epilogue_matches_the_float64_oracle(rows, hidden, offset, spread, out_dtype, res_dtype,
                                                                 weight, norm_bias, mid, eps, seed):
    """The reference's epilogue (``rows.norm_rows``, what ``reference`` runs on its rows) against the
    float64 oracle: within a few roundings of the output dtype (mid: of bf16 before the weight),
    plus fp32's centring error, an ulp of the mean over the spread."""
    g = torch.Generator().manual_seed(seed)
    res = (offset + spread * torch.randn(rows, hidden, generator=g)).to(res_dtype)
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(res_dtype) if weight else None
    nb = torch.randn(hidden, generator=g).to(res_dtype) if norm_bias else None
    mid_dtype = torch.bfloat16 if mid and weight else None
    got = norm_rows(res, w, eps, out_dtype, mid_dtype, 0.0, "layernorm", nb)
    ref, r = allreduce_add_rmsnorm_ref([res], None, None, w, eps=eps, out_dtype=torch.float64, mid_dtype=mid_dtype,
                                       norm="layernorm", norm_bias=nb)
    assert got.dtype == out_dtype and torch.equal(r, res)
    y0, _ = allreduce_add_rmsnorm_ref([res], eps=eps, out_dtype=torch.float64, norm="layernorm")  # normed alone
    r64 = res.double()
    std = (r64.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    centring = 2 ** -22 * (r64.mean(-1, keepdim=True).abs() + r64.abs().amax(-1, keepdim=True)) / std
    wabs = 1.0 if w is None else w.double().abs()
    mid_step = 2 ** -7 if mid_dtype is not None else 0.0
    tol = ((centring + 8 * torch.finfo(torch.float32).eps) * (y0.abs() + 1) + mid_step * y0.abs()) * wabs \
        + torch.finfo(out_dtype).eps * ref.abs() + 1e-6
    err = (got.double() - ref).abs()
    assert (err <= tol).all(), f"max err {err.max():.3g}, worst excess {(err - tol).max():.3g}"
