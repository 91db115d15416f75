"""One application of the token split to one graph: the walk, the per-half values, the helpers rules use.

:class:`Rewriter` plans the split (:mod:`.plan`), walks the graph in order and gives every op
that reads a split value its rule (:mod:`.rules`, :mod:`.attention`, the fused sites in
:mod:`.schedule`); an op without a rule, or whose rule raises :class:`.values.Barrier`, gets
the halves concatenated back and runs whole. Then the nodes are put in TokenWeave's order
(:func:`.schedule.schedule`).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from weave_compile.config import TokenWeaveConfig
from weave_compile.ops import FUSED_OP
from weave_compile.report import SplitSummary

from ..fuse_allreduce_rmsnorm import SITE_KEY
from ..graph_utils import call_with_meta, fake_mode_of, is_call, named_args, val
from . import attention, rules, schedule
from .plan import make_plan
from .values import HALF_KEY, Barrier, Split, SplitTuple, batch_split, memory_order, nodes_in, same

log = logging.getLogger(__name__)

aten = torch.ops.aten

#: What a per-half node inherits from the op it replaces: the source it came from (profiles and
#: Inductor's kernel names point at the model's code); ``original_aten`` (Inductor's kernel names,
#: e.g. ``triton_poi_fused__unsafe_view_mul_silu``) only where the half runs the same op.
_SOURCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


class Rewriter:
    """One application of the split to one graph (see the package docstring)."""

    def __init__(self, graph: fx.Graph, config: TokenWeaveConfig, fused: list[fx.Node], summary: SplitSummary):
        self.graph, self.config, self.fused, self.summary = graph, config, fused, summary
        self.fake_mode = fake_mode_of(graph)
        x0 = val(named_args(fused[0])["x"])
        self.split_dim = 0 if batch_split(x0) else x0.dim() - 2  # of the fused sites' input
        self.total = x0.shape[self.split_dim]  # its size: batch (B) or sequence (S)
        self.device = x0.device
        self.env: dict[fx.Node, Union[Split, SplitTuple]] = {}
        self.full_memo: dict[fx.Node, fx.Node] = {}
        self.slice_memo: dict[tuple[fx.Node, int], tuple[fx.Node, fx.Node]] = {}
        self.wait_of: dict[fx.Node, fx.Node] = {}  # start's result getitem -> its comm_wait
        self.starts: list[fx.Node] = []  # the start ops, A and B of each site
        self.last_wait_b: Optional[fx.Node] = None
        self.checked_masks: set[fx.Node] = set()
        self.origin: Optional[fx.Node] = None  # the op whose halves are being built
        #: every op's rule: the token-wise ops', attention's and the fused sites'
        self.rules = rules.table(rules.TOKENWISE, attention.ATTENTION, schedule.FUSED_SITES)

    # ------------------------------------------------------------------------- node helpers

    def mk(self, target, args: tuple, kwargs: Optional[dict] = None, half: Optional[int] = None) -> fx.Node:
        node = call_with_meta(self.graph, self.fake_mode, target, args, kwargs)
        if half is not None:
            node.meta[HALF_KEY] = half
        origin = self.origin
        if origin is not None:
            node.meta.update({k: origin.meta[k] for k in _SOURCE_META if k in origin.meta})
            if target == origin.target and "original_aten" in origin.meta:
                node.meta["original_aten"] = origin.meta["original_aten"]
        return node

    def full(self, node: fx.Node) -> fx.Node:
        """The whole value of a split node (concatenated once, on first need), laid out as the
        value it stands for: its readers were traced with those strides. A training graph's
        forward hands its saved activations to a backward that views them as traced (SDPA's
        output is [B, S, H, D] memory seen as [B, H, S, D]; a plain ``cat`` of the halves is
        contiguous, and the backward's ``view`` of its transpose fails). A dense permuted layout
        is rebuilt by concatenating the halves in memory order; others concatenate plainly."""
        if node not in self.full_memo:
            sp = self.env[node]
            assert isinstance(sp, Split)
            like = val(node)
            order = memory_order(like) if isinstance(like, torch.Tensor) else None
            if order is None:
                whole = self.mk(aten.cat.default, (list(sp.halves), sp.dim))
            else:
                halves = [self.mk(aten.permute.default, (h, order)) for h in sp.halves]
                joined = self.mk(aten.cat.default, (halves, order.index(sp.dim)))
                whole = self.mk(aten.permute.default, (joined, [order.index(d) for d in range(len(order))]))
            self.full_memo[node] = whole
        return self.full_memo[node]

    def sliced(self, node: fx.Node, dim: int) -> tuple[fx.Node, fx.Node]:
        """The two halves of an unsplit value that carries the token dimension at ``dim``."""
        key = (node, dim)
        if key not in self.slice_memo:
            a, b = self.sizes
            self.slice_memo[key] = (self.mk(aten.slice.Tensor, (node, dim, 0, a), half=0),
                                    self.mk(aten.slice.Tensor, (node, dim, a, self.total_arg), half=1))
        return self.slice_memo[key]

    # ------------------------------------------------------------------------- main loop

    def run(self) -> None:
        plan = make_plan(self)
        self.sizes, self.total_arg = plan.sizes, plan.total
        self.summary.tokens, self.summary.split_at = plan.tokens, plan.split_at
        original = [n for n in self.graph.nodes if n.op == "call_function"]
        barrier_nodes: list[tuple[fx.Node, str]] = []
        for n in original:
            touched = any(a in self.env for a in n.all_input_nodes)
            if not touched and not is_call(n, FUSED_OP):
                continue
            self.origin = n
            try:
                with self.graph.inserting_before(n):
                    result = rules.apply(self, n)
            except Barrier as e:
                barrier_nodes.append((n, str(e)))
                with self.graph.inserting_before(n):
                    self._make_whole(n)
                continue
            if result is not None:
                self.env[n] = result
        self.origin = None
        out = self.graph.output_node()
        if any(a in self.env for a in out.all_input_nodes):
            with self.graph.inserting_before(out):
                self._make_whole(out)
        for n, why in barrier_nodes:
            self.summary.barriers.append(f"{n.name} ({n.target}): {why}")
            log.info("tokenweave: split region ends at %s (%s): %s", n.name, n.target, why)
        # Until scheduled, a wait may name a start placed after it (see schedule.pin_order).
        schedule.schedule(self.graph, self.wait_of)
        self._erase_replaced(original)
        self.graph.eliminate_dead_code()
        self.summary.applied = True
        self.summary.halves = sum(1 for n in self.graph.nodes if n.meta.get(HALF_KEY) == 0)
        sites = [s.meta.get(SITE_KEY) for s in self.starts]
        self.summary.sites = list(dict.fromkeys(s for s in sites if s is not None))

    def _erase_replaced(self, original: list[fx.Node]) -> None:
        """Erase every op the halves replaced, whatever its side-effect flag.

        ``eliminate_dead_code`` keeps impure ops, and ``wait_tensor`` is registered as one: the
        whole-batch wait of an unfused collective (the lm_head's all_gather of a Hugging Face
        ``tp_plan`` model) kept its collective and the whole unsplit forward upstream of it alive
        beside the two halves. A replaced op has no reader left (every reader was itself replaced
        or reads the halves concatenated), so it goes, readers first.
        """
        erased = 0
        for n in reversed(original):
            if n in self.env and not n.users:
                self.graph.erase_node(n)
                erased += 1
        log.debug("tokenweave: split erased %d replaced whole-batch op(s)", erased)

    def _make_whole(self, n: fx.Node) -> None:
        def whole(a):
            if isinstance(a, fx.Node) and a in self.env:
                if not isinstance(self.env[a], Split):
                    raise RuntimeError(f"tokenweave split: tuple value {a} read whole")  # not reachable
                return self.full(a)
            return a

        n.args = fx.node.map_arg(n.args, whole)
        n.kwargs = fx.node.map_arg(n.kwargs, whole)

    # ------------------------------------------------------------------------- helpers for rules

    def split_arg(self, n: fx.Node, pos: int) -> Split:
        a = n.args[pos]
        sp = self.env.get(a) if isinstance(a, fx.Node) else None
        if not isinstance(sp, Split):
            raise Barrier(f"argument {pos} is not the token-split operand")
        others = [b for i, b in enumerate(n.args) if i != pos]
        if any(b in self.env for b in nodes_in(others) + nodes_in(n.kwargs)):
            raise Barrier("more than one token-split operand")
        return sp

    def check_out(self, n: fx.Node, dim: int, unit: Any) -> None:
        out = val(n)
        if dim is None or not (0 <= dim < out.dim()) or not same(out.shape[dim], self.total * unit):
            raise Barrier(f"split dimension not found in the result (dim {dim})")

    def unit_of(self, n: fx.Node) -> Any:
        units = [sp.unit for a in nodes_in(n.args) + nodes_in(n.kwargs)
                 if isinstance(sp := self.env.get(a), Split)]
        if any(not same(u, units[0]) for u in units[1:]):
            raise Barrier("operands split with different layouts")
        return units[0] if units else 1

    def per_half(self, n: fx.Node, dim: int, args_for, kwargs_for=None, unit: Any = None) -> Split:
        unit = self.unit_of(n) if unit is None else unit
        self.check_out(n, dim, unit)
        halves = tuple(self.mk(n.target, tuple(args_for(h)), kwargs_for(h) if kwargs_for else dict(n.kwargs), half=h)
                       for h in (0, 1))
        return Split(dim, halves, unit)

    def per_half_tuple(self, n: fx.Node, dim: int, count: int, args_for) -> SplitTuple:
        unit = self.unit_of(n)
        halves = [self.mk(n.target, tuple(args_for(h)), dict(n.kwargs), half=h) for h in (0, 1)]
        items = {}
        for i in range(count):
            items[i] = Split(dim, tuple(self.mk(operator.getitem, (halves[h], i), half=h) for h in (0, 1)), unit)
        return SplitTuple(items)

    def side(self, a: fx.Node, d: int, unit: Any, h: int) -> fx.Node:
        """Half ``h`` of an unsplit operand read along with a split value whose dim ``d`` it shares."""
        ta = val(a)
        if d < 0 or same(ta.shape[d], 1):
            return a  # broadcast along the split dimension
        if same(unit, 1) and same(ta.shape[d], self.total):
            return self.sliced(a, d)[h]
        raise Barrier(f"operand {a.name} is neither broadcast nor split-sized along the split dimension")
