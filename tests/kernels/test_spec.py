"""The op's arguments as implementations receive them (kernels/spec.py): one validated spec, one rows adapter."""

import dataclasses

import pytest
import torch

from weave_compile.kernels.shared.common import MAX_CTAS
from weave_compile.kernels.spec import FusedSpec, Rows


def test_the_spec_is_validated_once_where_it_is_built():
    spec = FusedSpec(residual_dtype=torch.float32, out_dtype=torch.bfloat16, comm_ctas=MAX_CTAS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.comm_ctas = 8  # handed down unchanged
    for bad in (0, MAX_CTAS + 1, True, 2.0):
        with pytest.raises(ValueError, match=r"comm_ctas must be an int in \[1, 32\]"):
            dataclasses.replace(spec, comm_ctas=bad)
    with pytest.raises(ValueError, match="out_slot"):
        dataclasses.replace(spec, out_slot=-2)
    with pytest.raises(TypeError, match="out_dtype must be a torch.dtype"):
        dataclasses.replace(spec, out_dtype="bf16")
    with pytest.raises(TypeError, match="mid_dtype"):
        dataclasses.replace(spec, mid_dtype="bf16")


def test_a_direct_call_spec_takes_its_dtypes_from_the_inputs():
    x, res = torch.randn(3, 8).bfloat16(), torch.randn(3, 8)
    assert FusedSpec.for_rows(x, res) == FusedSpec(residual_dtype=torch.float32, out_dtype=torch.bfloat16)
    assert FusedSpec.for_rows(x).residual_dtype == torch.bfloat16
    assert FusedSpec.for_rows(x, res, residual_dtype=None, out_dtype=torch.float16).out_dtype == torch.float16


@pytest.mark.parametrize("sharded_in,sharded_out", [(False, False), (True, True), (False, True), ("3d", True)])
def test_rows_view_any_leading_dims_as_token_rows_and_back(sharded_in, sharded_out):
    x = torch.randn(2, 5, 8)
    # a shard as the shard pass hands it on ([S, H]) or as a sequence-parallel model keeps it
    residual = {True: torch.randn(3, 8), "3d": torch.randn(1, 3, 8), False: torch.randn(2, 5, 8)}[sharded_in]
    rows = Rows.of(x, residual, torch.randn(1, 8), torch.randn(8))
    assert rows.x.shape == (10, 8) and rows.x.data_ptr() == x.data_ptr()  # a view, no copy
    assert rows.residual.shape == ((3, 8) if sharded_in else (10, 8))
    assert rows.residual.data_ptr() == residual.data_ptr()
    assert rows.bias.shape == (8,) and rows.weight.shape == (8,)
    assert (rows.num_tokens, rows.hidden) == (10, 8)
    normed, res_out, scales = rows.restore(torch.randn(10, 8), torch.randn(3 if sharded_out else 10, 8), sharded_out)
    assert scales.numel() == 0  # no epilogue: no scales
    assert normed.shape == (2, 5, 8) and res_out.shape == ((3, 8) if sharded_out else (2, 5, 8))


def test_rows_refuse_a_bias_or_weight_that_is_not_one_per_column():
    with pytest.raises(ValueError, match="bias must have 8 elements"):
        Rows.of(torch.randn(4, 8), bias=torch.randn(4))
    with pytest.raises(ValueError, match="weight must have 8 elements"):
        Rows.of(torch.randn(4, 8), weight=torch.randn(2, 8))
