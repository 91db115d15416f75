"""Match the fp8 quantization chains that read a norm's output, from the normed node.

Matches (post-grad ATen, as Inductor's custom post-pass sees it; each ``[...]`` optional, ``|``
alternatives; ``n`` is the normed node)::

    x    = n | view(n, [.., H])                              # rows; a view keeping the last dim
    xf   = x | convert(x, float32)                           # the values, in fp32
    q    = convert(c, float8_e4m3fn | float8_e5m2)
    c    = clamp_max(clamp_min(z, -M), M) | clamp_min(clamp_max(z, M), -M) | clamp(z, -M, M) | z
    z    = div(xf, S) | mul(xf, R) | mul(R, xf)
    R    = reciprocal(S) [mul(., 1.0)]                      # Python's 1.0 / s

  per-row dynamic (``kind="row"``; ``scales`` = S, fp32 ``[.., 1]``)::

    a    = abs(x | xf)
    m    = amax(a, [-1], keepdim=True) | getitem(max.dim(a, -1[, True]), 0) [unsqueeze(., -1)]
           [convert(., float32)]                             # before or after the unsqueeze
    S    = div(m, M) [convert] [clamp_min(., floor)] [convert ...]

  vLLM's per-token form multiplies by the reciprocal (``reciprocal=True``) after a floor of
  ``1 / (M * 512)``; torchao's per-row form divides (``reciprocal=False``), its quotient taken in
  the rows' dtype (``div`` of a bf16 amax: the scale is rounded to bf16 before ``.to(float32)``,
  recorded as ``scale_dtype``).

  static per-tensor (``kind="static"``; ``static_scale`` = S)::

    S    an fp32 tensor of one element (0-d or [1]) that does not depend on ``n``

``M`` is ``fp8_max``: the divisor of a row scale, and the clamp bound (a row chain whose clamp
bound is not its divisor is not matched: the op takes one). A static chain without a clamp records
``torch.finfo(dtype).max``. The floor is recorded as it acts: a clamp taken in fp32 then rounded
to bf16 (Inductor's form of a clamp on a bf16 tensor) floors at the bf16 rounding of the constant.

Not matched (and why):

- per-tensor dynamic fp8 (S one element computed from ``n``): one amax over all rows, and on a TP
  site over all ranks, before the gather; the op quantizes each rank's rows alone. torchao's default
  float8 config is per-tensor;
- values divided in bf16 (``x_bf16 / s``): a rounding to bf16 before the fp8 cast, outside the
  op's contract;
- a scale bound (vLLM's ``scale_ub``), per-group scales, a multiply by a precomputed inverse scale.

:func:`match_quant` returns one chain as a :class:`QuantMatch`; :func:`match_quant_readers` asks
whether every reader of ``n`` is such a chain (deduplicating identical ones, which rewrites the
graph: :func:`dedupe_quant_chains`), and says in words why not.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from weave_compile.quant import QuantSpec

from .graph_utils import aten, cast_dtype, is_call, shape_readers, val

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_ALL_FP8 = frozenset(d for d in vars(torch).values() if isinstance(d, torch.dtype) and "float8" in str(d))

PER_TENSOR_REASON = "per-tensor dynamic fp8 (one amax over all rows and ranks before the gather): not fused"

#: ops a quant chain is made of: the forward search from the normed rows walks only these, so it
#: stops at a GEMM (``_scaled_mm``) and never reaches the next layer's quant.
_CHAIN_OPS = frozenset({
    aten.abs.default, aten.amax.default, aten.max.dim, aten.max.default, aten.unsqueeze.default,
    aten.div.Tensor, aten.mul.Tensor, aten.reciprocal.default, aten.clamp_min.default,
    aten.clamp_max.default, aten.clamp.default, aten.view.default, aten.reshape.default,
    aten._unsafe_view.default, torch.ops.prims.convert_element_type.default, aten._to_copy.default,
    operator.getitem,
})
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclasses.dataclass
class QuantMatch:
    kind: str  # "row" (per-row dynamic) or "static" (per-tensor static scale)
    dtype: torch.dtype  # torch.float8_e4m3fn or torch.float8_e5m2
    fp8_max: float  # the divisor of a row scale and the clamp bound
    scale_floor: Optional[float]  # row: clamp_min on the scale, as it acts (None: absent)
    reciprocal: bool  # multiplies by the scale's reciprocal (vLLM per-token; static x * (1/s))
    clamp: bool  # values clamped to [-fp8_max, fp8_max] before the cast
    static_scale: Optional[fx.Node]  # static: the scale tensor's node (0-d or [1] fp32)
    q: fx.Node  # the convert to fp8: the quantized rows
    scales: Optional[fx.Node]  # row: the fp32 [.., 1] scale node its readers (``_scaled_mm``) read
    nodes: list[fx.Node]  # every node of the chain, in graph order
    #: the normed node, or the view of it the chain quantizes (q has its shape)
    rows: Optional[fx.Node] = None
    #: row: the dtype the quotient ``amax / fp8_max`` is rounded to before it becomes fp32
    #: (torchao divides a bf16 amax in bf16); float32 when computed in fp32
    scale_dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        name = str(self.dtype).replace("torch.float8_", "")
        if self.kind == "row":
            form = "vLLM per-token form" if self.reciprocal else "torchao per-row form"
            return f"fp8 {name} per-row ({form})"
        op = "x * (1/s)" if self.reciprocal else "x / s"
        return f"fp8 {name} static per-tensor ({op}{', clamped' if self.clamp else ''})"

    def spec(self) -> QuantSpec:
        """The fused op's epilogue that computes this chain (``weave_compile.quant``)."""
        return QuantSpec(self.kind, self.dtype, self.fp8_max, self.scale_floor or 0.0, self.reciprocal, self.clamp,
                         self.scale_dtype)

    def signature(self) -> tuple:
        """What makes two chains compute the same q and scales from the same rows."""
        # sizes as text: a symbolic size (dynamic=True) is not hashable, and one symbol prints alike
        shape = tuple(str(d) for d in val(self.rows).shape) if val(self.rows) is not None else None
        return (self.kind, self.dtype, self.fp8_max, self.scale_floor, self.reciprocal, self.clamp,
                self.static_scale, self.scale_dtype, shape)


