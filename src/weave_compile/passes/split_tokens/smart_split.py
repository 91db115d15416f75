"""Where to split T tokens into a prefix A and a suffix B: the layer time with overlap.

TokenWeave's third pillar. Each half's fused communication runs while the other half computes,
so a split point ``s`` is good when

1. **both halves hide the other's communication**: ``C_A(s) >= Q(T - s)`` and
   ``C_B(s) >= Q(s)``, where ``C`` is a half's compute (its GEMMs plus its attention) and ``Q``
   the fused op's communication for that many rows at every fused site of the graph; and
2. **among those, the split adds the least GEMM time**: ``C_A(s) + C_B(s) - C(T)`` (attention's
   FLOPs sum to the whole's, so what a split adds is GEMM time: partly empty waves, a worse cuBLAS
   kernel at a smaller ``M``). Costs that tie (within :data:`TIE` of the layer's time, about the
   measurement noise) go to the split whose halves are closest in time: a lopsided split hides
   less, the short half's compute cannot cover the long half's communication.

Where no split point hides both, the one with the least predicted layer time
``max(C_A, Q_B) + max(C_B, Q_A)`` wins. Candidates are the multiples of :data:`GRID` rows in
``[T/4, 3T/4]`` (outside it one half is too short to hide the other's communication at any
size measured here); ``T // 2`` below the size where that range holds none.

* **GEMM time** is the layer's own GEMM shapes (the N, K the split pass extracts) timed with
  cuBLAS at those row counts on this GPU and cached on disk (:mod:`.gemm_cost`);
  without a GPU, or with ``split_cost="formula"``, the SM-count wave formula.
* **Attention time**: causal attention's FLOPs (the suffix's queries also read the prefix's
  keys, so it costs more per token) at :data:`ATTN_FLOPS` per second.
* **Communication**: ``Q(r) = sites * (COMM_LATENCY_US + r * hidden * bytes / COMM_GBPS)``, a
  latency plus a rate fitted to the fused op's measured times across two GPUs
  (docs/performance.md, "Its GEMM cost, and the split point").

Every rank of a group must split at the same point (the halves' collectives have to match), and
measured curves differ by noise between ranks: with a measured curve and a process group of more
than one rank, the group's rank 0 decides and publishes the choice through the process group's
store; the others take it (:func:`_agree`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from typing import Callable, Optional

import torch

from . import gemm_cost

log = logging.getLogger(__name__)

#: Split points are multiples of this many rows (cuBLAS's smallest M tile on sm_90).
GRID = 64
#: Costs within this fraction of the whole layer's predicted time tie.
TIE = 0.005
#: Effective bytes per second of the fused op (bytes of x on one rank): the fit above.
COMM_GBPS = 245.0
#: Its fixed cost per call (launch, barriers), microseconds.
COMM_LATENCY_US = 8.0
#: Causal flash attention forward, bf16, H100/H200-class: FLOP/s the model assumes (a nominal
#: rate; docs/performance.md, section 4, has what the attention kernels reached).
ATTN_FLOPS = 350e12
#: SM count assumed where the graph is not on a GPU (CPU tests): an H100/H200's.
DEFAULT_NUM_SMS = 132  # (gemm_cost.FORMULA_FLOPS_PER_SM divides by the same count)
#: Seconds a non-zero rank waits for rank 0's choice before failing (never a silent hang).
AGREE_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What the split needs to know of the graph's layers (per rank, after TP sharding)."""

    #: (N, K) of each token-wise GEMM: QKV, O, gate/up, down... (repeated per layer)
    gemms: tuple[tuple[int, int], ...]
    #: query heads on this rank times head dim, summed over the attention ops
    attn_width: int = 0
    #: the fused op's row width and element size, and how many fused sites the graph has
    hidden: int = 0
    elem_bytes: int = 2
    sites: int = 0


