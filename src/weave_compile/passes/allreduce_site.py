"""Match one ``all_reduce -> (+bias) -> (+residual) -> RMSNorm`` site; the match replaces itself.

Matches (post-grad ATen; each ``[...]`` optional, views/widening casts allowed between)::

    ar   = _c10d_functional.all_reduce(x, "sum", group)     # dist.all_reduce, funcol, DTensor
         | _c10d_functional.reduce_scatter_tensor(x, "sum", N, group)   # sequence parallel
    y    = _c10d_functional.wait_tensor(ar)
    [y   = aten.copy(x, y)]                                 # in-place all_reduce write-back
    [y   = mul(y, s) | mul(s, y)]                           # s a 0-d tensor (Gemma's embed_scale)
                                                            # or a Python float (Granite's multipliers)
    [y   = add(y, bias[H])]  [y = add(residual, y)]...       # either order, either operand order;
                                                            # several same-shape addends are summed first
    n    = RMSNorm(y) | LayerNorm(y)                         # :mod:`.rmsnorm_match`, :mod:`.layernorm_match`
    [all_gather_into_tensor(n, N, group) + wait]             # after a reduce_scatter: required

A reduce-scatter site (sequence parallel, :mod:`.sequence_parallel`) is the same walk on this
rank's rows, with the residual the model's own shard, and its normed rows must be all-gathered
over the same ranks: the op then takes the reduce-scatter's input and returns the gathered rows.

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

from .fp8_quant_match import QuantMatch
from .graph_utils import (
    VIEW_TARGETS,
    aten,
    broadcasts_as_row,
    call_named,
    call_with_meta,
    cast_dtype,
    erase_if_dead,
    getitem_with_meta,
    is_call,
    only_wait,
    other_operand,
    prims,
    val,
)
from .layernorm_match import describe_layernorm, match_norm
from .rmsnorm_match import NormMatch, feeds_layernorm, scalar_operand
from .sequence_parallel import (
    Collective,
    GatherTail,
    NoMatch,
    SizeSource,
    collective_of,
    match_gather,
    repoint_size_readers,
    size_args,
    size_sources,
    unresolved_size_readers,
)

_MAX_CHAIN = 16  # views/casts/adds between the all_reduce and the norm; a real model has <= 4
_MAX_VISITS = 64  # users tried while walking (a node read twice is tried both ways)
_LAYERNORM = "{kind} result feeds a LayerNorm the fused op does not compute: {detail}"
#: What a LayerNorm outside :mod:`.layernorm_match`'s grammar is told, where nothing more precise is known.
_LAYERNORM_FORMS = ("its form is not one the fused op takes (F.layer_norm or nn.LayerNorm, or the mean "
                    "and the centred row's mean square, then rsqrt)")


@dataclasses.dataclass
class SiteMatch:
    collective: Collective
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
    #: a reduce-scatter site's all-gather of the normed rows (None: an all_reduce site)
    gather: Optional[GatherTail] = None
    #: the fp8 quantization every reader of the normed rows applies, taken into the op
    #: (:mod:`.fp8_quant_match`; set by the fuse pass); None: the op returns the normed rows
    quant: Optional[QuantMatch] = None

    @property
    def quant_spec(self):
        """The op's fp8 epilogue (``weave_compile.quant.QuantSpec``), or None."""
        return None if self.quant is None else self.quant.spec()

    @property
    def residual_out(self) -> fx.Node:
        return self.chain[-1]

    def removed_collectives(self) -> list[fx.Node]:
        """The collectives the rewrite removes (their ``sym_size`` readers are re-pointed)."""
        return [self.collective.node] + ([self.gather.all_gather] if self.gather is not None else [])

    def describe(self) -> str:
        more = f" (+{len(self.more_residuals)} more addends)" if self.more_residuals else ""
        terms = (("*scale", self.scale), ("+bias", self.bias), ("+residual" + more, self.residual))
        out = " ".join([self.collective.kind] + [t for t, node in terms if node is not None]) + " -> "
        out += self.norm.describe() + (" -> all_gather" if self.gather is not None else "")
        if self.quant is not None:
            spec = self.quant_spec
            out += (f" -> {spec.describe()} epilogue, gathered in fp8: "
                    f"{spec.row_bytes(int(val(self.collective.x).shape[-1]))} B/row")
        if self.extra_readers:
            out += f" (residual_out also read by {sum(len(r) for _, r in self.extra_readers)} other op(s))"
        return out

    def kept_norm_nodes(self) -> list[str]:
        """Norm intermediates other readers keep alive after :meth:`replace_with` (e.g. 1/rms)."""
        return [n.name for n in self.norm.nodes if n.users and n is not self.norm.out]

    def replace_with(self, fake_mode, *, kernel: str, comm_ctas: int, batch_invariant: bool = False) -> fx.Node:
        """Fused ``all_reduce -> ... -> RMSNorm`` into
        ``normed, residual_out = weave.allreduce_add_rmsnorm(x, residual, bias, w, eps, group, ...)``
        right after :attr:`anchor`: the norm's readers (a reduce-scatter site: the all-gather's)
        read ``normed``, the residual's (and the extra readers, cast and viewed back)
        ``residual_out``; the site's nodes are erased where dead. Returns the fused op's node."""
        c = self.collective
        graph = c.node.graph
        tx = val(c.x)
        res_node, norm_out = self.residual_out, self.norm.out
        tres, tout = val(res_node), val(norm_out)
        eps_node = self.norm.eps if isinstance(self.norm.eps, fx.Node) else None
        if eps_node is not None and tx.device.type != "cpu":
            eps_node = eps_on_device(graph, fake_mode, eps_node, tx.device)
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
        xin = c.x
        if not c.scatters:
            # Replay the chain's views on x so the op sees the residual's shape. (A reduce-scatter
            # site's x is N times the residual: the op takes both as rows.)
            for v in self.views:
                with graph.inserting_after(insert_after):
                    xin = call_with_meta(graph, fake_mode, v.target, (xin, *v.args[1:]))
                insert_after = xin
        with graph.inserting_after(insert_after):
            fused = call_named(
                graph, fake_mode, FUSED_OP, x=xin, residual=residual, bias=self.bias, weight=self.norm.weight,
                eps=0.0 if eps_node is not None else self.norm.eps, group_name=c.group_name,
                residual_dtype=tres.dtype, out_dtype=tout.dtype, mid_dtype=self.norm.mid_dtype,
                weight_offset=self.norm.weight_offset, norm=self.norm.kind, norm_bias=self.norm.bias,
                # A reduce-scatter site's residual is the model's shard, and stays one.
                residual_in_sharded=c.scatters and residual is not None, residual_out_sharded=c.scatters,
                kernel=kernel, comm_ctas=comm_ctas, scale=scale, eps_tensor=eps_node, batch_invariant=batch_invariant,
                **self._quant_args(),
            )
        with graph.inserting_after(fused):
            normed = getitem_with_meta(graph, fused, 0)
        with graph.inserting_after(normed):
            residual_out = getitem_with_meta(graph, fused, 1)
        if self.quant is not None:  # the chain's readers read the op's fp8 rows and scales
            self._serve_quant_readers(fake_mode, fused, normed, residual_out)
        if self.gather is None:
            self._serve_extra_readers(fake_mode, residual_out, self.extra_readers)
            norm_out.replace_all_uses_with(normed)
            res_node.replace_all_uses_with(residual_out)
        else:
            # Every reader of the residual reads this rank's rows, in the shape the graph gave them.
            readers = [(res_node, [u for u in res_node.users if u not in self.norm.nodes])]
            last = self._serve_extra_readers(fake_mode, residual_out, self.extra_readers + readers)
            gathered = self.gather.out
            normed = _view_as(graph, fake_mode, normed, gathered, self.gathered_shape(), last)
            gathered.replace_all_uses_with(normed)
        repoint_size_readers(graph, self.removed_collectives(), size_sources(c))
        tail = self.gather.nodes if self.gather is not None else []
        erase_if_dead(graph, [c.node, *self.chain, *self.norm.nodes, *tail])
        return fused

    def _serve_quant_readers(self, fake_mode, fused: fx.Node, q: fx.Node, after: fx.Node) -> None:
        """Point the readers of the chain's fp8 rows and scales at the op's (viewed as the chain
        viewed the normed rows, where it did: ``_scaled_mm`` takes ``[T, K]`` rows and ``[T, 1]``
        scales) and erase the chain."""
        graph = fused.graph
        quant = self.quant
        view = quant.rows if quant.rows is not None and quant.rows is not self.norm.out else None
        outs = [(quant.q, q)]
        if quant.scales is not None:
            with graph.inserting_after(after):
                after = getitem_with_meta(graph, fused, 2)
            outs.append((quant.scales, after))
        for old, new in outs:
            if view is not None:  # the same view on the op's output (the scales: its last size 1)
                sizes = list(view.args[1])
                if old is not quant.q:
                    sizes[-1] = 1
                with graph.inserting_after(after):
                    new = after = call_with_meta(graph, fake_mode, view.target, (new, sizes))
            old.replace_all_uses_with(new)
        erase_if_dead(graph, quant.nodes)

    def _quant_args(self) -> dict:
        """The op's fp8 epilogue arguments (none without :attr:`quant`)."""
        if self.quant is None:
            return {}
        return dict(self.quant_spec.op_args(), quant_scale=self.quant.static_scale)

    def _sum_addends(self, fake_mode, insert_after: fx.Node) -> tuple[fx.Node, fx.Node]:
        """The residual and the further addends, each through the chain's views after it, summed in graph order."""
        graph = self.collective.node.graph
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

    def _serve_extra_readers(self, fake_mode, residual_out: fx.Node, readers_of) -> fx.Node:
        """Point the readers of chain nodes (``readers_of``: ``(node, readers)``) at ``residual_out``,
        cast and viewed back to each node's value; returns the last node inserted.

        :func:`_extra_readers` proved that only views and widening casts lie between each such node
        and ``residual_out``: narrowing back is exact, and the view restores the node's shape (a
        reduce-scatter site's ``residual_out`` is this rank's rows, ``[T/N, H]``).
        """
        graph = self.collective.node.graph
        insert_after = residual_out
        tres = val(residual_out)
        for c, readers in readers_of:
            if not readers:
                continue
            tc = val(c)
            rec = residual_out
            if tc.dtype != tres.dtype:
                with graph.inserting_after(insert_after):
                    rec = call_with_meta(graph, fake_mode, prims.convert_element_type.default, (rec, tc.dtype))
                insert_after = rec
            same_shape = tc.dim() == tres.dim() and all(statically_known_true(a == b)
                                                        for a, b in zip(tc.shape, tres.shape))
            if not same_shape:
                rec = insert_after = _view_as(graph, fake_mode, rec, c, self._shape_of(c), insert_after)
            for r in readers:
                r.replace_input_with(c, rec)
        return insert_after

    def _shape_of(self, c: fx.Node) -> Optional[list]:
        """``c``'s shape as view arguments (:func:`_view_as`). An all_reduce site: the last view's
        size list before it, else the collective's input sizes. A reduce-scatter site: sizes read
        from the op's inputs (:func:`.sequence_parallel.size_args`; None where two symbolic sizes
        have no source there)."""
        if self.collective.scatters:
            return size_args(val(c).shape, size_sources(self.collective, self.residual))
        idx = self.chain.index(c)
        views = [v for v in self.chain[:idx + 1] if v in self.views]
        if views:
            return list(views[-1].args[1])
        x = self.collective.x
        return [(x, i) if isinstance(d, torch.SymInt) else int(d) for i, d in enumerate(val(x).shape)]

    def gathered_shape(self) -> Optional[list]:
        """The all-gathered value's shape as view arguments, read from the op's input ``x``."""
        return size_args(val(self.gather.out).shape, size_sources(self.collective))


