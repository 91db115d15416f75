"""What one fused op call is, as far as its time goes: its :class:`Signature`, and the token buckets it is timed at.

Two op calls with the same signature take the same time with any design, so a graph's sites are
timed once per signature (a Llama's interior sites share one; the first and the last differ in
their residual's layout). Everything that shapes a call's time is a field: the device, the group's
ranks, the dtypes, what the op applies besides the sum (bias, weight, scale, the norm's mid cast),
the norm (RMSNorm or LayerNorm), the residual's layout (sharded in, sharded out: as
:mod:`weave_compile.passes.shard_residual` leaves it), whether the op runs beside compute (a split
half: and the GEMMs it runs beside), its CTA budget and the token count:
static, or symbolic with the range the shape environment bounds it to.

A symbolic token count is timed at power-of-two buckets (:func:`Signature.buckets`), from the
lowest count the range allows up to its highest or :func:`max_bucket` (16K on GPUs, 1K on CPU
ranks), whichever is lower:
the op then dispatches by the call's token count to the winner of the smallest bucket that holds
it (above the largest bucket: the largest bucket's winner).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Optional

import torch

from weave_compile.quant import QuantSpec

#: The largest token bucket a symbolic token count is timed at on a GPU (a prefill of 16K tokens;
#: the benchmarks' largest T). Larger calls run the largest bucket's winner.
MAX_BUCKET_TOKENS = 16384
#: ... on CPU ranks (gloo: tests and dry runs; TP inference is not served there), where one call at
#: 16K rows takes tens of milliseconds and the buckets above 1K were most of a dynamic graph's
#: measurement (~6 of ~8 s on 2 gloo ranks, hidden 64).
CPU_MAX_BUCKET_TOKENS = 1024


def max_bucket(device: str) -> int:
    """The largest bucket a symbolic token count is timed at on ``device`` ("cuda", "cpu")."""
    return CPU_MAX_BUCKET_TOKENS if device == "cpu" else MAX_BUCKET_TOKENS


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).replace("torch.", "")


def dtype_of(name: Optional[str]) -> Optional[torch.dtype]:
    return None if name is None else getattr(torch, name)


@dataclasses.dataclass(frozen=True)
class Signature:
    """One fused op call's shape of work (module doc). Dtypes are names (``"bfloat16"``); a term
    the site does not apply is None."""

    device: str  # "cuda" | "cpu"
    ranks: tuple[int, ...]  # the group's global ranks, in group-rank order
    hidden: int
    dtype: str  # x's: the partial sums
    residual_in: Optional[str]  # the residual input's dtype; None: no residual
    residual_dtype: str  # the residual output's
    out_dtype: str
    mid_dtype: Optional[str] = None
    bias: Optional[str] = None
    weight: Optional[str] = None
    scale: Optional[str] = None
    weight_offset: float = 0.0
    eps_on_device: bool = False
    residual_in_sharded: bool = False
    residual_out_sharded: bool = False
    sequence_parallel: bool = False  # the site reduce-scatters the model's own sequence shard
    split: bool = False  # one half of a split layer: the op runs beside the other half's compute
    #: of a split half: the GEMMs the other half runs while this half's op communicates (the nodes
    #: between the op's start and its wait), as ``(rows, K, N)``; rows None: the half's token count
    beside: tuple[tuple, ...] = ()  # (rows, K, N), or (rows, K, N, "fp8"): passes/measured_sites.gemms_beside
    comm_ctas: int = 32
    batch_invariant: bool = False  # the op adds the partial sums in rank order (another reduction)
    out_slot: bool = False  # the op may leave its output in the symmetric output ring
    tokens: Optional[int] = None  # static token count; None: symbolic
    token_range: Optional[tuple[int, Optional[int]]] = None  # of a symbolic count, as bounded
    norm: str = "rmsnorm"  # or "layernorm"
    norm_bias: Optional[str] = None  # a LayerNorm's bias (after the weight)
    #: the fp8 epilogue (``weave_compile.quant.QuantSpec.encode``); None: none
    quant: Optional[str] = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def buckets(self) -> tuple[int, ...]:
        """The token counts it is timed at: the static count, else powers of two (module doc)."""
        if self.tokens is not None:
            return (max(1, self.tokens),)
        lo, hi = self.token_range or (1, None)
        lo = max(1, lo)
        cap = max_bucket(self.device)
        top = cap if hi is None else max(lo, min(hi, cap))
        out, b = [], 1
        while b < lo:
            b *= 2
        out.append(b)
        while b < top:
            b *= 2
            out.append(b)
        if self.sequence_parallel:  # a reduce-scatter's input holds whole shards: a multiple of N rows
            n = self.world_size
            out = sorted({-(-b // n) * n for b in out})
        return tuple(out)

    def describe(self) -> str:
        """A short line for ``explain()``."""
        terms = [t for t, on in (("bias", self.bias), ("scale", self.scale), ("weight", self.weight),
                                 ("norm bias", self.norm_bias)) if on]
        layout = ("res " + ("shard" if self.residual_in_sharded else "full") + "->"
                  + ("shard" if self.residual_out_sharded else "full")) if self.residual_in else "no residual"
        kind = ("sequence-parallel " if self.sequence_parallel else "") + ("LayerNorm " if self.norm == "layernorm" else "")
        if self.quant:
            terms.append(QuantSpec.decode(self.quant).describe())
        # T is the table's own column (a symbolic T has a row per bucket)
        return (f"{kind}H={self.hidden} {self.dtype} x{self.world_size}, {layout}"
                + (f", {'+'.join(terms)}" if terms else "") + (", split half" if self.split else "")
                + (f" beside {len(self.beside)} GEMM{'s' * (len(self.beside) != 1)}" if self.beside else ""))

    def key(self) -> str:
        """A stable digest of every field. The norm's fields are left out at their defaults (an
        RMSNorm site): signatures from before they existed keep their keys."""
        d = dataclasses.asdict(self)
        for name in _ADDED_LATER:
            if d[name] == _DEFAULTS[name]:
                del d[name]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:20]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Signature":
        d = dict(d)
        d["ranks"] = tuple(d["ranks"])
        if d.get("token_range") is not None:
            d["token_range"] = tuple(d["token_range"])
        d["beside"] = tuple(tuple(g) for g in d.get("beside", ()))
        return cls(**d)


def bucket_of(buckets: tuple[int, ...], num_tokens: int) -> int:
    """The bucket a call of ``num_tokens`` tokens falls in: the smallest that holds it, else the largest."""
    for b in buckets:
        if num_tokens <= b:
            return b
    return buckets[-1]


#: Fields added after signatures were first cached, left out of :meth:`Signature.key` at their defaults.
_ADDED_LATER = ("norm", "norm_bias", "quant")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Signature)}
