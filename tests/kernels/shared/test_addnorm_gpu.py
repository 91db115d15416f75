"""The shared add+norm kernel on a GPU: its LayerNorm variant (and RMSNorm beside it) in every loop
kind, forced, at model hidden sizes, bf16, against the float64 oracle.

The same check as the interpreter's (``_addnorm_cases.check_rows``: fresh random rows, outputs
poisoned with NaN, padding rows, the residual within one ulp, the normed rows against the oracle's
norm of the kernel's own residual), on CUDA tensors and the launch shapes a GPU gets:
``launch_config``'s pipelined and prefetched shapes at each H and the one-warp-per-row loop's
(8 warps, 256-column chunks; it spills past H=4096, where ``launch_config`` never picks it, and
must still be right). 37 valid rows: a partial last row block; two CTAs: a grid-stride loop over
several blocks. Skips without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.shared._addnorm_cases import check_rows, loop_configs

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
OPTIONS = {
    "layernorm": dict(),  # weight and norm bias, one received slot (ce's shape)
    "layernorm-bare": dict(weight=False, norm_bias=False, slots=0),  # nccl's shape (no slots)
    "layernorm-mid-bias-scale": dict(norm_bias=False, mid_dtype=BF16, bias=True, scale=True, slots=0),
    "layernorm-offset-2slots": dict(weight_offset=1.0, slots=2),
    "rmsnorm": dict(norm="rmsnorm", norm_bias=False),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("kind", ["pipelined", "prefetch", "rowwise"])
@pytest.mark.parametrize("H", [2048, 4096, 5120, 8192])
def test_addnorm_kernel_matches_float64_on_the_gpu(H, kind, option, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cfg = loop_configs(H, small=False)[kind]
    check_rows(cfg, g, hidden=H, n_valid=37, dtype=BF16, device="cuda", where=f"H={H} {kind} {option} {cfg}",
               **OPTIONS[option])
    torch.cuda.synchronize()
