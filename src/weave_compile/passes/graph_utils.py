"""Small FX helpers shared by the passes: node kinds, fake values, insertion with metadata."""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

ALL_REDUCE_TARGETS = {torch.ops._c10d_functional.all_reduce.default}
WAIT_TARGETS = {torch.ops._c10d_functional.wait_tensor.default}
VIEW_TARGETS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def val(node: Any) -> Optional[torch.Tensor]:
    """The FakeTensor an FX node computes, or None for non-nodes / untyped nodes."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def is_call(node: Any, *targets) -> bool:
    """``node`` calls one of ``targets`` (ops, or sets of ops)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return False
    return any(node.target in t if isinstance(t, (set, frozenset)) else node.target == t for t in targets)


def cast_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """Target dtype if ``node`` is a pure dtype conversion, else None."""
    if is_call(node, prims.convert_element_type.default):
        return node.args[1]
    if is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        return node.kwargs.get("dtype")
    return None


def is_last_dim(dims, ndim: int) -> bool:
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, ndim - 1)


def broadcasts_as_row(t: torch.Tensor, hidden) -> bool:
    """True for tensors shaped ``[H]`` or ``[1, ..., 1, H]``: a per-channel vector (bias, weight)."""
    return t.dim() >= 1 and t.shape[-1] == hidden and all(d == 1 for d in t.shape[:-1])


def other_operand(node: fx.Node, this: fx.Node) -> Any:
    a, b = node.args[0], node.args[1]
    return b if a is this else a


def fake_mode_of(graph: fx.Graph):
    from torch._guards import detect_fake_mode

    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    return detect_fake_mode(vals)


def _fake_args(args):
    """FakeTensors / SymInts for the nodes in ``args``, lists included (as plain lists: some
    schemas reject FX's immutable_list)."""

    def fake(a):
        if isinstance(a, (list, tuple)):
            return [fake(b) for b in a] if isinstance(a, list) else tuple(fake(b) for b in a)
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    return tuple(fake(a) for a in args)


def call_with_meta(graph: fx.Graph, fake_mode, target, args: tuple) -> fx.Node:
    """Insert ``target(*args)`` at the graph's current insert point with ``meta['val']`` set."""
    node = graph.call_function(target, args)
    with fake_mode:
        node.meta["val"] = target(*_fake_args(args))
    return node


def getitem_with_meta(graph: fx.Graph, node: fx.Node, index: int) -> fx.Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = node.meta["val"][index]
    return item


def erase_if_dead(graph: fx.Graph, nodes) -> None:
    """Erase ``nodes`` that have no users left, last first, so chains disappear whole."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted((n for n in nodes if n in order), key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
