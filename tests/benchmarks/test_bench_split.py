"""benchmarks/bench_split.py on CPU: its variants, the ``autotune`` one (the defaults: what a user
gets) among them, and what the point check accepts for it."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_split  # noqa: E402

sys.path.pop(0)


def _args(**kw):
    base = dict(fake_comm=False, rehearse=False, variants="", designs="", sweep="", sweep_offsets="", hf="")
    return SimpleNamespace(**{**base, **kw})


def test_two_gpus_time_the_defaults_beside_plain_torch_compile():
    assert bench_split.variants_of(_args()) == ["default", "autotune", "nocomm", "fused", "split"]
    assert bench_split.variants_of(_args(designs="p2p,ce"))[:3] == ["default", "autotune", "nocomm"]
    assert bench_split.parse_variant("autotune") == ("autotune", "", "", "")


@pytest.mark.parametrize("bad", [dict(variants="autotune/p2p"), dict(variants="autotune:64"),
                                 dict(fake_comm=True, variants="autotune"), dict(variants="tuned")])
def test_an_autotune_variant_that_would_time_something_else_is_refused(bad):
    with pytest.raises(SystemExit):
        bench_split.variants_of(_args(**bad))


def test_the_point_check_takes_sites_left_as_written_from_autotune_only(monkeypatch):
    import weave_compile

    site = SimpleNamespace(fused=False, kernel="-", reason="as written: measured", kernel_reason="", node="ar")
    monkeypatch.setattr(weave_compile, "explain", lambda: SimpleNamespace(graphs=[SimpleNamespace(sites=[site])]))
    check = bench_split.PointCheck(None)
    assert check.sites("autotune", "", True) == "as written"
    with pytest.raises(RuntimeError, match="no all_reduce site was fused"):
        check.sites("fused", "", True)
    site.fused, site.kernel = True, "nccl"
    assert check.sites("autotune", "", True) == "nccl"
