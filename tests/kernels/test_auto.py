"""Which implementation a fused site gets, or whether it stays as written, and the reason the report
shows (kernels/auto.py).

The symmetric-memory probe is stood in for (no GPU here): the tests set what it finds. Sites on a
CUDA device are only descriptions (``kernels.Site``): the choice is made from them alone, so the
GPU policy is tested here on CPU; ``tests/kernels/test_auto_gpu.py`` checks it on a real site.
"""

import dataclasses

import pytest
import torch

from weave_compile import kernels
from weave_compile.kernels import auto, auto_table, registry
from weave_compile.kernels.shared import probe

CUDA = torch.device("cuda", 0)
AS_WRITTEN = auto.AS_WRITTEN


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


#: The floor as bench_floor.py measures it (nccl's ms per layer over plain Inductor's, worst of the
#: architectures): slower at decode sizes, within noise at 1K, faster from 4K (the shape of the
#: Llama-8B measurement that opened this policy; the numbers here are the test's).
FLOOR = {(2, 4096): {1: {"nccl": 1.28}, 16: {"nccl": 1.14}, 128: {"nccl": 1.12}, 512: {"nccl": 1.05},
                     1024: {"nccl": 0.99}, 4096: {"nccl": 0.90}, 8192: {"nccl": 0.88}, 16384: {"nccl": 0.87}}}


@pytest.fixture
def tables(monkeypatch):
    """The measured tables as the test sets them (empty unless set): ``tables(TABLE=..., FLOOR=...)``."""
    for name in ("TABLE", "INTERFERENCE", "FLOOR"):
        monkeypatch.setattr(auto_table, name, {})
    monkeypatch.setattr(auto_table, "FLOOR_SOURCE", "floor.csv (test)")
    monkeypatch.setattr(auto_table, "SOURCE", "allreduce_rmsnorm.csv (test)")

    def set_tables(**kw):
        for name, value in kw.items():
            monkeypatch.setattr(auto_table, name, value)

    return set_tables


@pytest.fixture
def ready(request):
    """Designs as auto would see them once their measurement across GPUs is recorded."""
    old = []

    def make_ready(*names):
        for name in names:
            old.append(registry.replace(dataclasses.replace(registry.get(name), auto_ready=True)))

    yield make_ready
    for impl in old:
        registry.replace(impl)


def test_reference_when_requested_or_off_gpu(tables):
    assert auto.choose("reference", site()) == ("reference", "requested")
    kernel, why = auto.choose("auto", site(device=torch.device("cpu")))
    assert kernel == "reference" and "cpu tensors" in why
    for forced in ("p2p", "nccl", "ce"):  # off GPUs every forced design falls back to reference
        kernel, why = auto.choose(forced, site(device=torch.device("cpu")))
        assert kernel == "reference" and forced in why and "cpu" in why


def test_a_forced_implementation_that_cannot_run_on_a_gpu_gets_the_compiled_fallback_not_reference(symm, tables):
    """The done-when case on CPU: a CUDA site whose forced design cannot run gets nccl where the floor
    measured it faster at that T, the site as written where plain Inductor was, never reference."""
    tables(FLOOR=FLOOR)
    symm.update(variant="p2p", reason="no multicast pointer")
    for t in (4096, 8192, 16384, 30000):
        kernel, why = auto.choose("multimem", site(num_tokens=t))
        assert kernel == "nccl", (t, why)
        assert why.startswith("requested 'multimem' unavailable: no multicast pointer; GPU fallback nccl: ")
        assert "of plain Inductor (wins from T=4096 on)" in why and "floor.csv (test)" in why
    for t in (1, 16, 1024, 2048):
        kernel, why = auto.choose("multimem", site(num_tokens=t))
        assert kernel == AS_WRITTEN, (t, why)
        assert "left as written: plain Inductor measured faster, or nccl less than 2% faster, at T<=1024" in why, why
    assert "nccl 1.28x at T=1" in auto.choose("multimem", site(num_tokens=1))[1]
    assert "nccl 1.05x at T=512" in auto.choose("multimem", site(num_tokens=600))[1]
    # p2p forced where symmetric memory fails, and a design needing a package that is missing.
    symm.update(variant=None, reason="symmetric memory unavailable for group g: no store")
    assert auto.choose("p2p", site(num_tokens=8192))[0] == "nccl"
    symm.update(variant="p2p", ce="cuda-python is not installed (test)")
    kernel, why = auto.choose("ce", site(num_tokens=1))
    assert kernel == AS_WRITTEN and "cuda-python" in why and "reference" not in why


