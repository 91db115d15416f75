"""Match one ``all_reduce -> (+bias) -> (+residual) -> RMSNorm`` site; the match replaces itself.

Matches (post-grad ATen; each ``[...]`` optional, views/widening casts allowed between)::

    ar   = _c10d_functional.all_reduce(x, "sum", group)     # dist.all_reduce, funcol, DTensor
    y    = _c10d_functional.wait_tensor(ar)
    [y   = aten.copy(x, y)]                                 # in-place all_reduce write-back
    [y   = mul(y, s) | mul(s, y)]                           # s a 0-d tensor (Gemma's embed_scale)
                                                            # or a Python float (Granite's multipliers)
    [y   = add(y, bias[H])]  [y = add(residual, y)]...       # either order, either operand order;
                                                            # several same-shape addends are summed first
    n    = RMSNorm(y)                                        # :mod:`.rmsnorm_match`

:func:`match_site` walks users from the all_reduce (structural, not a fixed list of traced
patterns: the forms models produce multiply, and a walk covers their product) and returns a
:class:`SiteMatch`, or raises :class:`NoMatch` with the reason for the explain report. Its
eligibility checks (the value the op would have to return, where the op can go) are part of the
match; :meth:`SiteMatch.replace_with` then rewrites the graph.

Intermediate results used elsewhere stay computed from ``residual_out`` (correct, just not free).
A value between the all_reduce and the norm that something else also reads (returned, read by
another layer) is rebuilt for those readers from ``residual_out`` when it equals it up to views
and widening casts (the op then returns ``residual_out`` gathered: the shard pass keeps a residual
with such readers full); a value the op does not return (the sum before a residual or bias add,
or before a scale) blocks the rewrite.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from weave_compile.ops import FUSED_OP

from .graph_utils import (
    VIEW_TARGETS,
    all_reduce_wait,
    aten,
    broadcasts_as_row,
    call_named,
    call_with_meta,
    cast_dtype,
    erase_if_dead,
    getitem_with_meta,
    is_call,
    other_operand,
    prims,
    val,
)
from .rmsnorm_match import NormMatch, match_rmsnorm, scalar_operand

_MAX_CHAIN = 16  # views/casts/adds between the all_reduce and the norm; a real model has <= 4
_MAX_VISITS = 64  # users tried while walking (a node read twice is tried both ways)


class NoMatch(Exception):
    """Why a site was left alone (the message goes to the explain report)."""


@dataclasses.dataclass
class SiteMatch:
    all_reduce: fx.Node
    chain: list[fx.Node]  # wait .. residual_out, in order
    views: list[fx.Node]
    residual: Optional[fx.Node]
    bias: Optional[fx.Node]
    norm: NormMatch
    scale: Union[None, fx.Node, float] = None  # 0-d tensor or number multiplying the reduced sum
    #: further same-shape addends after the first residual (Qwen2-MoE's gated shared expert, a
    #: replicated tensor added before the residual), each with how many of ``views`` precede it
    more_residuals: list[tuple[fx.Node, int]] = dataclasses.field(default_factory=list)
    residual_views: int = 0  # how many of ``views`` precede the residual add
    #: chain nodes (not the last) that something outside the site also reads, with those readers
    extra_readers: list[tuple[fx.Node, list[fx.Node]]] = dataclasses.field(default_factory=list)
    #: the node the fused op goes after (its last input; :func:`match_site` checks it is early enough)
    anchor: Optional[fx.Node] = None

    @property
    def residual_out(self) -> fx.Node:
        return self.chain[-1]

    def describe(self) -> str:
        more = f" (+{len(self.more_residuals)} more addends)" if self.more_residuals else ""
        terms = (("*scale", self.scale), ("+bias", self.bias), ("+residual" + more, self.residual))
        out = " ".join(["all_reduce"] + [t for t, node in terms if node is not None]) + " -> " + self.norm.describe()
        if self.extra_readers:
            out += f" (residual_out also read by {sum(len(r) for _, r in self.extra_readers)} other op(s))"
        return out

    def kept_norm_nodes(self) -> list[str]:
        """Norm intermediates other readers keep alive after :meth:`replace_with` (e.g. 1/rms)."""
        return [n.name for n in self.norm.nodes if n.users and n is not self.norm.out]

    def replace_with(self, fake_mode, *, kernel: str, comm_ctas: int) -> fx.Node:
        """Fused ``all_reduce -> ... -> RMSNorm`` into
        ``normed, residual_out = weave.allreduce_add_rmsnorm(x, residual, bias, w, eps, group, ...)``
        right after :attr:`anchor`: the norm's readers read ``normed``, the residual's (and the
        extra readers, cast and viewed back) ``residual_out``; the site's nodes are erased where
        dead. Returns the fused op's node."""
        graph = self.all_reduce.graph
        x = self.all_reduce.args[0]
        tx = val(x)
        res_node, norm_out = self.residual_out, self.norm.out
        tres, tout = val(res_node), val(norm_out)
        eps_node = self.norm.eps if isinstance(self.norm.eps, fx.Node) else None
        insert_after = self.anchor
        scale = self.scale
        if isinstance(scale, float):  # the op takes a 0-d tensor
            with graph.inserting_after(insert_after):
                scale = graph.call_function(aten.scalar_tensor.default, (self.scale,),
                                            {"dtype": torch.float32, "device": tx.device})
            with fake_mode:
                scale.meta["val"] = torch.scalar_tensor(self.scale, dtype=torch.float32, device=tx.device)
            insert_after = scale
        residual = self.residual
        if self.more_residuals:
            insert_after, residual = self._sum_addends(fake_mode, insert_after)
        # Replay the chain's views on x so the op sees the residual's shape.
        xin = x
        for v in self.views:
            with graph.inserting_after(insert_after):
                xin = call_with_meta(graph, fake_mode, v.target, (xin, *v.args[1:]))
            insert_after = xin
        with graph.inserting_after(insert_after):
            fused = call_named(
                graph, fake_mode, FUSED_OP, x=xin, residual=residual, bias=self.bias, weight=self.norm.weight,
                eps=0.0 if eps_node is not None else self.norm.eps, group_name=self.all_reduce.args[2],
                residual_dtype=tres.dtype, out_dtype=tout.dtype, mid_dtype=self.norm.mid_dtype,
                weight_offset=self.norm.weight_offset, residual_in_sharded=False, residual_out_sharded=False,
                kernel=kernel, comm_ctas=comm_ctas, scale=scale, eps_tensor=eps_node,
            )
        with graph.inserting_after(fused):
            normed = getitem_with_meta(graph, fused, 0)
        with graph.inserting_after(normed):
            residual_out = getitem_with_meta(graph, fused, 1)
        self._serve_extra_readers(fake_mode, residual_out)
        norm_out.replace_all_uses_with(normed)
        res_node.replace_all_uses_with(residual_out)
        erase_if_dead(graph, [self.all_reduce, *self.chain, *self.norm.nodes])
        return fused

    def _sum_addends(self, fake_mode, insert_after: fx.Node) -> tuple[fx.Node, fx.Node]:
        """The residual and the further addends, each through the chain's views after it, summed in graph order."""
        graph = self.all_reduce.graph
        total = None
        for node, k in [(self.residual, self.residual_views)] + self.more_residuals:
            for v in self.views[k:]:
                with graph.inserting_after(insert_after):
                    node = call_with_meta(graph, fake_mode, v.target, (node, *v.args[1:]))
                insert_after = node
            if total is not None:
                with graph.inserting_after(insert_after):
                    node = call_with_meta(graph, fake_mode, aten.add.Tensor, (total, node))
                insert_after = node
            total = node
        return insert_after, total

    def _serve_extra_readers(self, fake_mode, residual_out: fx.Node) -> None:
        """Point the readers of inner chain nodes at ``residual_out``, cast and viewed back to their value.

        :func:`_extra_readers` proved that only views and widening casts lie between each such node
        and ``residual_out``: narrowing back is exact, and the view restores the node's shape.
        """
        graph = self.all_reduce.graph
        insert_after = residual_out
        tres = val(residual_out)
        for c, readers in self.extra_readers:
            tc = val(c)
            rec = residual_out
            if tc.dtype != tres.dtype:
                with graph.inserting_after(insert_after):
                    rec = call_with_meta(graph, fake_mode, prims.convert_element_type.default, (rec, tc.dtype))
                insert_after = rec
            same_shape = tc.dim() == tres.dim() and all(statically_known_true(a == b)
                                                        for a, b in zip(tc.shape, tres.shape))
            if not same_shape:
                shape = []
                for d in self._shape_of(c):
                    if isinstance(d, tuple):  # (x, dim): a symbolic size, read from x
                        with graph.inserting_after(insert_after):
                            insert_after = graph.call_function(aten.sym_size.int, d)
                        insert_after.meta["val"] = val(d[0]).shape[d[1]]
                        d = insert_after
                    shape.append(d)
                with graph.inserting_after(insert_after):
                    rec = call_with_meta(graph, fake_mode, aten.view.default, (rec, shape))
                insert_after = rec
            for r in readers:
                r.replace_input_with(c, rec)

    def _shape_of(self, c: fx.Node) -> list:
        """``c``'s shape as view arguments: the last view's size list before it, else the all_reduce
        input's sizes (ints, or ``(x, dim)`` for a symbolic one)."""
        idx = self.chain.index(c)
        views = [v for v in self.chain[:idx + 1] if v in self.views]
        if views:
            return list(views[-1].args[1])
        x = self.all_reduce.args[0]
        return [(x, i) if isinstance(d, torch.SymInt) else int(d) for i, d in enumerate(val(x).shape)]


