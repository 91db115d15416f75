"""Leave a fused op's normed output in the symmetric output ring, where the peers pushed it.

The ``p2p`` kernel's peers push their normed rows into this rank's output region; without this
pass the kernel then copies them out to a fresh tensor (its gather phase: a second copy of
(N-1)/N of the output). With ``out_slot=k`` the output *is* ring slot ``k`` of the region
(:func:`weave_compile.kernels.shared.workspace.ring_output`), and nothing is copied. That slot is
written again, on every rank, by the next launch that uses it, so an output may live there only
where this pass proves every use of it is over by then. For fused call ``B`` taking slot ``k``
after call ``A`` left its output there, it requires:

* every node that may read ``A``'s output (:func:`readers_of`) and ``A`` itself are run-time
  *ancestors* of ``B``: whatever order the compiler schedules the nodes in, they were enqueued
  before ``B``. A peer writes into our slot only after ``B``'s entry barrier, which this rank
  reaches only after its stream has run everything enqueued before ``B`` (``B``'s start on the
  comm stream waits for the compute stream first, streams.fork). The readers are not only the
  FX users: Inductor recomputes an unstored pointwise value inside each consumer's kernel, so
  the closure runs on through every op but those that always store their result (GEMMs on
  their non-bias inputs, attention, our ops, other libraries' ops Inductor lowers as fallback
  kernels); ``weave.comm_wait`` only orders, shape queries read nothing and give no run-time
  order;
* ``B`` does not read ``A``'s output itself;
* no alias of an in-place output, nor a value computed from it on the way to a storing op,
  leaves the graph, and no op writes into it, or may be made to by Inductor's reinplacing,
  which runs after this pass (scatters, ``index_put``, foreach ops, functional collectives on
  it as their first argument): what the caller keeps must not be overwritten by the next step.

Slot 0 of the ring is every copying launch's staging region (the peers' slots), so only slots
``1 .. OUT_RING_SLOTS - 1`` hold outputs; they are picked greedily in graph order, per workspace
(group, dtypes, hidden). A call that finds no provably free slot copies as before; the reason is
in ``explain()`` (the site's ``output`` column). Only implementations that take an output slot
(``takes_out_slot`` in their registry entry: the ``p2p`` kernel) leave their output in place; the
others ignore ``out_slot``. Inductor must not reuse such an output's memory for
another buffer (an in-place pointwise kernel would write into the ring): the op's lowering
(:mod:`weave_compile.ops.lowering`) marks those outputs never-reuse; where it cannot be
installed the pass leaves every output copied under Inductor, and a node annotated to fall back
to eager (which Inductor lowers without it) is copied too.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

from weave_compile import kernels
from weave_compile.kernels.measured import dispatch
from weave_compile.kernels.shared.common import OUT_RING_SLOTS
from weave_compile.ops import FUSED_OPS, WAIT_OP

from .base import WeavePass
from .fuse_allreduce_rmsnorm import SITE_KEY
from .graph_utils import is_call, named_args, replace_args, val

log = logging.getLogger(__name__)

#: The ring slots an output may take (slot 0 is the copying launches' staging region).
RING_SLOTS = tuple(range(1, OUT_RING_SLOTS))
#: What the report says of an output that is copied out because the option is off.
OFF = "copied (output_in_place off)"


def _normed_items(node: fx.Node) -> list:
    return [u for u in node.users if is_call(u, operator.getitem) and u.args[1] == 0]


def _returns_alias(target) -> bool:
    """True if the op's results may alias an input (a view such as ``view``, ``split``)."""
    return any(r.alias_info is not None for r in target._schema.returns)


def _writes(node: fx.Node, arg: fx.Node) -> bool:
    """True if ``node`` passes ``arg`` to a parameter its schema marks as written."""
    schema = node.target._schema
    for i, p in enumerate(schema.arguments):
        given = node.args[i] if i < len(node.args) else node.kwargs.get(p.name)
        given = given if isinstance(given, (list, tuple)) else [given]
        if any(g is arg for g in given) and p.alias_info is not None and p.alias_info.is_write:
            return True
    return False


