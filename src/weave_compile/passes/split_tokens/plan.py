"""Where the token split cuts: the split dimension's two sizes, from the smart split or forced.

With a static token count the prefix length comes from :func:`weave_compile.passes.split_tokens.smart_split.plan`:
the layer time with overlap, on cuBLAS curves of this graph's GEMM shapes measured on the GPU at
compile time (the SM formula off-GPU or with ``split_cost="formula"``), its prediction recorded
for explain(). With a symbolic count the compiled code evaluates a tile-aligned near-half per call,
``((T // 2 + 63) // 64) * 64`` (:func:`weave_compile.passes.split_tokens.smart_split.near_half`; ``T // 2`` where
fewer than 128 tokens can reach the graph). A batch split (``[B, S, H]`` with ``B >= 2``) cuts
whole sequences.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_bool

from weave_compile.ops.sibling_linear import SIBLING_LINEAR

from ..graph_utils import is_call, named_args, val
from . import smart_split
from .values import NotSplit, prod, same

if TYPE_CHECKING:
    from .rewriter import Rewriter

aten = torch.ops.aten

#: Attention ops as they reach the post-grad graph, by backend.
ATTENTION_OPS = tuple(
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, name)
)


@dataclasses.dataclass
class Plan:
    """The split dimension's rows per half (ints, or nodes the compiled code evaluates)."""

    sizes: tuple[Any, Any]
    total: Any  # the whole dimension as the graph reads it: an int or a sym_size node
    tokens: str  # for the report: what is split
    split_at: str  # for the report: where and why there


def layer_shape(graph: fx.Graph, x: torch.Tensor, sites: int) -> tuple[smart_split.LayerShape, torch.dtype]:
    """The GEMMs over the token rows and the attention width in ``graph``, the fused op's row width
    (``x``, its input) and site count; the GEMMs' dtype."""
    gemm_n, gemm_k, attn_width, dtype = [], [], 0, None
    rows = prod(x.shape[:-1])
    for n in graph.nodes:
        if is_call(n, aten.mm.default, aten.addmm.default):
            a, b = (n.args[0], n.args[1]) if n.target == aten.mm.default else (n.args[1], n.args[2])
            ta, tb = val(a), val(b)
            if (ta is not None and tb is not None and same(ta.shape[0], rows)
                    and all(isinstance(d, int) for d in tb.shape)):
                gemm_k.append(int(tb.shape[0]))
                gemm_n.append(int(tb.shape[1]))
                dtype = dtype or ta.dtype
        elif is_call(n, SIBLING_LINEAR):  # merged linears: one GEMM of their stacked weights
            ta, ws = val(n.args[0]), [val(w) for w in n.args[1]]
            if (ta is not None and same(prod(ta.shape[:-1]), rows) and isinstance(ta.shape[-1], int)
                    and all(w is not None and isinstance(w.shape[0], int) for w in ws)):
                gemm_k.append(int(ta.shape[-1]))
                gemm_n.append(sum(int(w.shape[0]) for w in ws))
                dtype = dtype or ta.dtype
        elif is_call(n, *ATTENTION_OPS):
            q = val(n.args[0])
            if all(isinstance(d, int) for d in q.shape[1:]):
                attn_width += int(q.shape[1] * q.shape[3])
    hidden = x.shape[-1] if isinstance(x.shape[-1], int) else 0
    layer = smart_split.LayerShape(gemms=tuple(zip(gemm_n, gemm_k)), attn_width=attn_width, hidden=hidden,
                                   elem_bytes=x.element_size(), sites=sites)
    return layer, dtype or x.dtype


def make_plan(rw: Rewriter) -> Plan:
    """The plan for ``rw``'s graph; inserts the size arithmetic a symbolic count needs."""
    config, total = rw.config, rw.total
    anchor = named_args(rw.fused[0])["x"]
    if rw.split_dim == 0 and isinstance(total, int):
        # Batch split: whole sequences per half, attention needs no rewrite.
        b = min(max(config.split_at, 1), total - 1) if config.split_at else total // 2
        # "split a batch of 4 sequences at 2 (half)", as "split 41 tokens at 5" for tokens
        return Plan((b, total - b), total, f"a batch of {total} sequences",
                    f"{b}" + (" (forced)" if config.split_at else " (half)"))
    if isinstance(total, int):
        layer, dtype = layer_shape(rw.graph, val(anchor), len(rw.fused))
        choice = smart_split.plan(total, layer, forced=config.split_at, cost=config.split_cost, device=rw.device,
                                  dtype=dtype, num_sms=config.num_sms,
                                  group_name=named_args(rw.fused[0])["group_name"])
        return Plan((choice.at, total - choice.at), total, f"{total} tokens", choice.describe())
    # Symbolic sequence length: one graph for every length, so the split point must be an
    # expression of it that the compiled code evaluates per call. A data-dependent split
    # point (an unbacked size from a custom op) was tried: Inductor then cannot decide
    # attention's input layouts. So: the tile-aligned near-half, as size arithmetic.
    if config.split_at and not guard_bool(total > config.split_at):
        raise NotSplit(f"forced split_at={config.split_at} >= the token count (guarded)")
    graph = rw.graph
    with graph.inserting_after(anchor):
        seq_node = rw.mk(aten.sym_size.int, (anchor, rw.split_dim))
    with graph.inserting_after(seq_node):
        if config.split_at:
            s_node = config.split_at
            split_at = f"{s_node} (forced)"
        elif guard_bool(seq_node.meta["val"] >= 2 * smart_split.GRID):
            # smart_split.near_half: in [1, T - 1] for T >= 2 * GRID, which this guard keeps (the
            # default split_threshold implies it: no extra graph).
            grid = smart_split.GRID
            half = rw.mk(operator.floordiv, (seq_node, 2))
            up = rw.mk(operator.floordiv, (rw.mk(operator.add, (half, grid - 1)), grid))
            s_node = rw.mk(operator.mul, (up, grid))
            split_at = (f"run time: ((T // 2 + {grid - 1}) // {grid}) * {grid} (tile-aligned near-half; "
                        "the measured smart split needs a static T)")
        else:
            s_node = rw.mk(operator.floordiv, (seq_node, 2))
            split_at = "run time: T // 2 (equal halves; fewer than 128 tokens can reach this graph)"
    with graph.inserting_after(s_node if isinstance(s_node, fx.Node) else seq_node):
        rest = rw.mk(operator.sub, (seq_node, s_node))
    tokens = "a symbolic batch" if rw.split_dim == 0 else "a symbolic token count"
    return Plan((s_node, rest), seq_node, tokens, split_at)
