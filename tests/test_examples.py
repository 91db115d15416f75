"""The examples run end to end as a user runs them (2 CPU ranks over gloo)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_on_2_cpu_ranks():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--tokens", "19"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "spawning 2 CPU ranks" in out
    # 2 layers: 2 sites each plus the vocab-parallel embedding's all_reduce, all fused.
    assert "5 all_reduce site(s), 5 fused" in out, out
    diff = float(re.search(r"max \|compiled - eager\| = ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4, out


def test_hf_tp_example_on_2_cpu_ranks():
    """Gemma3 tiny: sandwich norms, (1 + w), the scaled vocab-parallel embedding, q/k norms."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "hf_tp.py"), "--arch", "gemma3"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "5 all_reduce site(s), 5 fused" in out, out
    row = re.search(r"prefill\s+\d+ tokenweave\s+\S+\s+\S+\s+(\S+)\s+(\S+)", out)
    assert row is not None and float(row.group(2)) < 1e-5, out
