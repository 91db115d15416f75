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

A residual read by anything else (the model's output, a non-fused op, a fused site over other
ranks or of another shape) stays full: the producing op gathers it. A residual nobody reads (the last layer) is left sharded, which skips its gather.

A sequence-parallel site's op (``MODEL_SHARDED_KEY``) reads and returns the model's own shard: its
layout is the model's, and this pass leaves it and its report label alone.
"""

from __future__ import annotations

import logging
import operator

import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from weave_compile.agreement import group_ranks
from weave_compile.ops import FUSED_OPS, WAIT_OP

from .base import WeavePass
from .fuse_allreduce_rmsnorm import MODEL_SHARDED_KEY, SITE_KEY
from .graph_utils import aten, fake_mode_of, is_call, named_args, replace_args, set_fake_val, val

log = logging.getLogger(__name__)



def _residual_item(fused: fx.Node):
    items = [u for u in fused.users if is_call(u, operator.getitem) and u.args[1] == 1]
    return items[0] if items else None


def _same_rows(a: fx.Node, b: fx.Node) -> bool:
    ta, tb = val(a), val(b)
    return ta.dim() == tb.dim() and all(statically_known_true(p == q) for p, q in zip(ta.shape, tb.shape))


def _why_not_sharded(producer: fx.Node, item, readers: list[fx.Node]):
    """None when every reader provably reads this rank's rows of ``item`` as its own shard; else why not.

    A shard is rows ``[p*S, (p+1)*S)`` of the padded residual, ``p`` this rank's position in the
    group and ``S = ceil(T / N)``. The reader owns the same rows only if its group lists the same
    global ranks in the same order (so ``p`` and ``N`` agree: comparing group names is not enough,
    two names can hold the same ranks, and a 2-D mesh's row and column groups share members) and
    its ``x`` has the same shape (same ``T``, hence the same ``S`` and padding). The answer must be
    the same on every rank of the group, or ranks would disagree on whether the producer gathers:
    the rank lists are the same on every member, ``p`` is not, so ``p`` is never compared alone.
    """
    others = sorted({str(r.target) for r in readers if not is_call(r, *FUSED_OPS)})
    if others:
        if any(is_call(r, aten.var_mean.correction) for r in readers):  # e.g. GPT-NeoX: two norms of one sum
            return f"another LayerNorm: {', '.join(others)}; the fused op computes one norm"
        return ", ".join(others)
    mine = named_args(producer)
    for r in readers:
        args = named_args(r)
        if args["residual"] is not item or item in [v for k, v in args.items() if k != "residual"]:
            return f"{r.name} as another operand than its residual"
        if not _same_rows(args["x"], mine["x"]):
            return f"{r.name}, a fused site of another shape ({_shape(args['x'])} vs {_shape(mine['x'])})"
        ours, theirs = group_ranks(mine["group_name"]), group_ranks(args["group_name"])
        if ours != theirs:
            return (f"{r.name}, a fused site over ranks {list(theirs)} while this site reduces over "
                    f"{list(ours)}: the ranks own different rows there")
    return None


def _shape(node: fx.Node) -> list:
    return list(val(node).shape)


class ShardResidualPass(WeavePass):
    """Returns each fused site's residual label (site id -> "full" / "in sharded" / ...)."""

    def __call__(self, graph: fx.Graph) -> dict[str, str]:
        fused_nodes = [n for n in graph.nodes if is_call(n, *FUSED_OPS) and not n.meta.get(MODEL_SHARDED_KEY)]
        kept_full: dict[fx.Node, str] = {}
        changed: set[fx.Node] = set()
        for fused in fused_nodes:
            item = _residual_item(fused)
            readers = [u for u in item.users if not is_call(u, WAIT_OP)] if item is not None else []
            why = _why_not_sharded(fused, item, readers)
            if why is not None:
                kept_full[fused] = why
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
