"""Split the token-wise part of the graph into a prefix (A) and a suffix (B) on two streams.

TokenWeave's coarse token split, as a post-grad FX pass that runs after ``fuse``:

1. **Where** (:mod:`.rewriter`, :mod:`.rules`, :mod:`.attention`). Every
   ``weave::allreduce_add_rmsnorm`` op becomes a pair of ops, one per half. From there the pass
   walks the graph in order and gives every op that is *token-wise* (row ``t`` of its output
   depends only on row ``t`` of its token-carrying inputs) a copy per half: GEMMs with the token
   rows as M, pointwise ops (broadcast operands that carry the token dimension, e.g. rotary
   ``cos``/``sin``, are sliced), views/permutes/expands (the token dimension is tracked through
   them), reductions over other dimensions, embedding/index lookups, unfused collectives. Causal
   self-attention, the one op that mixes tokens, becomes plain causal attention over A's own
   keys for A, and ``weave::causal_suffix_attention`` (B's queries over A's keys and, causally,
   its own) for B. Any other op that reads a split value is a *barrier*: it gets the halves concatenated
   back and runs whole (recorded in explain()), so the result is never wrong, only less overlapped.
2. **When** (:mod:`.decision`). Only where batch x tokens >= ``split_threshold``. For a symbolic
   token count the decision adds a guard on that comparison (one graph below, one above; no
   recompile per length).
3. **How much** (:mod:`.plan`). The prefix length comes from :mod:`.smart_split`.
4. **Streams** (:mod:`.schedule`). Each half's fused op runs on the comm stream
   (``weave::allreduce_add_rmsnorm_start`` + ``weave::comm_wait``), in TokenWeave's interleaved order.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_bool

from weave_compile.config import TokenWeaveConfig
from weave_compile.ops import FUSED_OP, START_OP, WAIT_OP
from weave_compile.report import SplitSummary

from ..base import WeavePass
from ..graph_utils import is_call, named_args, val
from .decision import SplitDecision
from .rewriter import Rewriter
from .values import NotSplit, batch_split

log = logging.getLogger(__name__)

__all__ = ["START_OP", "WAIT_OP", "SplitSummary", "SplitTokensPass"]


class SplitTokensPass(WeavePass):
    """Returns what it did to the graph (a :class:`SplitSummary`)."""

    WHOLE_PACKAGE = True

    def __init__(self, config: TokenWeaveConfig):
        self.config = config

    def __call__(self, graph: fx.Graph, decision: SplitDecision) -> SplitSummary:
        """Apply ``decision`` (:func:`.decision.decide`, made before the fuse pass) to ``graph``."""
        summary = SplitSummary()
        fused = [n for n in graph.nodes if is_call(n, FUSED_OP)]
        why = decision.reason if not decision.applies else self._why_not(fused)
        if why:
            summary.reason = why
            log.info("tokenweave: token split not applied: %s", why)
            return summary
        try:
            Rewriter(graph, self.config, fused, summary).run()
        except NotSplit as e:  # raised before the graph is touched
            summary.reason = str(e)
            log.info("tokenweave: token split not applied: %s", e)
        return summary

    def _why_not(self, fused: list[fx.Node]) -> Optional[str]:
        """Why a graph the decision splits has nothing to split after all, or None."""
        if not fused:
            return "no fused AllReduce-RMSNorm site"
        x = val(named_args(fused[0])["x"])
        if x.dim() < 2:
            return "fused op input has no token dimension"
        seq = x.shape[0] if batch_split(x) else x.shape[-2]  # the dimension to split
        if not (guard_bool(seq >= 2) if isinstance(seq, torch.SymInt) else seq >= 2):
            return "fewer than 2 tokens to split"
        return None