def test_without_a_floor_measurement_the_gpu_fallback_leaves_the_site_as_written(symm, tables):
    symm.update(variant=None, reason="no symmetric memory on this group")
    kernel, why = auto.choose("p2p", site(num_tokens=8192))
    assert kernel == AS_WRITTEN
    assert "no floor measured at world size 2" in why and "plain Inductor is kept" in why
    tables(FLOOR=FLOOR)
    kernel, why = auto.choose("p2p", site(hidden=16384, num_tokens=8192))  # H far from every measured one
    assert kernel == AS_WRITTEN and "no floor measured near H=16384" in why


def test_the_gpu_fallback_that_cannot_run_either_leaves_the_site_as_written(symm, tables):
    tables(FLOOR=FLOOR)
    kernel, why = auto.choose("nccl", site(num_tokens=8192, dtype=torch.float64))
    assert kernel == AS_WRITTEN and "not supported" in why
    kernel, why = auto.choose("auto", site(num_tokens=8192, dtype=torch.float64))
    assert kernel == AS_WRITTEN and "nccl, the GPU fallback, cannot run here either" in why


def test_a_device_eps_goes_to_the_designs_that_read_it_there(symm, tables):
    """Under dynamic shapes eps reaches the op as a device tensor. Every design that runs reads it
    there; multimem (compiled, never run here) reads it on the host, so a site forced to it gets
    the GPU fallback, which reads it there."""
    tables(FLOOR=FLOOR)
    readers = sorted(e.name for e in registry.implementations() if e.takes_eps_tensor)
    assert readers == ["ce", "nccl", "oneshot", "p2p", "reference"], readers
    for name in ("p2p", "ce", "oneshot"):
        assert auto.choose(name, site(num_tokens=8192, eps_on_device=True)) == (name, "requested"), name
    symm.update(variant="multimem", reason="multicast pointer present")
    kernel, why = auto.choose("multimem", site(num_tokens=8192, eps_on_device=True))
    assert why.startswith("requested 'multimem' unavailable: eps is a device tensor: only reference, p2p, "
                          "oneshot, ce, nccl read it"), why
    assert kernel == "nccl" and "GPU fallback nccl" in why, (kernel, why)  # the floor: nccl faster at 8K
    kernel, why = auto.choose("auto", site(num_tokens=16, eps_on_device=True))
    assert kernel == AS_WRITTEN and "cannot run here" not in why, (kernel, why)  # the floor: slower at 16


def test_under_the_split_the_fallback_is_the_compiled_design(symm, tables):
    """The split needs a fused op at the sites it splits: the GPU fallback, not the plain graph."""
    symm.update(variant=None, reason="no symmetric memory")
    kernel, why = auto.choose("auto", site(num_tokens=1024, split=True))
    assert kernel == "nccl" and "the split needs a fused op" in why


