"""Tests for benchmarks/pacing.py on the CPU: the copy lines, their fit and the Pace arithmetic.

The copies themselves (calibration, a Pace's measured length, capture) run in
tests/testing/test_fake_comm_gpu.py.
"""

from __future__ import annotations

import random

import pytest

import pacing
from pacing import D2H, H2D, Calibration, Line, fit_line

CAL = Calibration(d2d=Line(2.0, 1800.0), h2d=Line(3.0, 50.0), d2h=Line(4.0, 45.0))


def test_fit_line_recovers_a_line(seed):
    rng = random.Random(seed)
    lat, gbps = rng.uniform(0.5, 10), rng.uniform(10, 3000)
    sizes = sorted(rng.sample(range(1 << 16, 1 << 26), 4))
    fit = fit_line(sizes, [Line(lat, gbps).time_us(n) for n in sizes])
    assert fit.latency_us == pytest.approx(lat, rel=1e-6, abs=1e-6)
    assert fit.gbps == pytest.approx(gbps, rel=1e-6)


def test_fit_line_refuses_what_is_not_a_copy_line():
    with pytest.raises(ValueError, match="two distinct sizes"):
        fit_line([1 << 20, 1 << 20], [5.0, 6.0])
    with pytest.raises(ValueError, match="do not grow"):
        fit_line([1 << 20, 1 << 22], [9.0, 5.0])
    with pytest.raises(ValueError):
        Line(-1.0, 10.0)
    with pytest.raises(ValueError):
        Line(1.0, 0.0)


@pytest.mark.parametrize("direction", [H2D, D2H])
def test_delay_lasts_what_is_asked(direction, seed):
    line = CAL.line(direction)
    rng = random.Random(seed)
    for us in [rng.uniform(line.latency_us, 2000) for _ in range(20)]:
        pace = CAL.delay(us, direction, "x")
        assert pace.direction == direction and pace.us == us and pace.nbytes % 256 == 0
        # rounded up to 256 bytes: at most 256 B / rate late, never early
        assert us - 1e-9 <= line.time_us(pace.nbytes) <= us + 256 / (line.gbps * 1e3) + 1e-9


def test_short_delays_round_to_nothing_or_one_minimal_copy():
    lat = CAL.h2d.latency_us
    assert CAL.delay(lat / 2, H2D) is None
    assert CAL.delay(0.0, H2D) is None
    p = CAL.delay(0.75 * lat, H2D)
    assert p is not None and p.nbytes == 256  # lasts ~lat: off by at most lat / 2
    with pytest.raises(ValueError, match="direction"):
        CAL.delay(10.0, "d2d")


def test_transfer_pace_makes_local_copy_plus_pace_last_the_link_time(seed):
    rng = random.Random(seed)
    for _ in range(20):
        n = rng.randrange(1 << 20, 1 << 28)
        gbps = rng.choice([150.0, 370.0, 450.0])
        _check_transfer(n, gbps)
    # both sides of the latency: a pace longer than one copy's latency, and one shorter
    _check_transfer(256 << 20, 150.0)
    assert CAL.transfer(1 << 20, 450.0, D2H, link_latency_us=1.5).us < CAL.d2h.latency_us
    _check_transfer(1 << 20, 450.0)


def _check_transfer(n: int, gbps: float) -> None:
    """The local copy and its pace last the link's time: at most 256 B of the PCIe rate late where
    the pace is longer than a copy's latency; within half that latency where it is shorter (a pace
    is then nothing or one minimal copy, test_short_delays_round_to_nothing_or_one_minimal_copy)."""
    pace = CAL.transfer(n, gbps, D2H, link_latency_us=1.5)
    want = CAL.d2d.latency_us + 1.5 + n / (gbps * 1e3)
    got = CAL.d2d.time_us(n) + (CAL.d2h.time_us(pace.nbytes) if pace is not None else 0.0)
    late = 256 / (CAL.d2h.gbps * 1e3) + 1e-6
    if want - CAL.d2d.time_us(n) > CAL.d2h.latency_us:
        assert want - 1e-6 <= got <= want + late, (n, gbps, pace)
    else:
        assert abs(got - want) <= CAL.d2h.latency_us / 2 + late, (n, gbps, pace)


def test_no_pace_where_the_local_copy_is_already_slower_than_the_link():
    assert CAL.transfer(64 << 20, 5000.0, H2D) is None
    assert CAL.transfer(64, 370.0, H2D) is None  # 64 bytes: nothing to wait for
    with pytest.raises(ValueError):
        CAL.transfer(1 << 20, 0.0, H2D)


def test_calibration_measures_a_bent_line_again_and_raises_when_it_stays_bent(monkeypatch):
    measured = []  # the medians _median_copy_us returns, one per size, in order

    def fake_median(fn, stream, iters=10, repeats=5):
        return measured.pop(0)

    monkeypatch.setattr(pacing, "_median_copy_us", fake_median)
    # other work on the GPU stretched the first size's median once: measured again, fitted
    measured[:] = [31.0, 18.9, 18.6] + [3.0, 5.0, 9.0]
    line = pacing._fit_measured((1 << 20, 2 << 20, 4 << 20), lambda n: None, None)
    assert not measured and line.gbps == pytest.approx((2 << 20) / 4.0 / 1e3)
    # bent every time: the calibration error, after the attempts
    measured[:] = [5.0, 3.0, 2.0] * 3
    with pytest.raises(ValueError, match="do not grow with size"):
        pacing._fit_measured((1, 2, 3), lambda n: None, None, attempts=3)
    assert not measured