# ----------------------------------------------------------------------------- the walk


@dataclasses.dataclass(frozen=True)
class _Walk:
    """Where the walk from one all_reduce stands: the chain so far and what it absorbed."""

    chain: tuple
    views: tuple = ()
    residual: Optional[fx.Node] = None
    bias: Optional[fx.Node] = None
    scale: Union[None, fx.Node, float] = None
    dtype: Optional[torch.dtype] = None
    residual_views: int = 0  # views before the first residual add
    more_residuals: tuple = ()


def match_site(ar: fx.Node) -> SiteMatch:
    """Walk from one all_reduce to its RMSNorm; raises NoMatch with the reason."""
    reduce_op = ar.args[1]
    if reduce_op != "sum":
        raise NoMatch(f"reduce op {reduce_op!r} is not sum")
    wait = all_reduce_wait(ar)
    if wait is None:
        raise NoMatch("all_reduce result is read before wait_tensor")
    x = ar.args[0]
    tx = val(x)
    if tx is None:
        raise NoMatch("no shape information on the all_reduce input")
    if not tx.is_floating_point():
        raise NoMatch(f"all_reduce of {tx.dtype}")
    budget = [_MAX_VISITS]
    m = _walk(ar, wait, _Walk(chain=(wait,), dtype=tx.dtype), tx.shape[-1], budget)
    m.extra_readers = _extra_readers(m)
    m.anchor = _anchor(m)
    return m


