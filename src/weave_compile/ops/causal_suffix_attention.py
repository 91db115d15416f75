"""``weave::causal_suffix_attention``: causal attention of a suffix of the queries over all keys.

When the token split cuts a sequence into a prefix A (``s`` tokens) and a suffix B (``T - s``),
B's queries must see A's keys and values as well as their own. With ``q`` holding B's
``Tq = T - s`` queries and ``k``/``v`` all ``Tk = T`` positions, query ``i`` is position
``Tk - Tq + i`` and sees keys ``0 .. Tk - Tq + i``: the causal mask aligned to the lower
right corner. The prefix half needs no new op: it is plain causal attention over its own keys.

The implementation is PyTorch's SDPA with ``torch.nn.attention.bias.causal_lower_right``, which
on CUDA dispatches to FlashAttention (whose causal mask is lower-right aligned) without
materializing a mask. Grouped-query attention (fewer key/value heads) is expanded here.
``causal_suffix_attention_ref`` is the float64 oracle.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("causal_suffix_attention: q, k, v must be [batch, heads, tokens, head_dim]")
    if k.shape[2] != v.shape[2] or k.shape[2] < q.shape[2]:
        raise ValueError(f"causal_suffix_attention: need k/v positions ({k.shape[2]}) >= queries ({q.shape[2]})")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"causal_suffix_attention: {q.shape[1]} query heads cannot share {k.shape[1]} kv heads")


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output layout SDPA's CUDA kernels produce: [B, Tq, H, D] memory seen as [B, H, Tq, D]."""
    b, h, tq, _ = q.shape
    return q.new_empty((b, tq, h, v.shape[-1])).transpose(1, 2)


@torch.library.custom_op("weave::causal_suffix_attention", mutates_args=())
def causal_suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """Attention of the last ``q.shape[2]`` positions over all ``k.shape[2]`` positions, causal."""
    from torch.nn.attention.bias import causal_lower_right

    _check(q, k, v)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)
    res = _out_like(q, v)
    if res.stride() == out.stride():
        return out
    # The fake impl promises one layout; the compiled graph's reinterpretations rely on it.
    res.copy_(out)
    return res


@causal_suffix_attention.register_fake
def _(q, k, v, scale):
    _check(q, k, v)
    return _out_like(q, v)


def causal_suffix_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                scale: Optional[float] = None) -> torch.Tensor:
    """Float64 oracle: explicit scores with the lower-right causal mask."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    tq, tk = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    qpos = torch.arange(tk - tq, tk).unsqueeze(1)
    kpos = torch.arange(tk).unsqueeze(0)
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
SUFFIX_ATTENTION = torch.ops.weave.causal_suffix_attention.default
