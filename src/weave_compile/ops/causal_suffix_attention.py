"""``weave::causal_suffix_attention``: causal attention of a sequence's suffix, given the prefix's keys.

When the token split cuts a sequence into a prefix A (``P`` tokens) and a suffix B (``Tq``), B's
query ``i`` (position ``P + i``) sees all of A's keys and B's keys ``0 .. i``. The op takes B's
queries, A's keys/values and B's keys/values *separately*: the split pass never concatenates
``[K_A; K_B]`` (at Llama-8B TP=2, T=8K that copy moved ~64 MB per layer). The prefix half needs
no new op: it is plain causal attention over its own keys.

**How (CUDA).** Two standard attention calls, each returning its log-sum-exp, merged in one pass:

1. B's queries over A's keys, not causal (every prefix key is visible): ``o1, lse1``;
2. B's queries over B's keys, causal (square, so top-left and lower-right alignment agree): ``o2, lse2``;
3. ``out = o2 + (o1 - o2) * sigmoid(lse1 - lse2)`` in fp32 (the softmax over both key sets,
   ``(o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)``), one Triton kernel (:func:`combine`).

Each call runs the backend PyTorch's own SDPA dispatch picks for its shapes
(``torch._fused_sdp_choice``: cuDNN's sm90 flash kernel on H100/H200 where cuDNN is preferred, the
kernel the whole layer's attention runs), through the aten op that returns the log-sum-exp, with
grouped-query K/V unexpanded where the backend takes them so (cuDNN, flash). Where cuDNN runs
the whole's attention, SDPA with a lower-right causal mask (the fallback below) runs
FlashAttention-2, which is over twice as slow; two cuDNN calls merged by one kernel come close to
the whole's rate, and merged by unfused torch ops they do not (docs/performance.md, "Suffix
attention on the whole's kernels"; ``benchmarks/bench_split_attention.py`` times this op, its
merge alone and the fallback).

The op stays a custom op, not two SDPA calls and pointwise ops in the graph: the merge is one
memory-bound pass either way (the one-kernel merge measured was Inductor's; in the graph it
would at best fuse into the copy that lays the output out for ``o_proj``, which this op's output
layout makes a view), and inside the op the backend is chosen per call from the run-time shapes
(cuDNN refuses a key length of 1, which a split at 1 or ``T - 1`` produces; a symbolic T cannot
decide that at compile time).

**Checked once.** Before a backend's result is trusted, :func:`check_backend` runs it once per
(backend, dtype, head dims, query heads per kv head) on a small problem against float64 (its
output and its log-sum-exp, which the merge relies on: natural log, ``[B, H, Tq]``); a failure
logs why and that backend's calls take the fallback.

**Fallback** (CPU, a dtype or head dim no LSE-returning backend takes, a failed check, a first
use inside CUDA-graph capture): SDPA over ``[K_A; K_B]`` with ``causal_lower_right`` and K/V
expanded per query head; the reason is logged once. ``causal_suffix_attention_ref`` is the
float64 oracle.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:  # Triton is optional: without it the merge runs as fp32 torch ops.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - machines without triton
    triton = tl = None
    HAS_TRITON = False

aten = torch.ops.aten

#: ``torch.nn.attention.SDPBackend`` values, as ``torch._fused_sdp_choice`` returns them.
FLASH, EFFICIENT, CUDNN = 1, 2, 3
BACKEND_NAMES = {-1: "none", 0: "math", FLASH: "flash", EFFICIENT: "efficient", CUDNN: "cudnn", 4: "overrideable"}

#: (out, lse [B, H, Tq] fp32) = attend(q, k, v, causal, scale)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, Optional[float]],
                  tuple[torch.Tensor, torch.Tensor]]


class NoFastPath(Exception):
    """The two-call path cannot run these inputs; the message says why."""


# ----------------------------------------------------------------------------- the merge kernel

if HAS_TRITON:

    @triton.jit
    def _combine_kernel(O1, L1, O2, L2, OUT, H, TQ, D,
                        stride_o1_b, stride_o1_h, stride_o1_t, stride_l1_b, stride_l1_h, stride_l1_t,
                        stride_o2_b, stride_o2_h, stride_o2_t, stride_l2_b, stride_l2_h, stride_l2_t,
                        stride_out_b, stride_out_h, stride_out_t,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (batch, head) and BLOCK_T queries per program: out = o2 + (o1 - o2) * sigmoid(l1 - l2)."""
        bh = tl.program_id(0).to(tl.int64)
        b, h = bh // H, bh % H
        t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        tmask = t < TQ
        mask = tmask[:, None] & (d[None, :] < D)
        l1 = tl.load(L1 + b * stride_l1_b + h * stride_l1_h + t * stride_l1_t, mask=tmask, other=0.0)
        l2 = tl.load(L2 + b * stride_l2_b + h * stride_l2_h + t * stride_l2_t, mask=tmask, other=0.0)
        # Weight of the prefix part: e^l1 / (e^l1 + e^l2). exp overflows to inf (weight 0) or
        # underflows to 0 (weight 1): no NaN for any finite or infinite difference.
        w1 = 1.0 / (1.0 + tl.exp(l2.to(tl.float32) - l1.to(tl.float32)))
        o1 = tl.load(O1 + b * stride_o1_b + h * stride_o1_h + t[:, None] * stride_o1_t + d[None, :],
                     mask=mask, other=0.0).to(tl.float32)
        o2 = tl.load(O2 + b * stride_o2_b + h * stride_o2_h + t[:, None] * stride_o2_t + d[None, :],
                     mask=mask, other=0.0).to(tl.float32)
        out = o2 + (o1 - o2) * w1[:, None]
        tl.store(OUT + b * stride_out_b + h * stride_out_h + t[:, None] * stride_out_t + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def combine(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
            out: torch.Tensor) -> torch.Tensor:
    """Write into ``out`` ([B, H, Tq, D], any layout with unit stride in D) the attention over both
    key sets from the two parts' outputs ``o1``/``o2`` ([B, H, Tq, D]) and log-sum-exps
    ``lse1``/``lse2`` ([B, H, Tq], any strides). One Triton pass on CUDA (and under
    ``TRITON_INTERPRET=1``); fp32 torch ops elsewhere."""
    b, h, tq, d = out.shape
    if tq == 0 or out.numel() == 0:
        return out
    usable = HAS_TRITON and (out.is_cuda or _interpreting()) and all(x.stride(-1) == 1 for x in (o1, o2, out))
    if not usable:
        return combine_torch(o1, lse1, o2, lse2, out)
    block_d = triton.next_power_of_2(d)
    block_t = max(1, min(64, 4096 // block_d))
    grid = (b * h, triton.cdiv(tq, block_t))
    _combine_kernel[grid](o1, lse1, o2, lse2, out, h, tq, d,
                          *o1.stride()[:3], *lse1.stride(), *o2.stride()[:3], *lse2.stride(), *out.stride()[:3],
                          BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return out


def combine_torch(o1, lse1, o2, lse2, out):
    """:func:`combine` as fp32 (float64 for float64 inputs) torch ops: the reference and the fallback."""
    acc = torch.promote_types(o1.dtype, torch.float32)
    w1 = torch.sigmoid(lse1.to(acc) - lse2.to(acc)).unsqueeze(-1)
    o2a = o2.to(acc)
    return out.copy_(o2a + (o1.to(acc) - o2a) * w1)


# ----------------------------------------------------------------------------- the two parts


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * rep, T, D], query head ``h`` reading kv head ``h // rep``
    (``repeat_interleave(rep, 1)`` as a broadcast and one copy: nothing for CUDA-graph capture
    to synchronize on)."""
    if rep == 1:
        return x
    b, h, t, d = x.shape
    return x.unsqueeze(2).expand(b, h, rep, t, d).reshape(b, h * rep, t, d)


def attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with explicit scores and its log-sum-exp, in fp32 (float64 for float64 inputs);
    grouped-query K/V expanded; ``causal``: key ``j`` visible to query ``i`` iff
    ``j <= i + Tk - Tq`` (lower right). For tests and :func:`check_backend`."""
    acc = torch.promote_types(q.dtype, torch.float32)
    rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k.to(acc), rep), repeat_kv(v.to(acc), rep)
    tq, tk = q.shape[2], k.shape[2]
    s = (q.to(acc) @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        qpos = torch.arange(tk - tq, tk, device=q.device).unsqueeze(1)
        s = s.masked_fill(torch.arange(tk, device=q.device).unsqueeze(0) > qpos, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v).to(q.dtype), lse


def attend_backend(backend: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of ``backend``'s aten op, returning (out, lse [B, H, Tq] fp32); grouped-query K/V go
    in unexpanded (cuDNN and flash take them so; :func:`choose` keeps efficient to equal heads)."""
    b, h, tq = q.shape[:3]
    if backend == CUDNN:
        r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        out, lse = r[0], r[1]
        if lse.dim() == 4 and lse.shape[-1] == 1:  # [B, H, Tq, 1]
            lse = lse.squeeze(-1)
    elif backend == FLASH:
        r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = r[0], r[1]
    elif backend == EFFICIENT:
        r = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        out, lse = r[0], r[1][:, :, :tq]  # padded to a multiple of 32 queries
    else:
        raise NoFastPath(f"SDPA backend {BACKEND_NAMES.get(backend, backend)} returns no log-sum-exp")
    if tuple(lse.shape) != (b, h, tq) or lse.dtype != torch.float32 or tuple(out.shape) != (b, h, tq, v.shape[-1]):
        raise NoFastPath(f"{BACKEND_NAMES[backend]} returned out {tuple(out.shape)} and log-sum-exp "
                         f"{tuple(lse.shape)} {lse.dtype}; expected {(b, h, tq, v.shape[-1])} and {(b, h, tq)} fp32")
    return out, lse


def choose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float]) -> int:
    """The backend SDPA's own dispatch picks for these inputs, if it returns a log-sum-exp."""
    gqa = q.shape[1] != k.shape[1]
    try:
        backend = int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, scale=scale, enable_gqa=gqa))
    except RuntimeError as e:  # no backend at all (every one disabled or refusing)
        raise NoFastPath(f"SDPA has no backend for these inputs: {str(e)[:200]}") from e
    if backend in (CUDNN, FLASH) or (backend == EFFICIENT and not gqa):
        return backend
    why = "with grouped-query heads" if backend == EFFICIENT else "(no log-sum-exp)"
    raise NoFastPath(f"SDPA picks {BACKEND_NAMES.get(backend, backend)} {why} for "
                     f"{'causal' if causal else 'full'} attention of {tuple(q.shape)} over {tuple(k.shape)} "
                     f"{q.dtype}")


def by_parts(q, k_prefix, v_prefix, k, v, scale, attend: Attend, out: torch.Tensor) -> torch.Tensor:
    """The op's math with ``attend`` for both calls (see the module docstring), written into ``out``."""
    o2, lse2 = attend(q, k, v, True, scale)
    if k_prefix.shape[2] == 0:
        return out.copy_(o2)
    o1, lse1 = attend(q, k_prefix, v_prefix, False, scale)
    return combine(o1, lse1, o2, lse2, out)


# ----------------------------------------------------------------------------- one check per backend

#: (backend, dtype, d, dv, rep, device) -> None (usable) or why not
_CHECKED: dict[tuple, Optional[str]] = {}


def check_backend(attend: Attend, dtype: torch.dtype, d: int, dv: int, rep: int, device: torch.device,
                  tol: float = 0.05) -> Optional[str]:
    """None if ``attend`` gives float64's output and log-sum-exp (within ``tol``) on a small
    problem (query layout [B, Tq, H, D] as the split's, ``rep`` query heads per kv head), both
    calls the op makes (full over 96 keys; causal, square); else why not. Synchronizes."""
    g = torch.Generator(device=device).manual_seed(1234)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    q = rnd(1, 64, rep, d).transpose(1, 2)
    k, v = rnd(1, 96, 1, d).transpose(1, 2), rnd(1, 96, 1, dv).transpose(1, 2)
    for causal, kk, vv in ((False, k, v), (True, k[:, :, :64], v[:, :, :64])):
        try:
            out, lse = attend(q, kk, vv, causal, None)
        except Exception as e:  # noqa: BLE001  (any refusal means: not this backend)
            return f"{type(e).__name__}: {str(e)[:200]}"
        want, want_lse = attend_math(q.double(), kk.double(), vv.double(), causal, None)
        err = (out.double() - want).abs().max().item()
        lse_err = (lse.double() - want_lse).abs().max().item()
        if not (err <= tol and lse_err <= tol):
            return (f"{'causal' if causal else 'full'} check: max |out - float64| {err:.3g}, "
                    f"max |lse - float64| {lse_err:.3g} (tolerance {tol})")
    return None


def _backend_ok(backend: int, q: torch.Tensor, v: torch.Tensor, rep: int) -> Optional[str]:
    key = (backend, q.dtype, q.shape[-1], v.shape[-1], rep, q.device)
    if key not in _CHECKED:
        if torch.cuda.is_current_stream_capturing():
            return "first use inside CUDA-graph capture (run once before capturing)"
        why = check_backend(functools.partial(attend_backend, backend), q.dtype, q.shape[-1], v.shape[-1], rep,
                            q.device)
        _CHECKED[key] = why
        if why:
            log.warning("tokenweave: suffix attention will not use %s for %s d=%d: %s", BACKEND_NAMES[backend],
                        q.dtype, q.shape[-1], why)
    return _CHECKED[key]


# ----------------------------------------------------------------------------- the op


def _check(q, k_prefix, v_prefix, k, v) -> None:
    if any(t.dim() != 4 for t in (q, k_prefix, v_prefix, k, v)):
        raise ValueError("causal_suffix_attention: q, k_prefix, v_prefix, k, v must be [batch, heads, tokens, head_dim]")
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        raise ValueError(f"causal_suffix_attention: the suffix's own keys/values ({k.shape[2]}, {v.shape[2]}) "
                         f"must be as many positions as its queries ({q.shape[2]})")
    if k_prefix.shape[2] != v_prefix.shape[2]:
        raise ValueError(f"causal_suffix_attention: prefix keys ({k_prefix.shape[2]}) and values "
                         f"({v_prefix.shape[2]}) differ in positions")
    kv = (k_prefix, v_prefix, k, v)
    if any(t.shape[1] != k.shape[1] for t in kv) or q.shape[1] % k.shape[1]:
        raise ValueError(f"causal_suffix_attention: {q.shape[1]} query heads cannot share "
                         f"{[t.shape[1] for t in kv]} kv heads")
    if any(t.shape[0] != q.shape[0] for t in kv) or k_prefix.shape[3] != q.shape[3] or k.shape[3] != q.shape[3] \
            or v_prefix.shape[3] != v.shape[3]:
        raise ValueError("causal_suffix_attention: batch or head_dim differ between q, k_prefix, v_prefix, k, v")
    if any(t.dtype != q.dtype or t.device != q.device for t in kv):
        raise ValueError("causal_suffix_attention: q, k_prefix, v_prefix, k, v must share dtype and device")


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output layout SDPA's CUDA kernels produce: [B, Tq, H, Dv] memory seen as [B, H, Tq, Dv]."""
    b, h, tq, _ = q.shape
    return q.new_empty((b, tq, h, v.shape[-1])).transpose(1, 2)


def plan(q, k_prefix, v_prefix, k, v, scale) -> tuple[Optional[Attend], str]:
    """(attend for :func:`by_parts`, its description), or (None, why the fallback runs)."""
    if not q.is_cuda:
        return None, f"{q.device.type} tensors"
    rep = q.shape[1] // k.shape[1]
    try:
        own = choose(q, k, v, True, scale)
        prefix = choose(q, k_prefix, v_prefix, False, scale) if k_prefix.shape[2] else own
    except NoFastPath as e:
        return None, str(e)
    for backend in {own, prefix}:
        why = _backend_ok(backend, q, v, rep)
        if why:
            return None, f"{BACKEND_NAMES[backend]}: {why}"

    def attend(q_, k_, v_, causal, scale_):
        return attend_backend(own if causal else prefix, q_, k_, v_, causal, scale_)

    merge = "triton" if HAS_TRITON else "torch"
    return attend, f"{BACKEND_NAMES[prefix]} (prefix keys) + {BACKEND_NAMES[own]} (own keys), {merge} merge"


_LOGGED: set[str] = set()


def _fallback(q, k_prefix, v_prefix, k, v, scale, why: str) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    if why not in _LOGGED:
        _LOGGED.add(why)
        (log.warning if q.is_cuda else log.info)(
            "tokenweave: suffix attention runs SDPA with a lower-right causal mask over [K_A; K_B]: %s", why)
    k_all, v_all = torch.cat([k_prefix, k], 2), torch.cat([v_prefix, v], 2)
    rep = q.shape[1] // k.shape[1]
    k_all, v_all = repeat_kv(k_all, rep), repeat_kv(v_all, rep)
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=causal_lower_right(q.shape[2], k_all.shape[2]),
                                         scale=scale)
    res = _out_like(q, v)
    # The fake impl promises one layout; the compiled graph's reinterpretations rely on it.
    return out if res.stride() == out.stride() else res.copy_(out)


@torch.library.custom_op("weave::causal_suffix_attention", mutates_args=())
def causal_suffix_attention(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """Causal attention of a suffix's queries ``q`` over the prefix's keys ``k_prefix`` (all visible)
    and the suffix's own ``k`` (query ``i`` sees keys ``0 .. i``); grouped-query K/V allowed."""
    _check(q, k_prefix, v_prefix, k, v)
    if q.shape[2] == 0:
        return _out_like(q, v)
    attend, why = plan(q, k_prefix, v_prefix, k, v, scale)
    if attend is None:
        return _fallback(q, k_prefix, v_prefix, k, v, scale, why)
    return by_parts(q, k_prefix, v_prefix, k, v, scale, attend, _out_like(q, v))


@causal_suffix_attention.register_fake
def _(q, k_prefix, v_prefix, k, v, scale):
    _check(q, k_prefix, v_prefix, k, v)
    return _out_like(q, v)


def causal_suffix_attention_ref(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Float64 oracle: explicit scores over ``[K_A; K_B]``, query ``i`` masked past key ``P + i``."""
    rep = q.shape[1] // k.shape[1]
    k_all = torch.cat([k_prefix, k], 2).double().repeat_interleave(rep, 1)
    v_all = torch.cat([v_prefix, v], 2).double().repeat_interleave(rep, 1)
    p, tq = k_prefix.shape[2], q.shape[2]
    scores = (q.double() @ k_all.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    visible = torch.arange(p + tq).unsqueeze(0) <= (p + torch.arange(tq)).unsqueeze(1)
    return torch.softmax(scores.masked_fill(~visible.to(q.device), float("-inf")), dim=-1) @ v_all


SUFFIX_ATTENTION = torch.ops.weave.causal_suffix_attention.default