def _anchor(m: SiteMatch) -> fx.Node:
    """Where the fused op goes: after the residual add, or after a later input of the op (the
    weight; an eps or a scale input's conversion, dynamic=True); NoMatch if that is not before
    the first reader of its results."""
    order = {n: i for i, n in enumerate(m.all_reduce.graph.nodes)}
    res_node, norm_out = m.residual_out, m.norm.out
    anchor = res_node
    for inp in (m.norm.weight, m.norm.eps, m.scale):
        if isinstance(inp, fx.Node) and order[inp] > order[anchor]:
            anchor = inp
    extra = [r for _, readers in m.extra_readers for r in readers]
    if extra and order[anchor] >= min(order[r] for r in extra):
        # A reader of an inner chain node comes first: put the op right after its last input.
        inputs = [m.all_reduce.args[0], m.residual, m.bias, m.norm.weight, m.norm.eps, m.scale]
        inputs += [n for n, _ in m.more_residuals]
        anchor = max((n for n in inputs if isinstance(n, fx.Node)), key=order.__getitem__)
    first_use = min((order[u] for n in (res_node, norm_out) for u in n.users
                     if u not in m.norm.nodes), default=len(order))
    first_use = min([first_use] + [order[r] for r in extra])
    if order[anchor] >= first_use:
        what = "the residual is first used" if not extra else "a reader of the reduced value"
        raise NoMatch(f"the norm's inputs (weight, eps, residual) are ready only after {what}")
    return anchor


def _walk(ar: fx.Node, cur: fx.Node, st: _Walk, hidden, budget: list[int]) -> SiteMatch:
    """Depth-first from ``cur``: the first user from which a chain reaches an RMSNorm wins.

    A node read twice (the reduced sum also returned, also read by the next layer) is tried
    through each reader; the readers the site does not use are checked by :func:`_extra_readers`.
    """
    norm = match_rmsnorm(cur)
    if norm is not None:
        m = SiteMatch(ar, list(st.chain), list(st.views), st.residual, st.bias, norm, st.scale)
        m.more_residuals, m.residual_views = list(st.more_residuals), st.residual_views
        return m
    if len(st.chain) > _MAX_CHAIN:
        raise NoMatch("no RMSNorm within the ops after the all_reduce")
    users = list(cur.users)
    failures: list[NoMatch] = []
    for u in users:
        budget[0] -= 1
        if budget[0] < 0:
            raise NoMatch(f"no RMSNorm found within {_MAX_VISITS} ops tried after the all_reduce")
        try:
            return _walk(ar, u, _step(cur, u, st, hidden), hidden, budget)
        except NoMatch as e:
            failures.append(e)
    if len(users) == 1:
        raise failures[0]
    uses = ", ".join(str(n.target) for n in users) or "nothing"
    raise NoMatch(f"all_reduce result feeds {len(users)} users ({uses}), no RMSNorm after it")


