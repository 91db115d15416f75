"""Match a LayerNorm over the last dim, computed in float32, from the value it normalizes.

Matches (post-grad ATen; each ``[...]`` optional; the tail is :func:`.rmsnorm_match.match_tail`)::

    r    = convert_element_type(v, float32)                  # absent when v is float32
    # F.layer_norm / nn.LayerNorm, decomposed by AOT:
    var, mean = var_mean(r, [-1], correction=0, keepdim=True)
    # or Cohere's hand-written form (often two identical subs):
    mean = mean(r, [-1], keepdim=True)
    var  = mean(pow(sub(r, mean), 2) | mul(c, c), [-1], keepdim=True)
    s    = rsqrt(add(var, eps))                              # eps a number, or a 0-d tensor input
    n    = mul(sub(r, mean), s)                              # either operand order
    [n   = convert(n, mid)] [n = mul(n, w | convert(w))] [n = add(n, b | convert(b))] [n = convert(n, out)]

Both compute the variance as the mean square of the centred row, which is what the fused op
computes (two passes over the row). :func:`match_layernorm` returns a
:class:`~.rmsnorm_match.NormMatch` with ``kind="layernorm"`` and the bias after the weight
(``bias``, the op's ``norm_bias``), or None; :func:`match_norm` tries the RMSNorm grammar, then
this one. A LayerNorm outside this grammar (an unbiased variance, another dim, an un-decomposed
op) is named in the site's reason by :func:`describe_layernorm`.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from .graph_utils import aten, cast_dtype, is_call, is_last_dim, other_operand, val
from .rmsnorm_match import (
    LAYER_NORM_OPS,
    VARIANCE_OPS,
    NormMatch,
    host_input,
    is_square_of,
    match_rmsnorm,
    match_tail,
    scalar_operand,
    single_user,
)


def match_norm(v: fx.Node) -> Optional[NormMatch]:
    """An RMSNorm or a LayerNorm over the last dim of ``v`` computed in float32, or None."""
    return match_rmsnorm(v) or match_layernorm(v)


def match_layernorm(v: fx.Node) -> Optional[NormMatch]:
    """A LayerNorm over the last dim of ``v`` computed in float32 (module doc), or None."""
    tv = val(v)
    if tv is None or not tv.is_floating_point() or tv.dim() == 0:  # a scalar has no rows to norm
        return None
    hidden, ndim = tv.shape[-1], tv.dim()
    starts = [v] if tv.dtype == torch.float32 else []
    starts += [u for u in v.users if cast_dtype(u) == torch.float32]
    for r in starts:
        for u in list(r.users):
            stats = _var_mean_of(u, r, ndim) or _hand_written_of(u, r, ndim)
            if stats is None:
                continue
            m = _finish(r, *stats, hidden)
            if m is not None:
                if r is not v:
                    m.nodes.insert(0, r)
                return m
    return None


def _keepdim(node: fx.Node, at: int) -> bool:
    return bool(node.args[at] if len(node.args) > at else node.kwargs.get("keepdim", False))


def _is_row_mean(node, x: fx.Node, ndim: int) -> bool:
    return is_call(node, aten.mean.dim) and node.args[0] is x and is_last_dim(node.args[1], ndim) and _keepdim(node, 2)


def _var_mean_of(u: fx.Node, r: fx.Node, ndim: int) -> Optional[tuple[list, fx.Node, fx.Node]]:
    """``(nodes, variance, mean)`` where ``u`` is ``var_mean(r, [-1], correction=0, keepdim=True)``."""
    if not (is_call(u, aten.var_mean.correction) and u.args[0] is r and len(u.args) > 1
            and is_last_dim(u.args[1], ndim) and u.kwargs.get("keepdim", False)
            and u.kwargs.get("correction", 1) == 0):
        return None
    items = {i.args[1]: i for i in u.users if i.op == "call_function" and i.target is operator.getitem}
    if set(items) != {0, 1} or len(u.users) != 2:
        return None
    return [u, items[0], items[1]], items[0], items[1]


def _hand_written_of(u: fx.Node, r: fx.Node, ndim: int) -> Optional[tuple[list, fx.Node, fx.Node]]:
    """``(nodes, variance, mean)`` where ``u`` is ``mean(r)`` and the variance is the mean square
    of ``r - mean`` (Cohere's form)."""
    if not _is_row_mean(u, r, ndim):
        return None
    for c in _centred(r, u):
        for sq in c.users:
            if not is_square_of(sq, c):
                continue
            var = single_user(sq)
            if _is_row_mean(var, sq, ndim):
                return [u, c, sq, var], var, u
    return None


def _centred(r: fx.Node, mean: fx.Node) -> list[fx.Node]:
    """Every ``sub(r, mean)`` node (a hand-written form computes it twice, and CSE may merge them)."""
    return [s for s in mean.users if is_call(s, aten.sub.Tensor) and s.args[0] is r and s.args[1] is mean
            and "alpha" not in s.kwargs]


def _finish(r: fx.Node, nodes: list, var: fx.Node, mean: fx.Node, hidden) -> Optional[NormMatch]:
    """From the variance on: ``rsqrt(var + eps)``, ``(r - mean) * rsqrt``, then the tail."""
    add_eps = single_user(var)
    if not is_call(add_eps, aten.add.Tensor, aten.add.Scalar):
        return None
    eps = scalar_operand(other_operand(add_eps, var))
    if eps is None:
        return None
    inv = single_user(add_eps)
    if not is_call(inv, aten.rsqrt.default):
        return None
    # 1/std and the mean may have other readers (saved for the backward): the rewrite keeps them.
    for c in _centred(r, mean):
        y = next((p for p in c.users if is_call(p, aten.mul.Tensor) and len(p.args) == 2
                  and {id(p.args[0]), id(p.args[1])} == {id(c), id(inv)}), None)
        if y is not None:
            out = nodes + ([] if c in nodes else [c]) + [add_eps, inv, y]
            return match_tail(out, host_input(eps), hidden, kind="layernorm")
    return None


def describe_layernorm(v: fx.Node) -> Optional[str]:
    """The user's words for a LayerNorm of ``v`` that :func:`match_layernorm` did not take (None:
    no LayerNorm reads ``v``): what about it the fused op does not compute."""
    reads = list(v.users) + [u for c in v.users if cast_dtype(c) is not None for u in c.users]
    for u in reads:
        if is_call(u, LAYER_NORM_OPS):
            return f"a LayerNorm left as one op ({u.target}), not decomposed"
        if is_call(u, VARIANCE_OPS):
            correction = u.kwargs.get("correction", 1)
            if is_call(u, aten.var_mean.dim, aten.var.dim):
                correction = 1 if (u.args[2] if len(u.args) > 2 else u.kwargs.get("unbiased", True)) else 0
            if correction != 0:
                return f"a LayerNorm with an unbiased variance (correction={correction}); the fused op divides by H"
            tu = val(u.args[0])
            if tu is not None and not is_last_dim(u.args[1] if len(u.args) > 1 else None, tu.dim()):
                return "a LayerNorm over other dims than the last"
    return None
