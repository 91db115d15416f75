"""The examples run end to end as a user runs them (2 CPU ranks over gloo), and print what a person reads."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, env=None):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _readable(out):
    assert "nan" not in out.split(), out
    wide = [line for line in out.splitlines() if len(line) > 100]
    assert not wide, "\n".join(wide)


def test_quickstart_on_2_cpu_ranks():
    proc = _run("quickstart.py", "--tokens", "19")
    out = proc.stdout
    assert "spawning 2 CPU ranks" in out
    # 2 layers, 2 sites each (after o and after down), decided together by the measurement: all
    # fused or all as written (on CPU ranks as written unless the reference is measured faster).
    assert re.search(r"4 all_reduce site\(s\), [04] fused", out), out
    assert re.search(r"measured choice, group \[0, 1\] \((measured now|cache of rank 0)", out), out
    diff = float(re.search(r"max \|compiled - eager\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4, out
    # its last lines: what auto does on GPUs
    assert " ".join(out.rstrip().splitlines()[-3:]).endswith(_quickstart().ON_GPUS), out
    assert "Warning" not in proc.stderr, proc.stderr
    _readable(out)


def test_quickstart_with_a_forced_design_fuses_every_site():
    proc = _run("quickstart.py", "--tokens", "19", "--kernel", "reference")
    out = proc.stdout
    assert "4 all_reduce site(s), 4 fused" in out, out  # 2 layers, after o and after down
    diff = float(re.search(r"max \|compiled - eager\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4, out


def _quickstart():
    import importlib.util

    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "examples", "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_shows_its_megatron_style_model():
    """The model the quickstart compiles is written in the file a user reads, not imported."""
    with open(os.path.join(ROOT, "examples", "quickstart.py")) as f:
        source = f.read()
    assert "weave_compile.testing.models" not in source and "TPLlama" not in source
    for code in ("class TPBlock(nn.Module):", "dist.all_reduce(y)", "class TPModel(nn.Module):",
                 "torch.compile(model, backend=\"tokenweave\")"):
        assert code in source, code


@pytest.mark.parametrize("hidden,tokens", [(128, 19), (4096, 1), (4096, 2048), (8192, 8192)])
def test_quickstarts_gpu_line_is_what_auto_chooses_on_gpus(hidden, tokens):
    """The quickstart's line on GPUs says what kernel="auto" chooses with autotune=False (the shipped
    rules) for such a site on a GPU where every implementation could run: the site as written."""
    import dataclasses

    import torch

    from weave_compile.kernels import auto, registry
    from weave_compile.kernels.registry import Site

    assert "autotune=False keeps them as written" in _quickstart().ON_GPUS
    site = Site(device=torch.device("cuda", 0), dtype=torch.bfloat16, residual_dtype=torch.bfloat16,
                out_dtype=torch.bfloat16, hidden=hidden, group_name="0", world_size=2, num_tokens=tokens,
                size_hint=tokens, residual_in_dtype=torch.bfloat16)
    originals = [registry.replace(dataclasses.replace(e, check=lambda site: None))
                 for e in registry.implementations()]
    try:
        name, why = auto.choose(registry.AUTO, site)
    finally:
        for e in originals:
            registry.replace(e)
    assert name == auto.AS_WRITTEN, (name, why)


def _results(out):
    """The results table's rows as dicts keyed by its header."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("phase "))
    names = re.split(r"\s{2,}", lines[head].strip())
    rows = []
    for line in lines[head + 2:]:
        cells = line.split()
        if len(cells) != len(names):
            break
        rows.append(dict(zip(names, cells)))
    return rows


@pytest.mark.slow
def test_hf_tp_example_on_2_cpu_ranks():
    """Gemma3 tiny: sandwich norms, (1 + w), the scaled vocab-parallel embedding, q/k norms."""
    # the rewrite is what this checks; on CPU ranks the default measured choice keeps the sites
    # as written (test_quickstart_on_2_cpu_ranks), so the oracle op is forced
    out = _run("hf_tp.py", "--arch", "gemma3", "--kernel", "reference").stdout
    assert "5 all_reduce site(s), 5 fused" in out, out
    assert re.search(r"^graph 0 prefill T=37 \[inductor\]", out, re.M), out
    rows = _results(out)
    assert [(r["phase"], r["batch"], r["tokens"], r["variant"]) for r in rows] == [
        ("prefill", "1", "37", "tokenweave")], out  # no eager row compared with itself
    assert float(rows[0]["max|diff|"]) < 1e-5, out
    assert "ms" not in rows[0] and "ms: not timed on CPU" in out, out
    _readable(out)


@pytest.mark.slow
def test_hf_tp_example_decode_reports_each_batch_once():
    out = _run("hf_tp.py", "--arch", "qwen3", "--phases", "decode", "--decode-context", "16",
               "--decode-batches", "1", "3", "--kernel", "reference").stdout
    assert "tokenweave: 2 graph(s), 8 all_reduce site(s), 8 fused" in out, out
    labels = re.findall(r"^graph (\d) (.*) \[inductor\]", out, re.M)
    assert labels == [("0", "decode batch=1 (+16 cached)"), ("1", "decode batch=3 (+16 cached)")], out
    rows = _results(out)
    assert [(r["phase"], r["batch"], r["tokens"], r["cached"]) for r in rows] == [
        ("decode", "1", "1", "16"), ("decode", "3", "1", "16")], out
    assert all(float(r["max|diff|"]) < 1e-4 for r in rows), out
    _readable(out)


@pytest.mark.slow
def test_hf_tp_fx_cache_serves_the_second_run_and_its_report_says_so(tmp_path):
    """``--fx-cache`` (its --help): the second run is served from Inductor's cache, skips the passes,
    and its report lists the sites recorded at the first run's compile, saying so."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    first = _run("hf_tp.py", "--arch", "qwen3", "--fx-cache", "--kernel", "reference", env=env).stdout
    second = _run("hf_tp.py", "--arch", "qwen3", "--fx-cache", "--kernel", "reference", env=env).stdout
    note = "served from Inductor's FX graph cache (sites as first compiled)"
    assert note not in first and "4 all_reduce site(s), 4 fused" in first, first
    assert note in second and "4 all_reduce site(s), 4 fused" in second, second
    _readable(second)
