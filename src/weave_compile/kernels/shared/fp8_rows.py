"""The fp8 epilogue's device body: a tile of normed rows to fp8 codes and row scales.

The contract is :mod:`weave_compile.quant` (its :func:`~weave_compile.quant.quantize_rows` is
the torch twin, bit for bit): per row ``s = max(amax(|y|) * r, floor)`` with ``r`` = 1 / fp8_max
rounded to fp32 (rounded to the scale dtype where the model divides in bf16), or the static scale;
``q = y / s`` or ``y * (1 / s)``, clamped to ``+-fp8_max`` where the model clamps, then rounded
to fp8.

Bit-exact to torch, not only close:

- the row scale multiplies by ``r``, as torch does when it divides a CUDA tensor by a Python
  number (a true quotient was an ulp off torch's on an H100); every other quotient is
  IEEE-rounded (``tl.div_rn``: Triton's ``/`` on fp32 is an approximate division on GPUs), since
  one ulp in a scale moves codes across rounding boundaries;
- NaN propagates through the row's amax and the clamp as in torch (``amax`` and ``clamp`` keep
  a NaN; Triton's max reduction and ``minimum`` would drop it);
- the fp8 rounding: round to nearest even, saturating at the format's largest finite value
  (torch's eager cast differs only for values past the range without a clamp, by version: NaN in
  e4m3fn on 2.11, saturated on 2.13's CPU build, infinity in e5m2), NaN kept. Done in integer
  arithmetic on the fp32 bits (:func:`fp8_bits`) everywhere: on an H100 Triton's fp32->fp8
  conversion put 0.1% of codes a step away from round-to-nearest-even (176 where torch gives
  160), and the interpreter's cast does not carry a mantissa round-up into the exponent (124.3
  became 64, not 128, in e4m3fn). The interpreter's bf16 cast truncates: :func:`bf16_round`
  rounds a bf16 row scale there.

Codes are produced as their bytes (int32 0..255, stored through a uint8 view of the output), so
no fp8 type crosses the kernel's stores.
"""

from __future__ import annotations

import torch

from .common import HAS_TRITON, tl, triton

#: Per fp8 format: (mantissa bits, exponent bias, largest finite value).
_FORMATS = {d: ({torch.float8_e4m3fn: 3}.get(d, 2), {torch.float8_e4m3fn: 7}.get(d, 15), float(torch.finfo(d).max))
            for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None}


def quant_constexprs(quant, out_dtype: torch.dtype) -> dict:
    """The add+norm kernel's epilogue constexprs for :class:`weave_compile.quant.QuantSpec` ``quant``."""
    from .common import tl_dtype

    mbits, bias, finite = _FORMATS[quant.dtype]
    return dict(QUANT=1 if quant.kind == "row" else 2, Q_INV_MAX=float(quant.inverse_max),
                Q_FLOOR=float(quant.floor), Q_RECIP=bool(quant.reciprocal),
                Q_SDTYPE=tl_dtype(quant.scale_dtype), Q_MBITS=mbits, Q_BIAS=bias,
                Q_SAT=float(quant.fp8_max) if quant.clamp else finite)


def code_vector(codes: torch.Tensor, out_dtype: torch.dtype) -> int:
    """The ``Q_VEC`` constexpr for storing fp8 codes to ``codes`` ([rows, H], one byte each): the
    elements a thread stores of the normed rows without the epilogue (16 bytes of ``out_dtype``)
    where the codes' rows start 16-byte aligned (base and row stride: what Triton specializes on,
    and only then would it give one-byte codes 16 a thread, widening the tile's layout); else 0 (no
    hint: Triton's own analysis keeps them narrower, and a hint there would claim an alignment the
    rows lack)."""
    aligned = codes.data_ptr() % 16 == 0 and codes.stride(0) * codes.element_size() % 16 == 0
    return 16 // out_dtype.itemsize if aligned else 0