def test_floor_rules(symm, tables):
    """From the crossover on, within twice the largest measured T; nothing below it, nothing unbounded."""
    tables(FLOOR=FLOOR)
    nccl = "nccl"
    assert auto.floor_verdict(nccl, site(num_tokens=4096))[0]
    assert auto.floor_verdict(nccl, site(num_tokens=3000))[0] is False  # between a loser (1024) and 4096
    assert auto.floor_verdict(nccl, site(num_tokens=32768))[0]  # twice the largest measured
    takes, why = auto.floor_verdict(nccl, site(num_tokens=40000))
    assert not takes and "exceeds twice the largest measured T=16384" in why
    # A symbolic T: its bounds from the shape environment decide; without them, the plain graph.
    assert auto.floor_verdict(nccl, site(token_range=(4096, 16384)))[0]
    takes, why = auto.floor_verdict(nccl, site(token_range=(2, None)))
    assert not takes and "plain Inductor measured faster, or nccl less than 2% faster, at T<=1024" in why
    takes, why = auto.floor_verdict(nccl, site(token_range=(4096, None)))
    assert not takes and "unbounded" in why
    takes, why = auto.floor_verdict(nccl, site())
    assert not takes and "token count unknown at compile time" in why
    # Within MIN_GAIN of plain Inductor is not faster; a loss above a win moves the crossover up.
    tables(FLOOR={(2, 4096): {1024: {"nccl": 0.99}, 4096: {"nccl": 0.985}, 8192: {"nccl": 0.97}}})
    assert not auto.floor_verdict(nccl, site(num_tokens=4096))[0]
    assert auto.floor_verdict(nccl, site(num_tokens=8192))[0]
    tables(FLOOR={(2, 4096): {1024: {"nccl": 0.9}, 4096: {"nccl": 1.01}, 8192: {"nccl": 0.9}}})
    assert not auto.floor_verdict(nccl, site(num_tokens=1024))[0]
    tables(FLOOR={(2, 4096): {1024: {"nccl": 0.9}, 4096: {"nccl": 1.01}}})
    takes, why = auto.floor_verdict(nccl, site(num_tokens=1024))
    assert not takes and "up to T=4096" in why
    # The floor measures all_reduce sites: a sequence-parallel site (reduce-scatter of the model's
    # shard) keeps its plain graph, which already norms this rank's rows only.
    tables(FLOOR=FLOOR)
    takes, why = auto.floor_verdict(nccl, site(num_tokens=8192, sequence_parallel=True))
    assert not takes and "sequence-parallel site: its plain graph already norms" in why
        # A design not measured at a T does not win there.
    tables(FLOOR={(2, 4096): {1024: {"reference": 1.4}, 4096: {"nccl": 0.9}}})
    assert auto.floor_verdict(nccl, site(num_tokens=4096))[0]
    assert not auto.floor_verdict(nccl, site(num_tokens=1024))[0]


def test_auto_on_a_gpu_without_measurements_leaves_sites_as_written(symm, tables):
    """p2p can run, but nothing measured it on today's kernels: auto prefers no design over the plain graph."""
    kernel, why = auto.choose("auto", site(num_tokens=4096))
    assert kernel == AS_WRITTEN and why.startswith("auto: nothing measured at world size 2 (unsplit)")
    assert "not oneshot" in why and "no floor measured" in why
    tables(FLOOR=FLOOR)
    kernel, why = auto.choose("auto", site(num_tokens=4096))
    assert kernel == "nccl" and "GPU fallback nccl" in why
    assert auto.choose("auto", site(num_tokens=16))[0] == AS_WRITTEN


def test_auto_takes_a_design_measured_across_gpus_only_against_the_plain_graph(symm, tables):
    tables(TABLE={(2, False): {1024: {"p2p": 80.0, AS_WRITTEN: 70.0}, 4096: {"p2p": 270.0, AS_WRITTEN: 300.0}}},
           FLOOR=FLOOR)
    kernel, why = auto.choose("auto", site(num_tokens=4096))
    assert kernel == "p2p" and "fastest measured at world size 2, unsplit, T=4096" in why
    assert "as written 300.0 us" in why and "allreduce_rmsnorm.csv (test)" in why
    kernel, why = auto.choose("auto", site(num_tokens=1024))
    assert kernel == AS_WRITTEN and "fastest measured" in why and "p2p 80.0 us" in why
    # Outside the measured range, or p2p unavailable: the fallback decides.
    kernel, why = auto.choose("auto", site(num_tokens=40000))
    assert kernel == AS_WRITTEN and "outside the measured range" in why
    symm.update(variant=None, reason="no symmetric memory")
    kernel, why = auto.choose("auto", site(num_tokens=4096))
    assert kernel == "nccl" and "no symmetric memory" in why
    # Unknown T: no design wins at every measured T, so the fallback decides.
    symm.update(variant="p2p", reason="ok")
    assert auto.choose("auto", site())[0] == AS_WRITTEN


