"""Error measures and tolerances shared by tests and benchmarks."""

from __future__ import annotations

import torch

#: ``||out - ref|| / ||ref||`` against a float64 reference, per dtype.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative norm error; ``inf`` for any non-finite output (so a NaN can never pass)."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
