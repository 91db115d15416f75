"""Keep the residual stream sharded by token rows between consecutive fused sites.

Matches::

    normed_a, res_a = weave.allreduce_add_rmsnorm(x_a, res_prev, ...)
    normed_b, res_b = weave.allreduce_add_rmsnorm(x_b, res_a, ...)   # res_a's only reader

Rewrite to the same ops with ``residual_out_sharded=True`` on the producer and
``residual_in_sharded=True`` on the consumer: ``res_a`` becomes this rank's ``[ceil(T/N), H]``
rows, which the next site reads directly. As in TokenWeave each rank owns the same rows every
layer, so nothing is gathered, and each rank adds and stores 1/N of the residual.

The split pass's per-half ``weave.allreduce_add_rmsnorm_start`` ops are treated the same (their
``weave.comm_wait`` reads only order and hold memory, they do not use the values).

A residual read by anything else (the model's output, a non-fused op) stays full: the producing
op gathers it. A residual nobody reads (the last layer) is left sharded, which skips its gather.
"""

from __future__ import annotations

import logging
import operator

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from weave_compile.agreement import group_ranks
from weave_compile.report import GraphReport

import torch

from .fuse_allreduce_rmsnorm import FUSED_OP
from .graph_utils import fake_mode_of, is_call, val

log = logging.getLogger(__name__)

_FUSED = (FUSED_OP, torch.ops.weave.allreduce_add_rmsnorm_start.default)
_WAIT = torch.ops.weave.comm_wait.default

# Argument positions in weave::allreduce_add_rmsnorm's schema.
_X, _RESIDUAL, _GROUP, _IN_SHARDED, _OUT_SHARDED = 0, 1, 5, 10, 11


def _residual_item(fused: fx.Node):
    items = [u for u in fused.users if is_call(u, operator.getitem) and u.args[1] == 1]
    return items[0] if items else None


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    ta, tb = val(a), val(b)
    return ta.dim() == tb.dim() and all(statically_known_true(p == q) for p, q in zip(ta.shape, tb.shape))


def _why_not_sharded(fused: fx.Node, item, readers: list[fx.Node]):
    """None when every reader provably reads this rank's rows of ``item`` as its own shard; else why not.

    A shard is rows ``[p*S, (p+1)*S)`` of the padded residual, ``p`` this rank's position in the
    group and ``S = ceil(T / N)``. The reader owns the same rows only if its group lists the same
    global ranks in the same order (so ``p`` and ``N`` agree: comparing group names is not enough,
    two names can hold the same ranks and a 2-D mesh's row and column groups share members) and
    its ``x`` has the same shape (same ``T``, hence the same ``S`` and padding). The test must give
    the same answer on every rank of the group, or ranks would disagree on whether the producer
    gathers: rank lists are the same on every member, ``p`` is not, so ``p`` is never compared alone.
    """
    if not readers:
        return None
    if item is None:
        return None
    others = sorted({str(r.target) for r in readers if not is_call(r, *_FUSED)})
    if others:
        return ", ".join(others)
    for r in readers:
        if r.args[_RESIDUAL] is not item or item in (r.args[:_RESIDUAL] + r.args[_RESIDUAL + 1:]):
            return f"{r.name} as another operand than its residual"
        if not _same_rows(r.args[_X], fused.args[_X]):
            return f"{r.name}, a fused site of another shape ({_shape(r.args[_X])} vs {_shape(fused.args[_X])})"
        mine, theirs = group_ranks(fused.args[_GROUP]), group_ranks(r.args[_GROUP])
        if mine != theirs:
            return (f"{r.name}, a fused site over ranks {list(theirs)} while this site reduces over "
                    f"{list(mine)}: the ranks own different rows there")
    return None


def _shape(node: fx.Node) -> list:
    return list(val(node).shape)


class ShardResidualPass:
    def __call__(self, graph: fx.Graph, report: GraphReport) -> None:
        fused_nodes = [n for n in graph.nodes if is_call(n, *_FUSED)]
        kept_full: dict[fx.Node, str] = {}
        changed: set[fx.Node] = set()
        for fused in fused_nodes:
            item = _residual_item(fused)
            readers = [u for u in item.users if not is_call(u, _WAIT)] if item is not None else []
            why = _why_not_sharded(fused, item, readers)
            if why is not None:
                kept_full[fused] = why
                continue
            fused.args = _with(fused.args, _OUT_SHARDED, True)
            changed.add(fused)
            for r in readers:
                r.args = _with(r.args, _IN_SHARDED, True)
                changed.add(r)
        fake_mode = fake_mode_of(graph) if changed else None
        for node in fused_nodes:
            if node in changed:  # new flags, new output shapes
                args = tuple(val(a) if isinstance(a, fx.Node) else a for a in node.args)
                with fake_mode:
                    node.meta["val"] = node.target(*args)
                for u in node.users:
                    if is_call(u, operator.getitem):
                        u.meta["val"] = node.meta["val"][u.args[1]]
            site = node.meta.get("weave_site")
            if site is not None:
                site.residual = _label(node.args[_IN_SHARDED], node.args[_OUT_SHARDED], kept_full.get(node))
        if changed:
            log.info("tokenweave: residual sharded across %d fused sites", len(changed))


def _label(in_sharded: bool, out_sharded: bool, full_reason) -> str:
    flags = [name for name, on in (("in", in_sharded), ("out", out_sharded)) if on]
    label = "+".join(flags) + " sharded" if flags else "full"
    if full_reason is not None:
        label = ("in sharded, out " if in_sharded else "") + f"full (read by {full_reason})"
    return label


def _with(args: tuple, pos: int, value) -> tuple:
    return args[:pos] + (value,) + args[pos + 1:]
