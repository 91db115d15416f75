"""The split chooser against brute force on synthetic cost curves, its fallbacks, and rank agreement."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weave_compile.passes.split_tokens import gemm_cost
from weave_compile.passes.split_tokens import smart_split as ss
from weave_compile.passes.split_tokens.smart_split import LayerShape

LLAMA8B_TP2 = LayerShape(gemms=((3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)), attn_width=16 * 128,
                         hidden=4096, sites=2)


def _step_curve(base_us_per_row: float, steps: list[float]):
    """A synthetic GEMM-time curve: linear in rows plus a staircase (waves, kernel switches)."""
    def us(m: int) -> float:
        return 0.0 if m <= 0 else base_us_per_row * m + sum(steps[: (m + 127) // 128 % (len(steps) + 1)])
    return us


curves = st.builds(_step_curve, st.floats(1e-3, 1.0),
                   st.lists(st.floats(0.0, 50.0), min_size=1, max_size=40))
layers = st.builds(LayerShape, gemms=st.just(((4096, 4096),)), attn_width=st.integers(0, 4096),
                   hidden=st.sampled_from([0, 1024, 4096, 8192]), sites=st.integers(0, 4))


def _brute_force(t, layer, gemm_us):
    """Every grid candidate in [T/4, 3T/4] with its halves' compute and communication."""
    out = []
    for s in range(1, t):
        if s % 64 or 4 * s < t or 4 * s > 3 * t:
            continue
        att_a, att_b = ss.attention_us(s, t, layer)
        a, b = gemm_us(s) + att_a, gemm_us(t - s) + att_b
        out.append(dict(s=s, a=a, b=b, qa=ss.comm_us(s, layer), qb=ss.comm_us(t - s, layer)))
    return out


@settings(max_examples=150, deadline=None)
@given(t=st.integers(2, 12000), layer=layers, gemm_us=curves)
def test_chooser_against_brute_force(t, layer, gemm_us):
    cands = _brute_force(t, layer, gemm_us)
    choice = ss.choose(t, layer, gemm_us, "synthetic")
    if not cands:
        assert choice is None
        assert ss.plan(t, layer, cost="formula").at == t // 2
        return
    assert [c["s"] for c in cands] == ss.candidates(t)
    by_s = {c["s"]: c for c in cands}
    c = by_s[choice.at]
    assert (choice.prefix_us, choice.suffix_us) == (c["a"], c["b"])
    whole = gemm_us(t) + ss.attention_us(t, t, layer)[0]
    hiding = [x for x in cands if x["a"] >= x["qb"] and x["b"] >= x["qa"]]
    tol = ss.TIE * whole
    if hiding:
        # Both halves hide the other's communication, and no hiding split adds clearly less.
        assert c in hiding and choice.hidden
        extra = lambda x: x["a"] + x["b"] - whole  # noqa: E731
        assert extra(c) <= min(extra(x) for x in hiding) + tol + 1e-9
        tied = [x for x in hiding if extra(x) <= min(extra(y) for y in hiding) + tol]
    else:
        layer_time = lambda x: max(x["a"], x["qb"]) + max(x["b"], x["qa"])  # noqa: E731
        assert layer_time(c) <= min(layer_time(x) for x in cands) + tol + 1e-9
        tied = [x for x in cands if layer_time(x) <= min(layer_time(y) for y in cands) + tol]
    # Among tied costs, the halves closest in time.
    assert abs(c["a"] - c["b"]) <= min(abs(x["a"] - x["b"]) for x in tied) + 1e-9


def test_flat_costs_split_near_the_middle():
    linear = lambda m: 0.5 * m  # noqa: E731  (no waves: every split costs the same)
    for t in (512, 1000, 2048, 4099, 16384):
        s = ss.choose(t, LayerShape(gemms=((1, 1),)), linear, "synthetic").at
        assert abs(2 * s - t) <= 64, (t, s)


def test_attention_moves_the_split_right_of_the_middle():
    linear = lambda m: 0.3 * m  # noqa: E731
    t = 8192
    no_attn = ss.choose(t, LayerShape(gemms=LLAMA8B_TP2.gemms), linear, "synthetic")
    with_attn = ss.choose(t, LLAMA8B_TP2, linear, "synthetic")
    assert with_attn.at > no_attn.at
    assert abs(with_attn.prefix_us - with_attn.suffix_us) / with_attn.whole_us < 0.02


def test_a_cheap_lopsided_split_that_hides_nothing_loses():
    """GEMM time lowest at s = T/4, but there the short half cannot hide the long one's comm."""
    t = 4096
    dip = lambda m: 0.3 * m - (200.0 if m in (1024, 3072) else 0.0)  # noqa: E731
    layer = LayerShape(gemms=((1, 1),), hidden=8192, sites=2)
    c = ss.choose(t, layer, dip, "synthetic")
    assert c.at not in (1024, 3072) and c.hidden
    # Without communication the dip wins.
    assert ss.choose(t, LayerShape(gemms=((1, 1),)), dip, "synthetic").at in (1024, 3072)


