"""Tests for kernels/select.py: kernel selection against fake symmetric-memory handles."""

from types import SimpleNamespace

import pytest
import torch

from weave_compile import kernels
from weave_compile.kernels import HAS_TRITON

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def _fake_handle(mc=0, world=2, ptrs=None):
    return SimpleNamespace(multicast_ptr=mc, world_size=world, rank=0,
                           buffer_ptrs=ptrs if ptrs is not None else [0x1000 * (i + 1)
                                                                      for i in range(world)])


@requires_triton
def test_select_p2p_without_multicast():
    v, why = kernels.select_symm_variant("g", "cpu", torch.bfloat16, 4096, handle=_fake_handle(0))
    assert v == "p2p", why


@requires_triton
def test_select_multimem_only_with_multicast():
    v, why = kernels.select_symm_variant("g", "cpu", torch.bfloat16, 4096,
                                     handle=_fake_handle(0x7F0000000000))
    assert v == "multimem", why
    for dt in (torch.float16, torch.float32):
        assert kernels.select_symm_variant("g", "cpu", dt, 8192,
                                       handle=_fake_handle(0x7F0000000000))[0] == "multimem"


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
        v, why = kernels.select_symm_variant("g", "cpu", dtype, hidden, handle=_fake_handle(mc))
        assert v is None and "hidden" in why


@requires_triton
def test_select_fp32_vector_width_is_4():
    assert kernels.vector_width(torch.float32) == 4 and kernels.vector_width(torch.bfloat16) == 8
    v, why = kernels.select_symm_variant("g", "cpu", torch.float32, 4100, handle=_fake_handle(0))
    assert v == "p2p", why


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_select_rejects_bad_dtype(dtype):
    v, why = kernels.select_symm_variant("g", "cpu", dtype, 4096, handle=_fake_handle(0x7F00))
    assert v is None and "dtype" in why


@requires_triton
def test_select_rejects_unmapped_peers_and_big_worlds():
    v, why = kernels.select_symm_variant("g", "cpu", torch.bfloat16, 4096,
                                     handle=_fake_handle(0, 2, [0x1000, 0]))
    assert v is None and "P2P" in why
    v, why = kernels.select_symm_variant("g", "cpu", torch.bfloat16, 4096,
                                     handle=_fake_handle(0, 16))
    assert v is None and "world size" in why


def test_select_without_distributed_is_none():
    if not HAS_TRITON:
        pytest.skip("triton not installed")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised")
    v, why = kernels.select_symm_variant("g", "cuda", torch.bfloat16, 4096)
    assert v is None and why


def test_check_hidden_names_the_problem():
    assert kernels.check_hidden(4096, [torch.bfloat16, torch.float32]) is None
    assert "vector width" in kernels.check_hidden(4100, [torch.float32, torch.bfloat16])
    assert "dtype" in kernels.check_hidden(4096, [torch.float64])
    assert "outside" in kernels.check_hidden(16384 + 8, [torch.bfloat16])
