"""benchmarks/bench_floor.py on CPU: its options, what it times per architecture and phase, how it
labels and checks what ran, the buckets of T it compiles auto for, and (slow) a whole smoke run on
the fake process group with the aot_eager compiler, where every design falls back to reference."""

from __future__ import annotations

import csv
import os
import sys
from types import SimpleNamespace

import pytest

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_floor  # noqa: E402
import make_auto_table  # noqa: E402

sys.path.pop(0)


def test_options_defaults_smoke_and_errors():
    a = bench_floor.parse([])
    assert a.dims == ["8b", "70b"] and a.archs == list(bench_floor.ARCHS) and a.tokens == list(bench_floor.TOKENS)
    assert a.layers == 2 and a.rounds == 0 and a.floor == "measured" and a.keep_going
    s = bench_floor.parse(["--smoke"])
    assert s.dims == ["smoke"] and s.archs == ["llama"] and s.tokens == [64] and s.decode and s.ops
    s = bench_floor.parse(["--smoke", "--archs", "llama,granite", "--tokens", "1,16,64"])
    assert s.archs == ["llama", "granite"] and s.tokens == [1, 16, 64]  # given values win over the smoke's
    b = bench_floor.parse(["--dims", "70b", "--tokens", "16384,1,16", "--archs", "mixtral", "--stop-on-error"])
    assert b.dims == ["70b"] and b.tokens == [1, 16, 16384] and not b.keep_going
    assert bench_floor.parse(["--comm", "nccl"]).floor == "committed"  # the floor is measured on the fake group
    for bad in (["--dims", "13b"], ["--archs", "gpt2"], ["--variants", "nccl,auto"], ["--variants", "default,p2p"],
                ["--decode", "--decode-tokens", "8"]):
        with pytest.raises(SystemExit):
            bench_floor.parse(bad)
    assert bench_floor.parse(["--comm", "nccl", "--variants", "default,p2p"]).variants == ["default", "p2p"]


def test_what_each_architecture_times_in_each_phase():
    a = bench_floor.parse([])
    assert bench_floor.variants_for(a, "llama", "impl") == ["default", "nccl", "reference", "ce"]
    assert bench_floor.variants_for(a, "granite", "impl") == ["default", "nccl"]
    assert bench_floor.variants_for(a, "llama", "auto") == ["default", "auto", "autotune", "fallback"]
    assert bench_floor.variants_for(a, "mixtral", "auto") == ["default", "auto", "autotune"]
    a = bench_floor.parse(["--impl-archs", "all", "--fallback-archs", "all"])
    assert bench_floor.variants_for(a, "gemma2", "all") == list(bench_floor.VARIANTS)
    a = bench_floor.parse(["--variants", "default,nccl,auto,inductor_again"])  # the control: beside auto only
    assert bench_floor.variants_for(a, "llama", "impl") == ["default", "nccl"]
    assert bench_floor.variants_for(a, "llama", "auto") == ["default", "auto", "inductor_again"]


def _site(fused, kernel="-", reason="", kernel_reason=""):
    return SimpleNamespace(fused=fused, kernel=kernel, reason=reason, kernel_reason=kernel_reason)


def test_labels_and_checks_of_what_ran():
    sites = [_site(True, "nccl")] * 4 + [_site(False, reason="no RMSNorm after it")]
    assert bench_floor.site_label(sites) == "as written x1+nccl x4"
    assert bench_floor.site_label([_site(True, "nccl")] * 2) == "nccl"
    assert make_auto_table.designs_of("as written x1+nccl x4") == {"nccl"}
    assert make_auto_table.designs_of("as written") == set()
    bench_floor.check_sites("nccl", sites, "nccl")  # a site the matcher leaves alone is fine
    with pytest.raises(bench_floor.VariantError, match="run \\['reference'\\], not nccl: why"):
        bench_floor.check_sites("nccl", [_site(True, "reference", kernel_reason="why")], "nccl")
    with pytest.raises(bench_floor.VariantError, match="left as written by the fallback"):
        bench_floor.check_sites("nccl", [_site(True, "nccl"), _site(False, reason="left as written: x")], "nccl")
    with pytest.raises(bench_floor.VariantError, match="no site fused"):
        bench_floor.check_sites("nccl", [_site(False, reason="x")], "nccl")
    bench_floor.check_sites("auto", [_site(False, reason="left as written: x")], None)  # auto: anything


