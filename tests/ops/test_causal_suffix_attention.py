"""weave::causal_suffix_attention against its float64 oracle and against full causal attention."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from weave_compile.ops.causal_suffix_attention import causal_suffix_attention, causal_suffix_attention_ref


@settings(max_examples=40, deadline=None)
@given(tk=st.integers(1, 70), frac=st.floats(0.01, 1.0), b=st.integers(1, 2), kv=st.sampled_from([1, 2]),
       rep=st.sampled_from([1, 3]), d=st.sampled_from([8, 16]), seed=st.integers(0, 2**31 - 1))
def test_matches_float64_oracle(tk, frac, b, kv, rep, d, seed):
    g = torch.Generator().manual_seed(seed)
    tq = max(1, int(tk * frac))
    q = torch.randn(b, kv * rep, tq, d, generator=g)
    k, v = torch.randn(b, kv, tk, d, generator=g), torch.randn(b, kv, tk, d, generator=g)
    out = causal_suffix_attention(q, k, v, None)
    ref = causal_suffix_attention_ref(q, k, v)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_suffix_rows_of_full_causal_attention():
    """The split identity the pass relies on: causal attention's last rows == suffix attention."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for s in (1, 10, 36):
        part = causal_suffix_attention(q[:, :, s:], k, v, 0.3 if s == 10 else None)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3 if s == 10 else None)[:, :, s:]
        torch.testing.assert_close(part, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(causal_suffix_attention(q[:, :, 20:], k, v, None), full[:, :, 20:], rtol=1e-5, atol=1e-5)


def test_fake_layout_matches_real():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = causal_suffix_attention(q, k, v, None)
    with FakeTensorMode() as mode:
        fake = causal_suffix_attention(mode.from_tensor(q), mode.from_tensor(k), mode.from_tensor(v), None)
    assert fake.shape == real.shape and fake.stride() == real.stride()


def test_bad_shapes_are_named():
    q, k = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="positions"):
        causal_suffix_attention(q, k, k, None)
    with pytest.raises(ValueError, match="kv heads"):
        causal_suffix_attention(torch.randn(1, 3, 2, 8), k, k, None)
