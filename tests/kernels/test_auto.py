"""Which implementation a fused site gets, and the reason the report shows (kernels/auto.py).

The symmetric-memory probe is stood in for (no GPU here): the tests set what it finds.
"""

import dataclasses

import pytest
import torch

from weave_compile import kernels
from weave_compile.kernels import auto, auto_table, registry
from weave_compile.kernels.shared import probe

CUDA = torch.device("cuda", 0)


def site(**kw) -> kernels.Site:
    """A bf16 site of H=4096 on 2 CUDA ranks (symbolic T unless given)."""
    base = dict(device=CUDA, dtype=torch.bfloat16, residual_dtype=torch.bfloat16, out_dtype=torch.bfloat16,
                hidden=4096, group_name="g", world_size=2)
    return kernels.Site(**{**base, **kw})


@pytest.fixture
def symm(monkeypatch):
    """The symmetric-memory probe and the hidden-size check, answering what the test sets; ``ce``
    (which also needs cuda-python) runs wherever they let it unless ``ce`` says why not."""
    from weave_compile.kernels.ce import copy_engine

    state = {"variant": "p2p", "reason": "p2p over symmetric memory", "hidden_problem": "", "ce": None}
    monkeypatch.setattr(probe, "probe", lambda group, device, dtype, hidden: probe.SymmProbe(
        state["variant"] is not None, state["variant"] == "multimem", state["reason"]))
    monkeypatch.setattr(probe, "check_hidden", lambda hidden, dtypes: state["hidden_problem"])
    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: state["ce"])
    return state


@pytest.fixture
def oneshot_ready():
    """The one-shot kernel as auto would see it once its measurement across GPUs is recorded."""
    old = registry.replace(dataclasses.replace(registry.get("oneshot"), auto_ready=True))
    yield
    registry.replace(old)


def test_reference_when_requested_or_off_gpu():
    assert auto.choose("reference", site()) == ("reference", "requested")
    kernel, why = auto.choose("auto", site(device=torch.device("cpu")))
    assert kernel == "reference" and "cpu tensors" in why


def test_auto_takes_the_available_variant(symm, request):
    # p2p capable, symbolic T: not one-shot; the measured table (world size 2) picks p2p.
    kernel, why = auto.choose("auto", site())
    assert kernel == "p2p" and why.startswith("auto: ") and "not oneshot: symbolic token count" in why
    # A small static T fits the one-shot kernel, but auto waits for its measurement across GPUs ...
    kernel, why = auto.choose("auto", site(num_tokens=64))
    assert kernel == "p2p" and "auto waits for its measurement across GPUs" in why
    # ... and takes it once that is recorded.
    request.getfixturevalue("oneshot_ready")
    kernel, why = auto.choose("auto", site(num_tokens=64))
    assert kernel == "oneshot" and why.startswith("auto: ") and "crossover" in why
    symm.update(variant="multimem", reason="multicast pointer present")
    assert auto.choose("auto", site()) == ("multimem", "auto: multicast pointer present")


def test_forced_kernels(symm):
    assert auto.choose("p2p", site()) == ("p2p", "requested")
    symm.update(variant="multimem")
    assert auto.choose("p2p", site()) == ("p2p", "requested (multimem also available)")
    symm.update(variant="p2p", reason="no multicast pointer")
    kernel, why = auto.choose("multimem", site())
    assert kernel == "reference" and why == "requested 'multimem' unavailable: no multicast pointer"


def test_a_hidden_size_or_dtype_the_kernels_cannot_take_falls_back_with_its_reason(symm):
    symm.update(hidden_problem="hidden size 4100 is not a multiple of 16 bytes")
    for requested in ("auto", "p2p"):
        kernel, why = auto.choose(requested, site(hidden=4100))
        assert kernel == "reference" and "not a multiple of 16 bytes" in why
    symm.update(variant=None, reason="no symmetric memory on this group", hidden_problem="")
    assert auto.choose("auto", site()) == ("reference", "no symmetric memory on this group")


