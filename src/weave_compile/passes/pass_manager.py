"""Runs the tokenweave passes on Inductor's post-grad graph, in this fixed order:

0. ``merge`` (:mod:`.merge_all_reduces`): ``all_reduce(a) + all_reduce(b)`` over one group becomes
   one ``all_reduce(a + b)`` (MoE routed + shared experts), so that the fuse pass sees one.
1. ``fuse``  (:mod:`.fuse_allreduce_rmsnorm`): all_reduce -> (+bias) -> (+residual) -> RMSNorm
   becomes one ``weave::allreduce_add_rmsnorm`` op.
2. ``split`` (:mod:`.split_tokens`): token prefix/suffix halves, their fused communication on a
   second stream, TokenWeave's interleaved schedule.
3. ``shard`` (:mod:`.shard_residual`): residuals passed only between fused sites stay sharded.

Split runs after fuse because fused sites delimit its segments; shard runs last because it
rewrites fused ops only, and per half after a split (each half's residual has its own rows). The manager is an Inductor
``CustomGraphPass``: its ``uuid()`` hashes every pass's source and the config, so Inductor's
FX graph cache never serves a graph compiled by other passes or options.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import sys

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from weave_compile import report as report_mod
from weave_compile.config import TokenWeaveConfig

from . import fuse_allreduce_rmsnorm, graph_utils, merge_all_reduces, shard_residual, split_tokens

log = logging.getLogger(__name__)


class WeavePassManager(CustomGraphPass):
    def __init__(self, config: TokenWeaveConfig, compiler: str = "inductor"):
        self.config = config
        self.compiler = compiler
        self.graph_reports: list[report_mod.GraphReport] = []

    def __call__(self, graph: fx.Graph) -> None:
        report = report_mod.new_graph(self.compiler)
        self.graph_reports.append(report)
        before = _count_ops(graph)
        merges = merge_all_reduces.MergeAllReducesPass(self.config)(graph)
        fuse_allreduce_rmsnorm.FuseAllReduceRMSNormPass(self.config)(graph, report)
        merge_all_reduces.annotate(report, merges)
        split_tokens.SplitTokensPass(self.config)(graph, report)
        if self.config.shard_residual:
            shard_residual.ShardResidualPass()(graph, report)
        graph.lint()
        after = _count_ops(graph)
        report.op_counts = {k: (before[k], after[k]) for k in before}
        log.debug("tokenweave: post-pass graph\n%s", graph)

    def uuid(self) -> str:
        return hashlib.sha256((_sources_digest() + self.config.cache_key()).encode()).hexdigest()


def _count_ops(graph: fx.Graph) -> dict[str, int]:
    fused = fuse_allreduce_rmsnorm.FUSED_OP
    return {
        "all_reduce": sum(graph_utils.is_call(n, graph_utils.ALL_REDUCE_TARGETS) for n in graph.nodes),
        "weave.allreduce_add_rmsnorm": sum(graph_utils.is_call(n, fused) for n in graph.nodes),
        "weave.allreduce_add_rmsnorm_start": sum(graph_utils.is_call(n, split_tokens.START_OP) for n in graph.nodes),
    }


@functools.lru_cache(maxsize=1)
def _sources_digest() -> str:
    from weave_compile.kernels import allreduce_rmsnorm

    h = hashlib.sha256()
    from weave_compile import smart_split
    from weave_compile.kernels import causal_suffix_attention

    for mod in (sys.modules[__name__], merge_all_reduces, fuse_allreduce_rmsnorm, shard_residual, split_tokens, graph_utils,
                allreduce_rmsnorm, smart_split, causal_suffix_attention):
        h.update(inspect.getsource(mod).encode())
    return h.hexdigest()
