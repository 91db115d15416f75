"""Leave a fused op's normed output in the symmetric output ring, where the peers pushed it.

The ``p2p`` kernel's peers push their normed rows into this rank's output region; without this
pass the kernel then copies them out to a fresh tensor (its gather phase: a second copy of
(N-1)/N of the output). With ``out_slot=k`` the output *is* ring slot ``k`` of the region
(:func:`weave_compile.kernels.workspace.ring_output`), and nothing is copied. That slot is
written again, on every rank, by the next launch that uses it, so an output may live there only
where this pass proves every use of it is over by then. For fused call ``B`` taking slot ``k``
after call ``A`` left its output there, it requires:

* every reader of ``A``'s output (through views; ``weave.comm_wait`` only orders) and ``A``
  itself are *ancestors* of ``B``: whatever order the compiler schedules the nodes in, they
  were enqueued before ``B``. A peer writes into our slot only after ``B``'s entry barrier,
  which this rank reaches only after its stream has run everything enqueued before ``B``
  (``B``'s start on the comm stream waits for the compute stream first, streams.fork);
* ``B`` does not read ``A``'s output itself;
* no alias of an in-place output leaves the graph (returned, or written by an op): what the
  caller keeps must not be overwritten by the next step.

Slot 0 of the ring is every copying launch's staging region (the peers' slots), so only slots
``1 .. OUT_RING_SLOTS - 1`` hold outputs; they are picked greedily in graph order, per workspace
(group, dtypes, hidden). A call that finds no provably free slot copies as before; the reason is
in ``explain()`` (the site's ``output`` column). Only ``kernel="p2p"`` leaves its output in place;
the other kernels ignore ``out_slot``. Inductor must not reuse such an output's memory for
another buffer (an in-place pointwise kernel would write into the ring): the op's lowering
(:mod:`weave_compile.ops.lowering`) marks those outputs never-reuse; where it cannot be
installed the pass leaves every output copied under Inductor.
"""

from __future__ import annotations

import logging
import operator
from typing import Optional

import torch
import torch.fx as fx

from weave_compile.kernels.common import OUT_RING_SLOTS
from weave_compile.ops import FUSED_OP, START_OP, WAIT_OP

from .base import WeavePass
from .fuse_allreduce_rmsnorm import SITE_KEY
from .graph_utils import is_call, named_args, replace_args, val

log = logging.getLogger(__name__)

_FUSED = (FUSED_OP, START_OP)
#: The ring slots an output may take (slot 0 is the copying launches' staging region).
RING_SLOTS = tuple(range(1, OUT_RING_SLOTS))
#: What the report says of an output that is copied out because the option is off.
OFF = "copied (output_in_place off)"


def _normed_item(node: fx.Node) -> Optional[fx.Node]:
    items = [u for u in node.users if is_call(u, operator.getitem) and u.args[1] == 0]
    return items[0] if len(items) == 1 else None


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


def readers_of(item: fx.Node) -> tuple[Optional[set], str]:
    """The nodes that read ``item``'s memory (through views), or ``(None, why not)`` when it may
    escape the graph or be written."""
    readers: set = set()
    stack, seen = [item], {item}
    while stack:
        a = stack.pop()
        for u in a.users:
            if u.op == "output":
                return None, "the graph returns it"
            if is_call(u, WAIT_OP):  # orders the stream; reads nothing
                continue
            if u.op != "call_function":
                return None, f"{u.name} ({u.op}) uses it"
            if u.target is operator.getitem:  # an item of a view list (split): our memory
                follow = True
            elif isinstance(u.target, torch._ops.OpOverload):
                if _writes(u, a):
                    return None, f"{u.name} ({u.target}) writes to it"
                # A view reads nothing, but may be an alias: its users read our memory. An op
                # returning an alias of another argument (copy_(dst, ours)) does read ours.
                readers.add(u)
                follow = _returns_alias(u.target)
            else:
                return None, f"{u.name} ({getattr(u.target, '__name__', u.target)}) may keep an alias"
            if follow and u not in seen:
                seen.add(u)
                stack.append(u)
    if not readers:
        return None, "nothing reads it"
    return readers, ""


def _not_before(nodes: set, node: fx.Node, index: dict) -> Optional[fx.Node]:
    """One of ``nodes`` that is not an ancestor of ``node``, or None if all are."""
    lo = min(index[n] for n in nodes)
    todo, seen = set(nodes), set()
    stack = [node]
    while stack and todo:
        n = stack.pop()
        for p in n.all_input_nodes:
            if p in seen or index[p] < lo:
                continue
            seen.add(p)
            todo.discard(p)
            stack.append(p)
    return min(todo, key=index.get) if todo else None


def _workspace_key(node: fx.Node, args: dict) -> tuple:
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
            if not is_call(node, *_FUSED):
                continue
            args = named_args(node)
            if not allowed:
                outcome[node] = why_off
                continue
            if args["kernel"] != "p2p":
                outcome[node] = f"copied (kernel {args['kernel']} returns a fresh tensor)"
                continue
            item = _normed_item(node)
            readers, why = readers_of(item) if item is not None else (None, "nothing reads it")
            if readers is None:
                outcome[node] = f"copied ({why})"
                continue
            key = _workspace_key(node, args)
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