@dataclasses.dataclass
class _Declined:
    """A chain from the rows to an fp8 cast that is not in the grammar, with the reason."""

    q: fx.Node
    reason: str


# ----------------------------------------------------------------------------- small helpers


def _number(o: Any) -> Optional[float]:
    return float(o) if isinstance(o, (int, float)) and not isinstance(o, bool) else None


def _round_to(x: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(dtype).to(torch.float64))


def _depends_on(node: fx.Node, target: fx.Node, limit: int = 256) -> bool:
    """``node`` is computed from ``target`` (a bounded walk up its inputs)."""
    todo, seen = [node], set()
    while todo and len(seen) < limit:
        n = todo.pop()
        if n is target:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _op_name(node: fx.Node) -> str:
    """``namespace.op`` of a call (an auto-functionalized op by the op it wraps); else the node's kind."""
    t = node.target
    if isinstance(t, torch._ops.HigherOrderOperator) and node.args and isinstance(node.args[0], torch._ops.OpOverload):
        t = node.args[0]
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._opname}" + ("" if t._overloadname == "default" else f".{t._overloadname}")
    return getattr(t, "__name__", str(t)) if node.op == "call_function" else node.op


def _values_of(node: fx.Node) -> list:
    v = node.meta.get("val")
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _opaque_fp8(node: fx.Node) -> bool:
    """A call outside aten/prims (a custom op, or an auto-functionalized one) with an fp8 tensor
    among its outputs or arguments (an out= buffer): a quant done where the pass cannot see it."""
    if node.op != "call_function" or is_call(node, _CHAIN_OPS):
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and t.namespace in ("aten", "prims"):
        return False
    if not isinstance(t, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return False
    tensors = [v for v in _values_of(node) if isinstance(v, torch.Tensor)]
    tensors += [val(a) for a in node.all_input_nodes if val(a) is not None]
    return any(t_.dtype in _ALL_FP8 for t_ in tensors)


def _strip_clamp(c: fx.Node) -> tuple[fx.Node, Optional[float], list[fx.Node]]:
    """``c`` = a symmetric clamp of ``z`` -> (z, bound, clamp nodes); (c, None, []) when none."""
    if is_call(c, aten.clamp.default) and len(c.args) == 3:
        lo, hi = _number(c.args[1]), _number(c.args[2])
        if lo is not None and hi is not None and lo == -hi > -float("inf"):
            return c.args[0], hi, [c]
        return c, None, []
    pair = {aten.clamp_min.default: aten.clamp_max.default, aten.clamp_max.default: aten.clamp_min.default}
    if is_call(c, *pair) and is_call(c.args[0], pair[c.target]) and len(c.args[0].users) == 1:
        inner = c.args[0]
        b1, b2 = _number(c.args[1]), _number(inner.args[1])
        if b1 is not None and b2 is not None and b1 == -b2:
            return inner.args[0], abs(b1), [inner, c]
    return c, None, []


def _rows_of(xf: Any, normed: fx.Node) -> Optional[list[fx.Node]]:
    """``xf`` = [convert(. , f32)] of the rows (normed or a view of it keeping the last dim):
    the nodes from the rows' first step to ``xf``, [] when ``xf`` is ``normed``; None otherwise."""
    nodes: list[fx.Node] = []
    cur = xf
    if isinstance(cur, fx.Node) and cast_dtype(cur) == torch.float32:
        nodes.insert(0, cur)
        cur = cur.args[0]
    if isinstance(cur, fx.Node) and is_call(cur, *_VIEWS) and cur.args[0] is normed:
        vn, vv = val(normed), val(cur)
        if vn is None or vv is None or vn.shape[-1] != vv.shape[-1]:
            return None
        nodes.insert(0, cur)
        cur = normed
    return nodes if cur is normed else None


# ----------------------------------------------------------------------------- the grammar


def _row_scale(s: fx.Node, rows: fx.Node, xf: fx.Node) -> Optional[dict]:
    """Parse S = div(m, M) [convert] [clamp_min(floor)] [convert ...] back to abs(rows | xf)."""
    nodes: list[fx.Node] = []
    # Walking back from S: the narrow (16-bit) dtypes the value is rounded to after the floor,
    # and anywhere on the way. A max and a monotone rounding commute, so one narrow dtype makes
    # the scale ``max(round(amax / M), round(floor))``: recorded as scale_dtype and the floor.
    cur, floor, narrow = s, None, set()
    while True:
        dt = cast_dtype(cur)
        if dt is not None:
            nodes.append(cur)
            cur = cur.args[0]
        elif is_call(cur, aten.clamp_min.default) and floor is None and _number(cur.args[1]) is not None:
            dt = val(cur).dtype
            floor = _round_to(_number(cur.args[1]), torch.float32)
            floor_narrow = set(narrow) | ({dt} if dt not in (torch.float32, torch.float64) else set())
            nodes.append(cur)
            cur = cur.args[0]
        elif is_call(cur, *_VIEWS) and _reshapes_row_scales(cur):
            # torchao reduces over the rows flattened to 2-D, then views the scales back to the
            # input's leading dims: the same per-row values
            nodes.append(cur)
            cur = cur.args[0]
            continue
        else:
            break
        if dt not in (torch.float32, torch.float64):
            narrow.add(dt)
    if not (is_call(cur, aten.div.Tensor) and _number(cur.args[1]) is not None and _number(cur.args[1]) > 0):
        return None
    if val(cur).dtype not in (torch.float32, torch.float64):
        narrow.add(val(cur).dtype)
    if len(narrow) > 1:
        return None  # rounded to two different 16-bit dtypes: not one rounding
    if floor is not None and floor_narrow:
        floor = _round_to(floor, next(iter(floor_narrow)))
    div, fp8_max, m = cur, _number(cur.args[1]), cur.args[0]
    nodes.append(div)
    keepdim = squeezed = False
    while isinstance(m, fx.Node):
        if cast_dtype(m) is not None:
            nodes.append(m)
            m = m.args[0]
        elif is_call(m, aten.unsqueeze.default) and m.args[1] in (-1, val(m).dim() - 1) and not keepdim:
            keepdim = True
            nodes.append(m)
            m = m.args[0]
        elif is_call(m, *_VIEWS) and not squeezed and _drops_last_one(m):
            # DTensor writes max(dim, keepdim=False) as keepdim=True and a view dropping the 1
            squeezed = True
            nodes.append(m)
            m = m.args[0]
        else:
            break
    if is_call(m, operator.getitem) and m.args[1] == 0 and is_call(m.args[0], aten.max.dim):
        red = m.args[0]
        dim = red.args[1]
        kd = red.args[2] if len(red.args) > 2 else red.kwargs.get("keepdim", False)
        if len(red.users) != 1:
            return None
        nodes += [m, red]
    elif is_call(m, aten.amax.default):
        red = m
        dims = red.args[1] if len(red.args) > 1 else red.kwargs.get("dim", [])
        if not (isinstance(dims, (list, tuple)) and len(dims) == 1):
            return None
        dim = dims[0]
        kd = red.args[2] if len(red.args) > 2 else red.kwargs.get("keepdim", False)
        nodes.append(red)
    else:
        return None
    a = red.args[0]
    nd = val(a).dim() if val(a) is not None else 0
    # the scale keeps one trailing 1: the reduction's keepdim, an unsqueeze, less a view dropping it
    if dim not in (-1, nd - 1) or int(bool(kd)) + keepdim - squeezed != 1 or not is_call(a, aten.abs.default):
        return None
    src = a.args[0]
    if src is not rows and src is not xf:
        if not (is_call(src, *_VIEWS) and src.args[0] in (rows, xf) and _keeps_rows(src)):
            return None
        nodes.append(src)  # the rows flattened to 2-D (torchao's reshape before its amax)
    nodes.append(a)
    scale_dtype = next(iter(narrow)) if narrow else torch.float32
    return {"fp8_max": fp8_max, "floor": floor, "scale_dtype": scale_dtype, "nodes": nodes}


def _reshapes_row_scales(view: fx.Node) -> bool:
    """Whether ``view`` only regroups the leading dims of ``[..., 1]`` row scales (as many rows, the
    trailing 1 kept on both sides)."""
    before, after = val(view.args[0]), val(view)
    if before is None or after is None or not before.dim() or not after.dim():
        return False
    return str(before.shape[-1]) == str(after.shape[-1]) == "1" and str(before.numel()) == str(after.numel())


def _keeps_rows(view: fx.Node) -> bool:
    """Whether ``view`` only regroups the leading dims of rows (the last dim, the row, kept)."""
    before, after = val(view.args[0]), val(view)
    if before is None or after is None or not before.dim() or not after.dim():
        return False
    return str(before.shape[-1]) == str(after.shape[-1]) and str(before.numel()) == str(after.numel())


def _drops_last_one(view: fx.Node) -> bool:
    """Whether ``view`` only drops its input's trailing size-1 dim (``[..., 1] -> [...]``)."""
    before, after = val(view.args[0]), val(view)
    if before is None or after is None or before.dim() != after.dim() + 1 or str(before.shape[-1]) != "1":
        return False
    return all(str(a) == str(b) for a, b in zip(before.shape[:-1], after.shape))


def _reciprocal_of(r: Any) -> Optional[tuple[fx.Node, list[fx.Node]]]:
    """``r`` = reciprocal(S) [* 1.0] -> (S, nodes); None otherwise."""
    nodes: list[fx.Node] = []
    if is_call(r, aten.mul.Tensor) and len(r.args) == 2:
        one = [a for a in r.args if _number(a) == 1.0]
        rest = [a for a in r.args if _number(a) != 1.0]
        if len(one) == 1 and len(rest) == 1:
            nodes.append(r)
            r = rest[0]
    if is_call(r, aten.reciprocal.default):
        return r.args[0], [r] + nodes
    return None


def _parse(q: fx.Node, normed: fx.Node) -> Union[QuantMatch, _Declined]:
    """The chain ending in fp8 cast ``q`` (reached from ``normed`` through chain ops), back to
    ``normed``; declined with the reason when it is not in the grammar."""
    unknown = _Declined(q, f"fp8 quant form not recognized (the cast {q.name} does not scale the rows "
                           "as a per-row or static quant does)")
    dtype = cast_dtype(q)
    c = q.args[0]
    if cast_dtype(c) in (torch.bfloat16, torch.float16):  # Inductor's form of a clamp on bf16 values
        return _Declined(q, f"fp8 quant with the values rounded to {cast_dtype(c)} before the fp8 cast: "
                            "not in the grammar")
    z, bound, clamp_nodes = _strip_clamp(c)
    if is_call(z, aten.div.Tensor) and isinstance(z.args[1], fx.Node):
        xf, s, recip, r_nodes = z.args[0], z.args[1], False, []
    elif is_call(z, aten.mul.Tensor) and len(z.args) == 2:
        xf, r = z.args
        got = _reciprocal_of(r)
        if got is None:
            r, xf = xf, r
            got = _reciprocal_of(r)
        if got is None:
            return unknown
        s, r_nodes = got
        recip = True
    else:
        return unknown
    lead = _rows_of(xf, normed)
    if lead is None:
        return unknown
    rows = lead[0] if lead and is_call(lead[0], *_VIEWS) else normed
    if val(z).dtype != torch.float32:
        return _Declined(q, f"fp8 quant with the values rounded to {val(z).dtype} before the fp8 cast: "
                            "not in the grammar")
    if dtype not in FP8_DTYPES:
        return _Declined(q, f"fp8 dtype {dtype}: only float8_e4m3fn and float8_e5m2 are fused")
    tail = r_nodes + [z] + clamp_nodes + [q]
    sv = val(s)
    if sv is not None and sv.numel() == 1 and sv.dim() <= 1:
        if _depends_on(s, normed):
            return _Declined(q, PER_TENSOR_REASON)
        if sv.dtype != torch.float32:
            return _Declined(q, f"static fp8 scale of dtype {sv.dtype}: only float32 scales are fused")
        fp8_max = bound if bound is not None else float(torch.finfo(dtype).max)
        return QuantMatch(kind="static", dtype=dtype, fp8_max=fp8_max, scale_floor=None, reciprocal=recip,
                          clamp=bound is not None, static_scale=s, q=q, scales=None,
                          nodes=_in_graph_order(lead + tail), rows=rows)
    row = _row_scale(s, rows, xf) if isinstance(s, fx.Node) else None
    if row is None or sv is None or sv.dtype != torch.float32 or sv.shape[-1] != 1:
        return _Declined(q, f"fp8 quant form not recognized (its scale {getattr(s, 'name', s)} is neither a "
                            "per-row amax nor a static per-tensor scale)")
    if bound is not None and bound != row["fp8_max"]:
        return _Declined(q, f"fp8 per-row quant clamped to {bound} but scaled by {row['fp8_max']}: not fused")
    return QuantMatch(kind="row", dtype=dtype, fp8_max=row["fp8_max"], scale_floor=row["floor"], reciprocal=recip,
                      clamp=bound is not None, static_scale=None, q=q, scales=s,
                      nodes=_in_graph_order(lead + row["nodes"] + tail), rows=rows,
                      scale_dtype=row["scale_dtype"])


def _in_graph_order(nodes: list[fx.Node]) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return sorted(set(nodes), key=order.__getitem__)


def _fp8_casts(normed: fx.Node, depth: int = 16) -> list[fx.Node]:
    """The casts to an fp8 dtype reachable from ``normed`` through chain ops only, in graph order."""
    found, seen, frontier = [], {normed}, [normed]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen or not is_call(u, _CHAIN_OPS):
                    continue
                seen.add(u)
                if cast_dtype(u) in _ALL_FP8:
                    found.append(u)
                else:
                    nxt.append(u)
        frontier = nxt
    return _in_graph_order(found)


def _chains(normed: fx.Node) -> list[Union[QuantMatch, _Declined]]:
    return [_parse(q, normed) for q in _fp8_casts(normed)]


def match_quant(normed: fx.Node) -> Optional[QuantMatch]:
    """The first (in graph order) quant chain in the grammar that reads ``normed``, or None.
    Whether ``normed`` has other readers is not asked here: :func:`match_quant_readers` asks it."""
    return next((m for m in _chains(normed) if isinstance(m, QuantMatch)), None)


# ----------------------------------------------------------------------------- every reader


def dedupe_quant_chains(chains: list[QuantMatch]) -> QuantMatch:
    """Keep one of several identical chains (same :meth:`QuantMatch.signature`): the readers of the
    others' q and scales read the survivor's, and the others' nodes no longer read are erased.
    MUTATES the graph. The survivor is the chain whose q comes first; a stable topological sort
    then places its nodes before every new reader. Returns the survivor."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    order = {n: i for i, n in enumerate(chains[0].q.graph.nodes)}
    keep = min(chains, key=lambda m: order[m.q])
    graph = keep.q.graph
    for m in chains:
        if m is keep:
            continue
        m.q.replace_all_uses_with(keep.q)
        if m.scales is not None:
            m.scales.replace_all_uses_with(keep.scales)
    gone = set(keep.nodes)  # kept, or already erased (chains may share nodes)
    for m in chains:
        for n in reversed(m.nodes):
            if n not in gone and not n.users:
                graph.erase_node(n)
                gone.add(n)
    stable_topological_sort(graph)
    return keep


def match_quant_readers(normed: fx.Node) -> tuple[Optional[QuantMatch], Optional[str]]:
    """Whether the op can take the quant: (the chain, None) when every reader of ``normed`` belongs
    to a chain in the grammar and all chains are identical (deduplicated first: this MUTATES the
    graph, see :func:`dedupe_quant_chains`); (None, reason) otherwise, the reason in the user's
    words; (None, None) when no reader quantizes to fp8 at all."""
    readers = [u for u in normed.users if u not in shape_readers(normed)]
    opaque = [u for u in readers if _opaque_fp8(u)]
    if opaque:
        return None, f"quantized by an opaque op {_op_name(opaque[0])}"
    found = _chains(normed)
    if not found:
        return None, None
    declined = [f for f in found if isinstance(f, _Declined)]
    if declined:
        return None, declined[0].reason
    covered = set().union(*(m.nodes for m in found))
    outputs = {m.q for m in found} | {m.scales for m in found if m.scales is not None}
    for n in [normed] + _in_graph_order(list(covered)):
        if n in outputs:
            continue
        other = next((u for u in n.users if u not in covered and u not in shape_readers(n)), None)
        if other is not None:
            return None, f"another reader needs the bf16 rows: {_op_name(other)}"
    if len({m.signature() for m in found}) > 1:
        kinds = sorted({m.describe() for m in found})
        scales = {m.static_scale.name for m in found if m.static_scale is not None}
        how = "; ".join(kinds) + (f"; static scales {', '.join(sorted(scales))}" if len(scales) > 1 else "")
        return None, f"the readers quantize the rows differently ({how}): not fused"
    return (dedupe_quant_chains(found) if len(found) > 1 else found[0]), None
