"""benchmarks/addnorm_grid.py: the grids it times for one launch shape (the timing itself needs a GPU)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import addnorm_grid  # noqa: E402

sys.path.pop(0)


@pytest.mark.parametrize("hidden,rows,quant", [(4096, 128, True), (8192, 128, False), (4096, 2048, True),
                                               (4096, 128, False), (4096, 3, True), (8192, 512, True)])
def test_the_arms_are_a_cta_per_8_rows_twice_then_nccls_grid_and_a_cta_per_tile_on_one_launch_shape(hidden, rows,
                                                                                                    quant):
    from weave_compile.kernels.shared import addnorm

    sms = 132
    cfg, ctas = addnorm_grid.grids(hidden, rows, quant, sms)
    tiles = -(-rows // cfg.block_rows)
    per8 = -(-rows // addnorm.ROWWISE_WARPS)
    # nccl's shape: no received slots, so never the one-warp-per-row loop
    assert cfg == addnorm.launch_config(hidden, slots=0, rows_per_cta=-(-rows // per8), quant=quant)
    assert not cfg.chunk
    assert ctas["per8"] == ctas["per8_again"] == min(per8, tiles)
    assert ctas["per_tile"] == tiles
    assert ctas["per8"] <= ctas["plan"] <= ctas["per_tile"]
    assert ctas["plan"] == addnorm.plan(hidden, rows, None, slots=0, quant=quant, sms=sms)[1]  # nccl's launch
    assert ctas["plan"] == min(tiles, max(per8, sms))
    if rows == 128 and hidden == 4096:  # the 2-row tile, bf16 or fp8: 16 CTAs of 4 tiles, or 64 of one
        assert (ctas["per8"], ctas["plan"], ctas["per_tile"]) == (16, 64, 64)
