"""The add+norm kernel's fp8 epilogue on a GPU: the hardware fp8 conversion (the interpreter runs
the integer rounding instead), bit for bit against the contract.

``_addnorm_cases.check_quant_rows`` on CUDA tensors at model hidden sizes in the tile loops a
quantizing launch takes (``launch_config``'s pipelined and prefetched shapes): codes and row scales
equal to :func:`weave_compile.quant.quantize_rows` of the kernel's own normed rows (computed by
torch on the GPU), and within one step at a rounding boundary of the float64 oracle; rows spanning
ten decades with a NaN and an infinity; static scales small enough to saturate the unclamped
forms. 37 valid rows over two CTAs. Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.shared._addnorm_cases import check_quant_rows, loop_configs, quant_forms

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORMS = quant_forms()
FORMS.pop("static-div")  # the interpreter's; the GPU keeps the forms that differ in the kernel's code


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("kind", ["pipelined", "prefetch"])
@pytest.mark.parametrize("H", [2048, 4096, 5120, 8192])
def test_epilogue_bit_exact_on_the_gpu(H, kind, form, norm, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cfg = loop_configs(H, small=False)[kind]
    for extremes in (False, True):
        check_quant_rows(cfg, g, FORMS[form], hidden=H, n_valid=37, norm=norm, static_scale=0.002,
                         extremes=extremes, device="cuda", where=f"H={H} {kind} {form} {norm} extremes={extremes}")
    torch.cuda.synchronize()
