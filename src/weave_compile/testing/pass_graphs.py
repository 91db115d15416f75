"""The post-grad graphs the tokenweave passes see, recorded for tests: before and after, and excerpts.

:func:`capture_pass_graphs` records every graph the pass manager rewrites (Inductor or
``aot_eager``) with its RMSNorms counted by size (:func:`rmsnorm_sizes`); :func:`excerpt` cuts the
lines downstream of one node out of a printed graph, for a failure's report.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from typing import Iterator

import torch

@dataclasses.dataclass
class PassGraph:
    """One post-grad graph as the tokenweave passes received it, and what they left."""

    before: str
    after: str
    #: RMSNorms (rsqrt nodes) by normalized size, before and after the passes
    norms_before: dict[int, int]
    norms_after: dict[int, int]


def rmsnorm_sizes(graph: torch.fx.Graph) -> dict[int, int]:
    """Count the graph's RMSNorms (``rsqrt(mean(x^2, -1) + eps)``) by the size they normalize over."""
    sizes: Counter = Counter()
    for n in graph.nodes:
        if n.op != "call_function" or n.target != torch.ops.aten.rsqrt.default:
            continue
        size = -1
        add = n.args[0]
        mean = add.args[0] if isinstance(add, torch.fx.Node) and add.args else None
        if isinstance(mean, torch.fx.Node) and mean.target == torch.ops.aten.mean.dim:
            sq = mean.args[0]
            v = sq.meta.get("val") if isinstance(sq, torch.fx.Node) else None
            if isinstance(v, torch.Tensor):
                size = int(v.shape[-1])
        sizes[size] += 1
    return dict(sizes)


@contextlib.contextmanager
def capture_pass_graphs() -> Iterator[list[PassGraph]]:
    """Record every post-grad graph the tokenweave pass manager sees (Inductor or aot_eager)."""
    from weave_compile.passes.pass_manager import WeavePassManager

    graphs: list[PassGraph] = []
    orig = WeavePassManager.__call__

    def recording_call(self, graph):
        before, norms_before = str(graph), rmsnorm_sizes(graph)
        out = orig(self, graph)
        graphs.append(PassGraph(before, str(graph), norms_before, rmsnorm_sizes(graph)))
        return out

    WeavePassManager.__call__ = recording_call
    try:
        yield graphs
    finally:
        WeavePassManager.__call__ = orig


def excerpt(graph_text: str, node: str, max_lines: int = 16) -> str:
    """The lines of a printed FX graph that define ``node`` and what it feeds, in graph order.

    A forward data-flow slice (for reports): the all_reduce, its wait, and the ops downstream of
    it, up to ``max_lines`` lines.
    """
    names, out = {node}, []
    for line in graph_text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("%") or " = " not in stripped:
            continue
        name = stripped[1:].split(" ", 1)[0]
        args = stripped.split(" = ", 1)[1]
        if name == node or any(f"%{n}," in args or f"%{n})" in args or f"%{n}]" in args for n in names):
            names.add(name)
            out.append(stripped)
            if len(out) >= max_lines:
                break
    return "\n".join(out)


class _Captured(Exception):
    """Stops Inductor's compile once the post-grad graph is recorded (codegen is not needed)."""


def post_grad_graph(fn, *inputs) -> torch.fx.GraphModule:
    """The post-grad ATen graph Inductor hands its custom post-pass (where the tokenweave passes
    run) for ``torch.compile(fn)(*inputs)``: Inductor's decompositions, functionalization and its
    own post-grad passes applied, the ``meta['val']`` fake values kept. Inductor stops there (no
    codegen): seconds, not the tens of seconds of a full compile on this CPU. Parameters and
    buffers of a module ``fn`` are graph inputs (placeholders) of the returned module; traced
    under ``no_grad``: the inference graph."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen: list[torch.fx.GraphModule] = []

    class Record(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            seen.append(torch.fx.GraphModule(graph.owning_module, graph))
            raise _Captured

        def uuid(self):
            return None  # never served from the FX graph cache: the pass must run

    def backend(gm, example_inputs):
        try:
            compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": Record(),
                                                           "fx_graph_cache": False})
        except Exception:
            if not seen:
                raise
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():  # the inference graph (fp8 GEMMs have no derivative)
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    if len(seen) != 1:
        raise RuntimeError(f"expected one post-grad graph, got {len(seen)}")
    return seen[0]
