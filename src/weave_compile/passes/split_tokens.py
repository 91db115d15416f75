"""Split the token-wise part of the graph into a prefix (A) and a suffix (B) on two streams.

TokenWeave's coarse token split, as a post-grad FX pass that runs after ``fuse``:

1. **Where.** Every ``weave::allreduce_add_rmsnorm`` op becomes a pair of ops, one per half.
   From there the pass walks the graph in order and gives every op that is *token-wise* (row
   ``t`` of its output depends only on row ``t`` of its token-carrying inputs) a copy per half:
   GEMMs with the token rows as M, pointwise ops (broadcast operands that carry the token
   dimension, e.g. rotary ``cos``/``sin``, are sliced), views/permutes/expands (the token
   dimension is tracked through them), reductions over other dimensions, embedding/index
   lookups, unfused collectives. Causal self-attention, the one op that mixes tokens, becomes
   plain causal attention over A's own keys for A, and ``weave::causal_suffix_attention``
   (lower-right causal over ``[K_A; K_B]``) for B. Any other op that reads a split value is a
   *barrier*: it gets the halves concatenated back and runs whole (recorded in explain()), so
   the result is never wrong, only less overlapped.
2. **When.** Only where batch x tokens >= ``split_threshold``. For a symbolic token count the
   pass adds a guard on that comparison (one graph below, one above; no recompile per length).
3. **How much.** The prefix length comes from :mod:`weave_compile.smart_split`, with the GEMM
   shapes and attention width found in this graph and the device's SM count. With a static
   count it is a constant; with a symbolic one the halves are equal (``T // 2``, evaluated by
   the compiled code per call).
4. **Streams.** Each half's fused op is ``weave::allreduce_add_rmsnorm_start`` (enqueued on the
   high-priority comm stream) plus ``weave::comm_wait`` (the join, placed just before the first
   reader). Nodes are then ordered as TokenWeave's schedule: A runs one segment ahead of B, so
   every segment of one half is enqueued while the other half's communication is in flight:
   ``comm(A_k) || compute(B_k); comm(B_k) || compute(A_k+1); ...``.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_bool, statically_known_true

from weave_compile import smart_split
from weave_compile.kernels import allreduce_rmsnorm as _ops_fused  # noqa: F401  (registers the ops)
from weave_compile.kernels import causal_suffix_attention as _ops_attention  # noqa: F401
from weave_compile.config import TokenWeaveConfig
from weave_compile.report import GraphReport

from .fuse_allreduce_rmsnorm import FUSED_OP
from .graph_utils import fake_mode_of, is_call, val

log = logging.getLogger(__name__)

aten = torch.ops.aten
START_OP = torch.ops.weave.allreduce_add_rmsnorm_start.default
WAIT_OP = torch.ops.weave.comm_wait.default
SUFFIX_ATTENTION = torch.ops.weave.causal_suffix_attention.default

# Positions in weave::allreduce_add_rmsnorm's schema (the start op's too).
_X, _RESIDUAL = 0, 1

#: Attention ops as they reach the post-grad graph, by backend.
ATTENTION_OPS = tuple(
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, name)
)

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_UNARY_SAME_DIM = (aten.clone.default, aten.alias.default, torch.ops.prims.convert_element_type.default,
                   aten.contiguous.default if hasattr(aten, "contiguous") else aten.clone.default,
                   torch.ops._c10d_functional.wait_tensor.default)
# Reductions: (dims argument position, keepdim argument position or None, keepdim default).
_REDUCTIONS = {
    aten.sum.dim_IntList: (1, 2, False),
    aten.mean.dim: (1, 2, False),
    aten.amax.default: (1, 2, False),
    aten.amin.default: (1, 2, False),
    aten.prod.dim_int: (1, 2, False),
    aten.argmax.default: (1, 2, False),
    aten.var.correction: (1, None, False),
}
# Along one dimension, output shaped like the input: (dim argument position).
_ALONG_DIM = {aten._softmax.default: 1, aten._log_softmax.default: 1, aten.cumsum.default: 1}
# Along one dimension, tuple output shaped like the input (values, indices).
_ALONG_DIM_TUPLE = {aten.topk.default: (2, -1), aten.sort.default: (1, -1)}


class _NotSplit(Exception):
    """The graph is left unsplit, for the recorded reason."""


class Barrier(Exception):
    """This op cannot run per half: concatenate its split inputs and run it whole."""


@dataclasses.dataclass
class Split:
    """A value computed per half: ``halves[0]`` (prefix) and ``halves[1]`` (suffix).

    Along ``dim`` each half has ``unit`` times the split dimension's rows: 1 where the layout
    is the split dimension itself, ``S`` after ``[B, S, H] -> [B*S, H]`` in a batch split.
    """

    dim: int
    halves: tuple[fx.Node, fx.Node]
    unit: Any = 1


@dataclasses.dataclass
class SplitTuple:
    """A tuple-valued op computed per half; ``items[i]`` is the Split of element ``i``."""

    items: dict[int, Split]


@dataclasses.dataclass
class SplitSummary:
    """What the pass did to one graph, for explain()."""

    applied: bool = False
    reason: str = ""
    tokens: str = "-"
    split_at: str = "-"
    halves: int = 0  # ops computed per half
    barriers: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if not self.applied:
            return f"not split: {self.reason}"
        text = f"split {self.tokens} at {self.split_at}: {self.halves} ops per half"
        if self.barriers:
            text += f"; {len(self.barriers)} barrier(s): " + "; ".join(self.barriers)
        return text


def _batch_split(x: torch.Tensor) -> bool:
    """Split whole sequences when the fused sites' input is [B, S, H] with B >= 2.

    A symbolic B is >= 2 (Dynamo specializes sizes 0 and 1)."""
    return x.dim() >= 3 and (not isinstance(x.shape[0], int) or x.shape[0] >= 2)


def _prod(xs) -> Any:
    out = 1
    for x in xs:
        out = out * x
    return out


def _same(a, b) -> bool:
    return statically_known_true(a == b) if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt) else a == b


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(val(a), torch.Tensor)


def _attention_args(node: fx.Node) -> dict[str, Any]:
    """The op's arguments by schema name (defaults filled in)."""
    schema = node.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


