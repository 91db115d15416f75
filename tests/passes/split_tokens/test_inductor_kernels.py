"""What the split costs in Inductor kernels: pointwise kernels per forward, unsplit vs split.

Each half runs its own copy of every per-token pointwise kernel (they run at different times, on
purpose: that is the overlap), so a split forward may launch up to twice the unsplit kernels; on
top of that only the join of the halves at the graph output (one copy kernel per half: the fused
op allocates its outputs, so Inductor cannot have it write into the joined buffer): **split <=
2 x unsplit + 2**. Measured on the CPU (TPLlama, 2 layers, 4 query heads per kv head, Inductor's
C++ kernels; the same graphs through Inductor's Triton code generator give 7 -> 11): 5 -> 8. Fusion
lost at the halves' boundaries (a per-half slice or view that stops a fusion, a concatenation of
the halves' keys, a value two readers each copy) shows up as more.

Compiled with the fake process group (one process, world size 2, rank 0's shard), as
``benchmarks/bench_split.py --fake-comm`` does on a GPU; ``--kernels`` there prints the same counts.
"""

import os
import subprocess
import sys

import pytest
import torch

_SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
from weave_compile.testing.kernel_counts import count_split_kernels
device, dynamic = sys.argv[1], sys.argv[2] == "dynamic"
print(json.dumps(count_split_kernels(torch.device(device), tokens=256, dynamic=dynamic)))
"""


def _counts(device: str, dynamic: bool) -> dict:
    p = subprocess.run([sys.executable, "-c", _SCRIPT, device, "dynamic" if dynamic else "static"],
                       env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    import json

    return json.loads(p.stdout.strip().splitlines()[-1])


def _check(c: dict) -> None:
    plain, split = c["unsplit"], c["split"]
    assert c["split_summary"].startswith("split "), c["split_summary"]
    assert plain > 0 and split <= 2 * plain + 2, c
    assert c["cats"] == 1, c  # the output's join; the halves' keys are never concatenated


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_split_keeps_the_fusions_cpu(dynamic):
    c = _counts("cpu", dynamic)
    print(c)
    _check(c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dynamic", [False, True])
def test_split_keeps_the_fusions_gpu(dynamic):
    c = _counts("cuda", dynamic)
    print(c)
    _check(c)