def test_auto_is_compiled_per_bucket_of_one_decision(group, monkeypatch):  # noqa: F811
    from weave_compile.kernels import auto_table

    run = SimpleNamespace()
    monkeypatch.setattr(auto_table, "FLOOR", {(2, 4096): {1: {"nccl": 1.3}, 16: {"nccl": 1.1}, 1024: {"nccl": 0.99},
                                                          4096: {"nccl": 0.9}, 16384: {"nccl": 0.88}}})
    got = bench_floor.buckets(run, 4096, [1, 16, 128, 1024, 4096, 8192, 16384])
    assert got == {1: None, 16: (16, 1024), 128: (16, 1024), 1024: (16, 1024), 4096: (4096, 16384),
                   8192: (4096, 16384), 16384: (4096, 16384)}
    monkeypatch.setattr(auto_table, "FLOOR", {})
    assert bench_floor.buckets(run, 4096, [1, 16, 64]) == {1: None, 16: (16, 64), 64: (16, 64)}
    assert bench_floor.buckets(run, 4096, [16]) == {16: None}  # one T: static
    # the implementations' phase: one range for every T above 1
    assert bench_floor.one_range([1, 16, 64]) == {1: None, 16: (16, 64), 64: (16, 64)}
    assert bench_floor.one_range([1, 16]) == {1: None, 16: None}


def test_inductor_again_compiles_again_where_torch_compile_would_reuse_defaults_entry():
    """The control must be a second compiled instance: ``torch.compile(mode=...)``'s backend compares
    equal to another with the same options, so Dynamo serves a second wrapper of the same module
    from the first's cache entry (no compile, not even a cache hit); ``second_inductor`` compiles."""
    import torch

    from weave_compile.testing.inductor_code import captured, compare

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)  # Inductor's program is one extern addmm call: no C++ kernel to build

    inner = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with captured() as first, torch.no_grad():
        want = torch.compile(Wrapper(inner), dynamic=False)(x)
    with captured() as reused, torch.no_grad():
        torch.compile(Wrapper(inner), dynamic=False)(x)
    with captured() as again, torch.no_grad():
        got = torch.compile(Wrapper(inner), backend=bench_floor.second_inductor("default"), dynamic=False)(x)
    assert first and not reused and again
    assert compare(first, again) == "same"
    assert torch.equal(got, want)


def test_the_floor_made_in_the_run_is_the_one_make_auto_table_makes():
    base = dict(gpu="g", comm="fake", scope="model", world_size="2", dims="8b", hidden="4096", git_commit="c")
    rows = [dict(base, arch="llama", T="16", variant="nccl", kernel="nccl x4", ratio_vs_default="1.2"),
            dict(base, arch="granite", T="16", variant="nccl", kernel="as written x1+nccl x3", ratio_vs_default="1.25"),
            dict(base, arch="llama", T="16", variant="auto", kernel="as written", ratio_vs_default="1.0"),
            dict(base, arch="llama", T="16", variant="default", kernel="default", ratio_vs_default="1.0")]
    table, source = make_auto_table.floor_table(rows, lambda design, row: True)
    assert table == {(2, 4096): {16: {"nccl": 1.25}}} and "granite, llama" in source