def _view_as(graph: fx.Graph, fake_mode, node: fx.Node, like: fx.Node, sizes: list, after: fx.Node) -> fx.Node:
    """``view(node, sizes)`` inserted after ``after`` (with the size arithmetic it needs), ``sizes``
    as :meth:`SiteMatch._shape_of` gives them: a symbolic size read from its source (every source
    is defined before the fused op). ``node`` as it is where it already has ``like``'s shape."""
    t, tl = val(node), val(like)
    if t.dim() == tl.dim() and all(statically_known_true(a == b) for a, b in zip(t.shape, tl.shape)):
        return node

    def insert(target, args):
        nonlocal after
        with graph.inserting_after(after):
            after = graph.call_function(target, args)
        return after

    shape = []
    for d in sizes:
        if isinstance(d, SizeSource):
            d = d.emit(graph, insert)
        elif isinstance(d, tuple):  # (x, dim): a symbolic size of the all_reduce's input
            d = SizeSource(*d).emit(graph, insert)
        shape.append(d)
    with graph.inserting_after(after):
        return call_with_meta(graph, fake_mode, aten.view.default, (node, shape))


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


def match_site(node: fx.Node, same_ranks=None) -> SiteMatch:
    """Walk from one all_reduce or reduce_scatter to its RMSNorm (and, after a reduce_scatter, the
    all-gather); raises NoMatch with the reason. ``same_ranks(a, b)``: whether two group names hold
    the same ranks in the same order (default: the same name)."""
    c = collective_of(node)
    if c.reduce_op != "sum":
        raise NoMatch(f"reduce op {c.reduce_op!r} is not sum")
    wait = only_wait(node)
    if wait is None:
        raise NoMatch(f"{c.kind} result is read before wait_tensor")
    tx = val(c.x)
    if tx is None:
        raise NoMatch(f"no shape information on the {c.kind} input")
    if not tx.is_floating_point():
        raise NoMatch(f"{c.kind} of {tx.dtype}")
    budget = [_MAX_VISITS]
    return _walk(c, wait, _Walk(chain=(wait,), dtype=tx.dtype), tx.shape[-1], budget,
                 lambda m: _finish(m, same_ranks or (lambda a, b: a == b)))


