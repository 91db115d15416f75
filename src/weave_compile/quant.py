"""The fused op's fp8 epilogue: what it computes per row, in torch ops (CPU paths, the oracle's twin).

Inference on H100/H200 mostly quantizes the normed rows to fp8 right after the norm (per row with
a dynamic scale, or with a static per-tensor scale) and feeds them to an fp8 GEMM. Inside the
fused op the quantization runs on this rank's 1/N of the rows and the all-gather moves fp8 rows
(H bytes) plus one fp32 scale per row instead of bf16 rows (2H bytes).

Contract, per row ``y`` = the op's normed row rounded to ``out_dtype`` (the spec's rounding), in
float32::

    row:    s = max(amax(|y|) * r, floor)                # the row's scale, returned [.., 1] fp32
            (r = 1 / fp8_max rounded to fp32: how torch divides a CUDA tensor by a Python number,
            and so the same bits from the kernel and from torch on either device)
            (rounded to scale_dtype first where the model divides in bf16, torchao's per-row form)
    static: s = scale                                    # the model's static per-tensor scale
    q = y * (1 / s)   if reciprocal else   y / s
    q = clamp(q, -fp8_max, fp8_max)   if clamp
    q = q.to(dtype)                                      # e4m3fn or e5m2, saturating

The cast rounds to nearest even and saturates at the format's largest finite value (NaN stays
NaN): what the hardware conversion, hence the model's own compiled chain on GPUs, does. Torch's
eager cast of a value past the range differs by version (e4m3fn: NaN on 2.11, saturated on
2.13's CPU build; e5m2: infinity); only a chain without a clamp can meet such a value.

``reciprocal`` and ``clamp`` follow what the model's code wrote (vLLM's per-token quant multiplies
by the reciprocal, torchao's per-row form divides); the fuse pass records them
(:mod:`weave_compile.passes.fp8_quant_match`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

#: The epilogue kinds (the op's ``quant`` argument; "" is none).
KINDS = ("row", "static")
#: The fp8 formats the epilogue writes.
FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
                   if d is not None)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """The fp8 epilogue's parameters (module doc): ``kind`` "row" or "static", the fp8 ``dtype``,
    ``fp8_max`` (the divisor of the row's amax and the clamp bound), ``floor`` (the row scale's
    lower bound; 0: none), ``reciprocal`` and ``clamp``."""

    kind: str
    dtype: torch.dtype
    fp8_max: float
    floor: float = 0.0
    reciprocal: bool = False
    clamp: bool = True
    scale_dtype: torch.dtype = torch.float32  # a row scale's quotient and floor are computed in it

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quant must be one of {KINDS} (or empty: none), got {self.kind!r}")
        if self.dtype not in FP8_DTYPES:
            raise ValueError(f"quant_dtype must be one of {FP8_DTYPES}, got {self.dtype!r}")
        if not self.fp8_max > 0:
            raise ValueError(f"quant_max must be > 0, got {self.fp8_max!r}")
        if self.floor < 0:
            raise ValueError(f"quant_floor must be >= 0, got {self.floor!r}")

    @classmethod
    def of(cls, kind: str, dtype: Optional[torch.dtype], fp8_max: float, floor: float, reciprocal: bool,
           clamp: bool, scale_dtype: Optional[torch.dtype] = None) -> Optional["QuantSpec"]:
        """The spec of the op's ``quant*`` arguments, or None where ``kind`` is empty (no epilogue)."""
        if not kind:
            return None
        return cls(kind, dtype, float(fp8_max), float(floor), bool(reciprocal), bool(clamp),
                   scale_dtype or torch.float32)

    def encode(self) -> str:
        """A stable text form (a measured signature's field, a cache key): :meth:`decode` reads it."""
        return ",".join((self.kind, str(self.dtype).removeprefix("torch."), repr(self.fp8_max), repr(self.floor),
                         str(int(self.reciprocal)), str(int(self.clamp)), str(self.scale_dtype).removeprefix("torch.")))

    @classmethod
    def decode(cls, text: str) -> "QuantSpec":
        kind, dtype, fp8_max, floor, reciprocal, clamp, scale_dtype = text.split(",")
        return cls(kind, getattr(torch, dtype), float(fp8_max), float(floor), reciprocal == "1", clamp == "1",
                   getattr(torch, scale_dtype))

    def op_args(self) -> dict:
        """The fused op's ``quant*`` arguments (the static scale, ``quant_scale``, is the caller's)."""
        return dict(quant=self.kind, quant_dtype=self.dtype, quant_max=self.fp8_max, quant_floor=self.floor,
                    quant_reciprocal=self.reciprocal, quant_clamp=self.clamp,
                    quant_scale_dtype=None if self.scale_dtype == torch.float32 else self.scale_dtype)

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.float8_")
        return f"fp8 {name} {'per-row' if self.kind == 'row' else 'static per-tensor'}"

    @property
    def inverse_max(self) -> float:
        """``1 / fp8_max`` rounded to fp32 (IEEE, once): the row scale is ``amax`` times it."""
        return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(self.fp8_max, dtype=torch.float32))

    @property
    def saturation(self) -> float:
        """The bound the quotient is clamped to: ``fp8_max`` where the model clamps, else the
        format's largest finite value (the cast saturates: module doc)."""
        return self.fp8_max if self.clamp else float(torch.finfo(self.dtype).max)

    def row_bytes(self, hidden: int) -> int:
        """Bytes one gathered row of the normed output takes (its fp8 codes, and a row's scale)."""
        return hidden + (4 if self.kind == "row" else 0)