@dataclasses.dataclass(frozen=True)
class SplitChoice:
    """A split point and the prediction behind it (for explain())."""

    at: int
    tokens: int
    #: ``smart`` (chosen here), ``forced`` (``split_at``), ``half`` (``T // 2``: too few tokens for the grid)
    how: str
    #: where the GEMM times came from: ``measured curve``, ``cached curve``, ``SM formula``
    source: str = "-"
    prefix_us: float = 0.0  # predicted compute of A, of B, of the unsplit whole
    suffix_us: float = 0.0
    whole_us: float = 0.0
    comm_prefix_us: float = 0.0  # predicted communication of A's rows, of B's rows
    comm_suffix_us: float = 0.0
    measure_s: float = 0.0  # seconds spent measuring GEMMs for this choice

    @property
    def hidden(self) -> bool:
        return self.prefix_us >= self.comm_suffix_us and self.suffix_us >= self.comm_prefix_us

    def describe(self) -> str:
        if self.how == "half":
            return f"{self.at} (smart split: T // 2, too few tokens for a {GRID}-row grid point in [T/4, 3T/4])"
        if self.how != "smart":
            return f"{self.at} ({self.how})"
        return (f"{self.at} (smart split; {self.source}: predicted A {self.prefix_us:.1f} us, "
                f"B {self.suffix_us:.1f} us, whole {self.whole_us:.1f} us; comm A {self.comm_prefix_us:.1f} us, "
                f"B {self.comm_suffix_us:.1f} us, {'hidden' if self.hidden else 'not hidden'})")


def gemm_waves(m: int, n: int, num_sms: int, tile_m: int = 128, tile_n: int = 128) -> int:
    if m <= 0:
        return 0
    return math.ceil(math.ceil(m / tile_m) * math.ceil(n / tile_n) / num_sms)


def half_costs(s: int, t: int, layer: LayerShape) -> tuple[float, float]:
    """FLOPs of the prefix (s tokens) and the suffix (t - s tokens) for one layer."""
    per_token = 2.0 * sum(n * k for n, k in layer.gemms)
    # Causal attention: 4 * width FLOPs per (query, key) pair with key <= query.
    attn = 4.0 * layer.attn_width
    prefix = per_token * s + attn * s * (s + 1) / 2
    suffix = per_token * (t - s) + attn * ((t * (t + 1) - s * (s + 1)) / 2)
    return prefix, suffix


def attention_us(s: int, t: int, layer: LayerShape) -> tuple[float, float]:
    """Predicted causal attention time of the prefix's and the suffix's queries."""
    attn = 4.0 * layer.attn_width / ATTN_FLOPS * 1e6
    return attn * s * (s + 1) / 2, attn * ((t * (t + 1) - s * (s + 1)) / 2)


def comm_us(rows: int, layer: LayerShape) -> float:
    """Predicted communication of ``rows`` rows at every fused site (see module docstring)."""
    if rows <= 0 or layer.sites == 0:
        return 0.0
    return layer.sites * (COMM_LATENCY_US + rows * layer.hidden * layer.elem_bytes / (COMM_GBPS * 1e3))


