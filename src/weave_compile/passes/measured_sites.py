"""What the measured choice times for a graph: its fused sites as the later passes will leave them.

A site's time depends on the layout the passes after ``fuse`` give it (``shard`` keeps the residual
sharded between consecutive fused sites, ``split`` runs each half's op beside compute, ``output``
may leave the normed rows in the ring), and a site left as written breaks its neighbours'
sharding: so the sites of a graph are measured together, in that layout. :func:`requests` runs
the passes on a copy of the graph with every site fused by a placeholder (no choice, nothing
collective), reads every fused op call's :class:`~weave_compile.kernels.measured.Signature` from the
copy, and returns one :class:`~weave_compile.kernels.measured.Request` per process group. The copy
is then dropped; the fuse pass on the real graph applies the answer.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Optional

import torch
import torch.fx as fx

from weave_compile.agreement import group_ranks
from weave_compile.kernels import Site
from weave_compile.kernels.measured import Request, Signature
from weave_compile.kernels.measured.signature import dtype_name
from weave_compile.ops import FUSED_OPS, SIBLING_LINEAR, START_OP, WAIT_OP

from .fuse_allreduce_rmsnorm import SITE_KEY
from .graph_utils import is_call, named_args, val

aten = torch.ops.aten

#: The placeholder the copy's sites are fused with: it takes every form and reserves nothing.
PLACEHOLDER = "reference"


def requests(graph: fx.Graph, run_passes: Callable[[fx.Graph, Callable], None], request_fields: dict) -> list[Request]:
    """One request per group of ``graph``'s sites (module doc). ``run_passes(copy, chooser)`` runs
    merge, fuse (choosing with ``chooser``), split, shard and output on the copy;
    ``request_fields`` are the :class:`Request` fields every request shares."""
    where: dict[str, Site] = {}

    def planner(name: str, site: Site) -> tuple[str, str, bool]:
        where[name] = site
        return PLACEHOLDER, "placeholder while planning", False

    dry = copy.deepcopy(graph)
    run_passes(dry, planner)
    by_group: dict[tuple, dict[str, list[Signature]]] = {}
    names: dict[tuple, str] = {}
    for node in dry.nodes:
        if not is_call(node, *FUSED_OPS) or SITE_KEY not in node.meta:
            continue
        name = node.meta[SITE_KEY]
        sig = signature_of(node, where[name])
        by_group.setdefault(sig.ranks, {}).setdefault(name, []).append(sig)
        names[sig.ranks] = named_args(node)["group_name"]
    return [Request(group_name=names[ranks], ranks=ranks, sites=sites,
                    where={n: where[n] for n in sites}, **request_fields)
            for ranks, sites in sorted(by_group.items())]


def signature_of(node: fx.Node, site: Site) -> Signature:
    """The signature of one fused (or split-half start) op call of the site ``site``."""
    a = named_args(node)
    tx = val(a["x"])
    lead = tx.shape[:-1]
    static = all(isinstance(d, int) for d in lead)
    tokens = math.prod(int(d) for d in lead) if static else None

    def dt(n: Optional[fx.Node]):
        return None if n is None else dtype_name(val(n).dtype)

    return Signature(
        device=tx.device.type, ranks=group_ranks(a["group_name"]), hidden=int(tx.shape[-1]), dtype=dtype_name(tx.dtype),
        residual_in=dt(a["residual"]), residual_dtype=dtype_name(a["residual_dtype"]),
        out_dtype=dtype_name(a["out_dtype"]), mid_dtype=dtype_name(a["mid_dtype"]), bias=dt(a["bias"]),
        weight=dt(a["weight"]), scale=dt(a["scale"]), weight_offset=float(a["weight_offset"]),
        eps_on_device=a["eps_tensor"] is not None, residual_in_sharded=bool(a["residual_in_sharded"]),
        residual_out_sharded=bool(a["residual_out_sharded"]), sequence_parallel=site.sequence_parallel,
        split=is_call(node, START_OP), beside=gemms_beside(node) if is_call(node, START_OP) else (),
        comm_ctas=int(a["comm_ctas"]), batch_invariant=bool(a["batch_invariant"]), out_slot=int(a["out_slot"]) >= 0,
        tokens=tokens, token_range=None if static else site.token_range, norm=a["norm"], norm_bias=dt(a["norm_bias"]),
        quant=site.quant.encode() if site.quant is not None else None)


#: The GEMMs recorded beside a split half's op (a layer's: QKV, O, gate+up, down and a few more).
MAX_BESIDE = 8
#: GEMMs whose output is ``[rows, N]`` (``sibling_linear``: ``[..., N]``) and whose input
#: (``x``: the first tensor argument, or addmm's second) has ``K`` columns
_GEMMS = {aten.mm.default: 0, aten.addmm.default: 1, SIBLING_LINEAR: 0, aten._scaled_mm.default: 0}
#: GEMMs on fp8 operands (an fp8 model's linears): recorded with the kind "fp8", timed as such
_FP8_GEMMS = (aten._scaled_mm.default,)


def gemms_beside(start: fx.Node) -> tuple[tuple, ...]:
    """The GEMMs the split schedule runs while ``start``'s communication is in flight: those
    between the start op and its wait in the graph's order (the other half's compute,
    :mod:`~weave_compile.passes.split_tokens.schedule`), as ``(rows, K, N)``, rows None where
    symbolic (the timing then takes the half's token count), and ``(rows, K, N, "fp8")`` for an
    fp8 GEMM (``torch._scaled_mm``: an fp8 model's linears, about twice a bf16 GEMM's speed on
    Hopper, so timed as fp8). Empty where no wait follows."""
    wait = next((u for g in start.users for u in g.users if is_call(u, WAIT_OP)), None)
    if wait is None:
        return ()
    out = []
    node = start.next
    while node is not wait and node.op != "output" and len(out) < MAX_BESIDE:
        if node.op == "call_function" and node.target in _GEMMS and isinstance(val(node), torch.Tensor):
            shape = val(node).shape
            rows = math.prod(shape[:-1]) if all(isinstance(d, int) for d in shape[:-1]) else None
            k = val(node.args[_GEMMS[node.target]]).shape[-1]
            out.append((rows, int(k), int(shape[-1])) + (("fp8",) if node.target in _FP8_GEMMS else ()))
        node = node.next
    return tuple(out)