def _step(cur: fx.Node, u: fx.Node, st: _Walk, hidden) -> _Walk:
    """The walk one op further, through ``u`` (a reader of ``cur``), or NoMatch."""
    if u.op != "call_function":
        raise NoMatch(f"all_reduce result reaches the graph {u.op} before any RMSNorm")
    tu = val(u)
    if tu is None:
        raise NoMatch(f"no shape information on {u.name}")
    chain = st.chain + (u,)
    if is_call(u, aten.copy.default) and u.args[1] is cur and val(u.args[0]).shape == tu.shape:
        return dataclasses.replace(st, chain=chain)  # functionalized in-place all_reduce write-back
    if is_call(u, VIEW_TARGETS) and tu.shape[-1] == hidden:
        return dataclasses.replace(st, chain=chain, views=st.views + (u,))
    if (is_call(u, aten.mul.Tensor, aten.mul.Scalar) and len(u.args) == 2 and not u.kwargs and st.scale is None
            and st.residual is None and st.bias is None and tu.dtype == st.dtype
            and scalar_operand(other_operand(u, cur)) is not None):
        # Gemma's embedding (* embed_scale, a 0-d buffer), Granite's residual_multiplier and
        # embedding_multiplier (Python floats, 0-d inputs under dynamic=True). Only before any
        # add, where the op applies it (to the reduced sum, in fp32); a cast before it is fine.
        return dataclasses.replace(st, chain=chain, scale=scalar_operand(other_operand(u, cur)))
    dt = cast_dtype(u)
    if dt is not None and torch.promote_types(st.dtype, dt) == dt:
        return dataclasses.replace(st, chain=chain, dtype=dt)
    if is_call(u, aten.add.Tensor) and "alpha" not in u.kwargs and len(u.args) == 2:
        other = other_operand(u, cur)
        to = val(other)
        if to is None:
            raise NoMatch(f"all_reduce result plus a non-tensor ({other!r})")
        if to.shape == tu.shape and st.residual is None:
            return dataclasses.replace(st, chain=chain, residual=other, dtype=tu.dtype, residual_views=len(st.views))
        if to.shape == tu.shape and to.dtype == val(st.residual).dtype:
            # Another addend: all_reduce(x) + s + r == all_reduce(x) + (s + r). The op takes one
            # residual: the pass sums the addends (in their dtype) before it.
            return dataclasses.replace(st, chain=chain, dtype=tu.dtype,
                                       more_residuals=st.more_residuals + ((other, len(st.views)),))
        if broadcasts_as_row(to, hidden) and st.bias is None:
            return dataclasses.replace(st, chain=chain, bias=other, dtype=tu.dtype)
        raise NoMatch(f"add of a {list(to.shape)} tensor after the all_reduce")
    raise NoMatch(f"all_reduce result feeds {u.target} before any RMSNorm")


def _value_preserving(node: fx.Node) -> bool:
    """``node`` passes its input's values through: the write-back copy, a view or a widening cast."""
    return is_call(node, aten.copy.default, VIEW_TARGETS) or cast_dtype(node) is not None


def _extra_readers(m: SiteMatch) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Readers of the chain's inner nodes that the site does not use, if ``residual_out`` can serve them.

    Such a node equals ``residual_out`` up to the views and (widening) casts after it; its readers
    then read a view/cast of ``residual_out`` instead. Anything else after it (a residual or bias
    add, a scale) makes a value the op does not return: NoMatch.
    """
    out = []
    for i, c in enumerate(m.chain[:-1]):
        nxt = m.chain[i + 1]
        others = [u for u in c.users if u is not nxt]
        if not others:
            continue
        blocker = next((n for n in m.chain[i + 1:] if not _value_preserving(n)), None)
        if blocker is not None:
            uses = ", ".join(str(n.target) for n in c.users)
            raise NoMatch(f"all_reduce result feeds {len(c.users)} users ({uses}): {c.name} is also read by "
                          f"{', '.join(n.name for n in others)}, and the fused op returns only the sum after "
                          f"{blocker.target}")
        out.append((c, others))
    return out
