"""The op rules of the token split: how each token-wise op is computed per half.

A rule takes the :class:`.rewriter.Rewriter` and a node that reads a split value, and returns
the node's :class:`.values.Split` (or :class:`.values.SplitTuple`), built from per-half copies;
or raises :class:`.values.Barrier` when the op cannot run per half. A :class:`RuleSet` maps ops to
their rules; this module's is :data:`TOKENWISE`, :mod:`.attention` and :mod:`.schedule` hold the
attention ops' and the fused sites' sets, and the rewriter joins the three explicitly
(:func:`table`). An op without an entry that is tagged pointwise takes the pointwise rule, any
other op is a barrier.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.fx as fx

from weave_compile.ops.sibling_linear import SIBLING_LINEAR

from ..graph_utils import val
from .values import Barrier, Split, SplitTuple, is_tensor_node, nodes_in, norm_dim, prod, same

if TYPE_CHECKING:
    from .rewriter import Rewriter

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

Result = Optional[Union[Split, SplitTuple]]


@dataclasses.dataclass(frozen=True)
class Rule:
    fn: Callable[[Rewriter, fx.Node], Result]
    #: a result that is not a tensor makes the op a barrier (the tuple-valued ops' rules say False)
    tensor_result: bool = True


class RuleSet:
    """Rules by op; ``@rule_set.rule(*targets)`` adds the decorated function as their rule."""

    def __init__(self):
        self.entries: dict[object, Rule] = {}

    def rule(self, *targets, tensor_result: bool = True):
        def add(fn):
            for t in targets:
                self.entries[t] = Rule(fn, tensor_result)
            return fn

        return add


def table(*sets: RuleSet) -> dict[object, Rule]:
    """One dispatch table of ``sets`` (an op in two sets is a mistake)."""
    out: dict[object, Rule] = {}
    for s in sets:
        twice = set(out) & set(s.entries)
        if twice:
            raise ValueError(f"tokenweave split: ops with two rules: {sorted(map(str, twice))}")  # a pass bug
        out.update(s.entries)
    return out


#: The token-wise ops' rules (this module's).
TOKENWISE = RuleSet()
rule = TOKENWISE.rule


def apply(rw: Rewriter, n: fx.Node) -> Result:
    """``n``'s rule in ``rw.rules`` applied (see module docstring)."""
    r = rw.rules.get(n.target)
    if r is None and isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags:
        r = _POINTWISE
    if r is None:
        raise Barrier("op not known to be token-wise")
    if r.tensor_result and not isinstance(val(n), torch.Tensor):
        raise Barrier("non-tensor result")
    return r.fn(rw, n)


def other_dim(n: fx.Node, src: Split, pos: int, default: int, what: str) -> int:
    """The op's dimension argument (at ``pos``), which must not be the split dimension."""
    dim = norm_dim(n.args[pos] if len(n.args) > pos else default, val(n.args[0]).dim())
    if dim == src.dim:
        raise Barrier(f"{what} along the token dimension")
    return dim


# ----------------------------------------------------------------------------- tuple-valued ops


@rule(operator.getitem, tensor_result=False)
def _getitem(rw: Rewriter, n: fx.Node) -> Split:
    sp = rw.env.get(n.args[0])
    if isinstance(sp, SplitTuple) and n.args[1] in sp.items:
        return sp.items[n.args[1]]
    raise Barrier("element of a value that is not split per element")


@rule(aten.split.Tensor, aten.split_with_sizes.default, tensor_result=False)
def _split(rw: Rewriter, n: fx.Node) -> SplitTuple:
    src = rw.split_arg(n, 0)
    other_dim(n, src, 2, 0, "splits")
    return rw.per_half_tuple(n, src.dim, len(n.meta["val"]), lambda h: (src.halves[h], *n.args[1:]))


# Along one dimension, output shaped like the input: (dim argument position).
_ALONG_DIM = {aten._softmax.default: 1, aten._log_softmax.default: 1, aten.cumsum.default: 1}
# Along one dimension, tuple output shaped like the input (values, indices): (dim position).
_ALONG_DIM_TUPLE = {aten.topk.default: 2, aten.sort.default: 1}


