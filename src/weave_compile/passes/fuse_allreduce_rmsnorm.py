"""Fuse ``all_reduce -> (+bias) -> (+residual) -> RMSNorm`` into ``weave::allreduce_add_rmsnorm``.

Matches (post-grad ATen; each ``[...]`` optional, views/widening casts allowed between)::

    ar   = _c10d_functional.all_reduce(x, "sum", group)     # dist.all_reduce, funcol, DTensor
    y    = _c10d_functional.wait_tensor(ar)
    [y   = aten.copy(x, y)]                                 # in-place all_reduce write-back
    [y   = mul(y, s)]                                       # s a 0-d tensor (Gemma's embed_scale)
    [y   = add(y, bias[H])]  [y = add(residual, y)]          # either order, either operand order
    r    = convert_element_type(y, float32)                  # absent when y is float32
    v    = mean(pow(r, 2) | mul(r, r), [-1], keepdim=True)
    s    = rsqrt(add(v, eps)) | reciprocal(sqrt(...))
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
free); the all_reduce result itself used elsewhere blocks the rewrite.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
import torch.fx as fx

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
    val,
)

log = logging.getLogger(__name__)

#: ``node.meta`` key of a fused op: the name of the all_reduce node it replaced (the site's id
#: in the report); the split pass copies it onto each half's op.
SITE_KEY = "weave_site"
_MAX_CHAIN = 16  # views/casts/adds between the all_reduce and the norm; a real model has <= 4


class NoMatch(Exception):
    """Why a site was left alone (the message goes to the explain report)."""


@dataclasses.dataclass
class NormMatch:
    nodes: list[fx.Node]  # every node of the norm, output last
    eps: float
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
        return " ".join(parts)


@dataclasses.dataclass
class SiteMatch:
    all_reduce: fx.Node
    chain: list[fx.Node]  # wait .. residual_out, in order
    views: list[fx.Node]
    residual: Optional[fx.Node]
    bias: Optional[fx.Node]
    norm: NormMatch
    scale: Optional[fx.Node] = None  # 0-d tensor multiplying the reduced sum

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
            parts.append("+residual")
        return " ".join(parts) + " -> " + self.norm.describe()


# ----------------------------------------------------------------------------- norm matcher


def _single_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _is_scalar_tensor(o: Any) -> bool:
    t = val(o)
    return t is not None and t.dim() == 0 and t.is_floating_point()


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
        eps = other_operand(add_eps, mean)
        if not isinstance(eps, (int, float)):
            continue
        nodes = [sq, mean, add_eps]
        inv = _single_user(add_eps)
        y = None
        if is_call(inv, aten.rsqrt.default):
            nodes.append(inv)
            y = _single_user(inv)
            ok = is_call(y, aten.mul.Tensor) and other_operand(y, inv) is r
        elif is_call(inv, aten.sqrt.default):
            nodes.append(inv)
            nxt = _single_user(inv)
            if is_call(nxt, aten.reciprocal.default):
                nodes.append(nxt)
                y = _single_user(nxt)
                ok = is_call(y, aten.mul.Tensor) and other_operand(y, nxt) is r
            else:
                y = nxt
                ok = is_call(y, aten.div.Tensor) and y.args[0] is r and y.args[1] is inv
        else:
            ok = False
        if not ok:
            continue
        nodes.append(y)
        return _match_tail(nodes, float(eps), hidden)
    return None


def _match_tail(nodes: list[fx.Node], eps: float, hidden) -> NormMatch:
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
    hidden = tx.shape[-1]
    chain, views = [wait], []
    residual = bias = scale = None
    cur, dtype = wait, tx.dtype
    for _ in range(_MAX_CHAIN):
        norm = match_rmsnorm(cur)
        if norm is not None:
            return SiteMatch(ar, chain, views, residual, bias, norm, scale)
        u = _single_user(cur)
        if u is None:
            uses = ", ".join(str(n.target) for n in cur.users) or "nothing"
            raise NoMatch(f"all_reduce result feeds {len(cur.users)} users ({uses}), no RMSNorm after it")
        if u.op != "call_function":
            raise NoMatch(f"all_reduce result reaches the graph {u.op} before any RMSNorm")
        tu = val(u)
        if tu is None:
            raise NoMatch(f"no shape information on {u.name}")
        if is_call(u, aten.copy.default) and u.args[1] is cur and val(u.args[0]).shape == tu.shape:
            pass  # functionalized in-place all_reduce: copy of the result into the input's slot
        elif is_call(u, VIEW_TARGETS) and tu.shape[-1] == hidden:
            views.append(u)
        elif (is_call(u, aten.mul.Tensor) and len(u.args) == 2 and not u.kwargs and scale is None
              and residual is None and bias is None and tu.dtype == dtype
              and _is_scalar_tensor(other_operand(u, cur))):
            # Gemma's embedding: all_reduce -> * embed_scale (0-d buffer) -> layer 0's norm.
            # Only before any add or cast, where the op applies it (to the reduced sum, in fp32).
            # Python-number factors stay unmatched: nothing here needs them.
            scale = other_operand(u, cur)
        elif cast_dtype(u) is not None and torch.promote_types(dtype, cast_dtype(u)) == cast_dtype(u):
            dtype = cast_dtype(u)
        elif is_call(u, aten.add.Tensor) and "alpha" not in u.kwargs and len(u.args) == 2:
            other = other_operand(u, cur)
            to = val(other)
            if to is None:
                raise NoMatch(f"all_reduce result plus a non-tensor ({other!r})")
            if to.shape == tu.shape and residual is None:
                residual = other
            elif broadcasts_as_row(to, hidden) and bias is None:
                bias = other
            else:
                raise NoMatch(f"add of a {list(to.shape)} tensor after the all_reduce")
            dtype = tu.dtype
        else:
            raise NoMatch(f"all_reduce result feeds {u.target} before any RMSNorm")
        chain.append(u)
        cur = u
    raise NoMatch("no RMSNorm within the ops after the all_reduce")


# ----------------------------------------------------------------------------- pass


#: Rows reserved at compile time at least: a later, larger T grows the workspace at run time.
MIN_RESERVED_ROWS = 8192


def _reserve_workspace(group: str, tx: torch.Tensor, residual_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Allocate the symmetric workspace now, outside any CUDA-graph pool.

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
                 residual_dtype=residual_dtype, device=tx.device)


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
        w = m.norm.weight
        if w is not None and order[w] > order[anchor]:
            anchor = w
        first_use = min((order[u] for n in (res_node, norm_out) for u in n.users
                         if u not in m.norm.nodes), default=len(order))
        if order[anchor] >= first_use:
            raise NoMatch("the norm weight is computed after the residual is first used")
        x = m.all_reduce.args[0]
        tx = val(x)
        tres, tout = val(res_node), val(norm_out)
        group = m.all_reduce.args[2]
        if m.scale is not None:
            kernel, kernel_reason = "reference", "scaled site: the symmetric-memory kernels take no scale"
        else:
            kernel, kernel_reason = select_kernel(self.config.kernel, tx.device, (tx.dtype, tres.dtype, tout.dtype),
                                                  tx.shape[-1], group)
            if kernel in ("p2p", "multimem"):
                _reserve_workspace(group, tx, tres.dtype, tout.dtype)
        # Replay the chain's views on x so the op sees the residual's shape.
        xin = x
        insert_after = anchor
        for v in m.views:
            with graph.inserting_after(insert_after):
                xin = call_with_meta(graph, fake_mode, v.target, (xin, *v.args[1:]))
            insert_after = xin
        with graph.inserting_after(insert_after):
            fused = call_named(
                graph, fake_mode, FUSED_OP, x=xin, residual=m.residual, bias=m.bias, weight=w, eps=m.norm.eps,
                group_name=group, residual_dtype=tres.dtype, out_dtype=tout.dtype, mid_dtype=m.norm.mid_dtype,
                weight_offset=m.norm.weight_offset, residual_in_sharded=False, residual_out_sharded=False,
                kernel=kernel, comm_ctas=self.config.comm_ctas, scale=m.scale,
            )
        with graph.inserting_after(fused):
            normed = getitem_with_meta(graph, fused, 0)
        with graph.inserting_after(normed):
            residual_out = getitem_with_meta(graph, fused, 1)
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
