"""Small FX helpers shared by the passes: node kinds, fake values, insertion with metadata, arguments by name."""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

aten = torch.ops.aten
prims = torch.ops.prims

ALL_REDUCE_TARGETS = {torch.ops._c10d_functional.all_reduce.default}
#: ``reduce_scatter_tensor(x, reduce_op, group_size, group)`` and ``all_gather_into_tensor(x,
#: group_size, group)``: what sequence-parallel code (DTensor's ``Shard`` redistributions, Megatron's
#: ``reduce_scatter_tensor`` / ``all_gather_into_tensor``, funcol) becomes.
REDUCE_SCATTER_TARGETS = {torch.ops._c10d_functional.reduce_scatter_tensor.default}
ALL_GATHER_TARGETS = {torch.ops._c10d_functional.all_gather_into_tensor.default}
#: Every collective that starts a fused site.
REDUCING_TARGETS = ALL_REDUCE_TARGETS | REDUCE_SCATTER_TARGETS
WAIT_TARGETS = {torch.ops._c10d_functional.wait_tensor.default}
VIEW_TARGETS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _wait_all_reduce_pattern():
    from torch._inductor.pattern_matcher import CallFunction, KeywordArg

    (all_reduce,), (wait,) = ALL_REDUCE_TARGETS, WAIT_TARGETS
    return CallFunction(wait, CallFunction(all_reduce, KeywordArg("x"), KeywordArg("reduce_op"),
                                           KeywordArg("group"), _users=1))


#: ``wait_tensor(all_reduce(x, reduce_op, group))``, the all_reduce read by the wait only: the
#: anchor of a fused site, as an Inductor pattern expression.
WAIT_ALL_REDUCE = _wait_all_reduce_pattern()


def all_reduce_wait(ar: fx.Node) -> Optional[fx.Node]:
    """The ``wait_tensor`` that is the only reader of all_reduce ``ar``, or None."""
    wait = next(iter(ar.users)) if len(ar.users) == 1 else None
    return wait if wait is not None and WAIT_ALL_REDUCE.match(wait) else None


def shape_readers(node: fx.Node) -> list[fx.Node]:
    """The readers of ``node`` that read only a size of it (``sym_size``: dynamic shapes)."""
    return [u for u in node.users if is_call(u, aten.sym_size.int)]


def only_wait(collective: fx.Node) -> Optional[fx.Node]:
    """The ``wait_tensor`` that is the only reader of ``collective`` (any functional collective)
    besides reads of its sizes (:func:`shape_readers`), or None."""
    users = [u for u in collective.users if u not in shape_readers(collective)]
    wait = users[0] if len(users) == 1 else None
    return wait if is_call(wait, WAIT_TARGETS) and wait.args[0] is collective else None


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


def _plain(a):
    """FX's immutable lists as plain lists: some schemas (``Tensor[]`` of a custom op) reject them."""
    if isinstance(a, (list, tuple)):
        return [_plain(b) for b in a] if isinstance(a, list) else tuple(_plain(b) for b in a)
    return a


def set_fake_val(node: fx.Node, fake_mode) -> None:
    """(Re)compute ``node.meta['val']`` from its inputs' fake values (torch's ``get_fake_args_kwargs``)."""
    from torch._inductor.fx_utils import get_fake_args_kwargs

    ok, args, kwargs = get_fake_args_kwargs(node)
    if not ok:
        raise RuntimeError(f"tokenweave: an input of {node.name} has no fake value")  # a pass bug
    with fake_mode:
        node.meta["val"] = node.target(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})


def call_with_meta(graph: fx.Graph, fake_mode, target, args: tuple, kwargs: Optional[dict] = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's current insert point with ``meta['val']`` set."""
    node = graph.call_function(target, tuple(args), dict(kwargs or {}))
    set_fake_val(node, fake_mode)
    return node


# ----------------------------------------------------------------------------- arguments by name


def named_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of an OpOverload call by schema name, defaults filled in.

    Works whichever way the node holds them: the passes read the fused op's 15 arguments as
    ``named_args(node)["residual"]``, never by position.
    """
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


def _schema_order(target, named: dict[str, Any]) -> tuple[tuple, dict]:
    """``named`` as the call's ``(args, kwargs)``: positional in schema order, kwarg-only by name.

    Positional because Inductor lowers a custom op through ``FallbackKernel.create(kernel, *args,
    **kwargs)``: an argument named ``kernel`` (the fused op has one) cannot be passed by name there.
    """
    schema = target._schema.arguments
    unknown = set(named) - {a.name for a in schema}
    missing = [a.name for a in schema if a.name not in named and not a.has_default_value()]
    if unknown or missing:
        raise TypeError(f"tokenweave: {target}: unknown {sorted(unknown)}, missing {missing}")  # a pass bug
    value = {a.name: named[a.name] if a.name in named else a.default_value for a in schema}
    args = tuple(value[a.name] for a in schema if not a.kwarg_only)
    kwargs = {a.name: value[a.name] for a in schema if a.kwarg_only}
    return args, kwargs


def call_named(graph: fx.Graph, fake_mode, target, **named) -> fx.Node:
    """Insert ``target(name=value, ...)`` with ``meta['val']`` set (every argument given by name).

    Example: ``call_named(graph, fake_mode, START_OP, **{**named_args(site), "x": half})``.
    """
    args, kwargs = _schema_order(target, named)
    return call_with_meta(graph, fake_mode, target, args, kwargs)


def replace_args(node: fx.Node, **changes) -> None:
    """Set some of ``node``'s arguments by name, e.g. ``replace_args(fused, residual_out_sharded=True)``.

    Its fake value is stale until :func:`set_fake_val` (the caller knows when to recompute).
    """
    node.args, node.kwargs = _schema_order(node.target, {**named_args(node), **changes})


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