@rule(*_ALONG_DIM, tensor_result=False)
def _along_dim(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    other_dim(n, src, _ALONG_DIM[n.target], -1, "operates")
    return rw.per_half(n, src.dim, lambda h: (src.halves[h], *n.args[1:]))


@rule(*_ALONG_DIM_TUPLE, tensor_result=False)
def _along_dim_tuple(rw: Rewriter, n: fx.Node) -> SplitTuple:
    src = rw.split_arg(n, 0)
    other_dim(n, src, _ALONG_DIM_TUPLE[n.target], -1, "operates")
    return rw.per_half_tuple(n, src.dim, 2, lambda h: (src.halves[h], *n.args[1:]))


# ----------------------------------------------------------------------------- layout ops


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(rw: Rewriter, n: fx.Node) -> Split:
    """Track the split dimension through a reshape, keeping it contiguous in memory order.

    The split dimension may merge with the dimensions right after it (its halves then span
    ``unit * rows``), or be unmerged back; it may not merge with a dimension before it
    (the halves would interleave). Its size in the new shape is left to ``-1``.
    """
    src = rw.split_arg(n, 0)
    tin, tout = val(n.args[0]), val(n)
    prefix = prod(tin.shape[:src.dim])
    rows = tin.shape[src.dim]
    for d in range(tout.dim()):
        if not same(prod(tout.shape[:d]), prefix):
            continue
        size = tout.shape[d]
        unit = None
        for j in range(src.dim + 1, tin.dim() + 1):  # merge with the next dims
            if same(size, rows * prod(tin.shape[src.dim + 1:j])):
                unit = src.unit * prod(tin.shape[src.dim + 1:j])
                break
        if unit is None:
            for j in range(d + 2, tout.dim() + 1):  # unmerge into [rows', inner...]
                inner = prod(tout.shape[d + 1:j])
                if same(rows, size * inner) and same(src.unit % inner, 0):
                    unit = src.unit // inner
                    break
        if unit is None:
            continue
        shape = _shape_with_free_dim(n.args[1], tout, d)
        return rw.per_half(n, d, lambda h: (src.halves[h], shape), unit=unit)
    raise Barrier("reshape merges the split dimension with an outer one")


def _shape_with_free_dim(shape: list, tout: torch.Tensor, d: int) -> list:
    shape = list(shape)
    for i, e in enumerate(shape):
        if i != d and isinstance(e, int) and e == -1:
            if not isinstance(tout.shape[i], int):
                raise Barrier("reshape with a symbolic -1 besides the split dimension")
            shape[i] = int(tout.shape[i])
    shape[d] = -1
    return shape


# clone and convert_element_type are tagged pointwise and take that rule.
@rule(aten.alias.default, aten.contiguous.default, c10d.wait_tensor.default, c10d.all_reduce.default)
def _unary_same_dim(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    return rw.per_half(n, src.dim, lambda h: (src.halves[h], *n.args[1:]))


@rule(aten.permute.default)
def _permute(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    perm = [norm_dim(p, val(n).dim()) for p in n.args[1]]
    return rw.per_half(n, perm.index(src.dim), lambda h: (src.halves[h], n.args[1]))


@rule(aten.transpose.int)
def _transpose(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    d0, d1 = (norm_dim(d, val(n).dim()) for d in n.args[1:3])
    d = {d0: d1, d1: d0}.get(src.dim, src.dim)
    return rw.per_half(n, d, lambda h: (src.halves[h], *n.args[1:]))


@rule(aten.t.default)
def _t(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    return rw.per_half(n, 1 - src.dim, lambda h: (src.halves[h],))


@rule(aten.unsqueeze.default)
def _unsqueeze(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    dim = norm_dim(n.args[1], val(n).dim())
    return rw.per_half(n, src.dim + (dim <= src.dim), lambda h: (src.halves[h], n.args[1]))


@rule(aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    ndim = val(n.args[0]).dim()
    dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
    dims = [norm_dim(d, ndim) for d in dims]
    if src.dim in dims:
        raise Barrier("squeezes the token dimension")
    removed = [d for d in dims if same(val(n.args[0]).shape[d], 1)]
    if len(removed) != val(n).dim() and ndim - len(removed) != val(n).dim():
        raise Barrier("cannot tell which dimensions are squeezed")
    return rw.per_half(n, src.dim - sum(d < src.dim for d in removed), lambda h: (src.halves[h], n.args[1]))


@rule(aten.expand.default)
def _expand(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    sizes = list(n.args[1])
    d = src.dim + len(sizes) - val(n.args[0]).dim()
    new = sizes[:d] + [-1] + sizes[d + 1:]  # -1: keep the half's size
    return rw.per_half(n, d, lambda h: (src.halves[h], new))


@rule(aten.slice.Tensor, aten.select.int)
def _slice(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    dim = other_dim(n, src, 1, 0, "slices")
    d = src.dim - (n.target is aten.select.int and dim < src.dim)
    return rw.per_half(n, d, lambda h: (src.halves[h], *n.args[1:]))


@rule(aten.cat.default)
def _cat(rw: Rewriter, n: fx.Node) -> Split:
    tensors = n.args[0]
    dim = norm_dim(n.args[1] if len(n.args) > 1 else 0, val(n).dim())
    dims = {rw.env[a].dim for a in tensors if a in rw.env}
    if len(dims) != 1 or dim in dims:
        raise Barrier("concatenates along the split dimension or mixed split dimensions")
    (d,) = dims
    unit = rw.unit_of(n)

    def part(a, h):
        return rw.env[a].halves[h] if a in rw.env else rw.side(a, d, unit, h)

    return rw.per_half(n, d, lambda h: ([part(a, h) for a in tensors], *n.args[1:]))


# ----------------------------------------------------------------------------- compute ops


def _pointwise(rw: Rewriter, n: fx.Node) -> Split:
    out = val(n)
    od = None
    for a in nodes_in(n.args) + nodes_in(n.kwargs):
        if a in rw.env:
            sp = rw.env[a]
            if not isinstance(sp, Split):
                raise Barrier("tuple operand")
            d = sp.dim + out.dim() - val(a).dim()
            if od is not None and od != d:
                raise Barrier("operands split along different dimensions")
            od = d
    unit = rw.unit_of(n)
    rw.check_out(n, od, unit)

    def arg(a, h):
        if not is_tensor_node(a):
            return a
        if a in rw.env:
            return rw.env[a].halves[h]
        return rw.side(a, od - (out.dim() - val(a).dim()), unit, h)

    halves = tuple(rw.mk(n.target, fx.node.map_aggregate(n.args, lambda a: arg(a, h)),
                         fx.node.map_aggregate(dict(n.kwargs), lambda a: arg(a, h)), half=h)
                   for h in (0, 1))
    return Split(od, halves, unit)


_POINTWISE = Rule(_pointwise)


@rule(aten.mm.default, aten.addmm.default, aten.bmm.default)
def _matmul(rw: Rewriter, n: fx.Node) -> Split:
    t = n.target
    a_pos = 1 if t is aten.addmm.default else 0
    src = rw.split_arg(n, a_pos)
    want = 1 if t is aten.bmm.default else 0
    if src.dim != want:
        raise Barrier("matmul over the token dimension")
    if t is aten.addmm.default:
        bias = val(n.args[0])
        if bias.dim() == 2 and not same(bias.shape[0], 1):
            raise Barrier("addmm with a per-row bias")
    return rw.per_half(n, want, lambda h: tuple(src.halves[h] if i == a_pos else a for i, a in enumerate(n.args)))


@rule(SIBLING_LINEAR)
def _sibling_linear(rw: Rewriter, n: fx.Node) -> Split:
    """Linears merged into one GEMM: row-wise in the input's leading dimensions, like one linear."""
    src = rw.split_arg(n, 0)
    if src.dim == val(n.args[0]).dim() - 1:
        raise Barrier("linear over the token dimension")
    return rw.per_half(n, src.dim, lambda h: (src.halves[h], *n.args[1:]))


# Reductions: (dims argument position, keepdim argument position or None, keepdim default).
_REDUCTIONS = {
    aten.sum.dim_IntList: (1, 2, False),
    aten.mean.dim: (1, 2, False),
    aten.amax.default: (1, 2, False),
    aten.amin.default: (1, 2, False),
    aten.prod.dim_int: (1, 2, False),
    aten.argmax.default: (1, 2, False),
    aten.var.correction: (1, None, False),
}


@rule(*_REDUCTIONS)
def _reduction(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    dims_pos, keep_pos, keep_default = _REDUCTIONS[n.target]
    ndim = val(n.args[0]).dim()
    dims = n.args[dims_pos] if len(n.args) > dims_pos else n.kwargs.get("dim")
    if dims is None:
        raise Barrier("reduces over every dimension")
    dims = [norm_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    if src.dim in dims:
        raise Barrier("reduces over the token dimension")
    keep = n.args[keep_pos] if keep_pos is not None and len(n.args) > keep_pos else n.kwargs.get("keepdim", keep_default)
    d = src.dim if keep else src.dim - sum(x < src.dim for x in dims)
    return rw.per_half(n, d, lambda h: (src.halves[h], *n.args[1:]))


@rule(c10d.all_gather_into_tensor.default)
def _all_gather(rw: Rewriter, n: fx.Node) -> Split:
    src = rw.split_arg(n, 0)
    if src.dim == 0:
        raise Barrier("gathers along the split dimension")
    return rw.per_half(n, src.dim, lambda h: (src.halves[h], *n.args[1:]))


@rule(aten.embedding.default)
def _embedding(rw: Rewriter, n: fx.Node) -> Split:
    if n.args[0] in rw.env:
        raise Barrier("embedding table is token-split")
    src = rw.split_arg(n, 1)
    return rw.per_half(n, src.dim, lambda h: (n.args[0], src.halves[h], *n.args[2:]))


@rule(aten.index.Tensor)
def _index(rw: Rewriter, n: fx.Node) -> Split:
    idx = n.args[1]
    if n.args[0] in rw.env or not idx or not isinstance(idx[0], fx.Node) or idx[0] not in rw.env \
            or any(i is not None for i in idx[1:]):
        raise Barrier("indexing form other than table[split_index]")
    src = rw.env[idx[0]]
    return rw.per_half(n, src.dim, lambda h: (n.args[0], [src.halves[h]]))
