"""weave::sibling_linear: one GEMM of stacked weights equals the linears it replaces, whether the
weights are one buffer (read in place) or not (copied together, with a warning)."""

import logging

import pytest
import torch

from weave_compile.ops import SIBLING_LINEAR
from weave_compile.ops.sibling_linear import sibling_linear_ref, stacked_view

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}


def _case(seed, dtype, sizes, k, bias, lead=(3, 7)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    ws = [torch.randn(n, k, generator=g).to(dtype) for n in sizes]
    bs = [torch.randn(n, generator=g).to(dtype) for n in sizes] if bias else []
    return x, ws, bs


def _one_buffer(parts):
    buf = torch.cat(parts)
    out, start = [], 0
    for p in parts:
        out.append(buf[start:start + p.shape[0]])
        start += p.shape[0]
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("sizes,k", [((8, 2, 2), 16), ((5, 3), 7), ((1, 1, 1, 1), 3)])
def test_one_buffer_is_read_in_place_and_equals_the_separate_linears(seed, dtype, sizes, k, bias):
    x, ws, bs = _case(seed, dtype, sizes, k, bias)
    ws, bs = _one_buffer(ws), (_one_buffer(bs) if bs else [])
    view = stacked_view(ws)
    assert view is not None and view.data_ptr() == ws[0].data_ptr() and view.shape == (sum(sizes), k)
    want = sibling_linear_ref(x.double(), [w.double() for w in ws], [b.double() for b in bs])
    got = SIBLING_LINEAR(x, ws, bs)
    assert got.shape == (*x.shape[:-1], sum(sizes))
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < TOL[dtype], err


def test_weights_that_are_not_one_buffer_are_copied_together_with_a_warning(seed, caplog):
    x, ws, bs = _case(seed, torch.float64, (4, 6, 2), 5, True)
    pieces = _one_buffer(ws)
    pieces[1] = pieces[1].clone()  # a parameter replaced after the compile
    assert stacked_view(pieces) is None
    assert stacked_view([pieces[0], pieces[2]]) is None  # not back to back
    assert stacked_view([pieces[2], pieces[0]]) is None  # out of order
    with caplog.at_level(logging.WARNING, logger="weave_compile.ops.sibling_linear"):
        got = SIBLING_LINEAR(x, pieces, bs)
    torch.testing.assert_close(got, sibling_linear_ref(x, pieces, bs), rtol=1e-12, atol=1e-12)
    assert any("not one buffer any more" in r.getMessage() for r in caplog.records)


def test_a_view_past_its_storage_is_never_taken():
    buf = torch.randn(10, 4)
    a, b = buf[4:8], buf[8:10]  # adjacent, and the last rows of the storage
    assert stacked_view([a, b]) is not None
    assert stacked_view([buf[8:10], torch.randn(3, 4)]) is None  # would run past the storage


def test_bad_arguments_name_the_problem():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="do not all take 4 input features"):
        SIBLING_LINEAR(x, [torch.randn(3, 4), torch.randn(3, 5)], [])
    with pytest.raises(ValueError, match="one bias of each weight's output size"):
        SIBLING_LINEAR(x, [torch.randn(3, 4), torch.randn(2, 4)], [torch.randn(3)])


def test_the_fake_impl_gives_the_output_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = SIBLING_LINEAR(torch.empty(2, 9, 16), [torch.empty(8, 16), torch.empty(4, 16)], [])
    assert out.shape == (2, 9, 12)
