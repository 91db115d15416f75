"""What the token split tracks per node, and the small shape helpers every part of it uses."""

from __future__ import annotations

import dataclasses
from typing import Any

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


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(val(a), torch.Tensor)


def nodes_in(args: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda a: found.append(a) or a)
    return found
