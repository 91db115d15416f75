"""benchmarks/bench_batch_invariant.py's row check on ONE GPU, as a test, at 3 and 4 ranks: ``nccl``'s
invariant path whole on a fake group of N ranks (the all-to-all, the rank-order sum, the add+norm
kernel at the CTA count and launch shape each T selects; the fake all-to-all hands every rank N
copies of its own rows, so what this checks is the launch shapes, the rank order being tested with
distinct partials on CPU ranks) and ``ce``'s add+norm kernel as its program launches it (the
rank-order variant over N-1 distinct received slots): rows of this rank's slice of a T-row call
equal, bit for bit, the same rows run alone. (``p2p`` and ``oneshot`` on emulated ranks: their own
GPU tests.)"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_batch_invariant  # noqa: E402
import fake_group  # noqa: E402

sys.path.pop(0)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("N", [3, 4])
@pytest.mark.parametrize("H", [4096, 8192])
def test_nccl_and_ce_rows_are_the_same_alone_on_the_gpu(N, H, seed):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import weave_compile.ops  # noqa: F401  (the op)

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    weight = (1 + 0.1 * torch.randn(H, generator=g, device=dev)).to(torch.bfloat16)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=N)
    try:
        with fake_group.written_collectives():
            # T < N, T % N != 0, one row per CTA and many (the launch shape changes with T)
            for T in (1, 2, N + 1, 9, 257, 1000, 4099, 8192):
                for design in ("nccl", "ce"):
                    assert bench_batch_invariant.row_check(design, T, H, N, weight, dist.group.WORLD.group_name,
                                                           dev, seed=seed + T), (design, T)
    finally:
        dist.destroy_process_group()
