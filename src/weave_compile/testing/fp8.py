"""fp8 activation quantization as users write it, and an fp8 tensor-parallel Llama, for tests.

The quant helpers are the forms :mod:`weave_compile.passes.fp8_quant_match` recognizes, each written
the way its source writes it in plain torch (not copied from it):

- :func:`quant_per_token`: vLLM's per-token dynamic form (``max`` over the row, a floor on the
  scale, a multiply by its reciprocal, a clamp, the cast);
- :func:`quant_per_row`: torchao's per-row form with its plain-torch kernel preference
  (``amax(keepdim)``, a divide, a clamp, the cast);
- :func:`quant_static`: a per-tensor static scale, ``x / s`` or ``x * (1 / s)``, with or without the clamp;
- :func:`quant_per_tensor_dynamic`: one amax over the whole tensor (declined by the matcher: on a TP
  site it would need a global amax across rows and ranks before the gather).

:class:`FP8TPLlama` is :class:`~weave_compile.testing.models.TPLlama` whose column-parallel linears
(q, k, v, gate, up, or the merged ones) quantize their input with one of those forms and call
``torch._scaled_mm`` with per-row weight scales. ``torch._scaled_mm`` runs on CPU in torch 2.13
(row-wise and tensor-wise scales), so nothing is emulated.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn as nn

from .models import LlamaDims, TPLlama

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quant_per_token(x: torch.Tensor, dtype: torch.dtype = E4M3, keepdim: bool = False):
    """vLLM's per-token form: the scale is the row's absolute max over fp8 max, floored at
    ``1 / (fp8max * 512)``; values are multiplied by its reciprocal, clamped and cast.
    Returns (fp8 rows, fp32 scales ``[.., 1]``)."""
    fmax = torch.finfo(dtype).max
    if keepdim:
        row_max = x.abs().max(dim=-1, keepdim=True).values.to(torch.float32)
    else:
        row_max = x.abs().max(dim=-1).values.unsqueeze(-1).to(torch.float32)
    scale = (row_max / fmax).clamp(min=1.0 / (fmax * 512.0))
    q = (x.to(torch.float32) * scale.reciprocal()).clamp(-fmax, fmax).to(dtype)
    return q, scale


def quant_per_row(x: torch.Tensor, dtype: torch.dtype = E4M3, floor: Optional[float] = None):
    """torchao's per-row form (plain-torch kernel): ``amax(|x|, -1, keepdim) / fp8max`` as fp32,
    optionally floored, then ``x / scale`` clamped and cast. Returns (fp8 rows, fp32 scales ``[.., 1]``)."""
    fmax = torch.finfo(dtype).max
    scale = torch.amax(torch.abs(x), dim=-1, keepdim=True) / fmax
    if floor is not None:
        scale = torch.clamp(scale, min=floor)
    scale = scale.to(torch.float32)
    q = torch.clamp(x.to(torch.float32) / scale, min=-fmax, max=fmax).to(dtype)
    return q, scale


def quant_static(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = E4M3,
                 reciprocal: bool = False, clamp: bool = True) -> torch.Tensor:
    """A per-tensor static scale (0-d or ``[1]`` fp32): ``x / s``, or ``x * (1 / s)`` with
    ``reciprocal``; clamped to the fp8 range unless ``clamp`` is False. Returns the fp8 rows."""
    fmax = torch.finfo(dtype).max
    xf = x.to(torch.float32)
    y = xf * (1.0 / scale) if reciprocal else xf / scale
    if clamp:
        y = y.clamp(-fmax, fmax)
    return y.to(dtype)


def quant_per_tensor_dynamic(x: torch.Tensor, dtype: torch.dtype = E4M3):
    """One amax over the whole tensor (torchao's default float8 config is per-tensor): the form
    the matcher declines. Returns (fp8 values, 0-d fp32 scale)."""
    fmax = torch.finfo(dtype).max
    scale = (x.abs().max().to(torch.float32) / fmax).clamp(min=1e-12)
    return (x.to(torch.float32) / scale).clamp(-fmax, fmax).to(dtype), scale


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """How :class:`FP8TPLlama`'s column-parallel linears quantize their input.

    ``form``: "per_token" (vLLM), "per_row" (torchao) or "static" (per-tensor scale
    ``static_scale``, divided, or multiplied by its reciprocal with ``reciprocal``)."""

    form: str = "per_token"
    dtype: torch.dtype = E4M3
    reciprocal: bool = False
    clamp: bool = True
    static_scale: float = 0.02


class Fp8Linear(nn.Module):
    """A column-parallel linear with fp8 weights (per-output-channel scales) whose input is
    quantized as ``cfg`` says, then ``torch._scaled_mm`` to the input's dtype."""

    def __init__(self, linear: nn.Linear, cfg: Fp8Config):
        super().__init__()
        self.cfg = cfg
        w = linear.weight.detach().to(torch.float32)
        fmax = torch.finfo(cfg.dtype).max
        # Per-output-channel weight scales with per-row inputs, one tensor-wise scale with a static
        # input scale: the pairs _scaled_mm takes ([T, 1] with [1, N], or 0-d with 0-d).
        amax = w.abs().amax(dim=1, keepdim=True) if cfg.form != "static" else w.abs().amax()
        w_scale = (amax / fmax).clamp(min=1e-12)
        self.register_buffer("weight", (w / w_scale).clamp(-fmax, fmax).to(cfg.dtype))
        self.register_buffer("weight_scale", w_scale.t().contiguous())
        self.register_buffer("input_scale", torch.tensor(cfg.static_scale, dtype=torch.float32))

    def quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if cfg.form == "per_token":
            return quant_per_token(x2, cfg.dtype)
        if cfg.form == "per_row":
            return quant_per_row(x2, cfg.dtype)
        if cfg.form == "static":
            return quant_static(x2, self.input_scale, cfg.dtype, cfg.reciprocal, cfg.clamp), self.input_scale
        raise ValueError(f"Fp8Config.form: {cfg.form!r} is not one of per_token, per_row, static")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        q, scale = self.quantize(x2)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])


