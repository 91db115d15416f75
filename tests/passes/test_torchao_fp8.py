"""torchao's own fp8 per-row inference config on a TP model, through the backend (2 gloo ranks).

What a torchao user writes: ``quantize_(model, Float8DynamicActivationFloat8WeightConfig(
granularity=PerRow()))`` on the column-parallel linears (q, k, v, gate, up: the readers of each
site's normed rows). torchao refuses to quantize without a CUDA GPU of compute capability 8.9 or
more (its hardware check, an assertion); with that check bypassed here, its activation quant
traces on CPU to the plain-torch per-row form (``abs -> amax(keepdim) -> / 448`` in the input's
dtype ``-> x.float() / scale -> clamp -> fp8``, then ``torch._scaled_mm`` with row-wise scales,
which torch 2.13 runs on CPU). The fuse pass must take that quant into the op (no fp8 cast left
after the passes; ``explain()`` names the per-row epilogue) and the logits must stay eager's
within the fp8 tolerance. Skips without torchao, or where its check cannot be bypassed (another
torchao release), or where ``_scaled_mm`` has no row-wise CPU path (torch 2.11).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

TIMEOUT = 600
TOL = 3e-2  # as tests/passes/test_fp8_epilogue_models.py: one fp8 step is 6% of a value


def _allow_cpu() -> int:
    """Bypass torchao's hardware check in every torchao module that holds it; how many did."""
    import torchao.quantization  # noqa: F401  (imports the modules that hold the check)

    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchao") and callable(getattr(mod, "_check_hardware_support", None)):
            mod._check_hardware_support = lambda *a, **k: None
            n += 1
    return n


def _rowwise_scaled_mm_on_cpu() -> bool:
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


def _run(rank, world):
    import torch.nn as nn
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama
    from weave_compile.testing.pass_graphs import capture_pass_graphs

    assert _allow_cpu() > 0
    d = LlamaDims(hidden=128, heads=4, kv_heads=2, intermediate=256, layers=2, vocab=128)
    model = TPLlama(d, tp=world, rank=rank, group=dist.group.WORLD, seed=3, dtype=torch.bfloat16)
    readers = {"q", "k", "v", "qkv", "gate", "up", "gate_up"}
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn.split(".")[-1] in readers)
    tokens = torch.randint(0, d.vocab, (1, 24), generator=torch.Generator().manual_seed(5))
    weave_compile.reset()
    with capture_pass_graphs() as graphs, torch.no_grad():
        out = torch.compile(model, backend="tokenweave", fullgraph=True,
                            options={"compiler": "aot_eager", "autotune": False, "kernel": "nccl"})(tokens).float()
        want = model(tokens).float()
    report = weave_compile.explain()

    def casts(text):
        return sum(1 for line in text.splitlines() if "convert_element_type" in line and "float8" in line)

    return {"err": ((out - want).norm() / want.norm()).item(), "before": sum(casts(g.before) for g in graphs),
            "after": sum(casts(g.after) for g in graphs), "fused": [s.fused for s in report.sites],
            "epilogues": [s.reason for s in report.sites if s.fused and "per-row epilogue" in s.reason],
            "text": str(report)}


def test_torchaos_per_row_config_quant_goes_inside_the_op():
    pytest.importorskip("torchao")
    if _allow_cpu() == 0:
        pytest.skip("this torchao release has no _check_hardware_support to bypass: its fp8 config needs a GPU")
    if not _rowwise_scaled_mm_on_cpu():
        pytest.skip("torch._scaled_mm has no row-wise CPU path in this torch (2.13 has one)")
    for run in assert_ranks_ok(run_ranks(_run, 2, timeout=TIMEOUT)):
        assert run["before"] > 0 and run["after"] == 0, run["text"]  # every fp8 cast moved into an op
        # the input norm's and the post-attention norm's sites of each layer quantize their rows
        assert len(run["epilogues"]) >= 4, run["text"]
        assert run["err"] < TOL, run
