"""Runs the tokenweave passes on Inductor's post-grad graph, in this fixed order:

0. ``merge`` (:mod:`.merge_all_reduces`): ``all_reduce(a) + all_reduce(b)`` over one group becomes
   one ``all_reduce(a + b)`` (MoE routed + shared experts), so that ``fuse`` sees one. Before it,
   the identity clones after a reduction (eval-mode dropout) go (:mod:`.identity_clones`).
1. ``fuse``  (:mod:`.fuse_allreduce_rmsnorm`): all_reduce -> (+bias) -> (+residual) -> RMSNorm,
   and reduce_scatter -> (+bias) -> (+residual shard) -> RMSNorm -> all_gather (sequence
   parallel), becomes one ``weave::allreduce_add_rmsnorm`` op.
2. ``split`` (:mod:`.split_tokens`): token prefix/suffix halves, their fused communication on a
   second stream, TokenWeave's interleaved schedule.
3. ``shard`` (:mod:`.shard_residual`): residuals passed only between fused sites stay sharded
   (a sequence-parallel site's residual is sharded by the model already).
4. ``output`` (:mod:`.output_in_place`): a ``p2p`` fused op's normed output stays in the symmetric
   output ring where the peers pushed it, where every reader provably runs before the ring slot
   is written again (option ``output_in_place``; off by default).

Split runs after fuse because fused sites delimit its segments; shard runs after split because it
rewrites fused ops only, and per half after a split (each half's residual has its own rows);
output runs last, on the final graph, because its proof is about every reader of every output.
Which passes run for a config is decided here and only here (``fuse`` gates merge and fuse,
``split``, ``shard_residual`` and ``output_in_place`` gate theirs). Each pass
returns what it did; the manager assembles the graph's report from that.

The manager is an Inductor ``CustomGraphPass``: its ``uuid()`` combines every pass's uuid, the
config and the digest of every library module (:func:`.base.sources_digest`), so Inductor's
FX graph cache never serves a graph compiled by other code or options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from weave_compile import agreement
from weave_compile import report as report_mod
from weave_compile.config import TokenWeaveConfig
from weave_compile.kernels import auto
from weave_compile.ops import FUSED_OP, START_OP
from weave_compile.report import SplitSummary

from . import base, graph_utils
from .fuse_allreduce_rmsnorm import FuseAllReduceRMSNormPass, reducing_sites
from .identity_clones import drop_identity_clones
from .merge_all_reduces import MergeAllReducesPass, annotate_merged
from .output_in_place import OFF, OutputInPlacePass
from .shard_residual import ShardResidualPass
from .split_tokens.decision import SplitDecision, decide
from .split_tokens.split import SplitTokensPass

log = logging.getLogger(__name__)

#: What the report says of a site whose fused op runs per half.
SPLIT_SITE = "per half, comm stream"


class WeavePassManager(CustomGraphPass):
    def __init__(self, config: TokenWeaveConfig, compiler: str = "inductor"):
        self.config = config
        self.compiler = compiler
        self.graph_reports: list[report_mod.GraphReport] = []
        #: per post-grad graph, its communication per group after and before the passes, for the
        #: ranks' first-call check
        self.comm_plans: list[dict] = []
        self.written_plans: list[dict] = []
        #: what the projection merge did to the Dynamo graph (:meth:`prepare`), for the reports
        self.projections = ""
        #: per graph's measured choice: (group ranks, digest, answer), for a graph Inductor later
        #: serves from its FX graph cache (the backend records it beside the reports)
        self.measured_digests: list[tuple] = []
        self._merged = None
        self.merge = MergeAllReducesPass()
        self.fuse = FuseAllReduceRMSNormPass(config)
        self.split = SplitTokensPass(config)
        self.shard = ShardResidualPass()
        self.output = OutputInPlacePass()

    def prepare(self, gm, example_inputs) -> None:
        """The pre-pass on the Dynamo graph, before AOT autograd: with the split's
        ``merge_projections``, sibling linears become one GEMM
        (:mod:`.split_tokens.merge_projections`); :meth:`after_compile` finishes it."""
        if self.config.split and self.config.merge_projections:
            from .split_tokens.merge_projections import merge_sibling_linears

            self._merged = merge_sibling_linears(gm, example_inputs, self.config)
            self.projections = self._merged.describe()

    def after_compile(self) -> None:
        """What :meth:`prepare` leaves for after the compile: re-pointing the merged weights into
        one buffer (done before, the compile would see parameters it did not trace)."""
        if self._merged is not None:
            self._merged.repoint()

    @property
    def passes(self) -> list[base.WeavePass]:
        return [self.merge, self.fuse, self.split, self.shard, self.output]

    def _output_allowed(self) -> tuple[bool, str]:
        """Whether outputs may stay in the ring, and what the report says when not."""
        if not self.config.output_in_place:
            return False, OFF
        if self.compiler == "inductor":
            from weave_compile.ops import lowering

            why = lowering.install()
            if why is not None:
                return False, f"copied (no never-reuse lowering for Inductor: {why})"
        return True, ""

    def __call__(self, graph: fx.Graph) -> None:
        report = report_mod.new_graph(self.compiler)
        report.projections = self.projections
        self.graph_reports.append(report)
        before = _count_ops(graph)
        # Only a rewriting run can make ranks' collectives differ; fuse=False is plain Inductor.
        written = agreement.plan(graph) if self.config.fuse else {}
        if not self.config.fuse:
            merges, sites, split, residual, output = self._rewrite(graph, SplitDecision(False, "fuse disabled by option"),
                                                                   None)
        else:
            # The split is decided once, here, before the sites' designs are chosen for it.
            decision = decide(graph, self.config)
            chooser = None
            if self.config.autotune and self.config.kernel == auto.registry.AUTO:
                outcomes = self._measure(graph, decision)
                chooser = _measured_chooser(self.fuse, outcomes)
                report.measured = [_measured_report(o, req) for req, o in outcomes]
            merges, sites, split, residual, output = self._rewrite(graph, decision, chooser)
        report.merged = [len(m.merged) for m in merges]
        report.leaves = _leaving_before_norm(graph)
        graph.lint()
        self.comm_plans.append(agreement.plan(graph) if self.config.fuse else {})
        self.written_plans.append(written)
        after = _count_ops(graph)
        report.sites = [dataclasses.replace(s, residual=residual.get(s.node, s.residual),
                                            split=SPLIT_SITE if s.node in split.sites else s.split,
                                            output=output.get(s.node, s.output))
                        for s in sites]
        report.split = split
        report.op_counts = {k: (before[k], after[k]) for k in before}
        if self.config.fuse:
            report.other_gathers = [n.name for n in graph.nodes
                                    if graph_utils.is_call(n, graph_utils.ALL_GATHER_TARGETS)]
        log.debug("tokenweave: post-pass graph\n%s", graph)

    def _rewrite(self, graph: fx.Graph, decision: SplitDecision, chooser):
        """merge, fuse (each site's design by ``chooser``; None: the configured ``kernel``), split,
        shard, output: ``(merges, site reports, split summary, residual labels, output labels)``."""
        if self.config.fuse:
            drop_identity_clones(graph)  # eval-mode dropout between a reduction and its norm
            merges = self.merge(graph)
            sites = annotate_merged(self.fuse(graph, decision.applies, chooser), merges)
        else:
            merges, sites = [], reducing_sites(graph, "fuse disabled by option")
        split = self.split(graph, decision) if self.config.split else SplitSummary(reason=decision.reason)
        residual = self.shard(graph) if self.config.shard_residual else {}
        output = self.output(graph, *self._output_allowed())
        return merges, sites, split, residual, output

    def _measure(self, graph: fx.Graph, decision: SplitDecision) -> list[tuple]:
        """The measured choice for each group of the graph's sites: ``[(request, outcome)]``."""
        from weave_compile.kernels import measured

        from . import measured_sites

        fields = dict(options=_measured_options(self.config), compiler=self.compiler, mode=self.config.mode,
                      timeout_s=self.config.agreement_timeout_s, store=agreement.measuring_store(),
                      compiling=agreement.is_compiling,
                      first_call=agreement.waiting_at_first_call, written_competes=not decision.applies,
                      backend=agreement.backend())
        # The copy is rewritten by passes of its own: this manager's passes count the real graph only.
        planning = WeavePassManager(self.config, self.compiler)
        reqs = measured_sites.requests(graph, lambda g, chooser: planning._rewrite(g, decision, chooser), fields)
        out = []
        for req in reqs:
            # A group whose ranks already disagreed runs as written: its peers may never come to measure.
            why = agreement.runs_as_written(req.ranks)
            outcome = (measured.Outcome(None, f"not measured: process group {list(req.ranks)} runs its "
                                              f"collectives as written: {why}") if why else measured.choose(req))
            log.info("tokenweave: measured choice for group %s: %s (%s)", list(req.ranks),
                     outcome.answer.get("reason") if outcome.ok else "none", outcome.source)
            out.append((req, outcome))
        self.measured_digests += [(req.ranks, o.digest, o.answer) for req, o in out if o.ok]
        return out

    def uuid(self) -> str:
        # The measured tables auto reads are in the sources, but a benchmark may install others.
        # The machine's fingerprint: a graph whose choice was measured here is never served from
        # a shared FX graph cache to another machine.
        from weave_compile.kernels.measured import cache as measured_cache

        parts = [p.uuid() for p in self.passes] + [self.config.cache_key(), base.sources_digest(),
                                                    auto.tables_digest(), measured_cache.machine_digest()]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _measured_options(config: TokenWeaveConfig) -> dict:
    """The options that shape the op or its timing: part of every measured-choice cache key."""
    return {k: getattr(config, k) for k in ("comm_ctas", "split", "shard_residual", "output_in_place", "mode",
                                             "compiler", "fuse", "batch_invariant")}


def _measured_chooser(fuse, outcomes: list[tuple]):
    """The fuse pass's chooser from the measured outcomes: a site of a group with an answer gets
    it (every site as written, or its fastest design); any other site the shipped rules, with why
    the measured choice did not decide."""
    from weave_compile.kernels import measured

    by_site = {name: (req, o) for req, o in outcomes for name in req.sites}

    def chooser(name: str, where):
        if name not in by_site:
            return fuse._choose(name, where)
        req, o = by_site[name]
        if not o.ok:
            kernel, why, reserve = fuse._choose(name, where)
            return kernel, f"{why} (measured choice: {o.source})", reserve
        if not o.answer["fused"]:
            kernel, why = auto.AS_WRITTEN, f"measured ({o.source}): {o.answer['reason']}"
        else:
            kernel, why = o.kernel(req.sites[name]), measured.site_reason(o, req.sites[name])
        if where.batch_invariant:  # only invariant candidates competed; as written: only where invariant
            kernel, why = auto.invariant(kernel, why, where)
        return kernel, why, kernel != auto.AS_WRITTEN

    return chooser


def _measured_report(outcome, req) -> dict:
    """What ``explain()`` shows of one group's measured choice."""
    from weave_compile.kernels import measured

    return measured.report(outcome, req)


def _leaving_before_norm(graph: fx.Graph) -> list[str]:
    """The all_reduces (and reduce_scatters) whose result reaches the graph's output before any RMSNorm: where a graph
    break ends the graph, the norm they would fuse with is in the next graph. Reading the graph
    backwards, a node reaches the output if it is the output or a reader does, not counting an
    ``rsqrt`` nor what reads one (the norm's product): one pass over the graph."""
    rsqrt = torch.ops.aten.rsqrt.default

    def normed(node: fx.Node) -> bool:
        return node.target == rsqrt or any(a.target == rsqrt for a in node.all_input_nodes)

    reaches: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output" or any(u in reaches and not normed(u) for u in node.users):
            reaches.add(node)
    return [n.name for n in graph.nodes if n in reaches and graph_utils.is_call(n, graph_utils.REDUCING_TARGETS)]


def _count_ops(graph: fx.Graph) -> dict[str, int]:
    return {
        "all_reduce": sum(graph_utils.is_call(n, graph_utils.ALL_REDUCE_TARGETS) for n in graph.nodes),
        "reduce_scatter": sum(graph_utils.is_call(n, graph_utils.REDUCE_SCATTER_TARGETS) for n in graph.nodes),
        "all_gather": sum(graph_utils.is_call(n, graph_utils.ALL_GATHER_TARGETS) for n in graph.nodes),
        "weave.allreduce_add_rmsnorm": sum(graph_utils.is_call(n, FUSED_OP) for n in graph.nodes),
        "weave.allreduce_add_rmsnorm_start": sum(graph_utils.is_call(n, START_OP) for n in graph.nodes),
    }
