"""Fuse ``all_reduce -> (+bias) -> (+residual) -> RMSNorm`` into ``weave::allreduce_add_rmsnorm``.

Matches (post-grad ATen; each ``[...]`` optional, views/widening casts allowed between)::

    ar   = _c10d_functional.all_reduce(x, "sum", group)     # dist.all_reduce, funcol, DTensor
    y    = _c10d_functional.wait_tensor(ar)
    [y   = aten.copy(x, y)]                                 # in-place all_reduce write-back
    [y   = mul(y, s) | mul(s, y)]                           # s a 0-d tensor (Gemma's embed_scale)
                                                            # or a Python float (Granite's multipliers)
    [y   = add(y, bias[H])]  [y = add(residual, y)]...       # either order, either operand order;
                                                            # several same-shape addends are summed first
    r    = convert_element_type(y, float32)                  # absent when y is float32
    v    = mean(pow(r, 2) | mul(r, r), [-1], keepdim=True)
    s    = rsqrt(add(v, eps)) | reciprocal(sqrt(...))        # eps a number, or a 0-d tensor input
                                                            # (dynamic=True: Dynamo's specialize_float=False)
    n    = mul(r, s) | div(r, sqrt(add(v, eps)))
    [n   = convert(n, mid)] [n = mul(n, w | convert(w) | add(convert(w), 1.0))] [n = convert(n, out)]

Rewrite to::

    normed, residual_out = weave.allreduce_add_rmsnorm(x, residual, bias, w, eps, group, ...)

The matcher is structural (it walks users from each all_reduce) instead of a fixed list of traced
patterns: the forms models produce multiply (casts, operand orders, weight before or after the
cast, Gemma's ``1 + w``, views between the mm and the add), and a walk covers their product.
A site that does not match keeps its graph and gets the reason in the explain report.

Assumption (TokenWeave's, and every TP program's): what the graph applies after the all_reduce
(bias, residual, scale, norm weight) is the same on every rank of the group, since each row is
now normalized on one rank and broadcast. The graph cannot prove it; TP frameworks guarantee it.
Intermediate results used elsewhere stay computed from ``residual_out`` (correct, just not
free). A value between the all_reduce and the norm that something else also reads (returned, read
by another layer) is rebuilt for those readers from ``residual_out`` when it equals it up to
views and widening casts (the op then returns ``residual_out`` gathered: the shard pass keeps a
residual with such readers full); a value the op does not return (the sum before a residual or
bias add, or before a scale) blocks the rewrite.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Union

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from weave_compile.config import TokenWeaveConfig
from weave_compile.ops import FUSED_OP, group_size, select_kernel
from weave_compile.ops.selection import symm_kernels
from weave_compile.report import SiteReport

from .base import WeavePass
from .graph_utils import (
    ALL_REDUCE_TARGETS,
    VIEW_TARGETS,
    all_reduce_wait,
    aten,
    broadcasts_as_row,
    call_named,
    call_with_meta,
    cast_dtype,
    erase_if_dead,
    fake_mode_of,
    getitem_with_meta,
    is_call,
    is_last_dim,
    other_operand,
    prims,
    val,
)

log = logging.getLogger(__name__)

#: ``node.meta`` key of a fused op: the name of the all_reduce node it replaced (the site's id
#: in the report); the split pass copies it onto each half's op.
SITE_KEY = "weave_site"
_MAX_CHAIN = 16  # views/casts/adds between the all_reduce and the norm; a real model has <= 4
_MAX_VISITS = 64  # users tried while walking (a node read twice is tried both ways)


class NoMatch(Exception):
    """Why a site was left alone (the message goes to the explain report)."""


@dataclasses.dataclass
class NormMatch:
    nodes: list[fx.Node]  # every node of the norm, output last
    eps: Union[float, fx.Node]  # a node: a 0-d tensor (dynamic=True turns the float into an input)
    weight: Optional[fx.Node]
    weight_offset: float
    mid_dtype: Optional[torch.dtype]

    @property
    def out(self) -> fx.Node:
        return self.nodes[-1]

    def describe(self) -> str:
        parts = ["rmsnorm"]
        if self.weight is not None:
            parts.append("(1+w)" if self.weight_offset else "*w")
            parts.append("after cast" if self.mid_dtype is not None else "in fp32")
        if isinstance(self.eps, fx.Node):
            parts.append("(eps a graph input)")
        return " ".join(parts)


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

    @property
    def residual_out(self) -> fx.Node:
        return self.chain[-1]

    def describe(self) -> str:
        parts = ["all_reduce"]
        if self.scale is not None:
            parts.append("*scale")
        if self.bias is not None:
            parts.append("+bias")
        if self.residual is not None:
            parts.append("+residual" + (f" (+{len(self.more_residuals)} more addends)" if self.more_residuals else ""))
        out = " ".join(parts) + " -> " + self.norm.describe()
        if self.extra_readers:
            out += f" (residual_out also read by {sum(len(r) for _, r in self.extra_readers)} other op(s))"
        return out


# ----------------------------------------------------------------------------- norm matcher


def _single_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_scalar_tensor(o: Any) -> bool:
    t = val(o)
    return t is not None and t.dim() == 0 and t.is_floating_point()


def _is_number(o: Any) -> bool:
    return isinstance(o, (int, float)) and not isinstance(o, bool)


def _scalar_operand(o: Any) -> Union[None, float, fx.Node]:
    """A Python number (as float) or a 0-d floating tensor node; None for anything else."""
    if _is_number(o):
        return float(o)
    return o if _is_scalar_tensor(o) else None


def _is_square_of(node: fx.Node, r: fx.Node) -> bool:
    if is_call(node, aten.pow.Tensor_Scalar):
        return node.args[0] is r and node.args[1] == 2
    return is_call(node, aten.mul.Tensor) and node.args[0] is r and node.args[1] is r


def _strip_weight(node: Any, hidden) -> tuple[Optional[fx.Node], float]:
    """``w``, ``convert(w)`` or ``add(convert(w), c)`` -> (w, c); (None, 0) if not a weight vector."""
    offset = 0.0
    if is_call(node, aten.add.Tensor, aten.add.Scalar) and isinstance(node.args[1], (int, float)):
        offset, node = float(node.args[1]), node.args[0]
    elif is_call(node, aten.add.Tensor) and isinstance(node.args[0], (int, float)):
        offset, node = float(node.args[0]), node.args[1]
    dt = cast_dtype(node) if isinstance(node, fx.Node) else None
    if dt is not None and dt == torch.float32:
        node = node.args[0]
    v = val(node)
    if v is None or not broadcasts_as_row(v, hidden) or not v.is_floating_point():
        return None, 0.0
    return node, offset


def match_rmsnorm(v: fx.Node) -> Optional[NormMatch]:
    """An RMSNorm over the last dim of ``v`` computed in float32, or None."""
    tv = val(v)
    if tv is None or not tv.is_floating_point():
        return None
    hidden = tv.shape[-1]
    starts = [v] if tv.dtype == torch.float32 else []
    starts += [u for u in v.users if cast_dtype(u) == torch.float32]
    for r in starts:
        m = _match_from(r, hidden, tv.dim())
        if m is not None:
            if r is not v:
                m.nodes.insert(0, r)
            return m
    return None


def _match_from(r: fx.Node, hidden, ndim: int) -> Optional[NormMatch]:
    for sq in r.users:
        if not _is_square_of(sq, r):
            continue
        mean = _single_user(sq)
        if not (is_call(mean, aten.mean.dim) and is_last_dim(mean.args[1], ndim)
                and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))):
            continue
        add_eps = _single_user(mean)
        if not is_call(add_eps, aten.add.Tensor, aten.add.Scalar):
            continue
        eps = _scalar_operand(other_operand(add_eps, mean))
        if eps is None:
            continue
        nodes = [sq, mean, add_eps]
        inv = _single_user(add_eps)
        y = None
        if is_call(inv, aten.rsqrt.default):
            nodes.append(inv)
            # 1/rms may have other readers (a returned statistic): they are kept, see _rewrite.
            y = _times(inv, r)
            ok = y is not None
        elif is_call(inv, aten.sqrt.default):
            nodes.append(inv)
            nxt = _single_user(inv)
            if is_call(nxt, aten.reciprocal.default):
                nodes.append(nxt)
                y = _times(nxt, r)
                ok = y is not None
            else:
                y = nxt
                ok = is_call(y, aten.div.Tensor) and y.args[0] is r and y.args[1] is inv
        else:
            ok = False
        if not ok:
            continue
        nodes.append(y)
        return _match_tail(nodes, eps, hidden)
    return None


def _times(inv: fx.Node, r: fx.Node) -> Optional[fx.Node]:
    """The reader of ``inv`` that is ``r * inv`` (either order), or None."""
    return next((u for u in inv.users if is_call(u, aten.mul.Tensor) and len(u.args) == 2
                 and {id(u.args[0]), id(u.args[1])} == {id(r), id(inv)}), None)


def _match_tail(nodes: list[fx.Node], eps: Union[float, fx.Node], hidden) -> NormMatch:
    """Extend past ``y = r * rsqrt(..)``: [cast mid] [* weight] [cast out], as far as it is exact."""
    m = NormMatch(nodes=nodes, eps=eps, weight=None, weight_offset=0.0, mid_dtype=None)
    cur = nodes[-1]
    nxt = _single_user(cur)
    dt = cast_dtype(nxt) if nxt is not None else None
    if dt is not None:
        m.mid_dtype = dt
        nodes.append(nxt)
        cur, nxt = nxt, _single_user(nxt)
    if is_call(nxt, aten.mul.Tensor):
        w, offset = _strip_weight(other_operand(nxt, cur), hidden)
        if w is not None and val(nxt).shape == val(cur).shape:
            m.weight, m.weight_offset = w, offset
            nodes.append(nxt)
            cur, nxt = nxt, _single_user(nxt)
    # A cast after the weight only if the product was float32: then the cast is the one rounding
    # the contract does. A bf16 product already rounded; a later widening cast must stay outside.
    if m.mid_dtype is None and val(cur).dtype == torch.float32 and nxt is not None:
        dt = cast_dtype(nxt)
        if dt is not None:
            nodes.append(nxt)
    if m.mid_dtype is not None and m.weight is None:
        # "cast only": y.to(mid) is the output itself, not a mid step.
        m.mid_dtype = None
    return m


# ----------------------------------------------------------------------------- site matcher


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
    return m


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
            and _scalar_operand(other_operand(u, cur)) is not None):
        # Gemma's embedding (* embed_scale, a 0-d buffer), Granite's residual_multiplier and
        # embedding_multiplier (Python floats, 0-d inputs under dynamic=True). Only before any
        # add, where the op applies it (to the reduced sum, in fp32); a cast before it is fine.
        return dataclasses.replace(st, chain=chain, scale=_scalar_operand(other_operand(u, cur)))
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


# ----------------------------------------------------------------------------- pass


#: Rows reserved at compile time at least: a later, larger T grows the workspace at run time.
MIN_RESERVED_ROWS = 8192


def _reserve_workspace(group: str, tx: torch.Tensor, residual_dtype: torch.dtype, out_dtype: torch.dtype,
                       ring: bool = False) -> None:
    """Allocate the symmetric workspace now (with the output ring if ``ring``), outside any CUDA-graph pool.

    Run-time allocation would land in the pool of cudagraph trees' warm-up under
    mode="reduce-overhead" (which rejects live allocations it does not own). Collective: every
    rank compiles the same graph.
    """
    symm = symm_kernels()
    rows = 1
    for d in tx.shape[:-1]:
        hint = d if isinstance(d, int) else d.node.hint
        rows *= int(hint) if hint is not None else MIN_RESERVED_ROWS
    symm.reserve(group, tx.dtype, int(tx.shape[-1]), max(rows, MIN_RESERVED_ROWS), out_dtype=out_dtype,
                 residual_dtype=residual_dtype, device=tx.device, ring=ring)


def _static_rows(tx: torch.Tensor) -> Optional[int]:
    """The token count if it is static, else None."""
    rows = 1
    for d in tx.shape[:-1]:
        if not isinstance(d, int):
            return None
        rows *= d
    return rows


def _reserve_oneshot(group: str, tx: torch.Tensor, tres_in: Optional[torch.Tensor]) -> None:
    """The one-shot kernel's buffers, outside any CUDA-graph pool (collective, like the above)."""
    from weave_compile.kernels import oneshot

    hidden = int(tx.shape[-1])
    rows = oneshot.reserve_rows(hidden, tx.dtype, _static_rows(tx) or 1)
    res_dtype = tres_in.dtype if tres_in is not None else tx.dtype
    oneshot.reserve(group, tx.dtype, res_dtype, hidden, rows, tx.device)


