"""What a sequence-parallel site adds to an all_reduce site: its collectives and their row layout.

Sequence-parallel code (PyTorch's TP plans with ``SequenceParallel`` norms, as torchtitan writes
them; Megatron-LM's sequence parallelism; vLLM's sequence-parallel pass) keeps the activations
between blocks sharded by token rows, so each block boundary reads, in the post-grad graph::

    rs   = _c10d_functional.reduce_scatter_tensor(x, "sum", N, group)   # x: [N * d0, ...]
    r    = wait_tensor(rs)                                              # this rank's rows
    ...  (+bias) (+residual shard) -> RMSNorm, as an all_reduce site    # allreduce_site.py
    ag   = _c10d_functional.all_gather_into_tensor(normed[.view], N, group)
    out  = wait_tensor(ag)  [-> copy(buffer, out)]                      # c10d's in-place form

which is the fused op's own computation with a sharded residual: reduce-scatter, add and norm on
this rank's rows, all-gather.

The row layout is the model's, kept as it is. The reduce-scatter gives rank ``r`` block ``r`` of
``x``'s leading dim, which is the fused op's contract (``T = rows of x``, rank ``r`` owns rows
``[r*T/N, (r+1)*T/N)``; the reduce-scatter requires ``T`` divisible by ``N``, so no padding).
Whatever re-layout the model does around its collectives stays in the graph as written: DTensor's
``Shard(1)`` of ``[B, S, H]`` chunks the sequence and concatenates the chunks along dim 0 before
the reduce-scatter (for ``B > 1`` a rank's rows are not one block of the flattened tokens), and
chunks and concatenates back after the all-gather; the fused op takes ``x`` after the first and
hands its gathered output to the second, so each rank owns exactly the rows the graph gives it,
with no copy and no collective added. Megatron's ``[S, B, H]`` is sharded along dim 0 already.

The residual is the model's own shard (any shape with ``H`` last); the op returns its new value
as this rank's rows, viewed back to the shard's shape.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.fx as fx

from .graph_utils import (
    ALL_GATHER_TARGETS,
    ALL_REDUCE_TARGETS,
    REDUCE_SCATTER_TARGETS,
    VIEW_TARGETS,
    aten,
    is_call,
    only_wait,
    shape_readers,
    val,
)

#: The form of a site, as the report names it.
ALL_REDUCE = "all_reduce"
SEQUENCE_PARALLEL = "reduce_scatter/all_gather"


class NoMatch(Exception):
    """Why a site was left alone (the message goes to the explain report)."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """The collective a site starts with: an all_reduce, or a reduce-scatter (``world_size`` set)."""

    node: fx.Node
    x: fx.Node
    reduce_op: str
    group_name: str
    world_size: Optional[int] = None  # the reduce-scatter's group size; None: an all_reduce

    @property
    def scatters(self) -> bool:
        return self.world_size is not None

    @property
    def kind(self) -> str:
        """How messages name it."""
        return "reduce_scatter" if self.scatters else "all_reduce"

    @property
    def form(self) -> str:
        return SEQUENCE_PARALLEL if self.scatters else ALL_REDUCE


def collective_of(node: fx.Node) -> Collective:
    """``node`` (an all_reduce or a reduce_scatter_tensor call) as a :class:`Collective`."""
    if is_call(node, ALL_REDUCE_TARGETS):
        x, reduce_op, group = node.args[:3]
        return Collective(node, x, reduce_op, str(group))
    if is_call(node, REDUCE_SCATTER_TARGETS):
        x, reduce_op, world_size, group = node.args[:4]
        return Collective(node, x, reduce_op, str(group), int(world_size))
    raise TypeError(f"tokenweave: {node.name} is not an all_reduce or a reduce_scatter")  # a pass bug


@dataclasses.dataclass
class GatherTail:
    """How a sequence-parallel site's normed rows leave it: views, the all-gather, its wait, and
    ``out``, the gathered value the rest of the graph reads (the wait, or c10d's copy of it)."""

    views: list[fx.Node]
    all_gather: fx.Node
    wait: fx.Node
    out: fx.Node

    @property
    def nodes(self) -> list[fx.Node]:
        return [*self.views, self.all_gather, self.wait] + ([self.out] if self.out is not self.wait else [])


def match_gather(norm_out: fx.Node, c: Collective, same_ranks) -> GatherTail:
    """The all-gather of ``norm_out`` over ``c``'s group, through views; NoMatch if the normed rows
    go anywhere else (the fused op returns them only gathered). ``same_ranks(a, b)``: whether two
    group names hold the same ranks in the same order."""
    hidden = val(norm_out).shape[-1]
    cur, views = norm_out, []
    while True:
        users = list(cur.users)
        if len(users) != 1:
            what = ", ".join(str(u.target) for u in users) or "nothing"
            raise NoMatch(f"the normed rows of this rank are read by {len(users)} op(s) ({what}), not only "
                          f"all-gathered: the fused op returns them gathered")
        u = users[0]
        if is_call(u, VIEW_TARGETS) and val(u) is not None and val(u).shape[-1] == hidden:
            views.append(u)
            cur = u
            continue
        if is_call(u, ALL_GATHER_TARGETS) and u.args[0] is cur:
            break
        raise NoMatch(f"the normed rows of this rank feed {u.target}, not an all_gather: the fused op "
                      f"returns them gathered")
    ag = u
    if int(ag.args[1]) != c.world_size or not same_ranks(str(ag.args[2]), c.group_name):
        raise NoMatch(f"the normed rows are all-gathered over another group ({ag.args[2]!r}, {ag.args[1]} ranks) "
                      f"than they were reduce-scattered over ({c.group_name!r}, {c.world_size} ranks)")
    wait = only_wait(ag)
    if wait is None:
        raise NoMatch("the all_gather result is read before wait_tensor")
    out = wait
    nxt = next(iter(wait.users)) if len(wait.users) == 1 else None
    if is_call(nxt, aten.copy.default) and nxt.args[1] is wait and val(nxt.args[0]).shape == val(wait).shape:
        out = nxt  # functionalized in-place all_gather_into_tensor into a caller's buffer
    return GatherTail(views, ag, wait, out)


@dataclasses.dataclass(frozen=True)
class SizeSource:
    """Where a symbolic size can be read: ``node.size(dim) // div * mul``."""

    node: fx.Node
    dim: int
    div: int = 1
    mul: int = 1

    def value(self):
        d = val(self.node).shape[self.dim]
        return (d // self.div) * self.mul if (self.div, self.mul) != (1, 1) else d

    def emit(self, graph: fx.Graph, insert) -> fx.Node:
        """The size as graph nodes; ``insert(target, args)`` places each one and returns it."""
        import operator

        size = insert(aten.sym_size.int, (self.node, self.dim))
        size.meta["val"] = val(self.node).shape[self.dim]
        for op, k in ((operator.floordiv, self.div), (operator.mul, self.mul)):
            if k != 1:
                whole = size
                size = insert(op, (whole, k))
                size.meta["val"] = op(whole.meta["val"], k)
        return size


def size_sources(c: Collective, *others: Optional[fx.Node]) -> list[SizeSource]:
    """Where a symbolic size of a value of a site can be read, all defined before the fused op:
    the collective's input; after a reduce-scatter, its result's leading dim (the input's over
    ``N``) and the all-gather's (that times ``N``: the input's, as the shapes say it); ``others``
    (the residual)."""
    x = c.x
    out = [SizeSource(x, 0, c.world_size), SizeSource(x, 0, c.world_size, c.world_size)] if c.scatters else []
    out += [SizeSource(x, i) for i in range(val(x).dim())]
    for node in others:
        if node is not None:
            out += [SizeSource(node, i) for i in range(val(node).dim())]
    return out


def size_args(shape, sources: list[SizeSource]) -> Optional[list]:
    """``shape`` as view arguments: ints, a source for a symbolic size one of them equals, ``-1``
    for at most one size none equals; None where two sizes have no source."""
    from torch import SymInt
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    out: list = []
    for d in shape:
        if not isinstance(d, SymInt):
            out.append(int(d))
            continue
        src = next((s for s in sources if statically_known_true(s.value() == d)), None)
        out.append(src if src is not None else -1)
    return out if out.count(-1) <= 1 else None


def size_node_source(reader: fx.Node, sources: list[SizeSource]) -> Optional[SizeSource]:
    """The source that a ``sym_size`` reader's value equals, or None."""
    found = size_args([reader.meta["val"]], sources)
    return None if found is None or found[0] == -1 else found[0]


def unresolved_size_readers(nodes, sources: list[SizeSource]) -> list[fx.Node]:
    """The ``sym_size`` readers of ``nodes`` (values the rewrite removes) that no source carries."""
    from torch import SymInt

    return [r for n in nodes for r in shape_readers(n)
            if not isinstance(r.meta.get("val"), SymInt) or size_node_source(r, sources) is None]


def repoint_size_readers(graph: fx.Graph, nodes, sources: list[SizeSource]) -> None:
    """Read each size that a ``sym_size`` reader of ``nodes`` reads from its source instead (before
    ``nodes`` are erased; :func:`unresolved_size_readers` was empty)."""
    for n in nodes:
        for r in shape_readers(n):
            def insert(target, args, r=r):
                with graph.inserting_before(r):
                    return graph.call_function(target, args)

            r.replace_all_uses_with(size_node_source(r, sources).emit(graph, insert))
            graph.erase_node(r)
