"""The GEMM cost curves: the SM formula, and the disk cache (hit, miss, corrupt file, atomic write)."""

import json
import logging
import os

import pytest
import torch

from weave_compile.passes.split_tokens import gemm_cost as gc

KEY = gc.GemmKey(device="Fake GPU", torch="0", blas="cublas0/default", n=4096, k=2048, dtype="bfloat16")


def test_formula_counts_waves():
    # 2048 x 4096 in 128x128 tiles = 512 tiles -> 4 waves on 132 SMs, each a 128x128xK tile.
    one_wave = 2 * 128 * 128 * 4096 / gc.FORMULA_FLOPS_PER_SM * 1e6
    assert gc.formula_us(2048, 4096, 4096, 132) == pytest.approx(4 * one_wave)
    assert gc.formula_us(0, 4096, 4096, 132) == 0.0
    assert gc.formula_us(1, 4096, 4096, 132) == gc.formula_us(128, 4096, 4096, 132)


def test_curve_interpolates_between_and_beyond_points():
    c = gc.Curve(1, 1, {64: 10.0, 128: 30.0}, "measured")
    assert c.at(64) == 10.0 and c.at(96) == pytest.approx(20.0) and c.at(0) == 0.0
    assert c.at(32) == pytest.approx(5.0) and c.at(256) == pytest.approx(60.0)


def test_store_then_load_and_no_temporary_file_is_left(tmp_path):
    assert gc.load(KEY, str(tmp_path)) == {}  # miss
    gc.store(KEY, {64: 1.5, 128: 2.5}, str(tmp_path))
    assert gc.load(KEY, str(tmp_path)) == {64: 1.5, 128: 2.5}  # hit
    assert os.listdir(tmp_path) == [f"{KEY.digest()}.json"]


@pytest.mark.parametrize("content", ["", "{not json", "[]", json.dumps({"key": {}, "points": {"64": 1.0}}),
                                     "KEY:" + json.dumps({"64": -1.0}), "KEY:" + json.dumps({"64": "nan"}),
                                     "KEY:" + json.dumps({"x": 1.0})])
def test_an_unusable_file_is_a_miss_with_a_warning(tmp_path, caplog, content):
    if content.startswith("KEY:"):
        content = json.dumps({"key": KEY.__dict__, "points": json.loads(content[4:])})
    (tmp_path / f"{KEY.digest()}.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="weave_compile.passes.split_tokens.gemm_cost"):
        assert gc.load(KEY, str(tmp_path)) == {}
    assert "unusable" in caplog.text


def test_an_unwritable_cache_is_logged_not_raised(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the folder should be
    with caplog.at_level(logging.WARNING, logger="weave_compile.passes.split_tokens.gemm_cost"):
        gc.store(KEY, {64: 1.0}, str(blocker / "sub"))
    assert "could not write" in caplog.text


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("WEAVE_COMPILE_CACHE_DIR", str(tmp_path))
    assert gc.cache_dir() == os.path.join(str(tmp_path), "gemm_cost")
    monkeypatch.delenv("WEAVE_COMPILE_CACHE_DIR")
    assert gc.cache_dir().endswith(os.path.join("weave_compile", "gemm_cost"))


@pytest.fixture
def fake_timer(monkeypatch):
    """Replace the GPU timing with a deterministic one; record which rows were timed."""
    timed = []

    def time_rows(n, k, rows, dtype, device, repeats):
        timed.append(list(rows))
        return {m: 0.001 * m * n * k / 1e6 + 1.0 for m in rows}

    monkeypatch.setattr(gc, "_time_rows", time_rows)
    monkeypatch.setattr(gc, "key_for", lambda n, k, dtype, device: gc.GemmKey("Fake GPU", "0", "b", n, k, "bfloat16"))
    return timed


def test_miss_measures_hit_measures_nothing_superset_measures_the_rest(tmp_path, fake_timer):
    dev = torch.device("cpu")
    shapes = [(4096, 2048), (1024, 4096), (4096, 2048)]  # a repeated shape is measured once
    first, spent = gc.measured_curves(shapes, [64, 128, 192], torch.bfloat16, dev, folder=str(tmp_path))
    assert fake_timer == [[64, 128, 192], [64, 128, 192]] and spent >= 0
    assert {c.source for c in first.values()} == {"measured"}
    fake_timer.clear()
    again, spent = gc.measured_curves(shapes, [64, 128, 192], torch.bfloat16, dev, folder=str(tmp_path))
    assert fake_timer == [] and spent == 0.0  # a cache hit measures nothing
    assert {c.source for c in again.values()} == {"cached"}
    assert {s: c.points for s, c in again.items()} == {s: c.points for s, c in first.items()}
    more, _ = gc.measured_curves(shapes[:1], [128, 256], torch.bfloat16, dev, folder=str(tmp_path))
    assert fake_timer == [[256]] and more[(4096, 2048)].source == "measured"
    assert sorted(gc.load(gc.key_for(4096, 2048, None, None), str(tmp_path))) == [64, 128, 192, 256]


def test_a_corrupt_file_is_measured_again_and_rewritten(tmp_path, fake_timer):
    key = gc.key_for(4096, 2048, None, None)
    path = tmp_path / f"{key.digest()}.json"
    path.write_text('{"key": {"device": "Fake GPU"}, "points": {"64": ')  # cut short mid-write
    curves, _ = gc.measured_curves([(4096, 2048)], [64, 128], torch.bfloat16, torch.device("cpu"), folder=str(tmp_path))
    assert fake_timer == [[64, 128]] and curves[(4096, 2048)].source == "measured"
    assert gc.load(key, str(tmp_path)) == curves[(4096, 2048)].points  # valid again
