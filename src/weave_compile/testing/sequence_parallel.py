"""Sequence-parallel TP Llamas: PyTorch's own TP plan (as torchtitan writes it) and Megatron-LM's form.

Both keep the activations between blocks sharded by sequence position, so every block boundary is
``reduce_scatter -> (+bias) -> + residual shard -> RMSNorm -> all_gather``:

* :class:`TitanLlama` + :func:`parallelize_titan`: torchtitan's Llama module tree parallelized with
  ``torch.distributed.tensor.parallel`` exactly as torchtitan's plan does (the embedding
  ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``, norms under
  ``SequenceParallel()``, ``wo``/``w2`` ``RowwiseParallel(output_layouts=Shard(1))``,
  ``PrepareModuleInput(Shard(1) -> Replicate())`` before attention and the MLP, the output
  projection ``ColwiseParallel(input_layouts=Shard(1))``): DTensor shards dim 1 of ``[B, S, H]``.
* :class:`MegatronSPLlama`: :class:`~weave_compile.testing.models.TPLlama`'s weights run the way
  Megatron-LM's sequence parallelism writes it by hand, on ``[S, B, H]`` sharded along dim 0,
  with c10d's in-place ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` or the functional
  collectives. A sequence whose length the group size does not divide is padded with zero rows
  at its end (causal attention: no real token sees them) and cut back after the last gather.

Weights come from seeded generators, identical on every rank, so each model equals its own
unsharded run up to collective rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .models import RMSNorm, TPLlama


class _TitanAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: after ColwiseParallel each rank holds its own heads (torchtitan does the same)
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _TitanFeedForward(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _norm(hidden: int, eps: float, form: str) -> nn.Module:
    """``nn.RMSNorm`` (torchtitan's), or one of :class:`~weave_compile.testing.models.RMSNorm`'s forms."""
    if form == "nn":
        return nn.RMSNorm(hidden, eps=eps)
    return RMSNorm(hidden, eps, form)


class _TitanBlock(nn.Module):
    def __init__(self, hidden, heads, kv_heads, intermediate, eps, norm):
        super().__init__()
        self.attention = _TitanAttention(hidden, heads, kv_heads)
        self.feed_forward = _TitanFeedForward(hidden, intermediate)
        self.attention_norm = _norm(hidden, eps, norm)
        self.ffn_norm = _norm(hidden, eps, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama module tree (names as its TP plan addresses them); ``forward(tokens)``
    returns logits ``[B, S, vocab]``. ``norm``: ``"nn"`` (``nn.RMSNorm``), ``"hf"``,
    ``"functional"`` or ``"gemma"``."""

    # Defaults divisible by 2 and 3 ranks (heads, vocabulary and intermediate are sharded).
    def __init__(self, vocab: int = 96, hidden: int = 48, heads: int = 6, kv_heads: int = 6,
                 intermediate: int = 96, layers: int = 2, eps: float = 1e-5, norm: str = "nn", seed: int = 0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # the same full weights on every rank
            self.tok_embeddings = nn.Embedding(vocab, hidden)
            self.layers = nn.ModuleDict({str(i): _TitanBlock(hidden, heads, kv_heads, intermediate, eps, norm)
                                         for i in range(layers)})
            self.norm = _norm(hidden, eps, norm)
            self.output = nn.Linear(hidden, vocab, bias=False)
            for p in self.parameters():  # norm weights away from their constant init
                if p.dim() == 1:
                    p.data.add_(0.1 * torch.randn_like(p))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def parallelize_titan(model: TitanLlama, mesh) -> TitanLlama:
    """torchtitan's tensor-parallel plan for its Llama, with sequence parallelism (loss not parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


class MegatronSPLlama(TPLlama):
    """:class:`TPLlama` with Megatron-LM's sequence parallelism: ``[S, B, H]`` activations, the
    residual stream this rank's ``[S/N, B, H]`` rows, each row-parallel output (and the
    vocab-parallel embedding) reduce-scattered along the sequence and each norm's output
    all-gathered. ``collectives``: ``"c10d"`` (in-place ``dist.reduce_scatter_tensor`` /
    ``dist.all_gather_into_tensor`` into buffers, as Megatron calls them) or ``"funcol"``.
    ``residual_multiplier`` scales each block's reduced output before the residual add (Granite's
    form). ``forward(tokens [B, S])`` returns the final normed hidden states ``[B, S, H]``."""

    def __init__(self, *args, collectives: str = "c10d", residual_multiplier: Optional[float] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if collectives not in ("c10d", "funcol"):
            raise ValueError(f"collectives must be 'c10d' or 'funcol', got {collectives!r}")
        if self.tp < 2 or self.group is None:
            raise ValueError("MegatronSPLlama needs a process group of 2 or more ranks")
        self.collectives, self.residual_multiplier = collectives, residual_multiplier

    def _reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.collectives == "funcol":
            import torch.distributed._functional_collectives as funcol

            return funcol.reduce_scatter_tensor(x, "sum", 0, self.group)
        out = x.new_empty((x.shape[0] // self.tp, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x, group=self.group)
        return out

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.collectives == "funcol":
            import torch.distributed._functional_collectives as funcol

            return funcol.all_gather_tensor(x, 0, self.group)
        out = x.new_empty((x.shape[0] * self.tp, *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.residual_multiplier is None else y * self.residual_multiplier

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        pad = -s % self.tp
        ids = F.pad(tokens, (0, pad)).t()  # [S', B]: pad rows at the sequence's end
        residual = self._reduce_scatter(self.embed_partial(ids))  # [S'/N, B, H]
        h = self._all_gather(self.layers[0].input_norm(residual))
        for i, layer in enumerate(self.layers):
            a = self._reduce_scatter(layer.o(layer.attention(h.transpose(0, 1)).transpose(0, 1)))
            if layer.o_bias is not None:
                a = a + layer.o_bias
            residual = residual + self._scaled(a)
            h = self._all_gather(layer.post_attn_norm(residual))
            if layer.d.merged:
                gate, up = layer.gate_up(h).split(layer.gate_up_sizes, -1)
            else:
                gate, up = layer.gate(h), layer.up(h)
            m = self._reduce_scatter(layer.down(F.silu(gate) * up))
            if layer.down_bias is not None:
                m = m + layer.down_bias
            residual = residual + self._scaled(m)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            h = self._all_gather(nxt(residual))
        return h.transpose(0, 1)[:, :s]


def expected_sequence_parallel_sites(layers: int) -> int:
    """Sites of either model: the embedding's, then two per layer (the last one the final norm's)."""
    return 1 + 2 * layers