class SplitTokensPass:
    def __init__(self, config: TokenWeaveConfig):
        self.config = config

    # ------------------------------------------------------------------------- entry

    def __call__(self, graph: fx.Graph, report: GraphReport) -> SplitSummary:
        summary = SplitSummary()
        report.split = summary
        fused = [n for n in graph.nodes if is_call(n, FUSED_OP)]
        why = self._why_not(graph, fused)
        if why:
            summary.reason = why
            log.info("tokenweave: token split not applied: %s", why)
            return summary
        try:
            _Rewriter(graph, self.config, fused, summary).run()
        except _NotSplit as e:  # raised before the graph is touched
            summary.reason = str(e)
            log.info("tokenweave: token split not applied: %s", e)
        return summary

    def _why_not(self, graph: fx.Graph, fused: list[fx.Node]) -> Optional[str]:
        if not self.config.split:
            return "split disabled by option"
        if not fused:
            return "no fused AllReduce-RMSNorm site"
        x = val(fused[0].args[_X])
        if x.dim() < 2:
            return "fused op input has no token dimension"
        seq = x.shape[0] if _batch_split(x) else x.shape[-2]  # the dimension to split
        rows = _prod(x.shape[:-1])
        threshold = self.config.split_threshold
        if isinstance(rows, torch.SymInt):
            # One graph per side of the threshold: Dynamo checks this guard before every call.
            if not guard_bool(rows >= threshold):
                return f"fewer than split_threshold={threshold} tokens (guarded)"
            if not guard_bool(seq >= 2):
                return "fewer than 2 tokens to split"
        elif rows < threshold:
            return f"{rows} tokens < split_threshold={threshold}"
        elif seq < 2:
            return "fewer than 2 tokens to split"
        return None