#: the column-parallel linears of a layer, separate or merged (``LlamaDims.merged``)
COLUMN_LINEARS = ("q", "k", "v", "gate", "up", "qkv", "gate_up")


class FP8TPLlama(TPLlama):
    """:class:`TPLlama` with fp8 column-parallel linears (:class:`Fp8Linear`), quantized per ``fp8``.

    A static-scale model has one tensor-wise weight scale per linear (``_scaled_mm`` with two 0-d
    scales); the per-row forms use per-output-channel weight scales. Each linear holds its own
    static input scale: with separate q, k, v (``LlamaDims.merged`` False) their chains differ by
    that scale and are not one quant; merged projections read one. Without a group (tp=1)
    it is the unsharded fp8 model: the same weights, for references."""

    def __init__(self, d: LlamaDims, fp8: Fp8Config = Fp8Config(), tp: int = 1, rank: int = 0, group=None,
                 seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: Optional[torch.device] = None):
        super().__init__(d, tp=tp, rank=rank, group=group, seed=seed, dtype=dtype, device=device)
        self.fp8 = fp8
        for layer in self.layers:
            for name in COLUMN_LINEARS:
                lin = getattr(layer, name, None)
                if isinstance(lin, nn.Linear):
                    setattr(layer, name, Fp8Linear(lin, fp8))

    def unsharded(self, seed: int = 0) -> FP8TPLlama:
        return FP8TPLlama(self.d, self.fp8, tp=1, seed=seed, dtype=self.embed.weight.dtype,
                          device=self.embed.weight.device)



class QuantDequantLinear(nn.Linear):
    """An ``nn.Linear`` (so PyTorch's ``ColwiseParallel`` takes it) whose input is quantized per
    token (:func:`quant_per_token`) and dequantized before its GEMM: the quant chain an fp8 model
    writes before ``_scaled_mm``, in a model that a DTensor plan parallelizes (the GEMM stays in the
    weight's dtype, which DTensor shards)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = quant_per_token(x)
        return nn.functional.linear((q.to(torch.float32) * s).to(x.dtype), self.weight, self.bias)


def titan_fp8_tp(mesh, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """torchtitan's Llama (:class:`~weave_compile.testing.sequence_parallel.TitanLlama`) whose q, k,
    v, w1 and w3 quantize their input per token (:class:`QuantDequantLinear`), parallelized on
    ``mesh`` with PyTorch's own TP plan without sequence parallelism (each row-parallel output
    all-reduced, the norms replicated)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from .sequence_parallel import TitanLlama

    model = TitanLlama(seed=seed).to(dtype)
    for block in model.layers.values():
        for owner, names in ((block.attention, ("wq", "wk", "wv")), (block.feed_forward, ("w1", "w3"))):
            for name in names:
                old = getattr(owner, name)
                new = QuantDequantLinear(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
                new.weight.data.copy_(old.weight.data)
                setattr(owner, name, new)
    parallelize_module(model, mesh, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                     "output": ColwiseParallel(output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            **{f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}, "attention.wo": RowwiseParallel(),
            **{f"feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")}, "feed_forward.w2": RowwiseParallel()})
    return model
