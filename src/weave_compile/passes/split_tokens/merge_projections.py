"""Merge sibling linears (several weights, one input) into one ``weave::sibling_linear`` GEMM.

Matches, on the Dynamo graph::

    q = linear(h, Wq, bq);  k = linear(h, Wk, bk);  v = linear(h, Wv, bv)

Rewrite to::

    qkv = weave.sibling_linear(h, [Wq, Wk, Wv], [bq, bk, bv])
    q = narrow(qkv, -1, 0, Nq);  k = narrow(qkv, -1, Nq, Nk);  v = narrow(qkv, -1, Nq + Nk, Nv)

and (:meth:`MergeSummary.repoint`) re-points ``Wq, Wk, Wv`` (and the biases) to consecutive views
of one new buffer holding the same values, so the GEMM reads them in place; the old storages are
freed, no memory is added. The backend calls it once the graph is compiled: done before, the
compile fails where it re-derives the inputs' metadata from what Dynamo traced (a re-pointed
parameter's storage offset is no longer 0).

Why: a token-split half pays each small GEMM's fixed cost again, and a Hugging Face layer has five
projections where a served one has two GEMMs (docs/performance.md, section 4, measures what the
halves lose either way). The op checks at every call that the weights are still one
buffer and copies them together otherwise (:mod:`weave_compile.ops.sibling_linear`).

It runs on the Dynamo graph, before AOT autograd, because only there are the parameters the
user's own tensors (Dynamo's ``example_inputs``) to re-point. A model sharded by Hugging Face's
``tp_plan`` holds DTensor parameters and runs each linear on ``weight.to_local()``: those are left
alone. Re-pointing a DTensor's local shard into a shared buffer computes right until Dynamo
recompiles the model (a new token count, a guard failure): torch then fails to re-fakeify a
DTensor whose local tensor shares a storage at an offset ("Attempted to set the storage of a
tensor on device cpu to a storage on different device meta"; torch 2.13, a minimal repro needs
only two such DTensors and a second shape).

It runs where the token split is on (``split`` and ``merge_projections``) and the graph may reach
``split_threshold`` tokens; each group it leaves alone is logged with why and shown in
``explain()``:

* grad mode on (the op has no autograd formula: inference only);
* a DTensor's local shard (above), or a weight that is not a graph input holding a plain tensor
  (a DTensor used as one, a constant), or not 2-D and contiguous, or of another dtype, device or
  input width than its siblings;
* biases on some siblings only, or biases that are not such inputs;
* a weight in two groups, or twice in one.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from weave_compile.ops.sibling_linear import SIBLING_LINEAR, stacked_view

from .decision import below_threshold
from .options import SplitOptions
from .values import prod

log = logging.getLogger(__name__)

LINEARS = (torch._C._nn.linear, F.linear)
#: node meta copied to each narrow from the linear it replaces (where it came from in the model)
_KEEP_META = ("stack_trace", "nn_module_stack")


@dataclasses.dataclass
class MergeSummary:
    #: one line per merged group, and one per group or linear left alone with why
    merged: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    #: why the pass did not look at the graph at all, "" if it did
    reason: str = ""
    #: the tensors :meth:`repoint` puts into one buffer, one list per group (weights, then biases)
    pending: list[list[torch.Tensor]] = dataclasses.field(default_factory=list, repr=False)

    def repoint(self) -> set[int]:
        """Put each pending group into one buffer (see the module docstring); the ids of the
        tensors whose storage changed."""
        moved: set[int] = set()
        for parts in self.pending:
            if _one_buffer(parts):
                moved.update(id(p) for p in parts)
        self.pending.clear()
        return moved

    def describe(self) -> str:
        if self.reason:
            return f"projections not merged: {self.reason}"
        if not self.merged and not self.skipped:
            return "projections: no linears share an input"
        text = "projections merged: " + ("; ".join(self.merged) if self.merged else "none")
        return text + (f"; left alone: {'; '.join(self.skipped)}" if self.skipped else "")


@dataclasses.dataclass
class _Linear:
    node: fx.Node
    x: fx.Node
    weight: Any
    bias: Any


def _as_linear(n: fx.Node) -> Optional[_Linear]:
    if n.op != "call_function" or n.target not in LINEARS:
        return None
    args = list(n.args) + [None] * (3 - len(n.args))
    x = args[0] if args[0] is not None else n.kwargs.get("input")
    w = args[1] if args[1] is not None else n.kwargs.get("weight")
    b = args[2] if args[2] is not None else n.kwargs.get("bias")
    return _Linear(n, x, w, b) if isinstance(x, fx.Node) else None


def _to_local_of(arg: Any) -> Optional[fx.Node]:
    """The node ``arg`` reads through ``.to_local()`` (a DTensor's local shard), else None."""
    if (isinstance(arg, fx.Node) and arg.op == "call_method" and arg.target == "to_local"
            and len(arg.args) == 1 and not arg.kwargs and isinstance(arg.args[0], fx.Node)):
        return arg.args[0]
    return None


def _value(arg: Any, real: dict) -> Any:
    """The tensor a graph input's node holds, else None."""
    return real.get(arg) if isinstance(arg, fx.Node) else None


#: why a linear on a DTensor's local shard is left alone (see the module docstring)
DTENSOR_REASON = ("a weight is a DTensor's local shard (a tp_plan model): re-pointed into one buffer, torch "
                  "could no longer re-fakeify the DTensor when Dynamo recompiles")


def _name(lin: _Linear) -> str:
    """The linear's module path as Dynamo spells its weight (``l_self_modules_layers_modules_0_modules_q_
    parameters_weight_`` -> ``layers.0.q``; a module reached as a call's argument is
    ``l_args_0_modules_...``), else the node's name."""
    w = _to_local_of(lin.weight) or lin.weight  # a tp_plan linear: named by its DTensor parameter
    w = w.name if isinstance(w, fx.Node) else ""
    if not w.endswith("_parameters_weight_"):
        return lin.node.name
    path = re.sub(r"^l_(?:self_|args_\d+_)?(?:modules_)?", "", w[: -len("_parameters_weight_")])
    return path.replace("_modules_", ".")


def _plain(t: Any) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def merge_sibling_linears(gm: fx.GraphModule, example_inputs: list[Any],
                          options: Optional[SplitOptions] = None) -> MergeSummary:
    """Rewrites ``gm`` in place (see the module docstring); with the split's ``options``, a graph
    whose linears' static row count is below their threshold is left alone (the split does not
    run there: :func:`.decision.below_threshold`)."""
    summary = MergeSummary()
    if torch.is_grad_enabled():
        summary.reason = "grad mode is on (inference only: the merged GEMM has no autograd formula)"
        return summary
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    real = dict(zip(placeholders, example_inputs))
    groups: dict[fx.Node, list[_Linear]] = {}
    for n in gm.graph.nodes:
        lin = _as_linear(n)
        if lin is not None:
            groups.setdefault(lin.x, []).append(lin)
    used: set[int] = set()
    changed = False
    for x, lins in groups.items():
        if len(lins) < 2:
            continue
        names = ", ".join(_name(lin) for lin in lins)
        why = _why_not(lins, real, used, x, options)
        if why:
            summary.skipped.append(f"{names} ({why})")
            log.info("tokenweave: linears %s not merged: %s", names, why)
            continue
        weights = [_value(lin.weight, real) for lin in lins]
        biases = [_value(lin.bias, real) for lin in lins] if lins[0].bias is not None else []
        used.update(id(t) for t in weights + biases)
        moved = stacked_view(weights) is None or bool(biases and stacked_view(biases) is None)
        summary.pending += [weights] + ([biases] if biases else [])
        sizes = [w.shape[0] for w in weights]
        _rewrite(gm.graph, x, lins, sizes)
        changed = True
        summary.merged.append(f"{names} -> 1 GEMM ({'+'.join(map(str, sizes))} x {weights[0].shape[1]}"
                              f"{', biases' if biases else ''}; {'re-pointed' if moved else 'already one buffer'})")
    if changed:
        gm.graph.lint()
        gm.recompile()
    if summary.merged:
        log.info("tokenweave: %s", summary.describe())
    return summary


def _why_not(lins: list[_Linear], real: dict, used: set[int], x: fx.Node, options: Optional[SplitOptions]) -> str:
    xv = x.meta.get("example_value")
    if isinstance(xv, torch.Tensor) and options is not None:
        rows = prod(xv.shape[:-1])
        # A static count only: a guard on the Dynamo graph's symbolic one would be the caller's.
        few = below_threshold(rows, options) if isinstance(rows, int) else None
        if few:
            return f"{few}: the split does not run here"
    if any(isinstance(real.get(_to_local_of(lin.weight)), DTensor) for lin in lins):
        return DTENSOR_REASON
    weights = [_value(lin.weight, real) for lin in lins]
    if not all(_plain(w) for w in weights):
        return "a weight is not a graph input holding a plain tensor (a DTensor, a constant?)"
    w0 = weights[0]
    if any(w.dim() != 2 or not w.is_contiguous() for w in weights):
        return "a weight is not 2-D and contiguous"
    if any(w.dtype != w0.dtype or w.device != w0.device or w.shape[1] != w0.shape[1] for w in weights):
        return "the weights differ in dtype, device or input width"
    has_bias = [lin.bias is not None for lin in lins]
    if any(has_bias) and not all(has_bias):
        return "biases on some of them only"
    biases = [_value(lin.bias, real) for lin in lins] if all(has_bias) else []
    if biases and not all(_plain(b) and b.dim() == 1 and b.dtype == w0.dtype and b.device == w0.device
                          and b.is_contiguous() for b in biases):
        return "a bias is not a graph input holding a contiguous 1-D tensor like the weights"
    ids = [id(t) for t in weights + biases]
    if len(set(ids)) != len(ids) or used & set(ids):
        return "a weight or bias is shared with another linear"
    return ""


@torch.no_grad()
def _one_buffer(parts: list[torch.Tensor]) -> bool:
    """Re-point ``parts`` to consecutive views of one new buffer with their values (True), unless
    they already are (False)."""
    if stacked_view(parts) is not None:
        return False
    buf = torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                      device=parts[0].device)
    start = 0
    for p in parts:
        view = buf[start:start + p.shape[0]]
        view.copy_(p)
        p.data = view
        start += p.shape[0]
    return True