def quantize_rows(y: torch.Tensor, quant: QuantSpec,
                  scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [T, H] in quant.dtype, scales [T, 1] fp32)`` of the normed rows ``y`` (already in the
    op's ``out_dtype``), computed in float32 as the module doc says; ``scale``: the static scale
    (``kind == "static"``; its scales output is empty, [0])."""
    yf = y.float()
    if quant.kind == "row":
        r = torch.tensor(quant.inverse_max, dtype=torch.float32, device=y.device)
        s = (yf.abs().amax(-1, keepdim=True) * r).to(quant.scale_dtype).clamp_min(quant.floor).float()
        scales = s
    else:
        if scale is None:
            raise ValueError("a static fp8 epilogue needs its scale (quant_scale)")
        s = scale.float().reshape(())
        scales = yf.new_empty((0,))
    q = yf * torch.reciprocal(s) if quant.reciprocal else yf / s
    return q.clamp(-quant.saturation, quant.saturation).to(quant.dtype), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, quant: QuantSpec,
               scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float64 values fp8 rows ``q`` stand for (``q * s``): how a check compares an epilogue's
    output with the oracle's."""
    s = scales if quant.kind == "row" else scale.reshape(())
    return q.to(torch.float64) * s.to(torch.float64)


def quotient_ref(y: torch.Tensor, quant: QuantSpec,
                 scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float64 [T, H], scales [T, 1] fp32)``: the contract in exact arithmetic up to the fp8
    cast, with the roundings it states and no others: the row scale computed exactly then rounded
    to fp32 (the value the contract returns and divides by; to ``scale_dtype`` first where the
    model divides there), the reciprocal of the form that multiplies rounded to fp32 (the model
    computes it as an fp32 tensor), the quotient or product exact, then clamped (or saturated:
    module doc). Only the fp8 cast is left: :func:`quantize_ref`; a code checks against ``q``'s
    rounding boundaries (``testing.numerics.codes_agree``)."""
    yd = y.to(torch.float64)
    if quant.kind == "row":
        s = (yd.abs().amax(-1, keepdim=True) * quant.inverse_max).to(torch.float32).to(torch.float64)
        if quant.scale_dtype != torch.float32:  # the model rounds its quotient there and floors it there
            s = s.to(quant.scale_dtype).clamp_min(quant.floor)
        else:
            s = s.clamp_min(quant.floor)
        scales = s.to(torch.float32)
        s = scales.to(torch.float64)
    else:
        s = scale.to(torch.float32).to(torch.float64).reshape(())
        scales = yd.new_empty((0,), dtype=torch.float32)
    if quant.reciprocal:
        q = yd * (1.0 / s).to(torch.float32).to(torch.float64)
    else:
        q = yd / s
    return q.clamp(-quant.saturation, quant.saturation), scales


def quantize_ref(y: torch.Tensor, quant: QuantSpec,
                 scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The epilogue's oracle from the normed rows ``y``: :func:`quotient_ref` rounded once to fp8
    (codes and scales as exact arithmetic would give them under the contract's own roundings)."""
    q, scales = quotient_ref(y, quant, scale)
    return q.to(quant.dtype), scales


def gathered_outputs(normed_shard: torch.Tensor, res_shard: torch.Tensor, quant: QuantSpec,
                     quant_scale: Optional[torch.Tensor], residual_out_sharded: bool, group_name: str,
                     world_size: int, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's outputs from this rank's normed rows and residual rows (``[S, H]`` each) with an
    fp8 epilogue: the rows quantized here with torch ops, then :func:`gather_quantized`."""
    q, scales = quantize_rows(normed_shard, quant, quant_scale)
    return gather_quantized(q, scales, res_shard, residual_out_sharded, group_name, world_size, total)


def gather_quantized(codes: torch.Tensor, scales: torch.Tensor, res_shard: torch.Tensor, residual_out_sharded: bool,
                     group_name: str, world_size: int, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's outputs from this rank's fp8 codes ``[S, H]``, row scales (``[S, 1]`` fp32; empty for
    a static scale) and residual rows: every rank's codes and scales gathered in rank order and cut
    to ``total`` rows (the codes travel as bytes: gloo has no fp8, NCCL needs none), and the
    residual gathered too unless it stays sharded."""
    from weave_compile.rows import all_gather_rows

    gathered = all_gather_rows(codes.view(torch.uint8), group_name, world_size)[:total].view(codes.dtype)
    if scales.numel():
        scales = all_gather_rows(scales, group_name, world_size)[:total]
    res = res_shard if residual_out_sharded else all_gather_rows(res_shard, group_name, world_size)[:total]
    return gathered, res, scales
