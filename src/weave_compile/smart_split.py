"""Wave-aware split of T tokens into a prefix and a suffix (TokenWeave's third pillar).

Splitting a batch in two is free only if the two halves need no more GEMM waves than the
whole: a GEMM of M rows runs ``ceil(ceil(M / tile_m) * ceil(N / tile_n) / num_sms)`` waves of
thread blocks, and a careless split can add a partly empty wave to each half. TokenWeave tuned
split offsets offline; here the split is computed at run time from T, the SM count and the GEMM
shapes of the layer:

1. candidates are split points on ``tile_m`` row boundaries (both halves non-empty);
2. keep those whose halves need no more waves than the whole, for every GEMM, where any do
   (else those with the fewest extra waves);
3. among them pick the one that balances the halves' compute, counting attention: causal
   attention of the suffix reads the prefix's keys too, so the suffix costs more per token
   and the balanced split sits right of T/2.

Balanced halves matter because each half's communication hides behind the other's compute.
"""

from __future__ import annotations

import dataclasses
import functools
import math


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What the split needs to know of a decoder layer (per rank, after TP sharding)."""

    #: (N, K) of each token-wise GEMM: QKV, O, gate/up, down...
    gemms: tuple[tuple[int, int], ...]
    #: query heads on this rank times head dim: attention FLOPs per (query, key) pair / 4
    attn_width: int = 0


def gemm_waves(m: int, n: int, num_sms: int, tile_m: int = 128, tile_n: int = 128) -> int:
    if m <= 0:
        return 0
    return math.ceil(math.ceil(m / tile_m) * math.ceil(n / tile_n) / num_sms)


def _extra_waves(s: int, t: int, layer: LayerShape, num_sms: int, tile_m: int, tile_n: int) -> int:
    return sum(
        max(0, gemm_waves(s, n, num_sms, tile_m, tile_n) + gemm_waves(t - s, n, num_sms, tile_m, tile_n)
            - gemm_waves(t, n, num_sms, tile_m, tile_n))
        for n, _ in layer.gemms
    )


def half_costs(s: int, t: int, layer: LayerShape) -> tuple[float, float]:
    """FLOPs of the prefix (s tokens) and the suffix (t - s tokens) for one layer."""
    per_token = 2.0 * sum(n * k for n, k in layer.gemms)
    # Causal attention: 4 * width FLOPs per (query, key) pair with key <= query.
    attn = 4.0 * layer.attn_width
    prefix = per_token * s + attn * s * (s + 1) / 2
    suffix = per_token * (t - s) + attn * ((t * (t + 1) - s * (s + 1)) / 2)
    return prefix, suffix


@functools.lru_cache(maxsize=4096)
def smart_split(t: int, layer: LayerShape, num_sms: int, tile_m: int = 128, tile_n: int = 128) -> int:
    """Prefix length for ``t`` tokens; 0 when ``t`` is too small to split on tile boundaries."""
    candidates = range(tile_m, t, tile_m)
    if not candidates:
        return 0
    extra = {s: _extra_waves(s, t, layer, num_sms, tile_m, tile_n) for s in candidates}
    fewest = min(extra.values())
    ok = [s for s in candidates if extra[s] == fewest]

    def imbalance(s: int) -> float:
        a, b = half_costs(s, t, layer)
        return abs(a - b)

    return min(ok, key=lambda s: (imbalance(s), s))


#: SM count assumed where the graph is not on a GPU (CPU tests): an H100/H200's.
DEFAULT_NUM_SMS = 132


def choose_split(t: int, layer: LayerShape, num_sms: int, forced: int = 0, tile_m: int = 128) -> int:
    """The prefix length the split pass uses for ``t >= 2`` tokens: always in ``[1, t - 1]``.

    ``forced > 0`` pins it (benchmark sweeps), clamped into range; otherwise :func:`smart_split`,
    or ``t // 2`` when ``t`` is too short for two tile-aligned halves.
    """
    if t < 2:
        raise ValueError(f"cannot split {t} token(s) into two non-empty halves")
    if forced > 0:
        return min(max(forced, 1), t - 1)
    s = smart_split(t, layer, num_sms, tile_m)
    return s if s > 0 else t // 2

