"""Match an RMSNorm over the last dim, computed in float32, from the value it normalizes.

Matches (post-grad ATen; each ``[...]`` optional)::

    r    = convert_element_type(v, float32)                  # absent when v is float32
    m    = mean(pow(r, 2) | mul(r, r), [-1], keepdim=True)
    s    = rsqrt(add(m, eps)) | reciprocal(sqrt(...))        # eps a number, or a 0-d tensor input
                                                            # (dynamic=True: Dynamo's specialize_float=False)
    n    = mul(r, s) | div(r, sqrt(add(m, eps)))
    [n   = convert(n, mid)] [n = mul(n, w | convert(w) | add(convert(w), 1.0))] [n = convert(n, out)]

:func:`match_rmsnorm` returns a :class:`NormMatch` (the nodes, eps, weight, weight offset and mid
dtype, as far as the tail is exact) or None. The LayerNorm grammar (:mod:`.layernorm_match`) shares
the tail (:func:`match_tail`, which there also takes the LayerNorm's bias after the weight) and
:class:`NormMatch`; :func:`.layernorm_match.match_norm` tries both, and the fuse pass
(:mod:`.fuse_allreduce_rmsnorm`) calls it at each step of its walk from an all_reduce.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from .graph_utils import aten, broadcasts_as_row, cast_dtype, is_call, is_last_dim, other_operand, val


@dataclasses.dataclass
class NormMatch:
    nodes: list[fx.Node]  # every node of the norm, output last
    eps: Union[float, fx.Node]  # a node: a 0-d tensor (dynamic=True turns the float into an input)
    weight: Optional[fx.Node]
    weight_offset: float
    mid_dtype: Optional[torch.dtype]
    kind: str = "rmsnorm"  # or "layernorm" (the op's ``norm`` argument)
    #: a LayerNorm's bias, added after the weight (the op's ``norm_bias``)
    bias: Optional[fx.Node] = None

    @property
    def out(self) -> fx.Node:
        return self.nodes[-1]

    def describe(self) -> str:
        parts = [self.kind]
        if self.weight is not None:
            parts.append("(1+w)" if self.weight_offset else "*w")
        if self.bias is not None:
            parts.append("+b")
        if self.weight is not None or self.bias is not None:
            parts.append("after cast" if self.mid_dtype is not None else "in fp32")
        if isinstance(self.eps, fx.Node):
            parts.append("(eps a graph input)")
        return " ".join(parts)


def single_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_scalar_tensor(o: Any) -> bool:
    t = val(o)
    return t is not None and t.dim() == 0 and t.is_floating_point()


def _is_number(o: Any) -> bool:
    return isinstance(o, (int, float)) and not isinstance(o, bool)


def scalar_operand(o: Any) -> Union[None, float, fx.Node]:
    """A Python number (as float) or a 0-d floating tensor node; None for anything else."""
    if _is_number(o):
        return float(o)
    return o if _is_scalar_tensor(o) else None


def host_input(eps: Union[float, fx.Node]) -> Union[float, fx.Node]:
    """The graph input a 0-d eps node converts (through dtype casts only), where that input is on
    the host and the casts round no further than fp32; else ``eps`` itself.

    Why: a graph input stays where the caller put it. On the host the op reads it without a
    device sync; for a CUDA site the pass copies it to the device once, at the graph's start,
    outside every CUDA-graph partition (``allreduce_site.eps_on_device``), which a cast node
    placed later in the graph would not allow. Its value rounds to the same fp32 in every
    implementation (they compute in fp32)."""
    src = eps
    while isinstance(src, fx.Node) and cast_dtype(src) in (torch.float32, torch.float64):
        src = src.args[0]
    if isinstance(src, fx.Node) and src.op == "placeholder" and _is_scalar_tensor(src) and val(src).device.type == "cpu":
        return src
    return eps


def is_square_of(node: fx.Node, r: fx.Node) -> bool:
    if is_call(node, aten.pow.Tensor_Scalar):
        return node.args[0] is r and node.args[1] == 2
    return is_call(node, aten.mul.Tensor) and node.args[0] is r and node.args[1] is r


def _row_vector(node: Any, hidden) -> Optional[fx.Node]:
    """``v`` or ``convert(v, float32)`` -> ``v`` where ``v`` is a floating per-channel vector; else None."""
    dt = cast_dtype(node) if isinstance(node, fx.Node) else None
    if dt is not None and dt == torch.float32:
        node = node.args[0]
    v = val(node)
    if v is None or not broadcasts_as_row(v, hidden) or not v.is_floating_point():
        return None
    return node


def _strip_weight(node: Any, hidden) -> tuple[Optional[fx.Node], float]:
    """``w``, ``convert(w)`` or ``add(convert(w), c)`` -> (w, c); (None, 0) if not a weight vector.

    The op adds the offset in fp32 (``weight.float() + c``), so only an fp32 add is taken apart:
    ``w + c`` formed in bf16 (Nemotron's LayerNorm1P, ``self.weight + 1`` in the weight's dtype) is
    rounded to bf16 before the norm reads it, and that rounded tensor is the op's weight, offset 0.
    """
    offset = 0.0
    t = val(node) if isinstance(node, fx.Node) else None
    in_fp32 = t is not None and t.dtype == torch.float32
    if in_fp32 and is_call(node, aten.add.Tensor, aten.add.Scalar) and isinstance(node.args[1], (int, float)):
        offset, node = float(node.args[1]), node.args[0]
    elif in_fp32 and is_call(node, aten.add.Tensor) and isinstance(node.args[0], (int, float)):
        offset, node = float(node.args[0]), node.args[1]
    node = _row_vector(node, hidden)
    return (node, offset) if node is not None else (None, 0.0)


#: LayerNorm as one op (pre-dispatch and un-decomposed graphs), and the statistic its decomposition
#: starts with (an RMSNorm takes a mean of squares, never a variance).
LAYER_NORM_OPS = frozenset({aten.native_layer_norm.default, aten.layer_norm.default})
VARIANCE_OPS = frozenset({aten.var_mean.correction, aten.var_mean.dim, aten.var.correction, aten.var.dim})


def feeds_layernorm(v: fx.Node) -> bool:
    """``v`` is normalized by a LayerNorm (the mean subtracted), not an RMSNorm: a layer_norm op reads
    it, a variance of it is taken, or ``v - mean(v)`` is computed. Only to name the norm a site has
    in the reason it is left as written, where :mod:`.layernorm_match` did not take it."""
    for u in v.users:
        if is_call(u, LAYER_NORM_OPS) and u.args[0] is v:
            return True
        if is_call(u, VARIANCE_OPS) and u.args[0] is v:
            return True
        if (is_call(u, aten.sub.Tensor) and u.args[0] is v and is_call(u.args[1], aten.mean.dim)
                and u.args[1].args[0] is v):
            return True
    return False


def match_rmsnorm(v: fx.Node) -> Optional[NormMatch]:
    """An RMSNorm over the last dim of ``v`` computed in float32, or None."""
    tv = val(v)
    if tv is None or not tv.is_floating_point() or tv.dim() == 0:  # a scalar has no rows to norm
        return None
    hidden = tv.shape[-1]
    starts = [v] if tv.dtype == torch.float32 else []
    starts += [u for u in v.users if cast_dtype(u) == torch.float32]
    for r in starts:
        m = _match_from(r, hidden, tv.dim())
        if m is not None:
            if r is not v:
                m.nodes.insert(0, r)
            return m
    return None


def _match_from(r: fx.Node, hidden, ndim: int) -> Optional[NormMatch]:
    for sq in r.users:
        if not is_square_of(sq, r):
            continue
        mean = single_user(sq)
        if not (is_call(mean, aten.mean.dim) and is_last_dim(mean.args[1], ndim)
                and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))):
            continue
        add_eps = single_user(mean)
        if not is_call(add_eps, aten.add.Tensor, aten.add.Scalar):
            continue
        eps = scalar_operand(other_operand(add_eps, mean))
        if eps is None:
            continue
        eps = host_input(eps)
        nodes = [sq, mean, add_eps]
        inv = single_user(add_eps)
        y = None
        if is_call(inv, aten.rsqrt.default):
            nodes.append(inv)
            # 1/rms may have other readers (a returned statistic): the rewrite keeps them.
            y = _times(inv, r)
            ok = y is not None
        elif is_call(inv, aten.sqrt.default):
            nodes.append(inv)
            nxt = single_user(inv)
            if is_call(nxt, aten.reciprocal.default):
                nodes.append(nxt)
                y = _times(nxt, r)
                ok = y is not None
            else:
                y = nxt
                ok = is_call(y, aten.div.Tensor) and y.args[0] is r and y.args[1] is inv
        else:
            ok = False
        if not ok:
            continue
        nodes.append(y)
        return match_tail(nodes, eps, hidden)
    return None


def _times(inv: fx.Node, r: fx.Node) -> Optional[fx.Node]:
    """The reader of ``inv`` that is ``r * inv`` (either order), or None."""
    return next((u for u in inv.users if is_call(u, aten.mul.Tensor) and len(u.args) == 2
                 and {id(u.args[0]), id(u.args[1])} == {id(r), id(inv)}), None)


def match_tail(nodes: list[fx.Node], eps: Union[float, fx.Node], hidden, kind: str = "rmsnorm") -> NormMatch:
    """Extend past ``y = r * rsqrt(..)``: [cast mid] [* weight] [+ bias: a LayerNorm's] [cast out],
    as far as it is exact."""
    m = NormMatch(nodes=nodes, eps=eps, weight=None, weight_offset=0.0, mid_dtype=None, kind=kind)
    cur = nodes[-1]
    nxt = single_user(cur)
    dt = cast_dtype(nxt) if nxt is not None else None
    if dt is not None:
        m.mid_dtype = dt
        nodes.append(nxt)
        cur, nxt = nxt, single_user(nxt)
    if is_call(nxt, aten.mul.Tensor):
        w, offset = _strip_weight(other_operand(nxt, cur), hidden)
        if w is not None and val(nxt).shape == val(cur).shape:
            m.weight, m.weight_offset = w, offset
            nodes.append(nxt)
            cur, nxt = nxt, single_user(nxt)
    # A LayerNorm's bias only on a float32 product: the op adds it in fp32, then rounds once. After
    # a product already rounded (a mid cast), the add stays outside, reading ``normed``.
    if (kind == "layernorm" and val(cur).dtype == torch.float32 and is_call(nxt, aten.add.Tensor)
            and len(nxt.args) == 2 and "alpha" not in nxt.kwargs and val(nxt).shape == val(cur).shape):
        b = _row_vector(other_operand(nxt, cur), hidden)
        if b is not None:
            m.bias = b
            nodes.append(nxt)
            cur, nxt = nxt, single_user(nxt)
    # A cast after the weight only if the product was float32: then the cast is the one rounding
    # the contract does. A bf16 product already rounded; a later widening cast must stay outside.
    if m.mid_dtype is None and val(cur).dtype == torch.float32 and nxt is not None:
        dt = cast_dtype(nxt)
        if dt is not None:
            nodes.append(nxt)
    if m.mid_dtype is not None and m.weight is None:
        # "cast only": y.to(mid) is the output itself, not a mid step (no bias follows it: above).
        m.mid_dtype = None
    return m