def test_designs_wait_for_their_measurement_across_gpus(symm, tables, ready):
    # A small static T fits the one-shot kernel, but auto waits for its measurement across GPUs ...
    kernel, why = auto.choose("auto", site(num_tokens=64))
    assert kernel == AS_WRITTEN and "auto waits for its measurement across GPUs" in why
    # ... and where multicast exists, multimem too.
    symm.update(variant="multimem", reason="multicast pointer present")
    kernel, why = auto.choose("auto", site(num_tokens=64))
    assert kernel == AS_WRITTEN and "not multimem" in why and "force kernel='multimem'" in why
    # Once recorded, they are taken (best rank first).
    ready("oneshot", "multimem")
    assert auto.choose("auto", site()) == ("multimem", "auto: multicast pointer present")
    symm.update(variant="p2p", reason="ok")
    kernel, why = auto.choose("auto", site(num_tokens=64))
    assert kernel == "oneshot" and why.startswith("auto: ") and "crossover" in why


def test_forced_kernels(symm, tables):
    assert auto.choose("p2p", site()) == ("p2p", "requested")
    assert auto.choose("nccl", site()) == ("nccl", "requested")
    symm.update(variant="multimem")
    assert auto.choose("p2p", site()) == ("p2p", "requested")  # multimem not ready: not "also available"


def test_a_hidden_size_or_dtype_the_kernels_cannot_take(symm, tables):
    symm.update(hidden_problem="hidden size 4100 is not a multiple of 16 bytes")
    kernel, why = auto.choose("p2p", site(hidden=4100))
    assert kernel == AS_WRITTEN and "not a multiple of 16 bytes" in why and "no floor measured" in why
    tables(FLOOR=FLOOR)  # nccl takes any H up to its limit: the floor decides
    assert auto.choose("p2p", site(hidden=4100, num_tokens=8192))[0] == "nccl"


def test_what_an_implementation_takes_decides_before_its_check(symm, tables):
    """A scale or an eps on the device goes only where it is taken; nothing else is probed."""
    tables(FLOOR=FLOOR)
    kernel, why = auto.choose("p2p", site(has_scale=True, num_tokens=8192))
    assert kernel == "nccl" and why.startswith("requested 'p2p' unavailable: scaled site: only reference, ce, nccl")
    assert auto.choose("nccl", site(has_scale=True)) == ("nccl", "requested")
    symm.update(variant=None, reason="probe must not decide this")
    assert "probe" not in auto.choose("p2p", site(has_scale=True))[1]


def test_kernel_names():
    assert kernels.names() == ("reference", "p2p", "multimem", "oneshot", "ce", "nccl")
    assert kernels.fallback().name == "reference" and kernels.gpu_fallback().name == "nccl"


def test_the_runtime_fallback_on_cuda_tensors_is_compiled_work():
    assert auto.runtime_fallback(CUDA).name == "nccl"
    assert auto.runtime_fallback(torch.device("cpu")).name == "reference"
    gpu = registry.unregister("nccl")
    try:
        with pytest.raises(RuntimeError, match="does not run on CUDA tensors unless forced"):
            auto.runtime_fallback(CUDA)
    finally:
        registry.register(gpu)