class FuseAllReduceRMSNormPass(WeavePass):
    """Rewrite every matchable site, in graph order; returns a report of every all_reduce."""

    def __init__(self, config: TokenWeaveConfig):
        self.config = config
        self.matched_count = 0

    def __call__(self, graph: fx.Graph) -> list[SiteReport]:
        fake_mode = fake_mode_of(graph)
        sites = []
        for ar in [n for n in graph.nodes if is_call(n, ALL_REDUCE_TARGETS)]:
            site = SiteReport(node=ar.name, group=str(ar.args[2]), fused=False, reason="")
            sites.append(site)
            try:
                if group_size(ar.args[2]) == 1:
                    raise NoMatch("group of size 1: nothing to reduce")
                if not self.config.fuse:
                    raise NoMatch("fuse disabled by option")
                m = match_site(ar)
                self._rewrite(graph, m, site, fake_mode)
            except NoMatch as e:
                site.reason = str(e)
                log.info("tokenweave: %s not fused: %s", ar.name, e)
        return sites

    def _rewrite(self, graph: fx.Graph, m: SiteMatch, site: SiteReport, fake_mode) -> None:
        order = {n: i for i, n in enumerate(graph.nodes)}
        res_node, norm_out = m.residual_out, m.norm.out
        anchor = res_node
        # The op's inputs that may be defined after the residual add (the weight; an eps or a
        # scale input's conversion, dynamic=True): the op goes after the last of them.
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
        x = m.all_reduce.args[0]
        tx = val(x)
        tres, tout = val(res_node), val(norm_out)
        group = m.all_reduce.args[2]
        eps_node = m.norm.eps if isinstance(m.norm.eps, fx.Node) else None
        if m.scale is not None:
            kernel, kernel_reason = "reference", "scaled site: the symmetric-memory kernels take no scale"
        else:
            rows = _static_rows(tx)
            # Whether the split will run here (the split pass decides later; its threshold is known).
            split = self.config.split and (rows is None or rows >= self.config.split_threshold)
            kernel, kernel_reason = select_kernel(self.config.kernel, tx.device, (tx.dtype, tres.dtype, tout.dtype),
                                                  tx.shape[-1], group, num_tokens=rows, split=split)
            if kernel != "reference" and eps_node is not None and val(eps_node).device.type != "cpu":
                kernel, kernel_reason = "reference", "eps is a device tensor: the kernels read it on the host"
            if kernel in ("p2p", "multimem"):
                _reserve_workspace(group, tx, tres.dtype, tout.dtype, ring=self.config.output_in_place)
            elif kernel == "oneshot":
                _reserve_oneshot(group, tx, val(m.residual) if m.residual is not None else None)
        w = m.norm.weight
        insert_after = anchor
        scale = m.scale
        if isinstance(scale, float):  # the op takes a 0-d tensor
            with graph.inserting_after(insert_after):
                scale = graph.call_function(aten.scalar_tensor.default, (m.scale,),
                                            {"dtype": torch.float32, "device": tx.device})
            with fake_mode:
                scale.meta["val"] = torch.scalar_tensor(m.scale, dtype=torch.float32, device=tx.device)
            insert_after = scale
        residual = m.residual
        if m.more_residuals:
            insert_after, residual = _sum_addends(graph, fake_mode, m, insert_after)
        # Replay the chain's views on x so the op sees the residual's shape.
        xin = x
        for v in m.views:
            with graph.inserting_after(insert_after):
                xin = call_with_meta(graph, fake_mode, v.target, (xin, *v.args[1:]))
            insert_after = xin
        with graph.inserting_after(insert_after):
            fused = call_named(
                graph, fake_mode, FUSED_OP, x=xin, residual=residual, bias=m.bias, weight=w,
                eps=0.0 if eps_node is not None else m.norm.eps, group_name=group, residual_dtype=tres.dtype,
                out_dtype=tout.dtype, mid_dtype=m.norm.mid_dtype, weight_offset=m.norm.weight_offset,
                residual_in_sharded=False, residual_out_sharded=False, kernel=kernel,
                comm_ctas=self.config.comm_ctas, scale=scale, eps_tensor=eps_node,
            )
        with graph.inserting_after(fused):
            normed = getitem_with_meta(graph, fused, 0)
        with graph.inserting_after(normed):
            residual_out = getitem_with_meta(graph, fused, 1)
        _serve_extra_readers(graph, fake_mode, m, residual_out)
        norm_out.replace_all_uses_with(normed)
        res_node.replace_all_uses_with(residual_out)
        erase_if_dead(graph, [m.all_reduce, *m.chain, *m.norm.nodes])
        kept = [n.name for n in m.norm.nodes if n.users and n is not norm_out]
        self.matched_count += 1
        site.fused = True
        site.reason = m.describe() + (f" (norm intermediates kept for other users: {kept})" if kept else "")
        site.kernel, site.kernel_reason = kernel, kernel_reason
        site.residual = "full"
        fused.meta[SITE_KEY] = m.all_reduce.name
        log.info("tokenweave: fused %s: %s, kernel %s", m.all_reduce.name, site.reason, kernel)


