"""The token split on 2 GPUs: real streams, the p2p kernel, dynamic T and CUDA-graph replay.

Skipped without 2 CUDA GPUs. Run: ``python -m pytest -m gpu tests/test_gpu_split.py``.
"""

import pytest
import torch

from weave_compile.testing.checks import split_tp_llama_vs_eager
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                       reason="needs >= 2 CUDA GPUs"),
]

BF16_TOL = 2e-2
#: Forced: auto takes a symmetric-memory design only from measurements on today's kernels (kernels/auto.py).
P2P = {"kernel": "p2p"}


def test_split_matches_eager_with_random_token_counts():
    # Random lengths above the 1024 threshold (odd ones too) and one below it.
    counts = (1024, 1337, 2048, 3001, 4096, 600)
    results = assert_ranks_ok(run_ranks(split_tp_llama_vs_eager, 2, args=(None, counts, 3, P2P),
                                        backend="nccl", timeout=580))
    for errs, summaries, vs_plain, _ in results:
        assert max(e for _, e in errs) < BF16_TOL, errs
        assert max(e for _, e in vs_plain) < BF16_TOL, vs_plain
        assert any(s.startswith("split a symbolic token count") and "barrier" not in s for s in summaries), summaries


def test_split_cuda_graph_replay_with_new_data():
    results = assert_ranks_ok(run_ranks(split_tp_llama_vs_eager, 2, args=("reduce-overhead", (1024, 2500), 3, P2P),
                                        backend="nccl", timeout=580))
    for errs, summaries, _, _ in results:
        assert max(e for _, e in errs) < BF16_TOL, errs
        assert sum(s.startswith("split ") for s in summaries) == 2, summaries


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_split_with_outputs_in_the_symmetric_ring(mode):
    """output_in_place under the split: the halves alternate ring slots (each half's readers feed
    its own next site); results equal eager with fresh data and random token counts."""
    counts = (1024, 1337, 3001) if mode is None else (1024, 2500)
    results = assert_ranks_ok(run_ranks(split_tp_llama_vs_eager, 2,
                                        args=(mode, counts, 3, {"output_in_place": True, **P2P}),
                                        backend="nccl", timeout=580))
    for errs, summaries, _, outputs in results:
        assert max(e for _, e in errs) < BF16_TOL, errs
        assert any(o.startswith("ring slot 1 / ring slot 2") for o in outputs), outputs
