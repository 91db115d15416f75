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

from weave_compile.ops import FUSED_OP, START_OP, WAIT_OP

from .base import WeavePass
from .fuse_allreduce_rmsnorm import SITE_KEY
from .graph_utils import fake_mode_of, is_call, named_args, replace_args, set_fake_val, val

log = logging.getLogger(__name__)

_FUSED = (FUSED_OP, START_OP)


def _residual_item(fused: fx.Node):
    items = [u for u in fused.users if is_call(u, operator.getitem) and u.args[1] == 1]
    return items[0] if items else None


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    ta, tb = val(a), val(b)
    return ta.dim() == tb.dim() and all(statically_known_true(p == q) for p, q in zip(ta.shape, tb.shape))


def _reads_as_residual_only(reader: fx.Node, item: fx.Node, producer: fx.Node) -> bool:
    """``reader`` is a fused op of the producer's rows that reads ``item`` as its residual, only."""
    if not is_call(reader, *_FUSED):
        return False
    args = named_args(reader)
    others = [v for k, v in args.items() if k != "residual"]
    return (args["residual"] is item and item not in others
            and _same_rows(args["x"], named_args(producer)["x"]))


class ShardResidualPass(WeavePass):
    """Returns each fused site's residual label (site id -> "full" / "in sharded" / ...)."""

    def __call__(self, graph: fx.Graph) -> dict[str, str]:
        fused_nodes = [n for n in graph.nodes if is_call(n, *_FUSED)]
        kept_full: dict[fx.Node, str] = {}
        changed: set[fx.Node] = set()
        for fused in fused_nodes:
            item = _residual_item(fused)
            readers = [u for u in item.users if not is_call(u, WAIT_OP)] if item is not None else []
            if not all(_reads_as_residual_only(r, item, fused) for r in readers):
                others = sorted({str(r.target) for r in readers if not is_call(r, *_FUSED)})
                kept_full[fused] = ", ".join(others) or "a fused site of another shape"
                continue
            replace_args(fused, residual_out_sharded=True)
            changed.add(fused)
            for r in readers:
                replace_args(r, residual_in_sharded=True)
                changed.add(r)
        fake_mode = fake_mode_of(graph) if changed else None
        labels: dict[str, str] = {}
        for node in fused_nodes:
            if node in changed:  # new flags, new output shapes
                set_fake_val(node, fake_mode)
                for u in node.users:
                    if is_call(u, operator.getitem):
                        set_fake_val(u, fake_mode)
            site = node.meta.get(SITE_KEY)
            if site is not None:
                args = named_args(node)
                labels[site] = _label(args["residual_in_sharded"], args["residual_out_sharded"],
                                      kept_full.get(node))
        if changed:
            log.info("tokenweave: residual sharded across %d fused sites", len(changed))
        return labels


def _label(in_sharded: bool, out_sharded: bool, full_reason) -> str:
    flags = [name for name, on in (("in", in_sharded), ("out", out_sharded)) if on]
    label = "+".join(flags) + " sharded" if flags else "full"
    if full_reason is not None:
        label = ("in sharded, out " if in_sharded else "") + f"full (read by {full_reason})"
    return label