class _Unfinished(NoMatch):
    """A chain that reached an RMSNorm but cannot be the site (the reason outranks a walk's dead ends)."""


def _finish(m: SiteMatch, same_ranks) -> SiteMatch:
    """``m`` with what it needs beyond the chain (the all-gather, the extra readers, the anchor),
    or :class:`_Unfinished` with why it cannot be rewritten."""
    c = m.collective
    try:
        if c.scatters:
            m.gather = match_gather(m.norm.out, c, same_ranks)
        m.extra_readers = _extra_readers(m)
        unresolved = unresolved_size_readers(m.removed_collectives(), size_sources(c))
        if unresolved:
            raise NoMatch(f"a size of a collective's result is read ({', '.join(r.name for r in unresolved)}) "
                          f"that its input does not carry")
        if c.scatters:
            # Every value the op's results stand in for must be rebuilt from them, in its shape.
            rebuilt = [n for n, _ in m.extra_readers] + [m.residual_out]
            if any(m._shape_of(n) is None for n in rebuilt) or m.gathered_shape() is None:
                raise NoMatch("a value of the site has two symbolic sizes that the fused op's inputs do not "
                              "carry: its shape cannot be rebuilt from the op's results")
        m.anchor = _anchor(m)
    except NoMatch as e:
        raise _Unfinished(str(e)) from None
    return m