def test_what_an_implementation_takes_decides_before_its_check(symm):
    """A scale or an eps on the device goes only where it is taken; nothing else is probed. Of
    auto's candidates only ce takes a scale: where it runs, a scaled site gets it by capability."""
    kernel, why = auto.choose("auto", site(has_scale=True))
    assert kernel == "ce" and "by capability" in why
    symm.update(ce="cuda-python is not installed (test)")
    kernel, why = auto.choose("auto", site(has_scale=True))
    assert kernel == "reference" and why == ("scaled site: only reference, ce, nccl take a scale; "
                                             "cuda-python is not installed (test)")
    kernel, why = auto.choose("p2p", site(has_scale=True))
    assert kernel == "reference" and why.startswith("requested 'p2p' unavailable: scaled site")
    kernel, why = auto.choose("auto", site(eps_on_device=True))
    assert kernel == "reference" and "eps is a device tensor" in why
    symm.update(variant=None, reason="probe must not decide this")
    assert "probe" not in auto.choose("auto", site(has_scale=True))[1]


def test_kernel_names():
    assert kernels.names() == ("reference", "p2p", "multimem", "oneshot", "ce", "nccl")


# ----------------------------------------------------------------------------- ce and nccl (forced only)


BF16 = (torch.bfloat16,) * 3


def test_forced_on_cpu_falls_back_with_reason():
    for k in ("ce", "nccl"):
        kernel, why = auto.choose(k, site(device=torch.device("cpu")))
        assert kernel == "reference" and k in why and "cpu" in why


def test_forced_ce_without_cuda_python_says_so(monkeypatch):
    from weave_compile.kernels.ce import copy_engine
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: "cuda-python is not installed (test)")
    monkeypatch.setattr(addnorm, "unavailable_reason", lambda *a: None)
    kernel, why = auto.choose("ce", site())
    assert kernel == "reference" and "cuda-python" in why


def test_hidden_too_large_is_refused(monkeypatch):
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(addnorm, "HAS_TRITON", True)
    kernel, why = auto.choose("nccl", site(hidden=1 << 15))
    assert kernel == "reference" and "hidden" in why


def test_a_forced_implementation_that_takes_a_scale_runs_a_scaled_site(monkeypatch):
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(addnorm, "unavailable_reason", lambda *a: None)
    assert auto.choose("nccl", site(has_scale=True)) == ("nccl", "requested")


# ----------------------------------------------------------------------------- the measured table


def test_auto_picks_only_measured_designs(symm):
    p2p, multimem = registry.get("p2p"), registry.get("multimem")
    # Measured: world 2, unsplit and split, p2p. Each pick names its source row.
    k, why = auto.from_table([p2p], site(num_tokens=2500))
    assert k == "p2p" and "nearest measured T=2048" in why and "2x H200" in why
    k, why = auto.from_table([p2p], site(num_tokens=5000, split=True))
    assert k == "p2p" and "split" in why
    # Multimem can run here but was never measured: the table does not pick it.
    k, _ = auto.from_table([multimem, p2p], site(num_tokens=4096))
    assert k == "p2p"
    k, why = auto.from_table([multimem], site(num_tokens=4096))
    assert k is None and "none of them can run here" in why
    # Unmeasured world size or size: the capability order's pick, and the reason says it is not measured.
    k, why = auto.choose("auto", site(world_size=8, num_tokens=4096))
    assert k == "p2p" and "world size 8" in why and "by capability" in why
    k, why = auto.choose("auto", site(num_tokens=40))
    assert k == "p2p" and "outside the measured range" in why and "by capability" in why
    # Nothing that can run: reference.
    symm.update(variant=None, reason="no symmetric memory")
    k, why = auto.choose("auto", site(num_tokens=4096))
    assert k == "reference" and "no symmetric memory" in why
    symm.update(variant="p2p", reason="ok")
    # Unknown T at compile time: the design that won at every measured T.
    k, why = auto.choose("auto", site())
    assert k == "p2p" and "unknown" in why


def test_table_rows_are_positive_times_of_selectable_kernels():
    assert auto_table.TABLE
    for (world, split), rows in auto_table.TABLE.items():
        assert world >= 2 and isinstance(split, bool)
        for t, row in rows.items():
            assert t > 0 and row and all(d in kernels.names() and us > 0 for d, us in row.items())


# ----------------------------------------------------------------------------- the split model


