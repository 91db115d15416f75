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


def codes_agree(q: torch.Tensor, q_ref: torch.Tensor, exact: torch.Tensor, rel: float = 1e-5) -> tuple[float, str]:
    """``(fraction of fp8 codes q that differ from the oracle's q_ref, what is wrong or "")``: a code
    may differ only by one step, and only where the exact value (``exact``, float64) lies within
    ``rel`` of the rounding boundary between the two codes (an fp32 rounding on the way moved it
    across); anything else is named in the second item."""
    a, b = q.to(torch.float64), q_ref.to(torch.float64)
    diff = a != b
    if not diff.any():
        return 0.0, ""
    mid = (a[diff] + b[diff]) / 2
    near = (exact[diff] - mid).abs() <= rel * exact[diff].abs().clamp_min(1e-30)
    # adjacent codes: nothing representable lies strictly between them
    lo, hi = torch.minimum(a[diff], b[diff]), torch.maximum(a[diff], b[diff])
    between = ((lo + hi) / 2).to(q.dtype).to(torch.float64)
    adjacent = (between == lo) | (between == hi)
    bad = ~(near & adjacent)
    return diff.double().mean().item(), (f"{int(bad.sum())} codes differ by more than one step or away from a "
                                         f"rounding boundary" if bad.any() else "")