_aten = torch.ops.aten
#: Ops that read their inputs where they run and store a fresh result (extern kernels: Inductor
#: never recomputes them inside a consumer), so the reading stops there. Not bmm/baddbmm (small
#: bmm is lowered to a pointwise product and sum, which Inductor may inline), and not a GEMM's
#: bias (addmm's ``self``, convolution's ``bias``: may be split off into a pointwise add).
_MATERIALIZING = tuple(getattr(_aten, n) for n in (
    "mm", "addmm", "_scaled_mm", "_int_mm", "convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(_aten, n))
#: Where a GEMM reads an argument as a bias: (op packet, argument index).
_BIAS_ARGS = {_aten.addmm: 0, _aten.convolution: 2}
#: Shape queries: no device read, and no run-time order through them.
_SHAPE_OPS = (_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default,
              _aten.sym_storage_offset.default)
#: Views whose schema does not say so (Inductor lowers them as views of their input).
_UNDECLARED_VIEWS = (_aten._unsafe_view.default,)


def _is_alias(target) -> bool:
    return _returns_alias(target) or target in _UNDECLARED_VIEWS


def _native_matmul() -> bool:
    """Inductor's ``triton.native_matmul``: GEMMs become ordinary fusable kernels."""
    try:
        from torch._inductor import config as inductor_config

        return bool(getattr(inductor_config.triton, "native_matmul", False))
    except Exception:  # pragma: no cover
        return True


def _inductor_stores(node: fx.Node, arg: fx.Node) -> bool:
    """True if ``node`` reads ``arg`` where it runs and stores its result (the closure stops)."""
    target = node.target
    if target.namespace == "weave":  # our ops: fallback kernels, their inputs realized
        return True
    if target.namespace in ("aten", "prims"):
        if target.overloadpacket not in _MATERIALIZING or _native_matmul():
            return False
        bias = _BIAS_ARGS.get(target.overloadpacket)
        return bias is None or not (len(node.args) > bias and node.args[bias] is arg)
    try:  # another library's op: stored only if Inductor lowers it as a fallback kernel
        from torch._inductor import lowering as L
    except Exception:  # pragma: no cover
        return False
    if target in getattr(L, "user_lowerings", {}):
        return False
    if target in L.fallbacks or target.overloadpacket in L.fallbacks:
        return True
    return target not in L.lowerings and target.overloadpacket not in L.lowerings


def _reinplaceable(target) -> bool:
    """Ops Inductor's reinplacing (which runs after this pass) may turn into writes to their
    first argument: scatters, index_put, foreach ops, functional collectives."""
    base = target._schema.name.split("::")[-1]
    if target.namespace in ("_c10d_functional", "c10d_functional") or "scatter" in base:
        return True
    if base.startswith("_foreach_") or base in ("index_put", "_unsafe_index_put"):
        return True
    try:
        from torch._inductor.fx_passes.reinplace import inplaceable_ops
    except Exception:  # pragma: no cover - an Inductor without it reinplaces nothing listed there
        return False
    return target in inplaceable_ops


def readers_of(*items: fx.Node) -> tuple[Optional[set], str]:
    """Every node that may read the memory of ``items`` (a fused op's normed results), or
    ``(None, why not)`` when it may escape the graph or be written.

    Not only their FX users: Inductor recomputes an unstored pointwise node inside each consumer's
    kernel, so a value *computed* from them may read them wherever any of its users runs. So the
    closure goes on through every op but those that always store their result (GEMMs and
    attention of :data:`_MATERIALIZING` on their non-bias inputs, our ops, and other libraries'
    ops that Inductor lowers as fallback kernels: :func:`_inductor_stores`), which read them
    when they run and end it.
    """
    readers: set = set()
    stack, seen = [(i, True) for i in items], set(items)  # (node, is it an alias of the memory)
    while stack:
        a, alias = stack.pop()
        for u in a.users:
            if u.op == "output":
                return None, "the graph returns it" if alias else \
                    "the graph returns a value Inductor may compute from it where it is used"
            if is_call(u, WAIT_OP) or is_call(u, *_SHAPE_OPS):  # orders the stream / reads no data
                continue
            if u.op != "call_function":
                return None, f"{u.name} ({u.op}) uses it"
            if u.target is operator.getitem:  # an item of a multi-result node: follow it
                follow, u_alias = True, alias
            elif isinstance(u.target, torch._ops.OpOverload):
                if alias and _writes(u, a):
                    return None, f"{u.name} ({u.target}) writes to it"
                first = u.args[0] if u.args else None
                if alias and _reinplaceable(u.target) and (
                        first is a or (isinstance(first, (list, tuple)) and any(f is a for f in first))):
                    return None, f"{u.name} ({u.target}) may be made to write into it (Inductor reinplacing)"
                readers.add(u)
                follow = not _inductor_stores(u, a) or _is_alias(u.target)
                u_alias = alias and _is_alias(u.target)
            else:
                return None, f"{u.name} ({getattr(u.target, '__name__', u.target)}) may keep an alias"
            if follow and u not in seen:
                seen.add(u)
                stack.append((u, u_alias))
    if not readers:
        return None, "nothing reads it"
    return readers, ""


def _runtime_inputs(node: fx.Node) -> list:
    """The inputs ``node`` is ordered after at run time (a shape query orders nothing)."""
    return [] if is_call(node, *_SHAPE_OPS) else node.all_input_nodes


def _not_before(nodes: set, node: fx.Node, index: dict) -> Optional[fx.Node]:
    """One of ``nodes`` that is not a run-time ancestor of ``node``, or None if all are."""
    lo = min(index[n] for n in nodes)
    todo, seen = set(nodes), set()
    stack = [node]
    while stack and todo:
        n = stack.pop()
        for p in _runtime_inputs(n):
            if p in seen or index[p] < lo:
                continue
            seen.add(p)
            todo.discard(p)
            stack.append(p)
    return min(todo, key=index.get) if todo else None


def _workspace_key(args: dict) -> tuple:
    """The workspace (hence the ring) a fused call uses: kernels/workspace.py's key."""
    x = val(args["x"])
    return (args["group_name"], x.dtype, args["out_dtype"], args["residual_dtype"], str(x.shape[-1]))


class OutputInPlacePass(WeavePass):
    """Returns each fused site's output label (site id -> "ring slot k" / "copied (why)").

    ``allowed``: False (the option is off, or Inductor's never-reuse lowering is missing) only
    labels the sites with ``why_off``."""

    def __call__(self, graph: fx.Graph, allowed: bool = True, why_off: str = OFF) -> dict[str, str]:
        index = {n: i for i, n in enumerate(graph.nodes)}
        last: dict[tuple, tuple[fx.Node, set]] = {}
        outcome: dict[fx.Node, str] = {}
        for node in graph.nodes:
            if not is_call(node, *FUSED_OPS):
                continue
            args = named_args(node)
            if not allowed:
                outcome[node] = why_off
                continue
            if not all(kernels.get(d).takes_out_slot for d in dispatch.designs(args["kernel"])):
                outcome[node] = f"copied (kernel {args['kernel']} returns a fresh tensor)"
                continue
            if args.get("quant"):  # the ring holds rows of the output dtype, not fp8 codes
                outcome[node] = "copied (the fp8 epilogue returns fresh fp8 rows)"
                continue
            if "should_fallback" in node.meta or node.meta.get("custom", {}).get("fallback_to_eager"):
                # Inductor lowers such a node without our lowering: nothing marks it never-reuse
                outcome[node] = "copied (annotated to fall back to eager)"
                continue
            readers, why = readers_of(*_normed_items(node))
            if readers is None:
                outcome[node] = f"copied ({why})"
                continue
            key = _workspace_key(args)
            busy = []
            for slot in RING_SLOTS:
                prev = last.get((key, slot))
                if prev is None:
                    break
                prev_node, prev_readers = prev
                if node in prev_readers:
                    busy.append(f"slot {slot}: it reads {prev_node.name}'s output there")
                    continue
                late = _not_before(prev_readers | {prev_node}, node, index)
                if late is not None:
                    busy.append(f"slot {slot}: {late.name} may run after it")
                    continue
                break
            else:
                outcome[node] = "copied (" + "; ".join(busy) + ")"
                continue
            replace_args(node, out_slot=slot)
            last[(key, slot)] = (node, readers)
            outcome[node] = f"ring slot {slot}"
        labels: dict[str, list[str]] = {}
        for node, text in outcome.items():
            site = node.meta.get(SITE_KEY)
            if site is not None and text not in labels.setdefault(site, []):
                labels[site].append(text)
        placed = sum(t.startswith("ring") for t in outcome.values())
        if placed:
            log.info("tokenweave: %d of %d fused outputs left in the symmetric ring", placed, len(outcome))
        return {site: " / ".join(texts) for site, texts in labels.items()}