def _write_csv(path, rows):
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


#: (design, ctas, rows, slowdown, comm alone us, comm beside us): one H200, Llama-8B TP=2 GEMMs of
#: 2048 rows, 6 layer passes = 3447 us (WAVE2 measurements), plus made-up points that test the rules.
FIXTURE = [("p2p", 2, 2048, 1.317, 461, 821), ("p2p", 8, 2048, 1.404, 132, 261), ("p2p", 32, 2048, 1.262, 56, 137),
           ("ce", 2, 2048, 1.077, 298, 676), ("ce", 8, 2048, 1.043, 118, 307), ("ce", 32, 2048, 1.029, 76, 198),
           ("oneshot", 32, 2048, 1.586, 207, 304), ("p2p_barriers", 8, 2048, 1.011, 8, 23),
           ("standin:spin", 4, 2048, 1.446, 0, 0),
           # 8192 rows (T=16384): here p2p wins (made up)
           ("p2p", 32, 8192, 1.01, 200, 210), ("ce", 32, 8192, 1.03, 300, ""),
           ]


def _interference_rows():
    base = dict(gpu="NVIDIA H200", dims="8b", tp=2, gemm_reps=6, gemm_alone_us=3447.0, comm_calls=10, torch="2.11",
                triton="3.6.0", git_commit="abc1234", date="2026-12-03")
    out = [dict(base, design=d, ctas=c, rows=r, slowdown=s, comm_alone_us=a, comm_with_gemm_us=b,
                gemm_with_comm_us=round(3447.0 * s, 1)) for d, c, r, s, a, b in FIXTURE]
    # rows whose comm was not measured at their world size (tp=8 GEMMs, comm emulated at 2 ranks)
    out.append(dict(base, design="p2p", ctas=32, rows=2048, tp=8, slowdown=1.0, comm_alone_us=1, comm_with_gemm_us=1,
                    gemm_with_comm_us=3447.0))
    out.append(dict(base, design="ce", ctas=32, rows=2048, dims="70b", gemm_alone_us=9000.0, slowdown=1.02,
                    comm_alone_us=150, comm_with_gemm_us=380, gemm_with_comm_us=9180.0))
    return out


@pytest.fixture
def generated(tmp_path, monkeypatch):
    """make_auto_table.py run on fixture CSVs; its module, and auto reading its tables."""
    import importlib.util
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    monkeypatch.syspath_prepend(bench)
    import make_auto_table

    _write_csv(tmp_path / "interference.csv", _interference_rows())
    _write_csv(tmp_path / "split_8b.csv", [dict(world_size=2, T=t, variant="split", ms_per_layer=ms, git_commit="s1")
                                           for t, ms in ((1024, 0.5), (16384, 9.0))])
    _write_csv(tmp_path / "allreduce_rmsnorm.csv", [dict(world_size=2, dtype="bf16", mode="graph", H=8192, T=4096,
                                                         variant="fused_symm", us=270.0, git_commit="u1")])
    make_auto_table.main(["--results", str(tmp_path), "--out", str(tmp_path / "table.py")])
    spec = importlib.util.spec_from_file_location("generated_auto_table", tmp_path / "table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules.pop("make_auto_table", None)
    for name in ("SOURCE", "TABLE", "INTERFERENCE_SOURCE", "INTERFERENCE"):
        monkeypatch.setattr(auto_table, name, getattr(mod, name))
    return mod


def test_make_auto_table_enters_designs_at_their_world_size(generated):
    inter = generated.INTERFERENCE
    assert set(inter) == {(2, 4096), (2, 8192)}
    assert set(inter[(2, 4096)]) == {4096, 16384}  # T = 2 x rows
    at4k = inter[(2, 4096)][4096]
    assert set(at4k) == {"p2p", "ce", "oneshot"}  # no stand-ins, no p2p_barriers
    assert at4k["ce"][32] == {"gemm_us": 574.5, "slowdown": 1.029, "comm_alone_us": 76.0, "comm_with_gemm_us": 198.0}
    assert at4k["p2p"][32]["slowdown"] == 1.262  # the tp=8 row (slowdown 1.0) did not enter
    assert inter[(2, 4096)][16384]["ce"][32]["comm_with_gemm_us"] is None
    assert "interference.csv" in generated.INTERFERENCE_SOURCE and "abc1234" in generated.INTERFERENCE_SOURCE
    assert generated.TABLE == {(2, False): {4096: {"p2p": 270.0}}, (2, True): {1024: {"p2p": 500.0},
                                                                                16384: {"p2p": 9000.0}}}


@pytest.fixture
def ce_runs(monkeypatch):
    from weave_compile.kernels.ce import copy_engine
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: None)
    monkeypatch.setattr(addnorm, "unavailable_reason", lambda *a: None)


