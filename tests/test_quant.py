"""The fp8 epilogue's math (``weave_compile.quant``): the fp32 torch path against the float64
oracle, the spec's checks and its text form."""

from __future__ import annotations

import pytest
import torch

import zlib

from weave_compile.quant import QuantSpec, dequantize, quantize_ref, quantize_rows, quotient_ref
from weave_compile.testing.numerics import codes_agree

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype,fp8_max", [(E4M3, 448.0), (E5M2, 57344.0)])
@pytest.mark.parametrize("reciprocal", [False, True])
@pytest.mark.parametrize("kind", ["row", "static"])
def test_the_fp32_path_matches_the_float64_oracle(kind, reciprocal, dtype, fp8_max, seed):
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind} {reciprocal} {dtype} {seed}".encode()))
    y = (torch.randn(257, 96, generator=g) * torch.rand(257, 1, generator=g) * 4).to(torch.bfloat16)
    spec = QuantSpec(kind, dtype, fp8_max, floor=1e-6 if kind == "row" else 0.0, reciprocal=reciprocal)
    # a calibrated static scale: the largest value maps to the format's top
    scale = (y.float().abs().max() / fp8_max).reshape(()) if kind == "static" else None
    q, s = quantize_rows(y, spec, scale)
    q_ref, s_ref = quantize_ref(y, spec, scale)
    assert q.dtype == dtype and q.shape == y.shape
    if kind == "row":
        assert s.shape == (257, 1) and s.dtype == torch.float32
        ulps = ((s.double() - s_ref.double()).abs() / torch.finfo(torch.float32).eps / s_ref.double()).max()
        assert ulps <= 1.0, f"row scales {ulps:.2f} ulp from the oracle"
    else:
        assert s.numel() == 0
    frac, bad = codes_agree(q, q_ref, quotient_ref(y, spec, scale)[0])
    assert not bad, bad
    assert frac < 1e-3, f"{frac:.2%} of codes differ"
    # the values the codes stand for: within half a step of the rows
    deq = dequantize(q, s, spec, scale)
    assert ((deq - y.double()).norm() / y.double().norm()) < (0.04 if dtype == E4M3 else 0.08)


def test_a_row_of_zeros_gets_the_floor_as_its_scale_and_zero_codes():
    spec = QuantSpec("row", E4M3, 448.0, floor=1e-6)
    q, s = quantize_rows(torch.zeros(2, 8, dtype=torch.bfloat16), spec)
    assert torch.all(s == torch.tensor(1e-6, dtype=torch.float32)) and torch.all(q.float() == 0)


def test_the_clamp_bounds_codes_of_a_static_scale_too_small():
    spec = QuantSpec("static", E4M3, 448.0, clamp=True)
    q, _ = quantize_rows(torch.full((1, 4), 1000.0), spec, torch.tensor(1.0))
    assert torch.all(q.float() == 448.0)


@pytest.mark.parametrize("bad,match", [
    (dict(kind="tensor"), "quant must be one of"),
    (dict(dtype=torch.bfloat16), "quant_dtype must be one of"),
    (dict(fp8_max=0.0), "quant_max must be > 0"),
    (dict(floor=-1.0), "quant_floor must be >= 0"),
])
def test_a_bad_spec_is_named(bad, match):
    args = {**dict(kind="row", dtype=E4M3, fp8_max=448.0, floor=0.0), **bad}
    with pytest.raises(ValueError, match=match):
        QuantSpec(**args)


def test_the_text_form_round_trips_and_says_what_it_is():
    spec = QuantSpec("row", E5M2, 57344.0, 1e-12, True, False)
    assert QuantSpec.decode(spec.encode()) == spec
    assert spec.describe() == "fp8 e5m2 per-row" and spec.row_bytes(4096) == 4100
    assert QuantSpec("static", E4M3, 448.0).row_bytes(4096) == 4096
    assert QuantSpec.of("", None, 0.0, 0.0, False, True) is None
