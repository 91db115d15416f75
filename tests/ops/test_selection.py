"""Which implementation a fused site gets, and the reason the report shows (symm kernels stood in for)."""

import pytest
import torch

from weave_compile.ops.selection import KERNELS, select_kernel

CUDA = torch.device("cuda", 0)
BF16 = (torch.bfloat16, torch.bfloat16, torch.bfloat16)


@pytest.fixture
def symm(monkeypatch):
    """The symmetric-memory module's two capability checks, answering what the test sets."""
    from weave_compile.kernels import symm_mem_allreduce_rmsnorm as mod

    state = {"variant": "p2p", "reason": "p2p over symmetric memory", "hidden_problem": ""}
    monkeypatch.setattr(mod, "select_symm_variant", lambda group, device, dtype, hidden: (state["variant"],
                                                                                         state["reason"]))
    monkeypatch.setattr(mod, "check_hidden", lambda hidden, dtypes: state["hidden_problem"])
    return state


def test_reference_when_requested_or_off_gpu():
    assert select_kernel("reference", CUDA, BF16, 4096, "g") == ("reference", "requested")
    kernel, why = select_kernel("auto", torch.device("cpu"), BF16, 4096, "g")
    assert kernel == "reference" and "cpu tensors" in why


def test_auto_takes_the_available_variant(symm):
    assert select_kernel("auto", CUDA, BF16, 4096, "g") == ("p2p", "auto: p2p over symmetric memory")
    symm.update(variant="multimem", reason="multicast pointer present")
    assert select_kernel("auto", CUDA, BF16, 4096, "g") == ("multimem", "auto: multicast pointer present")


def test_forced_kernels(symm):
    assert select_kernel("p2p", CUDA, BF16, 4096, "g") == ("p2p", "requested")
    symm.update(variant="multimem")
    assert select_kernel("p2p", CUDA, BF16, 4096, "g") == ("p2p", "requested (multimem also available)")
    symm.update(variant="p2p", reason="no multicast pointer")
    kernel, why = select_kernel("multimem", CUDA, BF16, 4096, "g")
    assert kernel == "reference" and why == "requested 'multimem' unavailable: no multicast pointer"


def test_a_hidden_size_or_dtype_the_kernels_cannot_take_falls_back_with_its_reason(symm):
    symm.update(hidden_problem="hidden size 4100 is not a multiple of 16 bytes")
    for requested in ("auto", "p2p"):
        kernel, why = select_kernel(requested, CUDA, BF16, 4100, "g")
        assert kernel == "reference" and "not a multiple of 16 bytes" in why
    symm.update(variant=None, reason="no symmetric memory on this group", hidden_problem="")
    assert select_kernel("auto", CUDA, BF16, 4096, "g") == ("reference", "no symmetric memory on this group")


def test_kernel_names():
    assert KERNELS == ("reference", "p2p", "multimem")