def test_forced_ce_without_cuda_python_says_so(monkeypatch, tables):
    from weave_compile.kernels.ce import copy_engine
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(copy_engine, "unavailable_reason", lambda: "cuda-python is not installed (test)")
    monkeypatch.setattr(addnorm, "unavailable_reason", lambda *a: None)
    kernel, why = auto.choose("ce", site())
    assert kernel == AS_WRITTEN and "cuda-python" in why


def test_hidden_too_large_is_refused(monkeypatch, tables):
    from weave_compile.kernels.shared import addnorm

    monkeypatch.setattr(addnorm, "HAS_TRITON", True)
    kernel, why = auto.choose("nccl", site(hidden=1 << 15))
    assert kernel == AS_WRITTEN and "hidden" in why


def test_table_rows_are_positive_times_of_selectable_kernels_or_the_plain_graph():
    for (world, split), rows in auto_table.TABLE.items():
        assert world >= 2 and isinstance(split, bool)
        for t, row in rows.items():
            assert t > 0 and row and all((d in kernels.names() or d == AS_WRITTEN) and us > 0 for d, us in row.items())
    for (world, hidden), rows in auto_table.FLOOR.items():
        assert world >= 2 and hidden > 0
        assert all(t > 0 and all(d in kernels.names() and r > 0 for d, r in row.items()) for t, row in rows.items())


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


def _fresh(design):
    """The ``source_hash`` a benchmark writes for a row of ``design`` measured on today's sources."""
    import make_auto_table

    return make_auto_table.source_fingerprint(design)


def _floor_rows():
    base = dict(gpu="NVIDIA H200", comm="fake", scope="model", world_size=2, dims="8b", hidden=4096, layers=2,
                torch="2.11", triton="3.6.0", git_commit="f1", date="2026-12-04")
    out = []
    for arch, ratios in (("llama", (1.2, 1.0, 0.9)), ("granite", (1.3, 0.97, 0.95))):
        for t, r in zip((16, 1024, 4096), ratios):
            out.append(dict(base, arch=arch, T=t, variant="default", kernel="default", ms_per_layer=1.0,
                            ratio_vs_default=1.0, source_hash=""))
            out.append(dict(base, arch=arch, T=t, variant="nccl", kernel="nccl", ms_per_layer=r, ratio_vs_default=r,
                            source_hash=_fresh("nccl")))
    # auto rows and a stale nccl row (other sources) do not enter; neither do rows of a real group
    out.append(dict(base, arch="llama", T=4096, variant="auto", kernel="nccl", ms_per_layer=0.5, ratio_vs_default=0.5,
                    source_hash=_fresh("nccl")))
    out.append(dict(base, arch="qwen2", T=4096, variant="nccl", kernel="nccl", ms_per_layer=2, ratio_vs_default=2.0,
                    source_hash="0123456789abcdef"))
    out.append(dict(base, comm="nccl", arch="qwen2", T=4096, variant="nccl", kernel="nccl", ms_per_layer=2,
                    ratio_vs_default=2.0, source_hash=_fresh("nccl")))
    return out


