"""Rank-local code on 2 GPUs (NCCL, Inductor, CUDA graphs or not): the ranks run it as written.

The cases of ``tests/test_agreement.py`` where NCCL, not gloo, meets the collectives: a mismatch
there hangs instead of aborting, and the graphs as written are compiled with CUDA graphs on.
Skipped without 2 CUDA GPUs. Run: ``python -m pytest -m gpu tests/test_gpu_agreement.py``.
"""

import random

import pytest
import torch

from tests.test_agreement import _run_case
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                       reason="needs >= 2 CUDA GPUs"),
]

CASES = ("stat", "print", "skip")


def _gpu_cases(rank, world, mode, seed):
    return {case: _run_case(rank, world, case, {"mode": mode}, seed, f"{mode}-{case}", device="cuda")
            for case in CASES}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_rank_local_code_runs_as_written_on_2_gpus(mode):
    seed = random.randrange(2**31)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # every collective checked across ranks
        results = assert_ranks_ok(run_ranks(_gpu_cases, 2, args=(mode, seed), backend="nccl", timeout=900))
    for case in CASES:
        runs = [r[case] for r in results]
        for rank, run in enumerate(runs):
            assert max(run["errs"]) < 1e-5, (seed, case, rank, run["errs"])
            assert run["as_written"] and run["fused"] == 0 and len(run["warnings"]) == 1, run["text"]
        counts = [r["collectives"] for r in runs]
        assert counts[0] > 0 and len(set(counts)) == 1, (case, counts)
