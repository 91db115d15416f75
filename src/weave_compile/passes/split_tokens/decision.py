"""Whether the token split runs on a graph: decided once, before the fuse pass.

The pass manager calls :func:`decide` on the post-grad graph as it arrives and hands the
:class:`SplitDecision` to the fuse pass (``auto`` chooses each site's design for a split or an
unsplit layer) and to the split rewrite, which applies it. ``split_threshold`` is compared here
and nowhere else (:func:`below_threshold` serves the Dynamo-graph pre-pass too).

The split runs where the option is on, the graph's sites are all_reduce sites (a graph with
sequence-parallel collectives is declined: :data:`SEQUENCE_PARALLEL_DECLINED`), and its token count
(batch x sequence: the rows of the first all_reduce's input) reaches ``split_threshold``. A
symbolic count gets a guard on that comparison: one graph below the threshold, one above, no
recompile per length.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_bool

from ..graph_utils import ALL_REDUCE_TARGETS, REDUCE_SCATTER_TARGETS, is_call, val
from .options import SplitOptions
from .values import prod

#: Why a graph with sequence-parallel sites is not split. Each half's fused op would own 1/N of that
#: half's rows on every rank, but the model's residual shard is one contiguous piece of every
#: sequence per rank: a token half is not one shard per rank, and re-laying the residual out per
#: half would add a copy and a collective at every site.
SEQUENCE_PARALLEL_DECLINED = ("sequence-parallel sites: the model shards each sequence across the ranks, so a "
                              "token half is not one shard per rank (re-laying the residual out per half would "
                              "add a copy and a collective at every site)")


@dataclasses.dataclass(frozen=True)
class SplitDecision:
    """Whether the split runs on one graph, and why not where it does not."""

    applies: bool
    reason: str = ""  # why not, when it does not apply


def below_threshold(rows, options: SplitOptions) -> Optional[str]:
    """Why ``rows`` tokens (an int, or a SymInt: then guarded) are too few to split, or None."""
    threshold = options.split_threshold
    if isinstance(rows, torch.SymInt):
        # One graph per side of the threshold: Dynamo checks this guard before every call.
        return None if guard_bool(rows >= threshold) else f"fewer than split_threshold={threshold} tokens (guarded)"
    return None if rows >= threshold else f"{rows} tokens < split_threshold={threshold}"


def decide(graph: fx.Graph, options: SplitOptions) -> SplitDecision:
    """The split's decision for ``graph`` (see the module doc)."""
    if not options.split:
        return SplitDecision(False, "split disabled by option")
    if any(is_call(n, REDUCE_SCATTER_TARGETS) for n in graph.nodes):
        return SplitDecision(False, SEQUENCE_PARALLEL_DECLINED)
    first = next((n for n in graph.nodes if is_call(n, ALL_REDUCE_TARGETS)), None)
    x = val(first.args[0]) if first is not None else None
    if x is None:
        return SplitDecision(False, "no all_reduce site")
    if x.dim() < 2:
        return SplitDecision(False, "the all_reduce input has no token dimension")
    why = below_threshold(prod(x.shape[:-1]), options)
    return SplitDecision(why is None, why or "")