def _rewrite(graph: fx.Graph, x: fx.Node, lins: list[_Linear], sizes: list[int]) -> None:
    weights = [lin.weight for lin in lins]
    biases = [lin.bias for lin in lins] if lins[0].bias is not None else []
    with graph.inserting_before(lins[0].node):
        merged = graph.call_function(SIBLING_LINEAR, (x, weights, biases))
    fake = _fake(SIBLING_LINEAR, x, weights, biases)
    if fake is not None:
        merged.meta["example_value"] = fake
    start = 0
    for lin, width in zip(lins, sizes):
        with graph.inserting_before(lin.node):
            part = graph.call_function(torch.narrow, (merged, -1, start, width))
        if fake is not None:
            part.meta["example_value"] = _fake(torch.narrow, fake, -1, start, width)
        part.meta.update({k: lin.node.meta[k] for k in _KEEP_META if k in lin.node.meta})
        lin.node.replace_all_uses_with(part)
        graph.erase_node(lin.node)
        start += width


def _fake(op, *args):
    """``op`` on the nodes' fake values (Dynamo's ``example_value``) under their fake mode, or None."""
    def fake_of(a):
        if isinstance(a, fx.Node):
            return a.meta.get("example_value")
        if isinstance(a, (list, tuple)):
            return type(a)(fake_of(v) for v in a)
        return a

    vals = [fake_of(a) for a in args]
    flat = [v for a in vals for v in (a if isinstance(a, (list, tuple)) else [a])]
    if any(v is None for v in flat):
        return None
    modes = {id(getattr(v, "fake_mode", None)): getattr(v, "fake_mode", None) for v in flat
             if isinstance(v, torch.Tensor)}
    mode = next(iter(modes.values()), None)
    if len(modes) != 1 or mode is None:
        return None
    with mode:
        return op(*vals)