def candidates(t: int) -> list[int]:
    quarter = -(-t // 4)  # ceil(t / 4)
    lo = max(GRID, -(-quarter // GRID) * GRID)
    return [s for s in range(lo, 3 * t // 4 + 1, GRID) if 0 < s < t]


def rows_needed(t: int) -> list[int]:
    """Every row count the chooser asks the GEMM curves for at ``t`` tokens."""
    cs = candidates(t)
    return sorted({t, *cs, *(t - s for s in cs)})


def near_half(t: int) -> int:
    """The split a symbolic token count uses: ``T // 2`` rounded up to :data:`GRID` rows (the
    suffix's attention costs more, so the prefix takes the rounding), ``T // 2`` below
    ``2 * GRID`` tokens. Always in ``[1, t - 1]`` for ``t >= 2``."""
    return ((t // 2 + GRID - 1) // GRID) * GRID if t >= 2 * GRID else t // 2


def choose(t: int, layer: LayerShape, gemm_us: Callable[[int], float], source: str) -> Optional[SplitChoice]:
    """The split point by the module docstring's rule; None when ``t`` has no grid candidate.

    ``gemm_us(m)``: predicted time of all of the layer's GEMMs at ``m`` rows."""
    cands = candidates(t)
    if not cands:
        return None
    whole = gemm_us(t) + attention_us(t, t, layer)[0]
    rows = []
    for s in cands:
        att_a, att_b = attention_us(s, t, layer)
        a, b = gemm_us(s) + att_a, gemm_us(t - s) + att_b
        qa, qb = comm_us(s, layer), comm_us(t - s, layer)
        rows.append((s, a, b, qa, qb))
    hiding = [r for r in rows if r[1] >= r[4] and r[2] >= r[3]]
    if hiding:
        pool, cost = hiding, (lambda r: r[1] + r[2] - whole)
    else:
        pool, cost = rows, (lambda r: max(r[1], r[4]) + max(r[2], r[3]))
    best = min(cost(r) for r in pool)
    tied = [r for r in pool if cost(r) <= best + TIE * whole]
    s, a, b, qa, qb = min(tied, key=lambda r: (abs(r[1] - r[2]), abs(2 * r[0] - t), r[0]))
    return SplitChoice(at=s, tokens=t, how="smart", source=source, prefix_us=a, suffix_us=b, whole_us=whole,
                       comm_prefix_us=qa, comm_suffix_us=qb)


def plan(t: int, layer: LayerShape, *, forced: int = 0, cost: str = "measured", device: Optional[torch.device] = None,
         dtype: torch.dtype = torch.bfloat16, num_sms: int = 0, group_name: Optional[str] = None,
         cache_folder: Optional[str] = None) -> SplitChoice:
    """The split the pass uses for ``t >= 2`` tokens: always in ``[1, t - 1]``.

    ``forced > 0`` pins it (clamped into range); otherwise :func:`choose` with measured cuBLAS
    curves when ``cost == "measured"`` and ``device`` is a GPU, else the SM formula
    (``num_sms`` SMs; 0: the device's, :data:`DEFAULT_NUM_SMS` off-GPU)."""
    if t < 2:
        raise ValueError(f"cannot split {t} token(s) into two non-empty halves")
    if forced > 0:
        return SplitChoice(at=min(max(forced, 1), t - 1), tokens=t, how="forced")
    on_gpu = device is not None and device.type == "cuda" and torch.cuda.is_available()
    if not candidates(t):
        return SplitChoice(at=t // 2, tokens=t, how="half")
    if cost == "measured" and on_gpu:
        curves, spent = gemm_cost.measured_curves(layer.gemms, rows_needed(t), dtype, device, folder=cache_folder)
        source = "measured curve" if any(c.source == "measured" for c in curves.values()) else "cached curve"
        choice = choose(t, layer, lambda m: sum(curves[g].at(m) for g in layer.gemms), source)
        choice = dataclasses.replace(choice, measure_s=spent)
        return _agree(choice, t, layer, group_name)
    sms = num_sms or (torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else DEFAULT_NUM_SMS)
    return choose(t, layer, lambda m: sum(gemm_cost.formula_us(m, n, k, sms) for n, k in layer.gemms), "SM formula")


def _agree(choice: SplitChoice, t: int, layer: LayerShape, group_name: Optional[str]) -> SplitChoice:
    """Rank 0 of the group publishes its choice through the store; the other ranks take it.

    Keyed by the group, ``t`` and the layer shape, so a recompile of the same graph gets the same
    answer. Without a process group (or a group of one rank) the choice stands."""
    import torch.distributed as dist

    if not group_name or not dist.is_available() or not dist.is_initialized():
        return choice
    from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
        if group.size() <= 1:
            return choice
        rank = dist.get_rank(group)
        store = _get_default_store()
    except Exception as e:  # noqa: BLE001  (a group we cannot talk to: fall back loudly, never guess)
        raise RuntimeError(f"tokenweave split: cannot agree on the split point across group {group_name}: {e}; "
                           f"compile with options={{'split_cost': 'formula'}}") from e
    digest = hashlib.sha256(json.dumps([group_name, t, dataclasses.astuple(layer)]).encode()).hexdigest()[:24]
    key = f"weave_compile/split/{digest}"
    if rank == 0:
        try:
            store.set(key, json.dumps(dataclasses.asdict(choice)))
        except Exception as e:  # noqa: BLE001  (e.g. the fake process group's store keeps nothing)
            log.info("tokenweave: split choice not published (%s); other ranks would use their own", e)
        return choice
    import datetime

    try:
        store.wait([key], datetime.timedelta(seconds=AGREE_TIMEOUT_S))
        theirs = SplitChoice(**json.loads(store.get(key)))
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"tokenweave split: rank {rank} got no split point from rank 0 of group {group_name} "
                           f"within {AGREE_TIMEOUT_S:.0f} s ({e}); compile with options={{'split_cost': 'formula'}}"
                           ) from e
    return dataclasses.replace(theirs, source=theirs.source + " (rank 0's)", measure_s=choice.measure_s)
