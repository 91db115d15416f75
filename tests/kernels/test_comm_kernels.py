"""Selection of ``ce`` / ``nccl`` and the measured ``auto`` table (kernels/comm_kernels.py, auto_table.py)."""

from __future__ import annotations

import torch

from weave_compile.kernels import auto_table, comm_kernels
from weave_compile.ops.selection import select_kernel

BF16 = (torch.bfloat16,) * 3


def test_forced_on_cpu_falls_back_with_reason():
    for k in ("ce", "nccl"):
        kernel, why = select_kernel(k, torch.device("cpu"), BF16, 4096, "0")
        assert kernel == "reference" and k in why and "cpu" in why


def test_forced_ce_without_cuda_python_says_so(monkeypatch):
    from weave_compile.kernels import copy_engine

    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: "cuda-python is not installed (test)")
    monkeypatch.setattr(comm_kernels, "_common_reason", lambda *a: None)
    kernel, why = comm_kernels.select("ce", torch.device("cuda", 0), BF16, 4096, "0")
    assert kernel == "reference" and "cuda-python" in why


def test_hidden_too_large_is_refused(monkeypatch):
    monkeypatch.setattr(comm_kernels.addnorm, "HAS_TRITON", True)
    kernel, why = comm_kernels.select("nccl", torch.device("cuda", 0), BF16, 1 << 15, "0")
    assert kernel == "reference" and "hidden" in why


def test_auto_picks_only_measured_designs():
    # Measured: world 2, unsplit and split, p2p. Each pick names its source row.
    k, why = comm_kernels.pick_auto("p2p", "ok", 2, 2500, False)
    assert k == "p2p" and "nearest measured T=2048" in why and "2x H200" in why
    k, why = comm_kernels.pick_auto("p2p", "ok", 2, 5000, True)
    assert k == "p2p" and "split" in why
    # Multimem is capable here but was never measured: auto does not pick it.
    k, _ = comm_kernels.pick_auto("multimem", "ok", 2, 4096, False)
    assert k == "p2p"
    # Unmeasured world size or size: the capability order's pick, and the reason says it is not measured.
    k, why = comm_kernels.pick_auto("p2p", "ok", 8, 4096, False)
    assert k == "p2p" and "world size 8" in why and "by capability" in why
    k, why = comm_kernels.pick_auto("p2p", "ok", 2, 40, False)
    assert k == "p2p" and "outside the measured range" in why and "by capability" in why
    # Nothing that can run: reference.
    k, why = comm_kernels.pick_auto(None, "no symmetric memory", 2, 4096, False)
    assert k == "reference" and "no symmetric memory" in why
    # Unknown T at compile time: the design that won at every measured T.
    k, why = comm_kernels.pick_auto("p2p", "ok", 2, None, False)
    assert k == "p2p" and "unknown" in why


def test_table_rows_are_positive_times_of_selectable_kernels():
    from weave_compile.ops.selection import KERNELS

    assert auto_table.TABLE
    for (world, split), rows in auto_table.TABLE.items():
        assert world >= 2 and isinstance(split, bool)
        for t, row in rows.items():
            assert t > 0 and row and all(d in KERNELS and us > 0 for d, us in row.items())