class _Rewriter:
    """One application of the split to one graph (see module docstring)."""

    def __init__(self, graph: fx.Graph, config: TokenWeaveConfig, fused: list[fx.Node], summary: SplitSummary):
        self.graph, self.config, self.fused, self.summary = graph, config, fused, summary
        self.fake_mode = fake_mode_of(graph)
        x0 = val(fused[0].args[_X])
        self.split_dim = 0 if _batch_split(x0) else x0.dim() - 2  # of the fused sites' input
        self.total = x0.shape[self.split_dim]  # its size: batch (B) or sequence (S)
        self.device = x0.device
        self.env: dict[fx.Node, Union[Split, SplitTuple]] = {}
        self.full_memo: dict[fx.Node, fx.Node] = {}
        self.slice_memo: dict[tuple[fx.Node, int], tuple[fx.Node, fx.Node]] = {}
        self.wait_of: dict[fx.Node, fx.Node] = {}  # start's result getitem -> its comm_wait
        self.starts: list[fx.Node] = []  # the start ops, A and B of each site
        self.last_wait_b: Optional[fx.Node] = None
        self.checked_masks: set[fx.Node] = set()

    # ------------------------------------------------------------------------- node helpers

    def mk(self, target, args: tuple, kwargs: Optional[dict] = None, half: Optional[int] = None) -> fx.Node:
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)

        def fake(a):
            if isinstance(a, (list, tuple)):  # plain lists: some schemas reject FX's immutable_list
                return type(a)(fake(b) for b in a) if isinstance(a, tuple) else [fake(b) for b in a]
            return a.meta.get("val") if isinstance(a, fx.Node) else a

        with self.fake_mode:
            node.meta["val"] = target(*fake(tuple(args)), **{k: fake(v) for k, v in kwargs.items()})
        if half is not None:
            node.meta["weave_half"] = half  # 0: prefix A, 1: suffix B
        return node

    def full(self, node: fx.Node) -> fx.Node:
        """The whole value of a split node (concatenated once, on first need)."""
        if node not in self.full_memo:
            sp = self.env[node]
            assert isinstance(sp, Split)
            self.full_memo[node] = self.mk(aten.cat.default, (list(sp.halves), sp.dim))
        return self.full_memo[node]

    def sliced(self, node: fx.Node, dim: int) -> tuple[fx.Node, fx.Node]:
        """The two halves of an unsplit value that carries the token dimension at ``dim``."""
        key = (node, dim)
        if key not in self.slice_memo:
            a, b = self.sizes
            self.slice_memo[key] = (self.mk(aten.slice.Tensor, (node, dim, 0, a), half=0),
                                    self.mk(aten.slice.Tensor, (node, dim, a, self.total_arg), half=1))
        return self.slice_memo[key]

    # ------------------------------------------------------------------------- split size

    def _layer_shape(self) -> tuple[smart_split.LayerShape, torch.dtype]:
        """The GEMMs over the token rows, the attention width and the fused sites in this graph;
        the GEMMs' dtype."""
        gemm_n, gemm_k, attn_width, dtype = [], [], 0, None
        x = val(self.fused[0].args[_X])
        rows = _prod(x.shape[:-1])
        for n in self.graph.nodes:
            if is_call(n, aten.mm.default, aten.addmm.default):
                a, b = (n.args[0], n.args[1]) if n.target == aten.mm.default else (n.args[1], n.args[2])
                ta, tb = val(a), val(b)
                if (ta is not None and tb is not None and _same(ta.shape[0], rows)
                        and all(isinstance(d, int) for d in tb.shape)):
                    gemm_k.append(int(tb.shape[0]))
                    gemm_n.append(int(tb.shape[1]))
                    dtype = dtype or ta.dtype
            elif is_call(n, *ATTENTION_OPS):
                q = val(n.args[0])
                if all(isinstance(d, int) for d in q.shape[1:]):
                    attn_width += int(q.shape[1] * q.shape[3])
        hidden = x.shape[-1] if isinstance(x.shape[-1], int) else 0
        layer = smart_split.LayerShape(gemms=tuple(zip(gemm_n, gemm_k)), attn_width=attn_width, hidden=hidden,
                                       elem_bytes=x.element_size(), sites=len(self.fused))
        return layer, dtype or x.dtype

    def _plan(self) -> None:
        anchor = self.fused[0].args[_X]
        if self.split_dim == 0 and isinstance(self.total, int):
            # Batch split: whole sequences per half, attention needs no rewrite.
            b = min(max(self.config.split_at, 1), self.total - 1) if self.config.split_at else self.total // 2
            self.sizes, self.total_arg = (b, self.total - b), self.total
            self.summary.tokens = f"a batch of {self.total} sequences"
            self.summary.split_at = f"{b} sequences" + (" (forced)" if self.config.split_at else " (half)")
            return
        if isinstance(self.total, int):
            layer, dtype = self._layer_shape()
            choice = smart_split.plan(self.total, layer, forced=self.config.split_at, cost=self.config.split_cost,
                                      device=self.device, dtype=dtype, num_sms=self.config.num_sms,
                                      group_name=_group_of(self.fused[0]))
            s = choice.at
            self.sizes, self.total_arg = (s, self.total - s), self.total
            self.summary.split_at = choice.describe()
            self.summary.tokens = f"{self.total} tokens"
            return
        # Symbolic sequence length: one graph for every length, so the split point must be an
        # expression of it that the compiled code evaluates per call. A data-dependent split
        # point (an unbacked size from a custom op) was tried: Inductor then cannot decide
        # attention's input layouts. So: equal halves, T // 2.
        if self.config.split_at and not guard_bool(self.total > self.config.split_at):
            raise _NotSplit(f"forced split_at={self.config.split_at} >= the token count (guarded)")
        with self.graph.inserting_after(anchor):
            seq_node = self.mk(aten.sym_size.int, (anchor, self.split_dim))
        with self.graph.inserting_after(seq_node):
            if self.config.split_at:
                s_node = self.config.split_at
                self.summary.split_at = f"{s_node} (forced)"
            elif guard_bool(seq_node.meta["val"] >= 2 * smart_split.GRID):
                # smart_split.near_half as graph arithmetic: T // 2 rounded up to the row grid
                # (in [1, T - 1] for T >= 2 * GRID, which the guard keeps; the threshold implies it
                # at the default split_threshold, so no extra graph).
                grid = smart_split.GRID
                half = self.mk(operator.floordiv, (seq_node, 2))
                up = self.mk(operator.floordiv, (self.mk(operator.add, (half, grid - 1)), grid))
                s_node = self.mk(operator.mul, (up, grid))
                self.summary.split_at = (f"run time: ((T // 2 + {grid - 1}) // {grid}) * {grid} (tile-aligned near-half; "
                                         "the measured smart split needs a static T)")
            else:
                s_node = self.mk(operator.floordiv, (seq_node, 2))
                self.summary.split_at = "run time: T // 2 (equal halves; fewer than 128 tokens possible)"
        with self.graph.inserting_after(s_node if isinstance(s_node, fx.Node) else seq_node):
            rest = self.mk(operator.sub, (seq_node, s_node))
        self.sizes, self.total_arg = (s_node, rest), seq_node
        self.summary.tokens = "a symbolic batch" if self.split_dim == 0 else "a symbolic token count"

    # ------------------------------------------------------------------------- main loop

    def run(self) -> None:
        self._plan()
        original = [n for n in self.graph.nodes if n.op == "call_function"]
        barrier_nodes: list[tuple[fx.Node, str]] = []
        for n in original:
            touched = any(a in self.env for a in n.all_input_nodes)
            if not touched and not is_call(n, FUSED_OP):
                continue
            try:
                with self.graph.inserting_before(n):
                    result = self.rewrite(n)
            except Barrier as e:
                barrier_nodes.append((n, str(e)))
                with self.graph.inserting_before(n):
                    self._make_whole(n)
                continue
            if result is not None:
                self.env[n] = result
        out = self.graph.output_node()
        if any(a in self.env for a in out.all_input_nodes):
            with self.graph.inserting_before(out):
                self._make_whole(out)
        for n, why in barrier_nodes:
            self.summary.barriers.append(f"{n.name} ({n.target}): {why}")
            log.info("tokenweave: split region ends at %s (%s): %s", n.name, n.target, why)
        # Until scheduled, a wait may name a start placed after it (see _pin_order).
        self._schedule()
        self._erase_replaced(original)
        self.graph.eliminate_dead_code()
        self.summary.applied = True
        self.summary.halves = sum(1 for n in self.graph.nodes if n.meta.get("weave_half") == 0)
        for start in self.starts:
            site = start.meta.get("weave_site")
            if site is not None:
                site.split = "per half, comm stream"

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

    # ------------------------------------------------------------------------- rules

    def rewrite(self, n: fx.Node) -> Optional[Union[Split, SplitTuple]]:
        t = n.target
        if t is FUSED_OP:
            return self._fused(n)
        if t is operator.getitem:
            src = n.args[0]
            sp = self.env.get(src)
            if isinstance(sp, SplitTuple) and n.args[1] in sp.items:
                return sp.items[n.args[1]]
            raise Barrier("element of a value that is not split per element")
        if t in ATTENTION_OPS:
            return self._attention(n)
        if t in (aten.split.Tensor, aten.split_with_sizes.default):
            src = self._split_arg(n, 0)
            self._other_dim(n, src, 2, 0, "splits")
            return self._per_half_tuple(n, src.dim, len(n.meta["val"]), lambda h: (src.halves[h], *n.args[1:]))
        if t in _ALONG_DIM or t in _ALONG_DIM_TUPLE:
            src = self._split_arg(n, 0)
            pos, _ = _ALONG_DIM_TUPLE.get(t, (_ALONG_DIM.get(t), None))
            self._other_dim(n, src, pos, -1, "operates")
            if t in _ALONG_DIM_TUPLE:
                return self._per_half_tuple(n, src.dim, 2, lambda h: (src.halves[h], *n.args[1:]))
            return self._per_half(n, src.dim, lambda h: (src.halves[h], *n.args[1:]))
        out = val(n)
        if not isinstance(out, torch.Tensor):
            raise Barrier("non-tensor result")
        if t in _VIEWS:
            return self._view(n)
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            return self._pointwise(n)
        if t in _UNARY_SAME_DIM or t is torch.ops._c10d_functional.all_reduce.default:
            src = self._split_arg(n, 0)
            return self._per_half(n, src.dim, lambda h: (src.halves[h], *n.args[1:]))
        if t is aten.permute.default:
            src = self._split_arg(n, 0)
            perm = [_norm_dim(p, out.dim()) for p in n.args[1]]
            return self._per_half(n, perm.index(src.dim), lambda h: (src.halves[h], n.args[1]))
        if t is aten.transpose.int:
            src = self._split_arg(n, 0)
            d0, d1 = (_norm_dim(d, out.dim()) for d in n.args[1:3])
            d = {d0: d1, d1: d0}.get(src.dim, src.dim)
            return self._per_half(n, d, lambda h: (src.halves[h], *n.args[1:]))
        if t is aten.t.default:
            src = self._split_arg(n, 0)
            return self._per_half(n, 1 - src.dim, lambda h: (src.halves[h],))
        if t is aten.unsqueeze.default:
            src = self._split_arg(n, 0)
            dim = _norm_dim(n.args[1], out.dim())
            return self._per_half(n, src.dim + (dim <= src.dim), lambda h: (src.halves[h], n.args[1]))
        if t in (aten.squeeze.dim, aten.squeeze.dims):
            src = self._split_arg(n, 0)
            ndim = val(n.args[0]).dim()
            dims = n.args[1] if isinstance(n.args[1], (list, tuple)) else [n.args[1]]
            dims = [_norm_dim(d, ndim) for d in dims]
            if src.dim in dims:
                raise Barrier("squeezes the token dimension")
            removed = [d for d in dims if _same(val(n.args[0]).shape[d], 1)]
            if len(removed) != out.dim() and ndim - len(removed) != out.dim():
                raise Barrier("cannot tell which dimensions are squeezed")
            return self._per_half(n, src.dim - sum(d < src.dim for d in removed), lambda h: (src.halves[h], n.args[1]))
        if t is aten.expand.default:
            return self._expand(n)
        if t in (aten.slice.Tensor, aten.select.int):
            src = self._split_arg(n, 0)
            dim = self._other_dim(n, src, 1, 0, "slices")
            d = src.dim - (t is aten.select.int and dim < src.dim)
            return self._per_half(n, d, lambda h: (src.halves[h], *n.args[1:]))
        if t is aten.cat.default:
            return self._cat(n)
        if t in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            return self._matmul(n)
        if t in _REDUCTIONS:
            return self._reduction(n)
        if t is torch.ops._c10d_functional.all_gather_into_tensor.default:
            src = self._split_arg(n, 0)
            if src.dim == 0:
                raise Barrier("gathers along the split dimension")
            return self._per_half(n, src.dim, lambda h: (src.halves[h], *n.args[1:]))
        if t is aten.embedding.default:
            if n.args[0] in self.env:
                raise Barrier("embedding table is token-split")
            src = self._split_arg(n, 1)
            return self._per_half(n, src.dim, lambda h: (n.args[0], src.halves[h], *n.args[2:]))
        if t is aten.index.Tensor:
            idx = n.args[1]
            if n.args[0] in self.env or not idx or not isinstance(idx[0], fx.Node) or idx[0] not in self.env \
                    or any(i is not None for i in idx[1:]):
                raise Barrier("indexing form other than table[split_index]")
            src = self.env[idx[0]]
            return self._per_half(n, src.dim, lambda h: (n.args[0], [src.halves[h]]))
        raise Barrier("op not known to be token-wise")

    def _split_arg(self, n: fx.Node, pos: int) -> Split:
        a = n.args[pos]
        sp = self.env.get(a) if isinstance(a, fx.Node) else None
        if not isinstance(sp, Split):
            raise Barrier(f"argument {pos} is not the token-split operand")
        others = [b for i, b in enumerate(n.args) if i != pos]
        if any(b in self.env for b in _nodes_in(others) + _nodes_in(n.kwargs)):
            raise Barrier("more than one token-split operand")
        return sp

    def _other_dim(self, n: fx.Node, src: Split, pos: int, default: int, what: str) -> int:
        """The op's dimension argument (at ``pos``), which must not be the split dimension."""
        dim = _norm_dim(n.args[pos] if len(n.args) > pos else default, val(n.args[0]).dim())
        if dim == src.dim:
            raise Barrier(f"{what} along the token dimension")
        return dim

    def _check_out(self, n: fx.Node, dim: int, unit: Any) -> None:
        out = val(n)
        if dim is None or not (0 <= dim < out.dim()) or not _same(out.shape[dim], self.total * unit):
            raise Barrier(f"split dimension not found in the result (dim {dim})")

    def _unit_of(self, n: fx.Node) -> Any:
        units = [sp.unit for a in _nodes_in(n.args) + _nodes_in(n.kwargs)
                 if isinstance(sp := self.env.get(a), Split)]
        if any(not _same(u, units[0]) for u in units[1:]):
            raise Barrier("operands split with different layouts")
        return units[0] if units else 1

    def _per_half(self, n: fx.Node, dim: int, args_for, kwargs_for=None, unit: Any = None) -> Split:
        unit = self._unit_of(n) if unit is None else unit
        self._check_out(n, dim, unit)
        halves = tuple(self.mk(n.target, tuple(args_for(h)), kwargs_for(h) if kwargs_for else dict(n.kwargs), half=h)
                       for h in (0, 1))
        return Split(dim, halves, unit)

    def _per_half_tuple(self, n: fx.Node, dim: int, count: int, args_for) -> SplitTuple:
        unit = self._unit_of(n)
        halves = [self.mk(n.target, tuple(args_for(h)), dict(n.kwargs), half=h) for h in (0, 1)]
        items = {}
        for i in range(count):
            items[i] = Split(dim, tuple(self.mk(operator.getitem, (halves[h], i), half=h) for h in (0, 1)), unit)
        return SplitTuple(items)

    def _side(self, a: fx.Node, d: int, unit: Any, h: int) -> fx.Node:
        """Half ``h`` of an unsplit operand read along with a split value whose dim ``d`` it shares."""
        ta = val(a)
        if d < 0 or _same(ta.shape[d], 1):
            return a  # broadcast along the split dimension
        if _same(unit, 1) and _same(ta.shape[d], self.total):
            return self.sliced(a, d)[h]
        raise Barrier(f"operand {a.name} is neither broadcast nor split-sized along the split dimension")

    def _pointwise(self, n: fx.Node) -> Split:
        out = val(n)
        od = None
        for a in _nodes_in(n.args) + _nodes_in(n.kwargs):
            if a in self.env:
                sp = self.env[a]
                if not isinstance(sp, Split):
                    raise Barrier("tuple operand")
                d = sp.dim + out.dim() - val(a).dim()
                if od is not None and od != d:
                    raise Barrier("operands split along different dimensions")
                od = d
        unit = self._unit_of(n)
        self._check_out(n, od, unit)

        def arg(a, h):
            if not _is_tensor_node(a):
                return a
            if a in self.env:
                return self.env[a].halves[h]
            return self._side(a, od - (out.dim() - val(a).dim()), unit, h)

        halves = tuple(self.mk(n.target, fx.node.map_aggregate(n.args, lambda a: arg(a, h)),
                               fx.node.map_aggregate(dict(n.kwargs), lambda a: arg(a, h)), half=h)
                       for h in (0, 1))
        return Split(od, halves, unit)

    def _view(self, n: fx.Node) -> Split:
        """Track the split dimension through a reshape, keeping it contiguous in memory order.

        The split dimension may merge with the dimensions right after it (its halves then span
        ``unit * rows``), or be unmerged back; it may not merge with a dimension before it
        (the halves would interleave). Its size in the new shape is left to ``-1``.
        """
        src = self._split_arg(n, 0)
        tin, tout = val(n.args[0]), val(n)
        prefix = _prod(tin.shape[:src.dim])
        rows = tin.shape[src.dim]
        for d in range(tout.dim()):
            if not _same(_prod(tout.shape[:d]), prefix):
                continue
            size = tout.shape[d]
            unit = None
            for j in range(src.dim + 1, tin.dim() + 1):  # merge with the next dims
                if _same(size, rows * _prod(tin.shape[src.dim + 1:j])):
                    unit = src.unit * _prod(tin.shape[src.dim + 1:j])
                    break
            if unit is None:
                for j in range(d + 2, tout.dim() + 1):  # unmerge into [rows', inner...]
                    inner = _prod(tout.shape[d + 1:j])
                    if _same(rows, size * inner) and _same(src.unit % inner, 0):
                        unit = src.unit // inner
                        break
            if unit is None:
                continue
            shape = self._shape_with_free_dim(n.args[1], tout, d)
            return self._per_half(n, d, lambda h: (src.halves[h], shape), unit=unit)
        raise Barrier("reshape merges the split dimension with an outer one")

    def _shape_with_free_dim(self, shape: list, tout: torch.Tensor, d: int) -> list:
        shape = list(shape)
        for i, e in enumerate(shape):
            if i != d and isinstance(e, int) and e == -1:
                if not isinstance(tout.shape[i], int):
                    raise Barrier("reshape with a symbolic -1 besides the split dimension")
                shape[i] = int(tout.shape[i])
        shape[d] = -1
        return shape

    def _expand(self, n: fx.Node) -> Split:
        src = self._split_arg(n, 0)
        sizes = list(n.args[1])
        d = src.dim + len(sizes) - val(n.args[0]).dim()
        new = sizes[:d] + [-1] + sizes[d + 1:]  # -1: keep the half's size
        return self._per_half(n, d, lambda h: (src.halves[h], new))

    def _cat(self, n: fx.Node) -> Split:
        tensors = n.args[0]
        out = val(n)
        dim = _norm_dim(n.args[1] if len(n.args) > 1 else 0, out.dim())
        dims = {self.env[a].dim for a in tensors if a in self.env}
        if len(dims) != 1 or dim in dims:
            raise Barrier("concatenates along the split dimension or mixed split dimensions")
        (d,) = dims
        unit = self._unit_of(n)

        def part(a, h):
            return self.env[a].halves[h] if a in self.env else self._side(a, d, unit, h)

        return self._per_half(n, d, lambda h: ([part(a, h) for a in tensors], *n.args[1:]))

    def _matmul(self, n: fx.Node) -> Split:
        t = n.target
        a_pos = 1 if t is aten.addmm.default else 0
        src = self._split_arg(n, a_pos)
        want = 1 if t is aten.bmm.default else 0
        if src.dim != want:
            raise Barrier("matmul over the token dimension")
        if t is aten.addmm.default:
            bias = val(n.args[0])
            if bias.dim() == 2 and not _same(bias.shape[0], 1):
                raise Barrier("addmm with a per-row bias")
        return self._per_half(n, want, lambda h: tuple(src.halves[h] if i == a_pos else a for i, a in enumerate(n.args)))

    def _reduction(self, n: fx.Node) -> Split:
        src = self._split_arg(n, 0)
        dims_pos, keep_pos, keep_default = _REDUCTIONS[n.target]
        ndim = val(n.args[0]).dim()
        dims = n.args[dims_pos] if len(n.args) > dims_pos else n.kwargs.get("dim")
        if dims is None:
            raise Barrier("reduces over every dimension")
        dims = [_norm_dim(d, ndim) for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if src.dim in dims:
            raise Barrier("reduces over the token dimension")
        keep = n.args[keep_pos] if keep_pos is not None and len(n.args) > keep_pos else n.kwargs.get("keepdim", keep_default)
        d = src.dim if keep else src.dim - sum(x < src.dim for x in dims)
        return self._per_half(n, d, lambda h: (src.halves[h], *n.args[1:]))

    # ------------------------------------------------------------------------- fused sites

    def _fused(self, n: fx.Node) -> Optional[SplitTuple]:
        x = n.args[_X]
        tx = val(x)
        xs = self.env.get(x)
        if xs is None:
            d, unit = self.split_dim, 1
            if tx.dim() - 1 <= d or not _same(tx.shape[d], self.total):
                raise Barrier("fused site of another shape")
            xh = self.sliced(x, d)
        elif isinstance(xs, Split) and xs.dim < tx.dim() - 1:
            d, unit, xh = xs.dim, xs.unit, xs.halves  # any row subset: the op is row-wise
        else:
            raise Barrier("fused site input split along the hidden dimension")
        res = n.args[_RESIDUAL]
        if res is None:
            rh = (None, None)
        elif res in self.env:
            rs = self.env[res]
            if not isinstance(rs, Split) or rs.dim != d or not _same(rs.unit, unit):
                raise Barrier("residual split unlike the input")
            rh = rs.halves
        elif val(res).dim() == tx.dim():
            rh = tuple(self._side(res, d, unit, h) for h in (0, 1))
        else:
            raise Barrier("residual of another shape")
        if any(a in self.env for a in _nodes_in(n.args[2:])):
            raise Barrier("weight/bias/scale is token-split")
        items: dict[int, list[fx.Node]] = {0: [], 1: []}
        waits = []
        for h in (0, 1):
            start = self.mk(START_OP, (xh[h], rh[h], *n.args[2:]), half=h)
            start.meta["weave_site"] = n.meta.get("weave_site")
            self.starts.append(start)
            g0 = self.mk(operator.getitem, (start, 0), half=h)
            g1 = self.mk(operator.getitem, (start, 1), half=h)
            items[0].append(g0)
            items[1].append(g1)
        for h in (0, 1):
            g0, g1 = items[0][h], items[1][h]
            keep = [a for a in (xh[h], rh[h]) if a is not None]
            wait = self.graph.call_function(WAIT_OP, (g0, g1, keep))
            wait.meta["val"] = None
            wait.meta["weave_half"] = h
            self.wait_of[g0] = self.wait_of[g1] = wait
            waits.append(wait)
        self._pin_order(waits, items[0])
        return SplitTuple({i: Split(d, tuple(items[i]), unit) for i in (0, 1)})

    def _pin_order(self, waits: list[fx.Node], results: list[fx.Node]) -> None:
        """Make TokenWeave's interleaving a data dependency, so no reordering can undo it.

        A's wait of this site takes B's start of this site (B's segment is enqueued before A
        blocks on its comm), and B's wait of the previous site takes A's start of this site.
        A wait only lists them to be ordered after them (Inductor reorders independent nodes
        for memory). An edge that would close a cycle (an A value that depends on B's wait,
        through a barrier) is skipped.
        """
        wait_a, wait_b = waits
        _append_keep(wait_a, results[1])
        prev_b = self.last_wait_b
        if prev_b is not None and not _depends_on(results[0].args[0], prev_b):  # from A's start
            _append_keep(prev_b, results[0])
        self.last_wait_b = wait_b

    # ------------------------------------------------------------------------- attention

    def _attention(self, n: fx.Node) -> SplitTuple:
        args = _attention_args(n)
        q, k, v = args["query"], args["key"], args["value"]
        sq, sk, sv = (self.env.get(a) for a in (q, k, v))
        if val(q).dim() != 4 or not all(isinstance(s, Split) and _same(s.unit, 1) for s in (sq, sk, sv)):
            raise Barrier("attention whose queries, keys and values are not all split")
        if args.get("dropout_p", 0.0):
            raise Barrier("attention with dropout")
        used = {u.args[1] for u in n.users if is_call(u, operator.getitem)}
        if used - {0} or any(not is_call(u, operator.getitem) for u in n.users):
            raise Barrier("attention's auxiliary outputs (log-sum-exp, ...) are used")
        if sq.dim == sk.dim == sv.dim == 0:
            # Batch split: whole sequences per half; a mask with a batch dimension is sliced.
            def arg(a, h):
                if a is q or a is k or a is v:
                    return self.env[a].halves[h]
                return self._side(a, 0, 1, h) if _is_tensor_node(a) and val(a).dim() == 4 else a

            calls = [self.mk(n.target, tuple(arg(a, h) for a in n.args),
                             {key: arg(a, h) for key, a in n.kwargs.items()}, half=h) for h in (0, 1)]
            outs = tuple(self.mk(operator.getitem, (c, 0), half=h) for h, c in enumerate(calls))
            return SplitTuple({0: Split(0, outs)})
        if not sq.dim == sk.dim == sv.dim == 2:
            raise Barrier("attention split along heads or head_dim")
        mask_name = "attn_mask" if args.get("attn_mask") is not None else "attn_bias"
        mask = args.get(mask_name)
        if mask is not None:
            if args.get("is_causal"):
                raise Barrier("attention with both a mask and is_causal")
            return self._masked_attention(n, sq, sk, sv, mask)
        if not args.get("is_causal"):
            raise Barrier("token split of attention that is neither causal nor masked")
        return self._causal_halves(n, sq, sk, sv, {})

    def _masked_attention(self, n: fx.Node, sq: Split, sk: Split, sv: Split, mask: fx.Node) -> SplitTuple:
        """Token split of attention with an explicit ``[.., S, S]`` mask (how Hugging Face models
        reach the graph under torch.compile: a materialized causal mask).

        The halves need a causal mask, which the graph cannot prove an arbitrary mask to be. So
        the mask is dropped for the halves' causal attention and an asynchronous device-side
        assert (no host sync, CUDA-graph safe) checks, once per mask and call, that it is
        exactly causal: 0/True where ``key <= query``, masked (-inf, the dtype's minimum, False)
        elsewhere. A mask that is not (padding, sliding window) stops the program loudly instead
        of giving a wrong number; such models should compile with ``split=False``.
        """
        tm = val(mask)
        if not isinstance(mask, fx.Node) or mask in self.env or tm is None or tm.dim() != 4 \
                or not _same(tm.shape[-1], self.total) or not _same(tm.shape[-2], self.total):
            raise Barrier("attention mask of a form other than [.., S, S]")
        if mask not in self.checked_masks:
            self.checked_masks.add(mask)
            self._assert_causal(mask, tm)
        return self._causal_halves(n, sq, sk, sv, {"attn_mask": None, "attn_bias": None, "is_causal": True})

    def _assert_causal(self, mask: fx.Node, tm: torch.Tensor) -> None:
        pos = self.mk(torch.ops.prims.iota.default, (self.total_arg,), {
            "start": 0, "step": 1, "dtype": torch.int64, "device": tm.device, "requires_grad": False})
        causal = self.mk(aten.le.Tensor, (self.mk(aten.unsqueeze.default, (pos, 0)),
                                          self.mk(aten.unsqueeze.default, (pos, 1))))
        if tm.dtype == torch.bool:
            bad = self.mk(aten.ne.Tensor, (mask, causal))
        else:
            allowed = self.mk(aten.eq.Scalar, (mask, 0))
            masked = self.mk(aten.le.Scalar, (mask, torch.finfo(tm.dtype).min / 2))
            # Where causal the entry must be 0, elsewhere masked.
            bad = self.mk(aten.logical_not.default, (self.mk(aten.where.self, (causal, allowed, masked)),))
        ok = self.mk(aten.logical_not.default, (self.mk(aten.any.default, (bad,)),))
        self.mk(aten._assert_async.msg, (ok, "tokenweave split: the attention mask is not causal (padding? "
                                              "sliding window?); compile with options={'split': False}"))

    def _causal_halves(self, n: fx.Node, sq: Split, sk: Split, sv: Split, overrides: dict) -> SplitTuple:
        """A: the same attention op on its own q/k/v; B: ``causal_suffix_attention`` over [K_A; K_B]."""
        schema = n.target._schema
        bound = _attention_args(n)
        bound.update({k: v for k, v in overrides.items() if k in bound})
        bound.update(query=sq.halves[0], key=sk.halves[0], value=sv.halves[0])
        args = tuple(bound[a.name] for a in schema.arguments if not a.kwarg_only)
        kwargs = {a.name: bound[a.name] for a in schema.arguments if a.kwarg_only}
        a_call = self.mk(n.target, args, kwargs, half=0)
        a_out = self.mk(operator.getitem, (a_call, 0), half=0)
        k_all = self.mk(aten.cat.default, (list(sk.halves), 2), half=1)
        v_all = self.mk(aten.cat.default, (list(sv.halves), 2), half=1)
        b_out = self.mk(SUFFIX_ATTENTION, (sq.halves[1], k_all, v_all, bound.get("scale")), half=1)
        return SplitTuple({0: Split(2, (a_out, b_out))})

    # ------------------------------------------------------------------------- schedule

    def _schedule(self) -> None:
        """Reorder nodes: A one segment ahead of B, each wait right before its half's next segment.

        ``level`` counts the fused sites a node is downstream of (a wait is one past its start).
        Keys: A's segment k at 2k, B's at 2k+1, A's wait closing k at 2k+1.5 (after B's start
        of segment k is enqueued), B's at 2k+2.5. A stable list schedule by key, respecting
        data dependencies and the waits' ordering (a reader of a start's result follows its
        wait), gives TokenWeave's interleaving.
        """
        nodes = list(self.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        preds: dict[fx.Node, set[fx.Node]] = {n: set(n.all_input_nodes) for n in nodes}
        for item, wait in self.wait_of.items():
            for u in item.users:
                if u.target is not WAIT_OP:  # other waits only keep it alive
                    preds[u].add(wait)
        users: dict[fx.Node, list[fx.Node]] = {n: [] for n in nodes}
        for n in nodes:
            for p in preds[n]:
                users[p].append(n)
        level: dict[fx.Node, int] = {}
        for n in _topological(nodes, preds, users, lambda n: index[n]):
            lv = max((level[p] for p in preds[n]), default=0)
            level[n] = lv + 1 if n.target is WAIT_OP else lv
        key: dict[fx.Node, float] = {}
        for n in nodes:
            h = n.meta.get("weave_half")
            if n.op == "placeholder":
                key[n] = -1.0
            elif n.op == "output":
                key[n] = float("inf")
            elif n.target is WAIT_OP:
                key[n] = 2 * level[n] - 0.5 if h == 0 else 2 * level[n] + 0.5
            else:
                key[n] = 2 * level[n] + (1 if h == 1 else 0)
        order = _topological(nodes, preds, users, lambda n: (key[n], index[n]))
        prev = None
        for n in order:
            if prev is not None and prev.next is not n:
                prev.append(n)
            prev = n


def _topological(nodes, preds, users, priority) -> list[fx.Node]:
    """Kahn's algorithm, taking the ready node of lowest ``priority`` first."""
    remaining = {n: len(preds[n]) for n in nodes}
    ready = [(priority(n), i, n) for i, n in enumerate(nodes) if remaining[n] == 0]
    heapq.heapify(ready)
    pos = {n: i for i, n in enumerate(nodes)}
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(ready, (priority(u), pos[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("tokenweave split: the schedule found a cycle")  # a bug, not bad input
    return order


def _append_keep(wait: fx.Node, node: fx.Node) -> None:
    normed, residual_out, keep = wait.args
    wait.args = (normed, residual_out, [*keep, node])


def _depends_on(node: fx.Node, target: fx.Node) -> bool:
    """Whether ``node`` reads ``target`` transitively (a wait is read through its mutation).

    A comm_wait has no users; a reader of its results depends on it through them, so the
    walk also steps from a start's result to its wait.
    """
    seen, stack = set(), [(node, True)]
    while stack:
        n, read = stack.pop()
        if n is target:
            return True
        if (n, read) in seen:
            continue
        seen.add((n, read))
        if n.target is WAIT_OP:
            # Its own results order it after its start; its keep-alive list is not a read.
            stack.extend((a, False) for a in n.all_input_nodes)
            continue
        stack.extend((a, True) for a in n.all_input_nodes)
        if read and is_call(n, operator.getitem):
            stack.extend((u, True) for u in n.users if u.target is WAIT_OP and u.args[0] is n or
                         u.target is WAIT_OP and u.args[1] is n)
    return False


def _group_of(fused: fx.Node) -> Optional[str]:
    """The fused op's process group name, passed by position or by name."""
    if "group_name" in fused.kwargs:
        return fused.kwargs["group_name"]
    return fused.args[5] if len(fused.args) > 5 else None


def _nodes_in(args: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, lambda a: found.append(a) or a)
    return found
