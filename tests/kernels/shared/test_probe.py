"""Tests for kernels/shared/probe.py: what the probe finds on fake symmetric-memory handles."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from weave_compile.kernels.shared import probe
from weave_compile.kernels.shared.common import HAS_TRITON, vector_width

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def _fake_handle(mc=0, world=2, ptrs=None):
    return SimpleNamespace(multicast_ptr=mc, world_size=world, rank=0,
                           buffer_ptrs=ptrs if ptrs is not None else [0x1000 * (i + 1)
                                                                      for i in range(world)])


@requires_triton
def test_select_p2p_without_multicast():
    p = probe.probe("g", "cpu", torch.bfloat16, 4096, handle=_fake_handle(0))
    assert p.mapped and not p.multicast, p.reason


@requires_triton
def test_select_multimem_only_with_multicast():
    p = probe.probe("g", "cpu", torch.bfloat16, 4096, handle=_fake_handle(0x7F0000000000))
    assert p.mapped and p.multicast, p.reason
    for dt in (torch.float16, torch.float32):
        assert probe.probe("g", "cpu", dt, 8192, handle=_fake_handle(0x7F0000000000)).multicast


@requires_triton
@pytest.mark.parametrize("dtype,hidden", [
    (torch.bfloat16, 4100),  # not a multiple of 8
    (torch.float16, 4092),  # multiple of 4 only
    (torch.float32, 4098),  # not a multiple of 4
    (torch.bfloat16, 32768),  # row does not fit in registers
    (torch.bfloat16, 0),
])
def test_select_rejects_bad_hidden(dtype, hidden):
    for mc in (0, 0x7F0000000000):
        p = probe.probe("g", "cpu", dtype, hidden, handle=_fake_handle(mc))
        assert not p.mapped and not p.multicast and "hidden" in p.reason


@requires_triton
def test_select_fp32_vector_width_is_4():
    assert vector_width(torch.float32) == 4 and vector_width(torch.bfloat16) == 8
    p = probe.probe("g", "cpu", torch.float32, 4100, handle=_fake_handle(0))
    assert p.mapped and not p.multicast, p.reason


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_select_rejects_bad_dtype(dtype):
    p = probe.probe("g", "cpu", dtype, 4096, handle=_fake_handle(0x7F00))
    assert not p.mapped and not p.multicast and "dtype" in p.reason


@requires_triton
def test_select_rejects_unmapped_peers_and_big_worlds():
    p = probe.probe("g", "cpu", torch.bfloat16, 4096, handle=_fake_handle(0, 2, [0x1000, 0]))
    assert not p.mapped and "P2P" in p.reason
    p = probe.probe("g", "cpu", torch.bfloat16, 4096, handle=_fake_handle(0, 16))
    assert not p.mapped and "world size" in p.reason


def test_select_without_distributed_is_none():
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised")
    p = probe.probe("g", "cuda", torch.bfloat16, 4096)
    assert not p.mapped and p.reason


def test_probe_of_a_site_needs_cuda_and_every_stored_dtype_to_fit(monkeypatch):
    from weave_compile.kernels.registry import Site

    monkeypatch.setattr(probe, "probe", lambda *a, **k: probe.SymmProbe(True, False, "mapped"))
    site = Site(device=torch.device("cuda", 0), dtype=torch.float32, residual_dtype=torch.float32,
                out_dtype=torch.float32, hidden=4100, group_name="g", world_size=2)
    assert probe.probe_site(site).mapped  # 4100 fp32: 4-element vectors fit
    p = probe.probe_site(dataclasses.replace(site, out_dtype=torch.bfloat16))  # 8-element vectors do not
    assert not p.mapped and "vector width" in p.reason
    p = probe.probe_site(dataclasses.replace(site, device=torch.device("cpu")))
    assert not p.mapped and "cpu tensors" in p.reason


def test_check_hidden_names_the_problem():
    assert probe.check_hidden(4096, [torch.bfloat16, torch.float32]) is None
    assert "vector width" in probe.check_hidden(4100, [torch.float32, torch.bfloat16])
    assert "dtype" in probe.check_hidden(4096, [torch.float64])
    assert "outside" in probe.check_hidden(16384 + 8, [torch.bfloat16])


@requires_triton
def test_a_fake_process_group_gets_a_short_reason_not_pytorchs_internal_assert():
    """Under the fake group (one-GPU benchmarks) explain() showed "fn INTERNAL ASSERT FAILED at
    .../init.cpp:219, please report a bug to PyTorch. Not implemented." as the reason."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        p = probe.probe(dist.group.WORLD.group_name, torch.device("cuda", 0), torch.bfloat16, 4096)
    finally:
        dist.destroy_process_group()
    assert not p.mapped and p.reason == probe.FAKE_GROUP, p.reason


def test_an_internal_assert_is_reported_without_its_bug_report_text():
    e = RuntimeError('fn INTERNAL ASSERT FAILED at "/pytorch/torch/csrc/distributed/c10d/init.cpp":219, please '
                     'report a bug to PyTorch. Not implemented.')
    assert probe._short(e) == "PyTorch's setup failed inside (Not implemented)"
    assert probe._short(ValueError("no P2P\nsecond line")) == "no P2P"
