"""End to end on 2 GPUs (NCCL, symmetric memory): compiled TP Llama == eager, with the p2p kernel.

Skipped without 2 CUDA GPUs. Run: ``python -m pytest -m gpu tests/test_gpu_end_to_end.py``.
"""

import pytest
import torch

from weave_compile.testing.checks import compiled_tp_llama_vs_eager
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                       reason="needs >= 2 CUDA GPUs"),
]


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_tp_llama_matches_eager_on_2_gpus(mode):
    # Forced: auto takes p2p only from a two-GPU measurement on today's kernels (kernels/auto.py).
    results = assert_ranks_ok(run_ranks(compiled_tp_llama_vs_eager, 2, args=(mode, (7, 1000, 2048),
                                                                            {"kernel": "p2p"}),
                                        backend="nccl", timeout=500))
    for errs, matched, kernels, expected, _ in results:
        assert matched >= expected  # one graph per token count (dynamic=False)
        assert kernels == ["p2p"], kernels
        assert max(errs) < 2e-2, errs


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_outputs_left_in_the_symmetric_ring_match_eager(mode):
    """output_in_place: every site's normed output stays where the peers pushed it (TPLlama's
    readers all feed the next site through GEMMs) except the final norm's, which the model returns."""
    results = assert_ranks_ok(run_ranks(compiled_tp_llama_vs_eager, 2, args=(mode, (7, 1000, 2048),
                                                                            {"output_in_place": True, "kernel": "p2p"}),
                                        backend="nccl", timeout=500))
    for errs, matched, kernels, expected, outputs in results:
        assert matched >= expected and kernels == ["p2p"], (matched, kernels)
        kept = [o for o in outputs if not o.startswith("ring slot")]
        assert kept == ["copied (the graph returns it)"] * 3, outputs  # one graph per token count
        assert max(errs) < 2e-2, errs
