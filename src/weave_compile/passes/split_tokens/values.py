"""What the token split tracks per node, and the small shape helpers every part of it uses."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import val


#: ``node.meta`` key of every node computed for one half: 0 (prefix A) or 1 (suffix B).
HALF_KEY = "weave_half"


class NotSplit(Exception):
    """The graph is left unsplit, for the recorded reason (raised before the graph is touched)."""


class Barrier(Exception):
    """This op cannot run per half: concatenate its split inputs and run it whole."""


@dataclasses.dataclass
class Split:
    """A value computed per half: ``halves[0]`` (prefix) and ``halves[1]`` (suffix).

    Along ``dim`` each half has ``unit`` times the split dimension's rows: 1 where the layout
    is the split dimension itself, ``S`` after ``[B, S, H] -> [B*S, H]`` in a batch split.
    """

    dim: int
    halves: tuple[fx.Node, fx.Node]
    unit: Any = 1


@dataclasses.dataclass
class SplitTuple:
    """A tuple-valued op computed per half; ``items[i]`` is the Split of element ``i``."""

    items: dict[int, Split]


def batch_split(x: torch.Tensor) -> bool:
    """Split whole sequences when the fused sites' input is [B, S, H] with B >= 2.

    A symbolic B is >= 2 (Dynamo specializes sizes 0 and 1)."""
    return x.dim() >= 3 and (not isinstance(x.shape[0], int) or x.shape[0] >= 2)


def prod(xs) -> Any:
    out = 1
    for x in xs:
        out = out * x
    return out


def same(a, b) -> bool:
    return statically_known_true(a == b) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) else a == b


def memory_order(t: torch.Tensor) -> Optional[list[int]]:
    """``t``'s dims outermost first when ``t`` is a dense, permuted (not contiguous) layout, so
    that ``t.permute(order)`` is contiguous; None for a contiguous tensor or a layout that is no
    permutation of a dense one (or whose symbolic strides cannot be ordered)."""
    shape, stride = list(t.shape), list(t.stride())
    if t.dim() < 2:
        return None

    def greater(a, b) -> Optional[bool]:
        if statically_known_true(a > b):
            return True
        if statically_known_true(a <= b):
            return False
        return None

    order: list[int] = []
    for d in range(t.dim()):  # insertion sort, larger strides first, ties keep the dims' order
        at = len(order)
        for i, e in enumerate(order):
            g = greater(stride[d], stride[e])
            if g is None:
                return None
            if g:
                at = i
                break
        order.insert(at, d)
    if order == list(range(t.dim())):
        return None
    want = 1
    for d in reversed(order):
        if not same(shape[d], 1) and not same(stride[d], want):
            return None
        want = want * shape[d]
    return order


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(val(a), torch.Tensor)


def nodes_in(args: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda a: found.append(a) or a)
    return found