@settings(max_examples=200, deadline=None)
@given(t=st.integers(2, 20000))
def test_near_half_is_grid_aligned_and_leaves_both_halves(t):
    s = ss.near_half(t)
    assert 1 <= s <= t - 1
    if t >= 128:
        assert s % 64 == 0 and t // 2 <= s < t // 2 + 64


@settings(max_examples=100, deadline=None)
@given(t=st.integers(2, 20000), forced=st.integers(0, 25000))
def test_plan_always_gives_two_nonempty_halves(t, forced):
    c = ss.plan(t, LLAMA8B_TP2, forced=forced, cost="formula")
    assert 1 <= c.at <= t - 1
    if forced:
        assert c.how == "forced" and c.at == min(max(forced, 1), t - 1)


def test_plan_refuses_one_token():
    with pytest.raises(ValueError, match="non-empty"):
        ss.plan(1, LLAMA8B_TP2)


def test_without_a_gpu_the_formula_is_used_and_nothing_is_measured(monkeypatch):
    def no_measuring(*a, **k):
        raise AssertionError("measured without a GPU")

    monkeypatch.setattr(gemm_cost, "measured_curves", no_measuring)
    for device in (None, torch.device("cpu"), torch.device("cuda")):
        if device is not None and device.type == "cuda" and torch.cuda.is_available():
            continue
        c = ss.plan(4096, LLAMA8B_TP2, cost="measured", device=device)
        assert c.source == "SM formula" and c.how == "smart", c
        assert "SM formula" in c.describe() and "predicted A" in c.describe()


def _fake_measured(slope_of_n):
    """measured_curves stand-in: a linear curve per (N, K), marked measured or cached."""
    calls = []

    def measured_curves(shapes, rows, dtype, device, folder=None):
        calls.append(list(rows))
        source = "measured" if len(calls) == 1 else "cached"
        return {(n, k): gemm_cost.Curve(n, k, {m: slope_of_n(n) * m for m in rows}, source)
                for n, k in shapes}, (0.25 if source == "measured" else 0.0)

    return measured_curves, calls


def test_measured_curves_drive_the_choice_and_explain_names_their_source(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fake, calls = _fake_measured(lambda n: n * 1e-4)
    monkeypatch.setattr(gemm_cost, "measured_curves", fake)
    first = ss.plan(2048, LLAMA8B_TP2, device=torch.device("cuda", 0))
    again = ss.plan(2048, LLAMA8B_TP2, device=torch.device("cuda", 0))
    assert first.source == "measured curve" and first.measure_s == 0.25
    assert again.source == "cached curve" and again.measure_s == 0.0
    assert calls[0] == ss.rows_needed(2048)
    assert "measured curve: predicted A" in first.describe()
    # Forced, or the formula by option: no measuring at all.
    assert ss.plan(2048, LLAMA8B_TP2, forced=100, device=torch.device("cuda", 0)).how == "forced"
    assert ss.plan(2048, LLAMA8B_TP2, cost="formula", device=torch.device("cuda", 0), num_sms=132).source == "SM formula"
    assert len(calls) == 2


def _ranks_disagree(rank, world_size):
    """Each rank's 'measurement' favours another split; all must take rank 0's."""
    import torch.distributed as dist

    from weave_compile.passes.split_tokens import gemm_cost as gc
    from weave_compile.passes.split_tokens import smart_split as s

    torch.cuda.is_available = lambda: True

    def measured_curves(shapes, rows, dtype, device, folder=None):
        dip = 1536 if rank == 0 else 1280  # the cheapest split differs per rank
        return {(n, k): gc.Curve(n, k, {m: 0.1 * m - (30.0 if m in (dip, 4096 - dip) else 0.0) for m in rows},
                                 "measured") for n, k in shapes}, 0.1

    gc.measured_curves = measured_curves
    layer = s.LayerShape(gemms=((4096, 4096),), hidden=1024, sites=1)
    got = s.plan(4096, layer, device=torch.device("cuda", 0), group_name=dist.group.WORLD.group_name)
    alone = s.plan(4096, layer, device=torch.device("cuda", 0))  # no group: this rank's own
    return got.at, got.source, alone.at


def test_every_rank_takes_rank_0s_measured_choice():
    from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

    (a0, src0, own0), (a1, src1, own1) = assert_ranks_ok(run_ranks(_ranks_disagree, 2, timeout=300))
    assert own0 != own1  # the two ranks' own choices differ...
    assert a0 == a1 == own0  # ...and both use rank 0's
    assert src0 == "measured curve" and src1 == "measured curve (rank 0's)"