@pytest.fixture
def generated(tmp_path, monkeypatch):
    """make_auto_table.py run on fixture CSVs; its module, and auto reading its tables."""
    import contextlib
    import importlib.util
    import io
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    monkeypatch.syspath_prepend(bench)
    import make_auto_table

    inter = _interference_rows()
    for r in inter:
        r["source_hash"] = _fresh(r["design"]) if r["design"] in make_auto_table.DESIGNS else ""
    stale = dict(inter[0], rows=8192, slowdown=9.9, git_commit="0000000", source_hash="")  # an unknown commit
    _write_csv(tmp_path / "interference.csv", inter + [stale])
    _write_csv(tmp_path / "split_8b.csv", [dict(world_size=2, T=t, variant="split", ms_per_layer=ms, git_commit="s1",
                                                source_hash=_fresh("p2p")) for t, ms in ((1024, 0.5), (16384, 9.0))])
    _write_csv(tmp_path / "allreduce_rmsnorm.csv", [
        dict(world_size=2, dtype="bf16", mode="graph", H=8192, T=4096, variant="fused_symm", us=270.0, git_commit="u1",
             source_hash=_fresh("p2p")),
        dict(world_size=2, dtype="bf16", mode="graph", H=8192, T=4096, variant="nccl_ar+norm", us=300.0,
             git_commit="u1", source_hash=""),
        # the plain graph alone (its p2p row is stale) decides nothing: no row at T=1024
        dict(world_size=2, dtype="bf16", mode="graph", H=8192, T=1024, variant="fused_symm", us=70.0,
             git_commit="af62422+push+ce", source_hash=""),
        dict(world_size=2, dtype="bf16", mode="graph", H=8192, T=1024, variant="nccl_ar+norm", us=80.0,
             git_commit="u1", source_hash="")])
    _write_csv(tmp_path / "floor.csv", _floor_rows())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        make_auto_table.main(["--results", str(tmp_path), "--out", str(tmp_path / "table.py")])
    spec = importlib.util.spec_from_file_location("generated_auto_table", tmp_path / "table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.printed = out.getvalue()
    sys.modules.pop("make_auto_table", None)
    for name in ("SOURCE", "TABLE", "INTERFERENCE_SOURCE", "INTERFERENCE", "FLOOR_SOURCE", "FLOOR"):
        monkeypatch.setattr(auto_table, name, getattr(mod, name))
    return mod


def test_make_auto_table_enters_designs_at_their_world_size(generated):
    inter = generated.INTERFERENCE
    assert set(inter) == {(2, 4096), (2, 8192)}
    assert set(inter[(2, 4096)]) == {4096, 16384}  # T = 2 x rows; the stale row (T=16384 from 8192 rows) is not in
    at4k = inter[(2, 4096)][4096]
    assert set(at4k) == {"p2p", "ce", "oneshot"}  # no stand-ins, no p2p_barriers
    assert at4k["ce"][32] == {"gemm_us": 574.5, "slowdown": 1.029, "comm_alone_us": 76.0, "comm_with_gemm_us": 198.0}
    assert at4k["p2p"][32]["slowdown"] == 1.262  # the tp=8 row (slowdown 1.0) did not enter
    assert inter[(2, 4096)][16384]["ce"][32]["comm_with_gemm_us"] is None
    assert inter[(2, 4096)][16384]["p2p"][32]["slowdown"] == 1.01  # not the stale 9.9
    assert "interference.csv" in generated.INTERFERENCE_SOURCE and "abc1234" in generated.INTERFERENCE_SOURCE
    assert generated.TABLE == {(2, False): {4096: {AS_WRITTEN: 300.0, "p2p": 270.0}},
                               (2, True): {1024: {"p2p": 500.0}, 16384: {"p2p": 9000.0}}}
    # The floor: nccl's worst ratio over the architectures, fresh fake-group model rows of implementations only.
    assert generated.FLOOR == {(2, 4096): {16: {"nccl": 1.3}, 1024: {"nccl": 1.0}, 4096: {"nccl": 0.95}}}
    assert "floor.csv" in generated.FLOOR_SOURCE and "granite, llama" in generated.FLOOR_SOURCE
    dropped = generated.printed
    assert "p2p @ 0000000 x1" in dropped and "p2p @ af62422+push+ce x1" in dropped and "nccl @ f1 x1" in dropped


def test_make_auto_table_applies_the_package_rule():
    """The script reads rows by the package's own fingerprint (kernels/sources.py), loaded by path."""
    import os
    import sys

    from weave_compile.kernels import sources

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    try:
        import make_auto_table as m
    finally:
        sys.path.pop(0)
    code = 'def f(x):\n    return x + 1\n'
    assert m.fingerprint({"a.py": code}) == sources.fingerprint({"a.py": code})
    assert m.DESIGN_SOURCES == sources.DESIGN_SOURCES
    assert m.source_fingerprint("nccl") == sources.source_fingerprint("nccl")


def test_the_committed_table_holds_only_rows_of_todays_kernels():
    """auto_table.py is what make_auto_table.py makes of benchmarks/results today: no row from sources
    that changed since they were measured (regenerate it after changing a design's code)."""
    import os
    import subprocess
    import sys

    if subprocess.run(["git", "rev-parse", "--git-dir"], capture_output=True,
                      cwd=os.path.dirname(__file__)).returncode != 0:
        pytest.skip("no git checkout: older rows cannot be checked against their commits")
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "make_auto_table.py")
    out = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


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
    # Outside every measured range: the GPU fallback, and the reason says why.
    kernel, why = auto.choose("auto", site(num_tokens=100_000, split=True, comm_ctas=32))
    assert kernel == "nccl" and "split model: T=100000 outside" in why and "T=100000 outside the measured range" in why
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


