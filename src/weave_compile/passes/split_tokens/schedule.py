"""The two-stream schedule: each fused site as a start/wait pair per half, and TokenWeave's node order.

Each half's fused op is ``weave::allreduce_add_rmsnorm_start`` (enqueued on the high-priority
comm stream) plus ``weave::comm_wait`` (the join, placed just before the first reader). Nodes
are then ordered as TokenWeave's schedule: A runs one segment ahead of B, so every segment of one
half is enqueued while the other half's communication is in flight:
``comm(A_k) || compute(B_k); comm(B_k) || compute(A_k+1); ...``.
"""

from __future__ import annotations

import heapq
import operator
from typing import TYPE_CHECKING

import torch.fx as fx

from weave_compile.ops import FUSED_OP, START_OP, WAIT_OP

from ..fuse_allreduce_rmsnorm import SITE_KEY
from ..graph_utils import call_named, is_call, named_args, val
from .rules import RuleSet
from .values import HALF_KEY, Barrier, Split, SplitTuple, nodes_in, same

if TYPE_CHECKING:
    from .rewriter import Rewriter


#: The fused sites' rule (this module's).
FUSED_SITES = RuleSet()


@FUSED_SITES.rule(FUSED_OP, tensor_result=False)
def fused_site(rw: Rewriter, n: fx.Node) -> SplitTuple:
    """A fused site as two start ops (one per half) and their waits."""
    args = named_args(n)
    x, res = args["x"], args["residual"]
    tx = val(x)
    xs = rw.env.get(x)
    if xs is None:
        d, unit = rw.split_dim, 1
        if tx.dim() - 1 <= d or not same(tx.shape[d], rw.total):
            raise Barrier("fused site of another shape")
        xh = rw.sliced(x, d)
    elif isinstance(xs, Split) and xs.dim < tx.dim() - 1:
        d, unit, xh = xs.dim, xs.unit, xs.halves  # any row subset: the op is row-wise
    else:
        raise Barrier("fused site input split along the hidden dimension")
    if res is None:
        rh = (None, None)
    elif res in rw.env:
        rs = rw.env[res]
        if not isinstance(rs, Split) or rs.dim != d or not same(rs.unit, unit):
            raise Barrier("residual split unlike the input")
        rh = rs.halves
    elif val(res).dim() == tx.dim():
        rh = tuple(rw.side(res, d, unit, h) for h in (0, 1))
    else:
        raise Barrier("residual of another shape")
    if any(a in rw.env for a in nodes_in([v for k, v in args.items() if k not in ("x", "residual")])):
        raise Barrier("weight/bias/scale is token-split")
    # normed, residual_out, and an fp8 epilogue's per-row scales (split like the rows; the other
    # kinds' scales output is empty and has no reader)
    count = 3 if args.get("quant") == "row" else 2
    items: dict[int, list[fx.Node]] = {i: [] for i in range(count)}
    waits = []
    for h in (0, 1):
        start = call_named(rw.graph, rw.fake_mode, START_OP, **{**args, "x": xh[h], "residual": rh[h]})
        start.meta[HALF_KEY] = h
        start.meta[SITE_KEY] = n.meta.get(SITE_KEY)
        rw.starts.append(start)
        for i in range(count):
            items[i].append(rw.mk(operator.getitem, (start, i), half=h))
    for h in (0, 1):
        results = [items[i][h] for i in range(count)]
        keep = [a for a in (xh[h], rh[h]) if a is not None]
        wait = rw.graph.call_function(WAIT_OP, (results[0], results[1], keep, results[2] if count == 3 else None))
        wait.meta["val"] = None
        wait.meta[HALF_KEY] = h
        for g in results:
            rw.wait_of[g] = wait
        waits.append(wait)
    _pin_order(rw, waits, items[0])
    return SplitTuple({i: Split(d, tuple(items[i]), unit) for i in range(count)})


