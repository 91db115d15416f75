"""Tests for kernels/multimem/launch.py and the registry entry: what the pull kernel is launched with.

The kernel is stubbed in these tests (nothing compiles or runs, multimem or not): they check the
keywords the launcher hands it. The kernel's LayerNorm variant is compiled for sm_90 in
tests/testing/test_ptx.py and run without multicast (peer loads, ``p2p_pull``) under Triton's
interpreter in tests/kernels/p2p/test_launch.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels import _layernorm_cases as lc
from weave_compile.kernels import registry
from weave_compile.kernels.shared.common import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def test_the_registry_entry_takes_a_layernorm():
    assert registry.get("multimem").takes_layernorm


@pytest.mark.parametrize("use_multimem", [False, True])
def test_the_launcher_passes_the_layernorm_keywords_only_for_a_layernorm_or_a_norm_bias(monkeypatch, use_multimem):
    """``lc.check_layernorm_keywords`` through ``launch_pull`` (multimem instructions or peer loads) and
    ``pull_on``, which stages x into the input buffer (with peer loads only: multimem there needs a
    multicast pointer, which the emulated workspace does not have)."""
    from weave_compile.kernels.multimem import launch
    from weave_compile.kernels.spec import FusedSpec, Rows
    from weave_compile.testing.emulated_ranks import EmulatedRanks

    stub = lc.KernelStub()
    monkeypatch.setattr(launch, "pull_allreduce_rmsnorm_kernel", stub)
    H, T, bf = 64, 6, torch.bfloat16
    ws = EmulatedRanks.create(2, H, T, dtype=bf, device="cpu").workspaces[0]
    x = torch.randn(T, H).to(bf)

    def keywords(norm, nb, via_pull_on):
        spec = FusedSpec(residual_dtype=bf, out_dtype=bf, comm_ctas=2, norm=norm)
        if via_pull_on:
            launch.pull_on(ws, Rows(x, norm_bias=nb), spec, use_multimem=False)
        else:
            launch.launch_pull(ws, Rows(x, norm_bias=nb), spec, None, use_multimem=use_multimem)
        kw = stub.seen.pop()
        assert kw["USE_MULTIMEM"] is (use_multimem and not via_pull_on)
        return kw

    lc.check_layernorm_keywords(keywords, H, bf)