@pytest.mark.slow
def test_a_smoke_run_on_cpu_writes_every_part(tmp_path):
    """On CPU every design falls back to reference (so forced designs are not checked there, and the
    kernel column says what ran): what is checked is the plumbing, the CSV and the decode's token
    comparison. ~1 min on 2 cores."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_floor.py")
    out = subprocess.run([sys.executable, script, "--smoke", "--tokens", "1,64", "--out", str(tmp_path), "--variants",
                          "default,nccl,auto,fallback,inductor_again"], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    path = tmp_path / "floor_smoke.csv"
    assert path.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == set(bench_floor.COLUMNS)
    model = {(r["T"], r["variant"]) for r in rows if r["scope"] == "model"}
    assert model == {(t, v) for t in ("1", "64") for v in ("default", "nccl", "auto", "fallback", "inductor_again")}, model
    assert {r["kernel"] for r in rows if r["variant"] == "inductor_again"} == {"inductor_again"}
    assert all(r["ratio_vs_default"] for r in rows if r["scope"] == "model")
    decode = {r["variant"]: r for r in rows if r["scope"] == "decode"}
    assert decode["default"]["tokens_equal"] == "True" and decode["auto"]["tokens_equal"] == "True", decode
    # A step is the difference of two generate() timings; on a loaded 2-core machine noise can exceed
    # it: then the row must say so instead of carrying a time <= 0.
    for r in decode.values():
        assert (float(r["ms_per_step"]) > 0 and float(r["spread"]) >= 0) if r["ms_per_step"] else \
            ("step time not resolved" in r["note"] and not r["ratio_vs_default"]), r
    # nccl cannot run on CPU: its row says that reference ran
    assert decode["nccl"]["kernel"] == "reference" and decode["nccl"]["tokens_equal"] == "True"


@pytest.mark.slow
def test_autotune_variant_and_compile_times_on_cpu(tmp_path):
    """The autotune variant is the default measured choice (here the CPU candidates against the site
    as written, on the fake group of one process), timed beside default; ``--compile-time`` writes
    cold and cached rows for default and autotune, the cached autotune compile served by the
    measured choice's disk cache. Plumbing only: CPU seconds say nothing of a GPU's."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_floor.py")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    small = ["--dims", "smoke", "--archs", "llama", "--layers", "1", "--rounds", "1", "--iters", "2", "--repeats", "1",
             "--tokens", "16,64", "--out", str(tmp_path)]  # --smoke's sizes without its decode and ops parts
    out = subprocess.run([sys.executable, script, *small, "--variants", "default,autotune", "--floor", "committed",
                          "--csv", "floor_smoke.csv"], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "floor_smoke.csv") as f:
        rows = list(csv.DictReader(f))
    auto = [r for r in rows if r["scope"] == "model" and r["variant"] == "autotune"]
    assert {r["T"] for r in auto} == {"16", "64"} and all(r["ratio_vs_default"] for r in auto), out.stdout[-3000:]
    # On CPU only reference competes with the site as written; what ran is one of them.
    assert all(set(r["kernel"].split("+")) <= {"reference", "as written"} for r in auto), auto
    out = subprocess.run([sys.executable, script, *small, "--compile-time", "--csv", "compile.csv"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "compile.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["scope"] == "compile"]
    assert {(r["variant"], r["note"].split(":")[0]) for r in rows} == {
        (v, s) for v in ("default", "autotune") for s in ("cold", "cached")}, rows
    assert all(float(r["compile_s"]) > 0 for r in rows)
    assert all(float(r["ratio_vs_default"]) == 1.0 for r in rows if r["variant"] == "default")
    assert "autotune cold" in out.stdout and "measured now" in out.stdout, out.stdout[-3000:]
    assert "autotune cached" in out.stdout and "disk cache" in out.stdout, out.stdout[-3000:]


def test_rounds_put_every_variant_in_every_place_once():
    a = bench_floor.parse([])
    assert bench_floor.rounds_for(a, 5) == 5 and bench_floor.rounds_for(a, 2) == 3
    assert bench_floor.rounds_for(bench_floor.parse(["--rounds", "4"]), 5) == 4
    order = ["default", "nccl", "auto", "fallback", "inductor_again"]
    rounds = [bench_floor.in_round(order, r) for r in range(len(order))]
    assert all(sorted(r) == sorted(order) for r in rounds)
    for place in range(len(order)):
        assert sorted(r[place] for r in rounds) == sorted(order), place


def test_keep_holds_what_this_run_does_not_measure_again():
    a = bench_floor.parse(["--dims", "70b", "--archs", "llama,mixtral", "--tokens", "1,512", "--ops"])
    assert bench_floor.keep_row(a, dict(scope="model", dims="8b", arch="llama", T="512"))
    assert not bench_floor.keep_row(a, dict(scope="model", dims="70b", arch="llama", T="512"))
    assert not bench_floor.keep_row(a, dict(scope="model", dims="70b", arch="mixtral", T="1"))
    assert bench_floor.keep_row(a, dict(scope="model", dims="70b", arch="llama", T="1024"))  # a T not measured now
    assert bench_floor.keep_row(a, dict(scope="model", dims="70b", arch="granite", T="512"))
    assert bench_floor.keep_row(a, dict(scope="op", dims="8b"))
    assert not bench_floor.keep_row(a, dict(scope="op", dims="70b"))
    assert bench_floor.keep_row(a, dict(scope="decode")) and not bench_floor.keep_row(bench_floor.parse(["--decode"]),
                                                                                         dict(scope="decode"))


def test_first_difference_tells_a_near_tie_from_a_wrong_token():
    import torch

    g = torch.Generator().manual_seed(3)
    ref_logits = torch.randn(2, 5, 11, generator=g)
    ref_tokens = ref_logits.argmax(-1)
    assert bench_floor.first_difference(ref_tokens, ref_logits, ref_tokens, ref_logits) == "tokens equal"
    # Row 1 at step 3 takes the runner-up: a margin of 0.3 against logits that moved by 0.5 is a near tie.
    logits = ref_logits.clone()
    runner_up = ref_logits[1, 3].topk(2).indices[1]
    ref_logits[1, 3, runner_up] = ref_logits[1, 3, ref_tokens[1, 3]] - 0.3
    logits[1, 3] = ref_logits[1, 3]
    logits[1, 3, runner_up] += 0.5
    tokens = ref_tokens.clone()
    tokens[1, 3:] = runner_up
    why = bench_floor.first_difference(tokens, logits, ref_tokens, ref_logits)
    assert "new token 3 (batch row 1)" in why and "margin for its token there 0.3000" in why and "(a near tie)" in why
    # The same flip with logits that moved by 0.01 only: not a tie, a wrong result.
    logits[1, 3, runner_up] = ref_logits[1, 3, runner_up] + 0.01
    assert "NOT a near tie" in bench_floor.first_difference(tokens, logits, ref_tokens, ref_logits)