def _sum_addends(graph: fx.Graph, fake_mode, m: SiteMatch, insert_after: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The residual and the further addends, each through the chain's views after it, summed in graph order."""
    total = None
    for node, k in [(m.residual, m.residual_views)] + m.more_residuals:
        for v in m.views[k:]:
            with graph.inserting_after(insert_after):
                node = call_with_meta(graph, fake_mode, v.target, (node, *v.args[1:]))
            insert_after = node
        if total is not None:
            with graph.inserting_after(insert_after):
                node = call_with_meta(graph, fake_mode, aten.add.Tensor, (total, node))
            insert_after = node
        total = node
    return insert_after, total


def _serve_extra_readers(graph: fx.Graph, fake_mode, m: SiteMatch, residual_out: fx.Node) -> None:
    """Point the readers of inner chain nodes at ``residual_out``, cast and viewed back to their value.

    :func:`_extra_readers` proved that only views and widening casts lie between each such node
    and ``residual_out``: narrowing back is exact, and the view restores the node's shape.
    """
    insert_after = residual_out
    tres = val(residual_out)
    for c, readers in m.extra_readers:
        tc = val(c)
        rec = residual_out
        if tc.dtype != tres.dtype:
            with graph.inserting_after(insert_after):
                rec = call_with_meta(graph, fake_mode, prims.convert_element_type.default, (rec, tc.dtype))
            insert_after = rec
        if not (tc.dim() == tres.dim() and all(statically_known_true(a == b) for a, b in zip(tc.shape, tres.shape))):
            shape = []
            for d in _shape_of(m, c):
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


def _shape_of(m: SiteMatch, c: fx.Node) -> list:
    """``c``'s shape as view arguments: the last view's size list before it, else the all_reduce
    input's sizes (ints, or ``(x, dim)`` for a symbolic one)."""
    idx = m.chain.index(c)
    views = [v for v in m.chain[:idx + 1] if v in m.views]
    if views:
        return list(views[-1].args[1])
    x = m.all_reduce.args[0]
    return [(x, i) if isinstance(d, torch.SymInt) else int(d) for i, d in enumerate(val(x).shape)]
