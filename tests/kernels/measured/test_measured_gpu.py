"""The measured choice on ONE GPU (fake process group: collectives move nothing, so the oracle
check is skipped and the timings are the local parts): a split TP Llama under CUDA graphs times
each half's op with the other half's GEMMs on the compute stream (captured with the op's stream
fork and join), and every site gets a design that ran (``nccl``: the symmetric-memory designs
cannot run on the fake group).

Run: ``python -m pytest -m gpu tests/kernels/measured/test_measured_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_a_split_graph_times_each_half_beside_the_other_halfs_gemms(group, mode, tmp_path, monkeypatch):  # noqa: F811
    import torch.distributed as dist

    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # measured now, not served from a cache
    d = LlamaDims(hidden=1024, heads=8, kv_heads=2, intermediate=2816, layers=2, vocab=1024, eps=1e-5)
    model = TPLlama(d, tp=2, rank=0, group=dist.group.WORLD, dtype=torch.bfloat16, device=torch.device("cuda"))
    tokens = torch.randint(0, 1024, (1, 2048), device="cuda")
    torch._dynamo.reset()
    weave_compile.reset()
    c = torch.compile(model, backend="tokenweave", options={"split": True, "mode": mode})
    with torch.no_grad():
        outs = [c(tokens).clone() for _ in range(3)]
    torch.cuda.synchronize()
    report = weave_compile.explain()
    [m] = [m for g in report.graphs for m in g.measured]
    assert m["source"].startswith("measured now"), str(report)
    sigs = {r["signature"] for r in m["rows"]}
    assert any("split half beside" in s for s in sigs), str(report)
    assert all("as written" not in r["times"] for r in m["rows"]), str(report)
    fused = [s for g in report.graphs for s in g.sites if s.fused]
    assert fused and {s.kernel for s in fused} == {"nccl"}, str(report)
    assert any(g.split is not None and g.split.applied for g in report.graphs), str(report)
    # (the fake group's collectives leave their outputs unwritten: the values are not checked here;
    # the numerics of the split and of nccl are tests/test_gpu_split.py's and the kernels' own)
    assert all(o.shape == outs[0].shape for o in outs)