def test_split_model_picks_the_least_predicted_phase(symm, ce_runs, generated):
    # T=4096 (2048 rows per half), 32 CTAs: p2p max(287 x 1.262, 137) = 363 us, ce max(287 x 1.029, 198) = 296.
    kernel, why = auto.choose("auto", site(num_tokens=4096, split=True, comm_ctas=32))
    assert kernel == "ce", why
    assert "ce@32 296 us" in why and "p2p@32 363 us" in why and "2048 rows per half" in why
    assert "interference.csv" in why
    # At 2 CTAs both are comm-bound: p2p 821 us beside the GEMMs, ce 676.
    kernel, why = auto.choose("auto", site(num_tokens=4096, split=True, comm_ctas=2))
    assert kernel == "ce" and "p2p@2 821 us" in why and "ce@2 676 us" in why
    # 12 CTAs: the nearest measured count (16 is not measured: 8 and 32 are; log-nearest is 8).
    assert "ce@8" in auto.choose("auto", site(num_tokens=4096, split=True, comm_ctas=12))[1]
    # T=16384: p2p costs the GEMMs less there; ce's time beside them was not measured (its alone time is used).
    kernel, why = auto.choose("auto", site(num_tokens=16384, split=True, comm_ctas=32))
    assert kernel == "p2p" and "alone (not measured beside them)" in why
    # Unsplit: the fused op alone, today's table (ce is not in it).
    kernel, why = auto.choose("auto", site(num_tokens=4096, split=False))
    assert kernel == "p2p" and "fastest measured" in why


def test_split_model_takes_only_what_can_run_and_says_where_it_does_not_decide(symm, ce_runs, generated, monkeypatch):
    from weave_compile.kernels.ce import copy_engine

    # ce cannot run: the model ranks p2p alone.
    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: "cuda-python is not installed (test)")
    kernel, why = auto.choose("auto", site(num_tokens=4096, split=True, comm_ctas=32))
    assert kernel == "p2p" and "p2p@32" in why and "ce@" not in why
    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: None)
    # Outside the measured range: the whole-model split table decides, and the reason says why.
    kernel, why = auto.choose("auto", site(num_tokens=100_000, split=True, comm_ctas=32))
    assert kernel == "p2p" and "split model: T=100000 outside" in why
    # A hidden size far from every measured one.
    kernel, why = auto.choose("auto", site(hidden=1024, num_tokens=4096, split=True))
    assert "no interference measured near H=1024" in why
    # H=8192: only ce measured there.
    kernel, why = auto.choose("auto", site(hidden=8192, num_tokens=4096, split=True, comm_ctas=32))
    assert kernel == "ce" and "H=8192" in why
    # Unknown T: ce wins at T=4096, p2p at 16384: no single winner, so the model does not decide.
    kernel, why = auto.choose("auto", site(split=True, comm_ctas=32))
    assert "no design has the least predicted phase at every measured T" in why
    # The configured CTA count defaults to the op's default.
    assert auto.from_split_model([registry.get("p2p"), registry.get("ce")],
                                 site(num_tokens=4096, split=True))[0] == "ce"


def test_without_interference_measurements_the_split_keeps_todays_table(symm, ce_runs):
    assert auto_table.INTERFERENCE == {} or "not measured" not in auto_table.INTERFERENCE_SOURCE
    if auto_table.INTERFERENCE:
        pytest.skip("the committed table has interference rows")
    kernel, why = auto.choose("auto", site(num_tokens=4096, split=True))
    assert kernel == "p2p" and "no interference measured at world size 2" in why and "fastest measured" in why
