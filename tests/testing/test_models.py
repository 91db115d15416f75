"""The test model's merged projections (one QKV, one gate/up GEMM) compute what the separate ones do."""

import torch

from weave_compile.testing.models import LlamaDims, TPLlama
from weave_compile.testing.numerics import rel_err


def test_merged_projections_equal_the_separate_ones(seed):
    dims = dict(hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, vocab=80)
    sep = TPLlama(LlamaDims(**dims), seed=seed, dtype=torch.float64)
    merged = TPLlama(LlamaDims(merged=True, **dims), seed=seed, dtype=torch.float64)
    names = {n for n, _ in merged.named_parameters()}
    assert {"layers.0.qkv.weight", "layers.0.gate_up.weight"} <= names and "layers.0.q.weight" not in names
    assert merged.layers[0].qkv.weight.shape == (4 * 16 + 2 * 2 * 16, 64)
    x = torch.randint(0, 80, (2, 19), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want, got = sep(x), merged(x)
    assert torch.isfinite(want).all() and want.abs().max() > 0.1
    assert rel_err(got, want) < 1e-12