def _anchor(m: SiteMatch) -> fx.Node:
    """Where the fused op goes: after the residual add, or after a later input of the op (the
    weight, a LayerNorm's bias; an eps or a scale input's conversion, dynamic=True); NoMatch if
    that is not before the first reader of its results."""
    order = {n: i for i, n in enumerate(m.collective.node.graph.nodes)}
    res_node, norm_out = m.residual_out, m.norm.out
    anchor = res_node
    for inp in (m.norm.weight, m.norm.bias, m.norm.eps, m.scale):
        if isinstance(inp, fx.Node) and order[inp] > order[anchor]:
            anchor = inp
    extra = [r for _, readers in m.extra_readers for r in readers]
    if extra and order[anchor] >= min(order[r] for r in extra):
        # A reader of an inner chain node comes first: put the op right after its last input.
        inputs = [m.collective.x, m.residual, m.bias, m.norm.weight, m.norm.bias, m.norm.eps, m.scale]
        inputs += [n for n, _ in m.more_residuals]
        anchor = max((n for n in inputs if isinstance(n, fx.Node)), key=order.__getitem__)
    first_use = min((order[u] for n in (res_node, norm_out) for u in n.users
                     if u not in m.norm.nodes), default=len(order))
    first_use = min([first_use] + [order[r] for r in extra])
    if order[anchor] >= first_use:
        what = "the residual is first used" if not extra else "a reader of the reduced value"
        raise NoMatch(f"the norm's inputs (weight, eps, residual) are ready only after {what}")
    return anchor


