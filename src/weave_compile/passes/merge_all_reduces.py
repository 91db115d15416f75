"""Merge ``all_reduce(a) + all_reduce(b)`` into one ``all_reduce(a + b)``: one collective, then one fused site.

MoE blocks with a shared expert (DeepSeek-V2/V3, and Qwen2-MoE once its experts are sharded)
reduce the routed experts' partial output and the shared expert's partial output separately,
then add them (and the residual) before the next norm. The fuse pass can absorb one all_reduce
per norm; after this pass there is one. It also deletes a collective per such layer.

Matches (post-grad ATen)::

    ra = _c10d_functional.all_reduce(a, "sum", group);  ya = wait_tensor(ra)
    rb = _c10d_functional.all_reduce(b, "sum", group);  yb = wait_tensor(rb)
    [y = aten.copy(a | b, y)]  [y = view(y, ..)]  [y = convert(y, wider)]   # on either side, any order
    s  = aten.add.Tensor(ya, yb)                                            # either operand order

Rewrite to::

    c  = aten.add.Tensor(view(a), view(b))        # the same views replayed on the partials
    s  = wait_tensor(all_reduce(c, "sum", group))  [-> convert(s, s's dtype)]

Preconditions, each checked (:func:`match_pair` names the one that fails):

1. Both reduce ops are ``"sum"`` over the same group (the same group name): only then
   ``sum_r a_r + sum_r b_r == sum_r (a_r + b_r)`` (linearity of the sum over one set of ranks).
   A max/avg reduce, or two groups, is left alone.
2. From each wait to the add there are only value-preserving ops (the in-place write-back copy,
   views, widening casts), each read by exactly the next one: *no other reader of either reduced
   result*, which would need the un-merged value. This also means no reader of one result sits
   between the two reductions.
3. The add has no ``alpha`` and both operands have the add's shape (no broadcasting), and both
   partials reach that shape through their views: the add is elementwise on the same elements.
   The casts move after the reduction: ``a + b`` is formed in the wider of the partials' dtypes
   (the narrower one is widened first), reduced in it, and cast to the add's dtype. In exact
   arithmetic this is the original value; in floating point it reassociates the same sums (one
   rounding of ``a_r + b_r`` per rank instead of one for the add of the two reduced sums).
4. Neither partial depends on the other's reduction (the merged collective needs both partials
   first; a dependency would make a cycle). Implied by 2, and checked.

What the graph applies after the reductions is assumed the same on every rank, as everywhere
in TP inference (see :mod:`.fuse_allreduce_rmsnorm`). Runs before the fuse pass, only with
``fuse`` on; merges repeat until none is left (``a + b + c`` becomes one all_reduce).

**Parallel blocks** (GPT-NeoX, GPT-J, Phi, Cohere, CodeGen: attention and MLP read the same
normed input, their row-parallel outputs are summed with the residual): each module reduces its
own output, and the two reduced sums meet in a tree of adds with the residual and the row-parallel
layers' biases between them, e.g. ``(all_reduce(a) + b_o) + (all_reduce(b) + b_m) + r`` or
``r + all_reduce(a) + all_reduce(b)``. :func:`reassociate` first rewrites such a tree (every
inner add read only by the next, no broadcasting between full-size terms, one dtype) as
``((ya + yb) + (b_o + b_m)) + r``: the reduced terms first (then merged as above), the broadcast
terms (biases) summed once and added next, the other full-size terms (the residual) last, so the
fuse pass sees ``all_reduce -> +bias -> +residual -> norm``. The sum is the same in exact
arithmetic; in floating point the order of the adds changes (the biases are summed before they
meet the rows, the residual comes last), as it does for the merge itself:
``tests/passes/test_merge_all_reduces.py`` bounds the difference against the block as written.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx as fx

from weave_compile.report import SiteReport

from .base import WeavePass
from .graph_utils import (
    ALL_REDUCE_TARGETS,
    VIEW_TARGETS,
    WAIT_TARGETS,
    aten,
    call_with_meta,
    cast_dtype,
    erase_if_dead,
    fake_mode_of,
    is_call,
    prims,
    val,
)

log = logging.getLogger(__name__)


class NoMerge(Exception):
    """Why two reductions feeding one add were not merged."""


@dataclasses.dataclass
class Side:
    """One operand of the add, traced back to its all_reduce."""

    all_reduce: fx.Node
    chain: list[fx.Node]  # wait .. the add's operand
    views: list[fx.Node]

    @property
    def partial(self) -> fx.Node:
        return self.all_reduce.args[0]


@dataclasses.dataclass
class Merge:
    """What one merge did: ``all_reduce`` (the new node's name) replaces ``merged`` (original names)."""

    all_reduce: str
    merged: tuple[str, ...]


def _trace_back(operand) -> Side:
    """From the add's operand back to an all_reduce through single-reader, value-preserving ops."""
    chain: list[fx.Node] = []
    views: list[fx.Node] = []
    cur = operand
    while isinstance(cur, fx.Node):
        if len(cur.users) != 1:
            raise NoMerge(f"{cur.name} has {len(cur.users)} readers: another reader needs the unmerged sum")
        chain.insert(0, cur)
        if is_call(cur, WAIT_TARGETS):
            ar = cur.args[0]
            if not is_call(ar, ALL_REDUCE_TARGETS) or len(ar.users) != 1:
                raise NoMerge(f"{cur.name} waits on something other than an all_reduce read once")
            return Side(ar, chain, views)
        if is_call(cur, aten.copy.default) and val(cur.args[0]) is not None and \
                val(cur.args[0]).shape == val(cur).shape:
            cur = cur.args[1]
        elif is_call(cur, VIEW_TARGETS):
            views.insert(0, cur)
            cur = cur.args[0]
        elif cast_dtype(cur) is not None and val(cur.args[0]) is not None and \
                torch.promote_types(val(cur.args[0]).dtype, cast_dtype(cur)) == cast_dtype(cur):
            cur = cur.args[0]
        else:
            raise NoMerge(f"{cur.target} between the reduction and the add")
    raise NoMerge("an operand is not a tensor")


def _depends_on(node: fx.Node, target: fx.Node, order: dict[fx.Node, int]) -> bool:
    """``node`` is computed from ``target`` (ancestor walk, pruned by graph order)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is target:
            return True
        if n in seen or order[n] < order[target]:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _plain_add(n) -> bool:
    """A two-operand ``aten.add.Tensor`` without ``alpha``, with a tensor value."""
    return (is_call(n, aten.add.Tensor) and not n.kwargs and len(n.args) == 2
            and isinstance(val(n), torch.Tensor))


def match_pair(add: fx.Node) -> tuple[Side, Side]:
    """The two reductions ``add`` sums, if they may be merged; raises NoMerge with the reason."""
    if not _plain_add(add):
        raise NoMerge("not a plain tensor add")
    ta = val(add)
    sides = []
    for operand in add.args:
        t = val(operand)
        if t is None or t.shape != ta.shape:
            raise NoMerge("operands of different shapes (broadcasting add)")
        sides.append(_trace_back(operand))
    a, b = sides
    if a.all_reduce is b.all_reduce:
        raise NoMerge("the same reduction twice")
    ops = (a.all_reduce.args[1], b.all_reduce.args[1])
    if ops != ("sum", "sum"):
        raise NoMerge(f"reduce ops {ops}: only sums are linear")
    if a.all_reduce.args[2] != b.all_reduce.args[2]:
        raise NoMerge(f"different groups ({a.all_reduce.args[2]!r}, {b.all_reduce.args[2]!r})")
    for s in (a, b):
        if val(s.partial) is None or not val(s.partial).is_floating_point():
            raise NoMerge("a partial without a floating-point value")
    order = {n: i for i, n in enumerate(add.graph.nodes)}
    if _depends_on(b.partial, a.all_reduce, order) or _depends_on(a.partial, b.all_reduce, order):
        raise NoMerge("one partial is computed from the other's reduction")
    return a, b


def _inner(o, parent: fx.Node) -> bool:
    """Whether operand ``o`` of the plain add ``parent`` belongs to its add tree: a plain add read
    only by ``parent``, of its shape and dtype (so of the whole tree's)."""
    return (_plain_add(o) and len(o.users) == 1 and val(o).shape == val(parent).shape
            and val(o).dtype == val(parent).dtype)


def _add_tree(root: fx.Node) -> tuple[list[fx.Node], list]:
    """``(inner adds, leaves in order)`` of the tree of plain adds under ``root`` (a plain add)."""
    inner, leaves = [root], []

    def walk(n):
        for o in n.args:
            if _inner(o, n):
                inner.append(o)
                walk(o)
            else:
                leaves.append(o)

    walk(root)
    return inner, leaves


def _reduced_group(leaf) -> str | None:
    """The group of the sum-reduction ``leaf`` traces back to (as :func:`match_pair` would), else None."""
    try:
        side = _trace_back(leaf)
    except NoMerge:
        return None
    ar = side.all_reduce
    ok = ar.args[1] == "sum" and val(ar.args[0]) is not None and val(ar.args[0]).is_floating_point()
    return ar.args[2] if ok else None


def reassociate(graph: fx.Graph) -> int:
    """Rewrite each add tree holding two or more sum-reductions over one group among other terms
    (module doc: parallel blocks) so that the reductions are added first; returns how many trees."""
    fake_mode, done = None, 0
    for root in list(graph.nodes):
        if getattr(root, "_erased", False) or not _plain_add(root) or not val(root).is_floating_point():
            continue
        t = val(root)
        parent = next(iter(root.users)) if len(root.users) == 1 else None
        if parent is not None and _plain_add(parent) and _inner(root, parent):
            continue  # an inner node of a larger tree: rewritten from its root
        inner, leaves = _add_tree(root)
        if len(leaves) < 3 or not all(isinstance(x, fx.Node) and val(x) is not None for x in leaves):
            continue
        groups = [_reduced_group(x) for x in leaves]
        by_group: dict[str, list[int]] = {}
        for i, g in enumerate(groups):
            if g is not None:
                by_group.setdefault(g, []).append(i)
        first = next((ix for ix in by_group.values() if len(ix) >= 2), None)
        if first is None:
            continue
        reduced = [leaves[i] for i in first]
        rest = [x for i, x in enumerate(leaves) if i not in first]
        full = [x for x in rest if val(x).shape == t.shape]
        broadcast = [x for x in rest if val(x).shape != t.shape]
        if any(torch.broadcast_shapes(val(x).shape, t.shape) != t.shape for x in broadcast):
            continue  # a term that widens the result: leave the tree as written
        if len(reduced) == 2 and not rest:
            continue  # already the pair the merge takes
        fake_mode = fake_mode or fake_mode_of(graph)
        made: list[fx.Node] = []

        def add(x, y):
            made.append(call_with_meta(graph, fake_mode, aten.add.Tensor, (x, y)))
            return made[-1]

        with graph.inserting_before(root):
            s = reduced[0]
            for x in reduced[1:]:
                s = add(s, x)
            if broadcast:
                bias = broadcast[0]
                for x in broadcast[1:]:
                    bias = add(bias, x)
                s = add(s, bias)
            for x in full:
                s = add(s, x)
        if val(s).dtype != t.dtype or val(s).shape != t.shape:  # a promotion the order changed: as written
            erase_if_dead(graph, made)
            continue
        root.replace_all_uses_with(s)
        erase_if_dead(graph, inner)
        done += 1
        log.info("tokenweave: reassociated %s: %d reductions first, then %d bias and %d other terms",
                 root.name, len(reduced), len(broadcast), len(full))
    return done


class MergeAllReducesPass(WeavePass):
    """Merge every pair of sum-reductions over one group that only feed one add (after
    :func:`reassociate`); returns what it did."""

    def __call__(self, graph: fx.Graph) -> list[Merge]:
        reassociate(graph)
        merges: list[Merge] = []
        origin: dict[str, tuple[str, ...]] = {}  # merged node name -> the original all_reduces
        fake_mode = None
        while True:
            found = None
            for n in graph.nodes:
                if not is_call(n, aten.add.Tensor):
                    continue
                try:
                    found = (n, *match_pair(n))
                    break
                except NoMerge as e:
                    if _both_reduced(n):
                        log.info("tokenweave: %s not merged: %s", n.name, e)
            if found is None:
                break
            fake_mode = fake_mode or fake_mode_of(graph)
            add, a, b = found
            new_ar = _rewrite(graph, fake_mode, add, a, b)
            names = origin.pop(a.all_reduce.name, (a.all_reduce.name,)) + \
                origin.pop(b.all_reduce.name, (b.all_reduce.name,))
            origin[new_ar.name] = names
            merges = [m for m in merges if m.all_reduce not in (a.all_reduce.name, b.all_reduce.name)]
            merges.append(Merge(new_ar.name, names))
            log.info("tokenweave: merged %s into one all_reduce (%s)", " + ".join(names), new_ar.name)
        return merges


def _both_reduced(add: fx.Node) -> bool:
    """Both operands of ``add`` come from a wait_tensor (worth a log line when not merged)."""
    def from_wait(o):
        while isinstance(o, fx.Node) and (is_call(o, VIEW_TARGETS, aten.copy.default) or cast_dtype(o) is not None):
            o = o.args[1] if is_call(o, aten.copy.default) else o.args[0]
        return is_call(o, WAIT_TARGETS)
    return len(add.args) == 2 and all(from_wait(o) for o in add.args)


def _rewrite(graph: fx.Graph, fake_mode, add: fx.Node, a: Side, b: Side) -> fx.Node:
    ta, tb = val(a.partial), val(b.partial)
    wide = torch.promote_types(ta.dtype, tb.dtype)
    operands = []
    with graph.inserting_before(add):
        for side, t in ((a, ta), (b, tb)):
            x = side.partial
            for v in side.views:
                x = call_with_meta(graph, fake_mode, v.target, (x, *v.args[1:]))
            if t.dtype != wide:
                x = call_with_meta(graph, fake_mode, prims.convert_element_type.default, (x, wide))
            operands.append(x)
        summed = call_with_meta(graph, fake_mode, aten.add.Tensor, tuple(operands))
        ar = call_with_meta(graph, fake_mode, a.all_reduce.target, (summed, "sum", a.all_reduce.args[2]))
        out = call_with_meta(graph, fake_mode, next(iter(WAIT_TARGETS)), (ar,))
        if val(add).dtype != wide:
            out = call_with_meta(graph, fake_mode, prims.convert_element_type.default, (out, val(add).dtype))
    add.replace_all_uses_with(out)
    erase_if_dead(graph, [add, a.all_reduce, *a.chain, b.all_reduce, *b.chain])
    return ar


def annotate_merged(sites: list[SiteReport], merges: list[Merge]) -> list[SiteReport]:
    """The fuse pass's site reports, each merged site saying which all_reduces it replaced."""
    by_name = {m.all_reduce: m.merged for m in merges}
    return [dataclasses.replace(s, reason=f"{s.reason}; one all_reduce for {' + '.join(by_name[s.node])} (merged)")
            if s.node in by_name else s for s in sites]
