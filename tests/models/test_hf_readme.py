"""README's Hugging Face snippet, executed as written on 2 CPU ranks.

The snippet is read from README.md (the first ``python`` block of its "Hugging Face models"
section), so the two cannot drift apart. It runs with three names given, as the prose before it
says: ``path`` (a ``save_pretrained`` directory: a tiny random Qwen3, whose q/k norms carry
transformers 5.17's grad-sync backward hooks), ``world_size`` and ``ids``. The compiled forward is
one graph and equals the eager TP model's logits; ``generate()`` gives eager TP's tokens. The
defaults run, so the measured choice decides the sites (on CPU ranks the sites as written win:
README's "What you get today"); the fused rewrite of these checkpoints is checked in
``test_hf_tp.py``. On CPU transformers runs the decode steps eagerly (it compiles them on GPUs
only; ``test_hf_decode.py`` compiles them on CPU through ``CompileConfig._compile_all_devices``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest
import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from . import checkpoints

pytestmark = pytest.mark.slow  # Inductor compiles the model on each rank
pytest.importorskip("accelerate", reason="from_pretrained with a tp_plan needs accelerate (pip install -e '.[test]')")

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
LAYERS = 2
TOL = 1e-5


def readme_snippet() -> str:
    """The first python block after README's "## Hugging Face models" heading."""
    with open(README) as f:
        text = f.read()
    section = text[text.index("\n## Hugging Face models"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _rank(rank, world, path, code, seed):
    import weave_compile
    from examples.hf_models import expected_fused_sites, prompt

    ids = prompt(2, 7, 128, seed)
    names = {"path": path, "world_size": world, "ids": ids}
    printed = io.StringIO()
    weave_compile.reset()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), names)
    model = names["model"]
    rep = weave_compile.explain()
    with torch.no_grad():
        eager = model(ids).logits
        eager_tokens = model.generate(ids, max_new_tokens=names["out"].shape[1] - ids.shape[1], do_sample=False,
                                      cache_implementation="static", disable_compile=True)
    return {"printed": printed.getvalue(), "report": str(rep), "graphs": len(rep.graphs),
            "fused": rep.matched_count, "sites": len(rep.sites), "expected": expected_fused_sites(model),
            "err": (names["logits"] - eager).norm().item() / eager.norm().item(),
            "same_tokens": torch.equal(names["out"], eager_tokens), "new_tokens": names["out"].shape[1] - 7,
            "hooks": sum(bool(m._backward_hooks) for m in model.modules())}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little") % 2**31
    print(f"seed={seed}")
    path = checkpoints.save("qwen3", str(tmp_path_factory.mktemp("readme_qwen3")), layers=LAYERS, seed=seed)
    return assert_ranks_ok(run_ranks(_rank, 2, args=(path, readme_snippet(), seed), timeout=600))


def test_snippet_is_the_user_path():
    code = readme_snippet()
    assert "from_pretrained(" in code and "DistributedConfig(" in code and 'backend="tokenweave"' in code, code
    assert "fullgraph=True" in code and "no_grad" in code, code
    assert "testing" not in code and "_backward_hooks" not in code and "_dynamo" not in code, code


def test_snippet_compiles_one_graph_and_decides_every_site_by_measuring(results):
    for res in results:
        assert res["graphs"] == 1, res["report"]  # generate() on CPU adds no graph: see the docstring
        assert res["sites"] == res["expected"] > 0, res["report"]
        # one answer for the graph's sites, measured on the group: all fused or all as written
        assert res["fused"] in (0, res["sites"]), res["report"]
        # measured now, or taken from the disk cache a run before this one left (CI runs this file
        # under two transformers releases with one Inductor cache directory)
        assert re.search(r"measured choice, group \[0, 1\] \((measured now|cache of rank \d)", res["report"]), \
            res["report"]
        assert res["report"] in res["printed"], res["printed"]
    assert len({r["fused"] for r in results}) == 1, [r["report"] for r in results]


def test_snippet_logits_and_tokens_equal_eager_tp(results):
    for res in results:
        assert res["err"] < TOL, res["err"]
        assert res["same_tokens"] and res["new_tokens"] > 0, res


def test_snippet_model_keeps_transformers_hooks(results):
    import transformers

    if not transformers.__version__.startswith("5.17."):
        pytest.skip(f"transformers {transformers.__version__} puts no module backward hook on the q/k norms")
    assert all(res["hooks"] == 2 * LAYERS for res in results), results