if HAS_TRITON:

    @triton.jit
    def fp8_bits(q, MBITS: tl.constexpr, BIAS: tl.constexpr):
        """The fp8 code (int32 0..255, sign included) of fp32 ``q`` rounded to nearest even, for
        |q| below the format's overflow (the caller fixes up the rest): normal values round on the
        fp32 bits; values under the smallest normal are added to a power of two that puts their
        last kept bit at fp32's last, so the fp32 add rounds them."""
        SHIFT: tl.constexpr = 23 - MBITS
        MIN_NORMAL: tl.constexpr = (128 - BIAS) << 23  # fp32 bits of 2**(1 - BIAS)
        DENORM: tl.constexpr = ((127 - BIAS) + SHIFT + 1) << 23  # fp32 bits of 2**(SHIFT + 1 - BIAS)
        bits = q.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        odd = (a >> SHIFT) & 1
        normal = (a + (((BIAS - 127) << 23) + (1 << (SHIFT - 1)) - 1) + odd) >> SHIFT
        denorm_f = tl.full(q.shape, DENORM, tl.int32).to(tl.float32, bitcast=True)
        sub = (a.to(tl.float32, bitcast=True) + denorm_f).to(tl.int32, bitcast=True) - DENORM
        code = tl.where(a < MIN_NORMAL, sub, normal)
        return code | tl.where(bits < 0, 0x80, 0)

    @triton.jit
    def bf16_round(v):
        """fp32 ``v`` rounded to the nearest bf16 (ties to even), as fp32; NaN stays NaN."""
        bits = v.to(tl.int32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(v != v, v, r)

    @triton.jit
    def to_scale_dtype(v, Q_SDTYPE: tl.constexpr, INTERPRET: tl.constexpr):
        """``v`` rounded to the row scale's dtype (fp32: as is), as fp32."""
        if Q_SDTYPE == tl.float32:
            return v
        elif INTERPRET:
            return bf16_round(v)
        else:
            return v.to(Q_SDTYPE).to(tl.float32)

    @triton.jit
    def quant_tile(y, qstatic, Q_INV_MAX: tl.constexpr, Q_FLOOR: tl.constexpr,
                   ROW: tl.constexpr, Q_RECIP: tl.constexpr, Q_SAT: tl.constexpr, Q_SDTYPE: tl.constexpr,
                   Q_MBITS: tl.constexpr, Q_BIAS: tl.constexpr, INTERPRET: tl.constexpr):
        """``(codes [R, BLOCK_H] int32 bytes, scales [R] fp32)`` of the normed tile ``y`` (already
        rounded to the op's output dtype; padding columns 0); ``ROW``: a per-row dynamic scale (its
        amax times ``Q_INV_MAX``, 1 / fp8_max in fp32, rounded to ``Q_SDTYPE`` and floored at
        ``Q_FLOOR``), else the static
        ``qstatic`` (an fp32 scalar); ``Q_SAT``: the clamp bound (the model's ``fp8_max``, or the
        format's largest finite value where the model does not clamp)."""
        yf = y.to(tl.float32)
        if ROW:
            amax = tl.max(tl.abs(yf), axis=1)
            has_nan = tl.max((yf != yf).to(tl.int32), axis=1) > 0
            amax = tl.where(has_nan, float("nan"), amax)
            s = to_scale_dtype(amax * Q_INV_MAX, Q_SDTYPE, INTERPRET)
            s = tl.maximum(s, tl.full(s.shape, Q_FLOOR, tl.float32), propagate_nan=tl.PropagateNan.ALL)
            s = to_scale_dtype(s, Q_SDTYPE, INTERPRET)
        else:
            s = tl.full((y.shape[0],), 0.0, tl.float32) + qstatic
        if Q_RECIP:
            q = yf * tl.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, None]
        else:
            q = tl.div_rn(yf, tl.broadcast_to(s[:, None], yf.shape))
        q = tl.clamp(q, -Q_SAT, Q_SAT, propagate_nan=tl.PropagateNan.ALL)
        code = fp8_bits(q, Q_MBITS, Q_BIAS)
        bits = q.to(tl.int32, bitcast=True)
        code = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, tl.where(bits < 0, 0xFF, 0x7F), code)  # NaN: its sign kept
        return code, s