def _pin_order(rw: Rewriter, waits: list[fx.Node], results: list[fx.Node]) -> None:
    """Make TokenWeave's interleaving a data dependency, so no reordering can undo it.

    A's wait of this site takes B's start of this site (B's segment is enqueued before A
    blocks on its comm), and B's wait of the previous site takes A's start of this site.
    A wait only lists them to be ordered after them (Inductor reorders independent nodes
    for memory). An edge that would close a cycle (an A value that depends on B's wait,
    through a barrier) is skipped.
    """
    wait_a, wait_b = waits
    _append_keep(wait_a, results[1])
    prev_b = rw.last_wait_b
    if prev_b is not None and not _depends_on(results[0].args[0], prev_b):  # from A's start
        _append_keep(prev_b, results[0])
    rw.last_wait_b = wait_b


def schedule(graph: fx.Graph, wait_of: dict[fx.Node, fx.Node]) -> None:
    """Reorder nodes: A one segment ahead of B, each wait right before its half's next segment.

    ``level`` counts the fused sites a node is downstream of (a wait is one past its start).
    Keys: A's segment k at 2k, B's at 2k+1, A's wait closing k at 2k+1.5 (after B's start
    of segment k is enqueued), B's at 2k+2.5. A stable list schedule by key, respecting
    data dependencies and the waits' ordering (a reader of a start's result follows its
    wait; ``wait_of`` maps each start's result to its wait), gives TokenWeave's interleaving.
    """
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    preds: dict[fx.Node, set[fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
    for item, wait in wait_of.items():
        for u in item.users:
            if u.target is not WAIT_OP:  # other waits only keep it alive
                preds[u].add(wait)
    users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for p in preds[n]:
            users[p].append(n)
    level: dict[fx.Node, int] = {}
    for n in _topological(nodes, preds, users, lambda n: index[n]):
        lv = max((level[p] for p in preds[n]), default=0)
        level[n] = lv + 1 if n.target is WAIT_OP else lv
    key: dict[fx.Node, float] = {}
    for n in nodes:
        h = n.meta.get(HALF_KEY)
        if n.op == "placeholder":
            key[n] = -1.0
        elif n.op == "output":
            key[n] = float("inf")
        elif n.target is WAIT_OP:
            key[n] = 2 * level[n] - 0.5 if h == 0 else 2 * level[n] + 0.5
        else:
            key[n] = 2 * level[n] + (1 if h == 1 else 0)
    order = _topological(nodes, preds, users, lambda n: (key[n], index[n]))
    prev = None
    for n in order:
        if prev is not None and prev.next is not n:
            prev.append(n)
        prev = n


def _topological(nodes, preds, users, priority) -> list[fx.Node]:
    """Kahn's algorithm, taking the ready node of lowest ``priority`` first."""
    remaining = {n: len(preds[n]) for n in nodes}
    ready = [(priority(n), i, n) for i, n in enumerate(nodes) if remaining[n] == 0]
    heapq.heapify(ready)
    pos = {n: i for i, n in enumerate(nodes)}
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(ready, (priority(u), pos[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("tokenweave split: the schedule found a cycle")  # a bug, not bad input
    return order


def _append_keep(wait: fx.Node, node: fx.Node) -> None:
    normed, residual_out, keep, *scales = wait.args
    wait.args = (normed, residual_out, [*keep, node], *scales)


def _waits_for(wait: fx.Node, result: fx.Node) -> bool:
    """Whether ``result`` (a start's getitem) is one of the results ``wait`` orders (not one it
    only keeps alive)."""
    return any(a is result for i, a in enumerate(wait.args) if i != 2)


def _depends_on(node: fx.Node, target: fx.Node) -> bool:
    """Whether ``node`` reads ``target`` transitively (a wait is read through its mutation).

    A comm_wait has no users; a reader of its results depends on it through them, so the
    walk also steps from a start's result to its wait.
    """
    seen, stack = set(), [(node, True)]
    while stack:
        n, read = stack.pop()
        if n is target:
            return True
        if (n, read) in seen:
            continue
        seen.add((n, read))
        if n.target is WAIT_OP:
            # Its own results order it after its start; its keep-alive list is not a read.
            stack.extend((a, False) for a in n.all_input_nodes)
            continue
        stack.extend((a, True) for a in n.all_input_nodes)
        if read and is_call(n, operator.getitem):
            stack.extend((u, True) for u in n.users if u.target is WAIT_OP and _waits_for(u, n))
    return False
