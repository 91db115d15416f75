"""Tests for kernels/shared/rownorm.py's contract: the float64 oracle the kernel tests compare with.

The add + RMSNorm body itself runs inside every kernel test (CPU interpreter simulations in
test_launch.py and test_push.py, GPU suites); here the oracle (rounded to the kernel's output
dtypes, tests/kernels/_symm_cases.py) is checked against the op as a model writes it, and by
hand.
"""

import math

import pytest
import torch

from tests.kernels._symm_cases import DTYPES, kernel_kwargs, make_case, make_inputs, reference, rows_ref


def _direct_fp32(xs, residual, bias, weight, eps, residual_dtype, out_dtype, mid_dtype,
                 weight_offset):
    """The op as a model would write it (fp32, HF style)."""
    h = torch.stack([x.float() for x in xs]).sum(0)
    if bias is not None:
        h = h + bias.float()
    if residual is not None:
        h = h + residual.float()
    res = h.to(residual_dtype)
    hf = res.float()
    var = hf.pow(2).mean(-1, keepdim=True)
    y = hf * torch.rsqrt(var + eps)
    if mid_dtype is not None:
        y = y.to(mid_dtype).float()
    if weight is not None:
        y = (weight.float() + weight_offset) * y
    return y.to(out_dtype), res


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("res", ["full", "none"])
@pytest.mark.parametrize("extras", ["plain", "mid", "gemma", "fp32res", "nobias"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_reference_matches_direct_formula(dtype, res, extras, world):
    c = make_case(37, 96, dtype, res=res, bias=extras != "nobias",
                  mid="bf16" if extras == "mid" else None,
                  woff=1.0 if extras == "gemma" else 0.0,
                  res_dtype="fp32" if extras == "fp32res" else None, seed=world * 7 + 1)
    xs, residual, bias, weight = make_inputs(c, world, "cpu")
    ref_n, ref_r = reference(c, xs, residual, bias, weight)
    kw = kernel_kwargs(c)
    dt = DTYPES[dtype]
    rdt = kw["residual_dtype"] or (residual.dtype if residual is not None else dt)
    d_n, d_r = _direct_fp32(xs, residual, bias, weight, kw["eps"], rdt, kw["out_dtype"] or dt,
                            kw["mid_dtype"], kw["weight_offset"])
    assert ref_n.dtype == d_n.dtype and ref_r.dtype == d_r.dtype == rdt
    assert ref_n.shape == (37, 96) and ref_r.shape == (37, 96)
    tol_r = 1e-5 if rdt == torch.float32 else 1e-2
    torch.testing.assert_close(ref_r.double(), d_r.double(), rtol=tol_r, atol=tol_r)
    tol_n = 1e-4 if (ref_n.dtype == torch.float32 and not kw["mid_dtype"]) else 2e-2
    torch.testing.assert_close(ref_n.double(), d_n.double(), rtol=tol_n, atol=tol_n)


def test_reference_semantics_small_exact():
    # hand-checkable: two ranks, one row, H=4, fp32 everywhere
    xs = [torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([[1.0, 0.0, -1.0, 0.0]])]
    res = torch.tensor([[0.0, 0.0, 0.0, 4.0]])
    bias = torch.tensor([1.0, 1.0, 1.0, 1.0])
    w = torch.tensor([1.0, 2.0, 0.5, 0.0])
    n, r = rows_ref(xs, res, bias, w, eps=0.0, weight_offset=1.0)
    assert torch.equal(r, torch.tensor([[3.0, 3.0, 3.0, 9.0]]))
    rms = math.sqrt((9 + 9 + 9 + 81) / 4)
    expect = torch.tensor([[3 / rms * 2, 3 / rms * 3, 3 / rms * 1.5, 9 / rms * 1]])
    torch.testing.assert_close(n, expect)
