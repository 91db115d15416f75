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

from weave_compile.report import GraphReport

import torch

from .fuse_allreduce_rmsnorm import FUSED_OP
from .graph_utils import fake_mode_of, is_call, val

log = logging.getLogger(__name__)

_FUSED = (FUSED_OP, torch.ops.weave.allreduce_add_rmsnorm_start.default)
_WAIT = torch.ops.weave.comm_wait.default

# Argument positions in weave::allreduce_add_rmsnorm's schema.
_X, _RESIDUAL, _IN_SHARDED, _OUT_SHARDED = 0, 1, 10, 11


def _residual_item(fused: fx.Node):
    items = [u for u in fused.users if is_call(u, operator.getitem) and u.args[1] == 1]
    return items[0] if items else None


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    ta, tb = val(a), val(b)
    return ta.dim() == tb.dim() and all(statically_known_true(p == q) for p, q in zip(ta.shape, tb.shape))


class ShardResidualPass:
    def __call__(self, graph: fx.Graph, report: GraphReport) -> None:
        fused_nodes = [n for n in graph.nodes if is_call(n, *_FUSED)]
        kept_full: dict[fx.Node, str] = {}
        changed: set[fx.Node] = set()
        for fused in fused_nodes:
            item = _residual_item(fused)
            readers = [u for u in item.users if not is_call(u, _WAIT)] if item is not None else []
            ok = all(
                is_call(r, *_FUSED) and r.args[_RESIDUAL] is item
                and item not in (r.args[:_RESIDUAL] + r.args[_RESIDUAL + 1:])
                and _same_rows(r.args[_X], fused.args[_X])
                for r in readers
            )
            if not ok:
                others = sorted({str(r.target) for r in readers if not is_call(r, *_FUSED)})
                kept_full[fused] = ", ".join(others) or "a fused site of another shape"
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
