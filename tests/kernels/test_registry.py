"""The registry of implementations (kernels/registry.py): everything else derives from it.

A dummy implementation registered through the registry alone must be accepted by the config,
chosen and reported by the fuse pass, and dispatched by the op (its run called, its result used).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weave_compile import TokenWeaveConfig, kernels
from weave_compile.kernels import registry
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks


def _dummy(calls: dict) -> kernels.Implementation:
    """Runs the fallback's math and counts its calls; with ``calls["poison"]`` its normed output is NaN;
    records the sites it reserves for in ``calls["reserved"]``."""

    def run(rows, spec):
        calls["run"] = calls.get("run", 0) + 1
        normed, residual_out = kernels.fallback().run(rows, spec)
        if calls.get("poison"):
            normed = torch.full_like(normed, float("nan"))
        return normed, residual_out

    def reserve(site):
        calls.setdefault("reserved", []).append(site)

    return kernels.Implementation(name="dummy", summary="a test stand-in", check=lambda site: None, run=run,
                                  reserve=reserve)


@pytest.fixture
def dummy():
    calls: dict = {}
    impl = kernels.register(_dummy(calls))
    try:
        yield impl, calls
    finally:
        kernels.unregister("dummy")


def test_the_config_accepts_exactly_the_registered_names(dummy):
    assert TokenWeaveConfig(kernel="dummy").kernel == "dummy"
    assert "dummy" in kernels.names() and kernels.get("dummy") is dummy[0]


def test_an_unregistered_name_is_refused_again():
    with pytest.raises(ValueError, match=r"'kernel' must be one of \['auto', 'reference', .*got 'dummy'"):
        TokenWeaveConfig(kernel="dummy")
    with pytest.raises(ValueError, match="unknown kernel 'dummy'"):
        kernels.get("dummy")


def test_registering_checks_the_name_and_the_single_fallback(dummy):
    impl, _ = dummy
    with pytest.raises(ValueError, match="already registered"):
        kernels.register(impl)
    with pytest.raises(ValueError, match="cannot name an implementation"):
        kernels.register(dataclasses.replace(impl, name="auto"))
    with pytest.raises(ValueError, match="fallback implementation"):
        kernels.register(dataclasses.replace(impl, name="dummy2", fallback=True))
    assert kernels.fallback().name == "reference" and "dummy2" not in kernels.names()
    with pytest.raises(ValueError, match="GPU fallback"):
        kernels.register(dataclasses.replace(impl, name="dummy3", gpu_fallback=True))
    assert kernels.gpu_fallback().name == "nccl" and "dummy3" not in kernels.names()


def _compile_with_dummy(rank, world_size, seed):
    """A 2-layer TP Llama compiled with ``kernel="dummy"`` (registered in this rank's process)."""
    import weave_compile
    from tests.passes.split_tokens.helpers import tokens, tp_llama

    calls: dict = {}
    kernels.register(_dummy(calls))
    try:
        d, model = tp_llama(rank, world_size, seed)
        ids = tokens(d, 1, 12, seed)
        weave_compile.reset()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tokenweave", options={"kernel": "dummy", "compiler": "aot_eager"})
        with torch.no_grad():
            got, want = compiled(ids), model(ids)
            runs = calls.get("run", 0)
            calls["poison"] = True
            poisoned = compiled(ids)
        sites = [(s.fused, s.kernel, s.kernel_reason) for s in weave_compile.explain().sites]
        terms = [site.terms for site in calls.get("reserved", [])]
        return sites, runs, (got - want).abs().max().item(), bool(poisoned.isnan().any()), terms
    finally:
        kernels.unregister("dummy")


def test_a_registered_implementation_is_chosen_reported_and_dispatched(seed):
    for sites, runs, err, poisoned, terms in assert_ranks_ok(run_ranks(_compile_with_dummy, 2, args=(seed,),
                                                                       timeout=600)):
        assert sites and all(s == (True, "dummy", "requested") for s in sites), sites
        # reserved once per site, knowing what the norm applies (a Llama: fp32 weight, no bias)
        assert terms == [kernels.NormTerms(bias=None, weight=torch.float32, mid=None, scale=None)] * len(sites), terms
        assert runs == len(sites)  # one call per fused site and forward
        assert err < 1e-5, err
        assert poisoned  # the op returned what the dummy returned


def test_options_check_a_kernel_name_without_loading_any_implementation():
    """weave_compile.config and Options(...) import no kernel implementation (dependencies point
    down: the registry knows the built-in names), yet the names are the registered ones."""
    import subprocess
    import sys

    code = ("import sys, weave_compile; weave_compile.Options(kernel='nccl', split=True); "
            "print(sorted(m for m in sys.modules if m.startswith('weave_compile.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    assert not [m for m in loaded if m.startswith("weave_compile.kernels.")
                and m.split(".")[2] in registry.BUILTINS], loaded
    assert not [m for m in loaded if m.startswith(("weave_compile.ops", "weave_compile.passes.split_tokens.split"))]
    # the names known unloaded are those the modules register
    assert tuple(e.name for e in registry.implementations()) == registry.BUILTINS == registry.names()