def _walk(c: Collective, cur: fx.Node, st: _Walk, hidden, budget: list[int], finish) -> SiteMatch:
    """Depth-first from ``cur``: the first chain that reaches an RMSNorm and that ``finish`` accepts wins.

    A node read twice (the reduced sum also returned, also read by the next layer) is tried
    through each reader; the readers the site does not use are checked by :func:`_extra_readers`
    (in ``finish``). A chain through the wrong reader (the next layer's residual add, reaching the
    next norm) fails there, and the walk goes on with the next reader. Where every chain fails,
    the reason of one that reached a norm is given, else of the walk's dead ends.
    """
    norm = match_norm(cur)
    if norm is not None:
        m = SiteMatch(c, list(st.chain), list(st.views), st.residual, st.bias, norm, st.scale)
        m.more_residuals, m.residual_views = list(st.more_residuals), st.residual_views
        return finish(m)
    if len(st.chain) > _MAX_CHAIN:
        raise NoMatch(f"no RMSNorm within the ops after the {c.kind}")
    users = list(cur.users)
    failures: list[NoMatch] = []
    for u in users:
        budget[0] -= 1
        if budget[0] < 0:
            raise NoMatch(f"no RMSNorm found within {_MAX_VISITS} ops tried after the {c.kind}")
        try:
            return _walk(c, u, _step(c, cur, u, st, hidden), hidden, budget, finish)
        except NoMatch as e:
            failures.append(e)
    unfinished = [e for e in failures if isinstance(e, _Unfinished)]
    if unfinished:
        raise unfinished[0]
    if feeds_layernorm(cur):
        raise NoMatch(_LAYERNORM.format(kind=c.kind, detail=describe_layernorm(cur) or _LAYERNORM_FORMS))
    if len(users) == 1:
        raise failures[0]
    uses = ", ".join(str(n.target) for n in users) or "nothing"
    raise NoMatch(f"{c.kind} result feeds {len(users)} users ({uses}), no RMSNorm after it")


def _step(c: Collective, cur: fx.Node, u: fx.Node, st: _Walk, hidden) -> _Walk:
    """The walk one op further, through ``u`` (a reader of ``cur``), or NoMatch."""
    if u.op != "call_function":
        raise NoMatch(f"{c.kind} result reaches the graph {u.op} before any RMSNorm")
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
            raise NoMatch(f"{c.kind} result plus a non-tensor ({other!r})")
        if to.shape == tu.shape and st.residual is None:
            return dataclasses.replace(st, chain=chain, residual=other, dtype=tu.dtype, residual_views=len(st.views))
        if to.shape == tu.shape and to.dtype == val(st.residual).dtype:
            # Another addend: all_reduce(x) + s + r == all_reduce(x) + (s + r). The op takes one
            # residual: the pass sums the addends (in their dtype) before it.
            return dataclasses.replace(st, chain=chain, dtype=tu.dtype,
                                       more_residuals=st.more_residuals + ((other, len(st.views)),))
        if broadcasts_as_row(to, hidden) and st.bias is None:
            return dataclasses.replace(st, chain=chain, bias=other, dtype=tu.dtype)
        raise NoMatch(f"add of a {list(to.shape)} tensor after the {c.kind}")
    raise NoMatch(f"{c.kind} result feeds {u.target} before any RMSNorm")


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
            raise NoMatch(f"{m.collective.kind} result feeds {len(c.users)} users ({uses}): {c.name} is also read by "
                          f"{', '.join(n.name for n in others)}, and the fused op returns only the sum after "
                          f"{blocker.target}")
        out.append((c, others))
    return out


def eps_on_device(graph: fx.Graph, fake_mode, eps: fx.Node, device: torch.device) -> fx.Node:
    """A 0-d host eps as a tensor on ``device``, copied once per graph at its start; a device eps
    as it is. (Its dtype stays: the implementations read it as fp32, as they compute.)

    Why: under ``dynamic=True`` Dynamo makes a model's Python-float eps a host graph input, and a
    host tensor must not reach the op where Inductor records CUDA graphs: it hands a host tensor
    to a CUDA-graph partition as an input, which the recording rejects ("storage data ptrs are
    not allocated in pool"; plain Inductor stages its own host scalars through one device copy).
    The copy is non-blocking (a pageable 0-d source is staged at once, no device sync) and a
    partition boundary of its own; a graph input's copy comes at the graph's start, so it splits
    no partition. The implementations read eps from it on the device (``takes_eps_tensor``)."""
    if val(eps).device == device:
        return eps
    for user in eps.users:
        if user.meta.get("weave_eps_copy") == str(device):
            return user
    # A graph input: copied before any other work. A host node (a cast of one): right after it.
    at = graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")) \
        if eps.op == "placeholder" else graph.inserting_after(eps)
    with at:
        # prims.device_put, not aten._to_copy: the post-grad graph holds decomposed ops only.
        node = call_with_meta(graph, fake_mode, torch.ops.prims.device_put.default, (eps, device, True))
    node.meta["weave_eps_copy"] = str(device)
    return node