def test_without_interference_measurements_the_split_runs_the_gpu_fallback(symm, ce_runs, tables):
    kernel, why = auto.choose("auto", site(num_tokens=4096, split=True))
    assert kernel == "nccl" and "no interference measured at world size 2" in why
    assert "the split needs a fused op" in why


# ----------------------------------------------------------------------------- LayerNorm sites


@pytest.fixture
def rmsnorm_only():
    """A registered design that computes RMSNorm only (every built-in one takes a LayerNorm): it runs
    wherever asked (its check passes) and ``auto`` never takes it by itself."""
    impl = registry.register(kernels.Implementation(
        "rmsonly", "a test stand-in that computes RMSNorm only", lambda site: None, lambda rows, spec: None,
        auto_ready=False))
    try:
        yield impl
    finally:
        registry.unregister(impl.name)


#: What a design that computes RMSNorm only is told at a LayerNorm site: the takers in listing order.
LAYERNORM_TAKERS = "LayerNorm site: only reference, p2p, multimem, oneshot, ce, nccl compute a LayerNorm"


def test_only_the_implementations_that_take_a_layernorm_are_handed_one(symm, tables, rmsnorm_only):
    assert {e.name for e in registry.implementations() if e.takes_layernorm} == \
        {"reference", "p2p", "multimem", "ce", "oneshot", "nccl"}
    cpu_ln = site(device=torch.device("cpu"), norm="layernorm")
    for name in ("rmsonly",):
        why = auto.takes(registry.get(name), cpu_ln)
        assert why == f"{LAYERNORM_TAKERS} (the others RMSNorm only)", name
        assert auto.takes(registry.get(name), site(device=torch.device("cpu"))) is None, name
        # Forced on CPU ranks: the CPU path, which takes it, with the reason for explain().
        kernel, reason = auto.choose(name, cpu_ln)
        assert kernel == "reference" and f"requested {name!r} unavailable: LayerNorm site" in reason, reason
    for name in ("p2p", "multimem", "oneshot", "nccl"):  # (their compile-time checks want CUDA)
        assert auto.takes(registry.get(name), cpu_ln) is None, name
    assert auto.choose("auto", cpu_ln)[0] == "reference"


