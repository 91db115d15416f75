"""On one GPU, a real site whose forced design cannot run gets compiled work, never the eager chain.

The fake process group (rank 0 of 2) and ``benchmarks/fake_comm.py`` "local" (under which the
symmetric-memory designs refuse fake groups): ``kernel="p2p"`` cannot run, so every site of a
compiled TP Llama gets the GPU fallback's choice (``kernels/auto.py``): ``nccl`` where the floor
measured it faster at that T, the site as written where it did not; where every site is left as written, Inductor generates the
very program it generates for plain ``torch.compile`` (``testing.inductor_code``). The numbers are compared with
the same model compiled by plain Inductor, both under CUDA graphs, with the fused op's collectives
behaving as the fake group's all_reduce does for plain Inductor (``benchmarks/fake_group.py``; the
residual kept whole so that every row is on this rank). ``reference``'s run is counted: it must
never be called. The op's run-time fallback (a workspace that cannot grow) on CUDA tensors runs
``nccl`` too.

Run: ``python -m pytest -m gpu tests/kernels/test_auto_gpu.py`` (one GPU, ~1 min).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import fake_comm  # noqa: E402
import fake_group  # noqa: E402

sys.path.pop(0)

H = 1024
T = 48  # static: one graph, its floor decision from the table below
BF16_TOL = 2e-2


@contextlib.contextmanager
def counting():
    """Calls of reference's and nccl's run as they are registered now (entries wrapped while inside)."""
    from weave_compile.kernels import registry

    calls: dict = {}
    originals = []
    for name in ("reference", "nccl"):
        impl = registry.get(name)

        def run(rows, spec, _run=impl.run, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _run(rows, spec)
        originals.append(registry.replace(dataclasses.replace(impl, run=run)))
    try:
        yield calls
    finally:
        for impl in originals:
            registry.replace(impl)


def _model():
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(hidden=H, heads=8, kv_heads=4, intermediate=2 * H, layers=2, vocab=512)
    return d, TPLlama(d, tp=2, rank=0, group=dist.group.WORLD, dtype=torch.bfloat16, device=torch.device("cuda"))


def _run(compiled, tokens):
    with torch.no_grad():
        for _ in range(3):  # reduce-overhead: warm-up, record, replay
            out = compiled(tokens).clone()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("nccl_ratio,want", [(0.9, "nccl"), (1.3, None)])
def test_a_forced_design_that_cannot_run_gets_the_compiled_fallback_on_a_gpu(group, monkeypatch,  # noqa: F811
                                                                             nccl_ratio, want):
    import weave_compile
    from weave_compile.kernels import auto_table
    from weave_compile.testing import inductor_code
    from weave_compile.testing.numerics import rel_err

    monkeypatch.setattr(auto_table, "FLOOR", {(2, H): {16: {"nccl": nccl_ratio}, 128: {"nccl": nccl_ratio}}})
    monkeypatch.setattr(auto_table, "FLOOR_SOURCE", "test floor")
    d, model = _model()
    tokens = torch.randint(0, d.vocab, (1, T), device="cuda", generator=torch.Generator("cuda").manual_seed(T))
    torch._dynamo.reset()
    weave_compile.reset()
    with fake_comm.installed("local"), fake_group.identity_collectives(), counting() as counted:
        with inductor_code.captured() as plain_code:
            plain = _run(torch.compile(model, mode="reduce-overhead", dynamic=False), tokens)
        torch._dynamo.reset()
        with inductor_code.captured() as code:
            got = _run(torch.compile(model, backend="tokenweave", dynamic=False,
                                     options={"kernel": "p2p", "mode": "reduce-overhead", "shard_residual": False}),
                       tokens)
        sites = [s for g in weave_compile.explain().graphs for s in g.sites]
    assert sites, "no all_reduce site in the graph"
    for s in sites:
        if want:
            assert s.fused and s.kernel == want, (s.kernel, s.kernel_reason)
            assert s.kernel_reason.startswith("requested 'p2p' unavailable: not emulated"), s.kernel_reason
            assert "GPU fallback nccl" in s.kernel_reason and "test floor" in s.kernel_reason
        else:
            assert not s.fused and s.reason.startswith("left as written: requested 'p2p' unavailable"), s.reason
    if not want:  # every site as written: the program plain Inductor generates, kernel for kernel
        assert inductor_code.compare(plain_code, code) in ("same", "same but comments"), \
            inductor_code.diff(plain_code, code, ("plain Inductor", "tokenweave"))[:4000]
    assert counted.get("reference", 0) == 0, counted
    if want:
        assert counted.get("nccl", 0) > 0, counted
    assert rel_err(got, plain) < BF16_TOL


def test_the_runtime_fallback_on_cuda_tensors_runs_nccl(group, caplog):  # noqa: F811
    """A design whose workspace cannot grow now (inside CUDA-graph capture) falls back at run time."""
    from weave_compile import kernels
    from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
    from weave_compile.ops import allreduce_add_rmsnorm
    from weave_compile.testing.numerics import rel_err

    class Full(RuntimeError):
        pass

    def full(rows, spec):
        raise Full("workspace too small during capture (test)")

    kernels.register(kernels.Implementation(name="standin_full", summary="test", check=lambda site: None, run=full,
                                            capacity_error=Full))
    try:
        g = torch.Generator("cuda").manual_seed(7)
        x = torch.randn(1, H, device="cuda", generator=g, dtype=torch.bfloat16)  # T=1: every row is rank 0's
        res = torch.randn(1, H, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.randn(H, device="cuda", generator=g, dtype=torch.bfloat16)
        with caplog.at_level(logging.WARNING), fake_group.identity_collectives(), counting() as counted:
            normed, *_ = allreduce_add_rmsnorm(x, res, None, w, eps=1e-6, group_name=group,
                                              residual_dtype=torch.bfloat16, out_dtype=torch.bfloat16, mid_dtype=None,
                                              weight_offset=0.0, residual_in_sharded=False,
                                              residual_out_sharded=False, kernel="standin_full", comm_ctas=32)
        torch.cuda.synchronize()
    finally:
        kernels.unregister("standin_full")
    assert counted.get("nccl", 0) == 1 and counted.get("reference", 0) == 0, counted
    assert "standin_full kernel fell back to nccl: workspace too small" in caplog.text
    # Under the fake group's all_reduce (x itself is the sum), the site as written.
    want, _ = allreduce_add_rmsnorm_ref([x], res, None, w, eps=1e-6)
    assert rel_err(normed, want) < BF16_TOL


def test_forced_nccl_records_cuda_graphs_under_dynamic_shapes(group):  # noqa: F811
    """``dynamic=True`` makes each norm's eps a host graph input; the pass copies it to the device
    once (a host tensor reaching the op inside a CUDA-graph partition fails the recording), and
    the add+norm kernel reads it there. Two token counts, one compile: both recorded, replayed,
    equal to plain Inductor's under the same collectives."""
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    d, model = _model()
    torch._dynamo.reset()
    weave_compile.reset()
    got, plain = {}, {}
    with fake_group.identity_collectives(), counting() as counted:
        ref = torch.compile(model, mode="reduce-overhead", dynamic=True)
        tw = torch.compile(model, backend="tokenweave", dynamic=True,
                           options={"kernel": "nccl", "mode": "reduce-overhead", "shard_residual": False})
        for t in (48, 80):
            tokens = torch.randint(0, d.vocab, (1, t), device="cuda", generator=torch.Generator("cuda").manual_seed(t))
            plain[t] = _run(ref, tokens)
            got[t] = _run(tw, tokens)
        sites = [s for g in weave_compile.explain().graphs for s in g.sites]
    assert sites and all(s.fused and s.kernel == "nccl" for s in sites), [(s.kernel, s.reason) for s in sites]
    assert all("eps a graph input" in s.reason for s in sites), sites[0].reason
    assert counted.get("nccl", 0) > 0 and counted.get("reference", 0) == 0, counted
    for t in got:
        assert rel_err(got[t], plain[t]) < BF16_TOL, t
