"""Drop the identity clones between a reduction and the next norm: eval-mode dropout.

``F.dropout(x, p, training=False)`` and ``nn.Dropout`` in eval reach the post-grad graph as
``aten.clone(x)`` (checked with torch 2.13 and transformers 5.25: StarCoder2's embedding and
residual dropout, GPT-NeoX's post-attention and post-MLP dropout). A clone has its input's values,
but the site walk (:mod:`.allreduce_site`) and the merge pass (:mod:`.merge_all_reduces`) take only
the ops they know, so every such site was left as written ("all_reduce result feeds
aten.clone.default before any RMSNorm"). :func:`drop_identity_clones` replaces those clones by
their inputs before the merge and fuse passes.

Only clones that are the identity in a functional graph, and only where a site can start:

- no kwargs but ``memory_format=torch.preserve_format`` (another layout is a real copy into it);
- the input is computed in the graph (a graph input may be written by a ``copy_`` at the end, and
  then a clone taken before that write is not the same value);
- the clone is not a graph output (AOT records which outputs alias inputs or each other: a clone
  is a fresh buffer, its input may not be);
- reached from a sum-reduction's ``wait_tensor`` through views, casts, the write-back copy, adds,
  multiplies and other such clones (at most ``_MAX_DEPTH`` ops on): the ops a site or a parallel
  block's add tree is made of. Clones elsewhere are left as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import REDUCING_TARGETS, VIEW_TARGETS, WAIT_TARGETS, aten, cast_dtype, is_call

_MAX_DEPTH = 16  # as the site walk's chain (allreduce_site._MAX_CHAIN)
_THROUGH = (aten.add.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.copy.default, *VIEW_TARGETS)


def _identity_clone(node: fx.Node) -> bool:
    if not is_call(node, aten.clone.default) or len(node.args) != 1:
        return False
    if any(k != "memory_format" or v is not torch.preserve_format for k, v in node.kwargs.items()):
        return False
    src = node.args[0]
    return (isinstance(src, fx.Node) and src.op == "call_function"
            and all(u.op != "output" for u in node.users))


def drop_identity_clones(graph: fx.Graph) -> int:
    """Replace each identity clone (module doc) after a sum-reduction by its input; returns how many."""
    clones: list[fx.Node] = []
    seen: set[fx.Node] = set()
    frontier = [w for w in graph.nodes if is_call(w, WAIT_TARGETS) and is_call(w.args[0], REDUCING_TARGETS)
                and w.args[0].args[1] == "sum"]
    for _ in range(_MAX_DEPTH):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                if _identity_clone(u):
                    clones.append(u)
                elif not (is_call(u, *_THROUGH) or cast_dtype(u) is not None):
                    continue
                nxt.append(u)
        frontier = nxt
    for c in clones:
        c.replace_all_uses_with(c.args[0])
        graph.erase_node(c)
    return len(clones)
