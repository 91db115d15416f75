"""Properties of the wave-aware split, checked against brute force on generated shapes."""

from hypothesis import given, settings
from hypothesis import strategies as st

from weave_compile.smart_split import LayerShape, _extra_waves, gemm_waves, half_costs, smart_split

LLAMA8B_TP2 = LayerShape(gemms=((3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)), attn_width=16 * 128)

layers = st.builds(
    LayerShape,
    gemms=st.lists(st.tuples(st.integers(64, 30000), st.integers(64, 16384)), min_size=1, max_size=5).map(tuple),
    attn_width=st.integers(0, 8192),
)


def test_gemm_waves_examples():
    assert gemm_waves(128, 128, 132) == 1
    assert gemm_waves(0, 4096, 132) == 0
    # 2048 rows x 4096 cols in 128x128 tiles = 16 * 32 = 512 tiles -> 4 waves on 132 SMs.
    assert gemm_waves(2048, 4096, 132) == 4


@settings(max_examples=300, deadline=None)
@given(t=st.integers(1, 20000), layer=layers, num_sms=st.sampled_from([78, 114, 132, 148]),
       tile_m=st.sampled_from([64, 128]))
def test_split_properties(t, layer, num_sms, tile_m):
    s = smart_split(t, layer, num_sms, tile_m)
    if t <= tile_m:
        assert s == 0  # nothing to split on tile boundaries
        return
    assert 0 < s < t and s % tile_m == 0  # both halves non-empty, prefix on a tile boundary
    candidates = range(tile_m, t, tile_m)
    best = min(_extra_waves(c, t, layer, num_sms, tile_m, 128) for c in candidates)
    # No more waves than the whole batch wherever some split achieves that (best == 0).
    assert _extra_waves(s, t, layer, num_sms, tile_m, 128) == best
    # Among the wave-optimal splits, the chosen one balances the halves best.
    ok = [c for c in candidates if _extra_waves(c, t, layer, num_sms, tile_m, 128) == best]
    imb = lambda c: abs(half_costs(c, t, layer)[0] - half_costs(c, t, layer)[1])
    assert imb(s) <= min(imb(c) for c in ok) + 1e-6


def test_attention_moves_the_split_right_of_the_middle():
    t = 8192
    no_attn = smart_split(t, LayerShape(gemms=LLAMA8B_TP2.gemms), 132)
    with_attn = smart_split(t, LLAMA8B_TP2, 132)
    assert with_attn >= no_attn
    a, b = half_costs(with_attn, t, LLAMA8B_TP2)
    assert abs(a - b) / (a + b) < 0.05


@settings(max_examples=200, deadline=None)
@given(t=st.integers(2, 20000), layer=layers, num_sms=st.sampled_from([78, 132]), forced=st.integers(0, 25000))
def test_choose_split_always_gives_two_nonempty_halves(t, layer, num_sms, forced):
    from weave_compile.smart_split import choose_split

    s = choose_split(t, layer, num_sms, forced)
    assert 1 <= s <= t - 1
    if forced:
        assert s == min(max(forced, 1), t - 1)
    elif t > 128:
        assert s == smart_split(t, layer, num_sms)  # tile-aligned, wave- and balance-checked above
    else:
        assert s == t // 2


def test_choose_split_refuses_one_token():
    import pytest

    from weave_compile.smart_split import choose_split

    with pytest.raises(ValueError, match="non-empty"):
        choose_split(1, LLAMA8B_TP2, 132)
