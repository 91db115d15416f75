"""A hand-written Megatron-style tensor-parallel Llama, for the quickstart, tests and benchmarks.

Column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj each followed by an in-place
``dist.all_reduce``, HF-style RMSNorm, or a LayerNorm (``LlamaDims.norm``: with ``bias=True``
the sequential LayerNorm blocks of StarCoder2 and GPT-NeoX's sequential variant, row-parallel
biases included; OLMo's and Cohere's norms). Weights come from a seeded generator over the *full*
model, and every rank keeps its slice, so the TP model equals :meth:`TPLlama.unsharded` up to
collective rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class LlamaDims:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    layers: int = 2
    vocab: int = 128
    eps: float = 1e-6
    #: RMSNorm: "hf" (fp32 upcast, weight after the cast-back), "functional" (F.rms_norm) or
    #: "gemma" ((1 + w) in fp32). LayerNorm: "layernorm" (nn.LayerNorm's weight and bias:
    #: StarCoder2, GPT-NeoX), "olmo" (no affine, fp32 upcast) or "cohere" (hand-written mean and
    #: variance in fp32, weight only).
    norm: str = "hf"
    #: Row-parallel layers carry a bias added after the all_reduce.
    bias: bool = False
    #: Vocab-parallel embedding: an all_reduce right after the embedding lookup.
    vocab_parallel: bool = True
    #: One QKV and one gate/up projection per layer, each a single GEMM (Megatron's and vLLM's
    #: layout), instead of Hugging Face's separate q, k, v, gate and up: the same numbers, fewer
    #: and larger GEMMs (what a split half pays for small ones, docs/performance.md section 4).
    merged: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA3_8B = LlamaDims(hidden=4096, heads=32, kv_heads=8, intermediate=14336, layers=32, vocab=128256, eps=1e-5)
LLAMA3_70B = LlamaDims(hidden=8192, heads=64, kv_heads=8, intermediate=28672, layers=80, vocab=128256, eps=1e-5)



class RMSNorm(nn.Module):
    """The model's norm in one of ``LlamaDims.norm``'s forms (an RMSNorm or a LayerNorm)."""

    def __init__(self, hidden: int, eps: float, form: str):
        super().__init__()
        self.eps, self.form = eps, form
        init = torch.zeros(hidden) if form == "gemma" else torch.ones(hidden)
        self.weight = nn.Parameter(init) if form != "olmo" else None
        self.bias = nn.Parameter(torch.zeros(hidden)) if form == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "functional":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.form == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        if self.form == "olmo":
            return F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)
        if self.form == "cohere":
            xf = x.float()
            mean = xf.mean(-1, keepdim=True)
            var = (xf - mean).pow(2).mean(-1, keepdim=True)
            return (self.weight.float() * ((xf - mean) * torch.rsqrt(var + self.eps))).to(x.dtype)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.form == "gemma":
            return (y * (1.0 + self.weight.float())).type_as(x)
        return self.weight * y.to(x.dtype)


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


class Layer(nn.Module):
    def __init__(self, d: LlamaDims, tp: int, group):
        super().__init__()
        self.d, self.tp, self.group = d, tp, group
        hd = d.head_dim
        #: output widths of q, k, v and of gate, up on this rank
        self.qkv_sizes = [d.heads // tp * hd, d.kv_heads // tp * hd, d.kv_heads // tp * hd]
        self.gate_up_sizes = [d.intermediate // tp] * 2
        if d.merged:
            self.qkv = nn.Linear(d.hidden, sum(self.qkv_sizes), bias=False)
            self.gate_up = nn.Linear(d.hidden, sum(self.gate_up_sizes), bias=False)
        else:
            self.q, self.k, self.v = (nn.Linear(d.hidden, n, bias=False) for n in self.qkv_sizes)
            self.gate, self.up = (nn.Linear(d.hidden, n, bias=False) for n in self.gate_up_sizes)
        self.o = nn.Linear(d.heads // tp * hd, d.hidden, bias=False)
        self.down = nn.Linear(d.intermediate // tp, d.hidden, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(d.hidden)) if d.bias else None
        self.down_bias = nn.Parameter(torch.zeros(d.hidden)) if d.bias else None
        self.input_norm = RMSNorm(d.hidden, d.eps, d.norm)
        self.post_attn_norm = RMSNorm(d.hidden, d.eps, d.norm)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        hd = self.d.head_dim
        qkv = self.qkv(h).split(self.qkv_sizes, -1) if self.d.merged else (self.q(h), self.k(h), self.v(h))
        q, k, v = (t.view(b, s, -1, hd).transpose(1, 2) for t in qkv)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(b, s, -1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        # The input norm of this layer is fed by the previous layer's (residual, all_reduce) pair.
        o = _all_reduce(self.o(self.attention(x)), self.group)
        if self.o_bias is not None:
            o = o + self.o_bias
        residual = residual + o
        h = self.post_attn_norm(residual)
        gate, up = self.gate_up(h).split(self.gate_up_sizes, -1) if self.d.merged else (self.gate(h), self.up(h))
        m = self.down(F.silu(gate) * up)
        m = _all_reduce(m, self.group)
        if self.down_bias is not None:
            m = m + self.down_bias
        return m, residual


class TPLlama(nn.Module):
    """Decoder stack; ``forward(tokens)`` returns the final normed hidden states [B, S, H]."""

    def __init__(self, d: LlamaDims, tp: int = 1, rank: int = 0, group=None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None):
        super().__init__()
        self.d, self.tp, self.group = d, tp, group
        self.vocab_parallel = d.vocab_parallel and tp > 1
        self.embed = nn.Embedding(d.vocab // tp if self.vocab_parallel else d.vocab, d.hidden)
        self.vocab_start = rank * (d.vocab // tp) if self.vocab_parallel else 0
        self.layers = nn.ModuleList(Layer(d, tp, group if tp > 1 else None) for _ in range(d.layers))
        self.final_norm = RMSNorm(d.hidden, d.eps, d.norm)
        self._init_from_full(seed, rank)
        self.to(device=device, dtype=dtype)

    def unsharded(self, seed: int = 0) -> TPLlama:
        return TPLlama(self.d, tp=1, seed=seed, dtype=self.embed.weight.dtype, device=self.embed.weight.device)

    @torch.no_grad()
    def _init_from_full(self, seed: int, rank: int) -> None:
        g = torch.Generator().manual_seed(seed)
        d, tp = self.d, self.tp

        def full(*shape, scale):
            return torch.randn(*shape, generator=g) * scale

        def shard(t, dim, parts=tp):
            return t.chunk(parts, dim=dim)[rank] if parts > 1 else t

        emb = full(d.vocab, d.hidden, scale=1.0)
        self.embed.weight.copy_(shard(emb, 0) if self.vocab_parallel else emb)
        hd = d.head_dim
        for layer in self.layers:
            s = d.hidden ** -0.5
            # The same draws in the same order either way: a merged model equals the separate one.
            q, k, v = (shard(full(n * hd, d.hidden, scale=s), 0) for n in (d.heads, d.kv_heads, d.kv_heads))
            layer.o.weight.copy_(shard(full(d.hidden, d.heads * hd, scale=s), 1))
            gate, up = (shard(full(d.intermediate, d.hidden, scale=s), 0) for _ in range(2))
            if d.merged:
                layer.qkv.weight.copy_(torch.cat([q, k, v]))
                layer.gate_up.weight.copy_(torch.cat([gate, up]))
            else:
                for lin, w in zip((layer.q, layer.k, layer.v, layer.gate, layer.up), (q, k, v, gate, up)):
                    lin.weight.copy_(w)
            layer.down.weight.copy_(shard(full(d.hidden, d.intermediate, scale=d.intermediate ** -0.5), 1))
            for norm in (layer.input_norm, layer.post_attn_norm):
                _perturb(norm, full, d.hidden)
            for b in (layer.o_bias, layer.down_bias):
                if b is not None:
                    b.copy_(full(d.hidden, scale=0.1))
        _perturb(self.final_norm, full, d.hidden)

    def embed_partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of the embedding: its vocabulary slice's rows, zeros elsewhere (the
        whole embedding without a vocab-parallel table)."""
        if not self.vocab_parallel:
            return self.embed(tokens)
        local = tokens - self.vocab_start
        mask = (local < 0) | (local >= self.embed.num_embeddings)
        return self.embed(local.clamp(0, self.embed.num_embeddings - 1)) * (~mask).unsqueeze(-1).to(self.embed.weight.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_partial(tokens)
        return _all_reduce(h, self.group) if self.vocab_parallel else h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens(tokens)
        h = self.layers[0].input_norm(residual)
        for i, layer in enumerate(self.layers):
            m, residual = layer(h, residual)
            residual = residual + m
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            h = nxt(residual)
        return h


def _perturb(norm: RMSNorm, full, hidden: int) -> None:
    """Random norm parameters around their init (the RMSNorm forms draw what they always drew)."""
    if norm.weight is not None:
        norm.weight.add_(full(hidden, scale=0.1))
    if norm.bias is not None:
        norm.bias.add_(full(hidden, scale=0.1))


def expected_fused_sites(d: LlamaDims, tp: int) -> int:
    """Fusable sites: 2 per layer (o_proj, down_proj) plus the vocab-parallel embedding's all_reduce."""
    return 2 * d.layers + (1 if d.vocab_parallel and tp > 1 else 0)