def test_a_layernorm_site_on_a_gpu_gets_its_kernels_and_the_others_the_floor_rule(symm, tables, ready,
                                                                                  rmsnorm_only):
    """p2p's push kernel, oneshot's kernel and nccl's add+norm kernel compute a LayerNorm on GPUs (and
    multimem's pull kernel, compiled only): p2p and oneshot forced take a LayerNorm site as they take an
    RMSNorm one, multimem too where the probe finds multicast, and auto decides one as it would an RMSNorm
    site (oneshot below its crossover once ready); a design that computes RMSNorm only, forced, gets the GPU
    fallback under the floor rule of any site (as written without a floor measurement, or where plain
    Inductor measured faster), the LayerNorm named in the reason."""
    ready("oneshot")
    ln = site(norm="layernorm", num_tokens=4096, size_hint=4096)
    rms = site(num_tokens=4096, size_hint=4096)
    for name in ("nccl", "p2p", "oneshot"):
        assert auto.unavailable(registry.get(name), ln) is None, name
    for name in ("p2p", "oneshot"):
        assert auto.choose(name, ln) == auto.choose(name, rms) == (name, "requested")
    small_ln, small_rms = site(norm="layernorm", num_tokens=16, size_hint=16), site(num_tokens=16, size_hint=16)
    kernel, reason = auto.choose("auto", small_ln)
    assert kernel == "oneshot" == auto.choose("auto", small_rms)[0], reason
    kernel, reason = auto.choose("rmsonly", ln)
    assert kernel == AS_WRITTEN, reason
    assert LAYERNORM_TAKERS in reason
    assert "no floor measured at world size 2" in reason, reason
    kernel, reason = auto.choose("auto", ln)
    assert kernel == AS_WRITTEN == auto.choose("auto", rms)[0], reason  # nothing measured: as written either way
    tables(FLOOR=FLOOR)
    kernel, reason = auto.choose("rmsonly", ln)
    assert kernel == "nccl", reason
    assert reason.startswith(f"requested 'rmsonly' unavailable: {LAYERNORM_TAKERS}") \
        and "GPU fallback nccl" in reason, reason
    kernel, reason = auto.choose("rmsonly", site(norm="layernorm", num_tokens=16, size_hint=16))
    assert kernel == AS_WRITTEN and "LayerNorm site" in reason, reason  # the floor: plain Inductor faster there
    kernel, reason = auto.choose("auto", ln)
    assert kernel == "nccl" == auto.choose("auto", rms)[0] and "GPU fallback nccl" in reason, reason
    symm.update(variant="multimem", reason="multicast pointer present")
    assert auto.choose("multimem", ln) == auto.choose("multimem", rms) == ("multimem", "requested")


def test_batch_invariance_on_a_gpu_is_claimed_where_tested_only(symm):
    """On a GPU the site as written is not batch-invariant even at two ranks (Inductor picks the norm's
    reduction kernel shape by the row count) and neither is ``reference`` (torch's CUDA reductions):
    with the option such a site gets the GPU fallback ``nccl`` (invariant, tested on a GPU), with the
    reason, or raises naming why where ``nccl`` cannot run; on CPU ranks both hold, as tested there."""
    from weave_compile.kernels.shared import addnorm

    cpu = torch.device("cpu")
    assert auto.written_invariant(2, cpu) and not auto.written_invariant(3, cpu)
    assert not auto.written_invariant(2, CUDA) and not auto.written_invariant(1, CUDA)
    s = site(num_tokens=64, batch_invariant=True)
    # auto: the shipped floor leaves the site as written, which on a GPU is not invariant: nccl
    name, why = auto.choose("auto", s)
    assert name == "nccl" and "not batch-invariant on a GPU" in why and "rank order" in why, why
    assert auto.choose("auto", dataclasses.replace(s, batch_invariant=False))[0] == AS_WRITTEN
    assert auto.invariant(AS_WRITTEN, "measured slower", dataclasses.replace(s, device=cpu))[0] == AS_WRITTEN
    # reference forced on a GPU with the option: not invariant there (its reason), nccl instead
    why = auto.takes(registry.get("reference"), s)
    assert why is not None and "cpu only" in why and "nccl" in why.split("batch-invariant here:")[1]
    name, why = auto.choose("reference", s)
    assert name == "nccl" and "reference is batch-invariant on cpu only" in why, why
    assert auto.takes(registry.get("nccl"), s) is None
    assert auto.invariant("nccl", "requested", s)[0] == "nccl"
    # where nccl cannot run either, the site cannot be kept invariant: an error naming why
    big = dataclasses.replace(s, hidden=2 * addnorm.MAX_HIDDEN)
    with pytest.raises(auto.BatchInvariantError, match="cuda.*Inductor picks the norm's reduction kernel shape"):
        auto.invariant(AS_WRITTEN, "measured slower", big)
