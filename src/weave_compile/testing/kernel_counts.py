"""Kernel launches in Inductor's generated code, unsplit vs split: what the token split costs in kernels.

:func:`launches` counts the kernel calls in a module of Inductor's output code by kind (Triton
``poi``/``red``/``per``/``tem``, C++ ``cpp``); :func:`count_split_kernels` compiles a small
``TPLlama`` on the current process group (the fake one in tests and ``bench_split.py
--fake-comm``) without and with the split and returns both counts. Used by
``tests/passes/split_tokens/test_inductor_kernels.py`` and ``benchmarks/bench_split.py``.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

_TRITON_CALL = re.compile(r"^\s+triton_([a-z]+)_\w+\.run\(", re.M)
_CPP_CALL = re.compile(r"^\s+cpp_fused_\w+\(", re.M)


def launches(code: str) -> dict[str, int]:
    """Kernel calls in Inductor output ``code``, by kind: Triton ``poi`` (pointwise), ``red``
    (reduction), ``per`` (persistent reduction), ``tem`` (template); ``cpp`` (C++ kernels, any
    kind). Definitions are not counted, calls are (a kernel called once per layer counts per layer)."""
    counts = Counter(_TRITON_CALL.findall(code))
    counts["cpp"] += len(_CPP_CALL.findall(code))
    return dict(counts)


def pointwise(counts: dict[str, int]) -> int:
    """Pointwise kernel calls: Triton ``poi``, or every C++ kernel (the C++ backend does not say)."""
    return counts.get("poi", 0) + counts.get("cpp", 0)


def compiled_launches(fn, *args) -> dict[str, int]:
    """Run ``fn(*args)`` (a compiled callable, compiling now) and count the kernels it generated;
    the FX graph cache is off so the code is generated here."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    with inductor_config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(fn, *args)
    return launches("\n".join(codes))


def count_split_kernels(device: torch.device, tokens: int = 256, dynamic: bool = False, layers: int = 2) -> dict:
    """Pointwise kernels per forward of a bf16 ``TPLlama`` (``layers`` layers, 4 query heads per kv
    head per rank) on the default process group, compiled by ``backend="tokenweave"`` with
    ``kernel="reference"``, without and with the split; the split graph's ``aten.cat`` nodes."""
    import torch.distributed as dist

    import weave_compile
    from weave_compile.testing.pass_graphs import capture_pass_graphs
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(layers=layers, hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=128)
    model = TPLlama(d, tp=dist.get_world_size(), rank=dist.get_rank(), group=dist.group.WORLD,
                    dtype=torch.bfloat16, device=device)
    x = torch.randint(0, d.vocab, (1, tokens), device=device, generator=torch.Generator(device=device).manual_seed(0))
    if dynamic:
        torch._dynamo.mark_dynamic(x, 1)
    out: dict = {"tokens": tokens, "dynamic": dynamic, "layers": layers}
    for split in (False, True):
        torch._dynamo.reset()
        weave_compile.reset()
        with capture_pass_graphs() as graphs, torch.no_grad():
            c = torch.compile(model, backend="tokenweave", dynamic=dynamic or None,
                              options={"split": split, "split_threshold": 16, "kernel": "reference"})
            counts = compiled_launches(c, x)
        out["split" if split else "unsplit"] = pointwise(counts)
        out[("split" if split else "unsplit") + "_by_kind"] = counts
        if split:
            out["cats"] = graphs[-1].after.count("aten.cat.default](")
            out["split_summary"] = weave_compile.explain().graphs[-1].split.describe()
    return out
