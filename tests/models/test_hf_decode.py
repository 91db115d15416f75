"""Decode end to end: a Hugging Face Llama checkpoint loaded sharded, ``generate()`` compiled by tokenweave.

Two gloo ranks (CPU). A tiny random Llama is saved with ``save_pretrained``; every rank loads it
back with ``from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2, tp_plan="auto"))``
(transformers' own TP sharding, ``checkpoints.load_tp``). Greedy ``generate()`` with a static KV
cache runs eagerly (TP, no compile) and with transformers' own decode-step compilation
(``generation_config.compile_config``) using ``backend="tokenweave"`` with static shapes: one graph
per decode batch size, the way serving engines capture fixed sizes. The compiled run must give
the same tokens, fuse every site in every graph, and compile exactly one graph per batch size (no
recompile per step, none when a batch size comes back). On CPU the graph runs with
``compiler="aot_eager"`` and transformers must be told to compile on CPU
(``_compile_all_devices``); on GPUs the same path runs with ``mode="reduce-overhead"``
(examples/hf_tp.py --decode).
"""

from __future__ import annotations

import pytest
import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from . import checkpoints

# transformers' from_pretrained with a TP plan refuses to run without accelerate (a test extra).
pytestmark = pytest.mark.slow  # save_pretrained, from_pretrained and generate() twice per batch
pytest.importorskip("accelerate", reason="from_pretrained with a tp_plan needs accelerate (pip install -e '.[test]')")

LAYERS = 2
NEW_TOKENS = 6
PROMPT = 5
#: (batch, seed) in order: batch 3 after batch 1, then batch 1 again with a new prompt (no new graph).
RUNS = [(1, 11), (3, 12), (1, 13)]


def _decode_rank(rank, world, path):
    from transformers import CompileConfig

    import weave_compile
    from examples.hf_models import expected_fused_sites, is_sharded, prompt

    model = checkpoints.load_tp(path, world)
    assert is_sharded(model), "from_pretrained with DistributedConfig(tp_plan='auto') left the model unsharded"
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, cache_implementation="static")
    compile_config = CompileConfig(backend="tokenweave", fullgraph=True, dynamic=False, mode=None,
                                   options={"compiler": "aot_eager", "kernel": "reference"})
    compile_config._compile_all_devices = True  # transformers compiles decode steps only on GPUs by default
    weave_compile.reset()
    torch._dynamo.reset()
    # o_proj and down_proj per layer, + the embedding where the release makes it vocab-parallel (5.24).
    out = {"tokens": [], "graphs_after": [], "sites": [], "expected_sites": expected_fused_sites(model)}
    with torch.no_grad():
        for batch, seed in RUNS:
            ids = prompt(batch, PROMPT, model.config.vocab_size, seed)
            eager = model.generate(ids, disable_compile=True, **gen)
            compiled = model.generate(ids, compile_config=compile_config, **gen)
            out["tokens"].append((eager[:, PROMPT:].tolist(), compiled[:, PROMPT:].tolist()))
            rep = weave_compile.explain()
            out["graphs_after"].append(len(rep.graphs))
        out["sites"] = [(g.matched_count, len(g.sites), sorted({s.kernel for s in g.sites if s.fused}))
                        for g in weave_compile.explain().graphs]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = checkpoints.save("llama", str(tmp_path_factory.mktemp("tiny_llama")), layers=LAYERS, seed=0)
    return assert_ranks_ok(run_ranks(_decode_rank, 2, args=(path,), timeout=900))


def test_generate_same_tokens_as_eager_tp(results):
    for rank, res in enumerate(results):
        for (batch, _), (eager, compiled) in zip(RUNS, res["tokens"]):
            assert len(eager) == batch and all(len(r) == NEW_TOKENS for r in eager)
            assert compiled == eager, f"rank {rank}, batch {batch}: {compiled} != {eager}"
    assert results[0]["tokens"] == results[1]["tokens"]  # TP ranks generate the same sequence


def test_one_graph_per_decode_batch_size(results):
    # Batch 1 -> one graph; batch 3 -> a second; batch 1 again reuses the first. No graph per step.
    for res in results:
        assert res["graphs_after"] == [1, 2, 2], res["graphs_after"]


def test_every_site_fused_in_every_decode_graph(results):
    for res in results:
        assert res["expected_sites"] in (2 * LAYERS, 2 * LAYERS + 1), res["expected_sites"]
        for fused, total, kernels in res["sites"]:
            assert total == res["expected_sites"] and fused == total, (res["expected_sites"], res["sites"])
            assert kernels == ["reference"], kernels  # CPU tensors: the collective path
