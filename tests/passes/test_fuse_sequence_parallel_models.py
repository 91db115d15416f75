"""Sequence-parallel models on gloo ranks: every block boundary fused, compiled == eager.

PyTorch's own TP plan as torchtitan writes it (DTensor, ``SequenceParallel`` norms, ``Shard(1)`` of
``[B, S, H]``) and Megatron-LM's hand-written form (``[S, B, H]``, c10d's in-place collectives or
funcol), on 2 and 3 ranks, under ``aot_eager`` and Inductor with ``dynamic=True``. The reference is
the same module run eagerly (its DTensor / c10d collectives), so the compiled graph must equal it
within fp32 noise. Each test runs its cases inside one ``run_ranks`` call and asserts in this process.
"""

import pytest
import torch
import torch.distributed as dist

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks
from weave_compile.testing.numerics import rel_err

FP32_NOISE = 1e-5
BF16_NOISE = 2e-2


def _compile_and_compare(model, token_lists, compiler, **options):
    """Compile ``model`` (fullgraph, dynamic) and compare with eager for each token batch."""
    import weave_compile

    weave_compile.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tokenweave", fullgraph=True, dynamic=True,
                             options={"compiler": compiler, "kernel": "reference", **options})
    errs = []
    with torch.no_grad():
        for tokens in token_lists:
            errs.append(rel_err(compiled(tokens), model(tokens)))
    rep = weave_compile.explain()
    return {"errs": errs, "matched": rep.matched_count, "graphs": len(rep.graphs), "text": str(rep),
            "sites": [(s.fused, s.form, s.residual, s.kernel) for s in rep.sites],
            "op_counts": [g.op_counts for g in rep.graphs],
            "split": [g.split.describe() for g in rep.graphs if g.split is not None]}


def _tokens(batch, seqs, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, s), generator=g) for s in seqs]


# ----------------------------------------------------------------------------- torchtitan's plan


def _titan(rank, world_size, seed, compilers, batches, norm="nn", dtype=torch.float32, options=None):
    from torch.distributed.device_mesh import init_device_mesh

    from weave_compile.testing.sequence_parallel import TitanLlama, parallelize_titan

    mesh = init_device_mesh("cpu", (world_size,))
    model = parallelize_titan(TitanLlama(norm=norm, seed=seed).to(dtype), mesh)
    out = {}
    for compiler in compilers:
        # every batch size, each at two sequence lengths (dynamic=True: B=1 is its own graph)
        tokens = [t for b in batches for t in _tokens(b, (2 * world_size, 5 * world_size), 96, seed + b)]
        out[compiler] = _compile_and_compare(model, tokens, compiler, **(options or {}))
    return out


def _check_all_fused(r, sites, tol, label):
    assert r["matched"] == sites * r["graphs"], f"{label}:\n{r['text']}"
    assert all(fused and form == "reduce_scatter/all_gather" and residual.startswith("sharded by the model")
               for fused, form, residual, _ in r["sites"]), f"{label}:\n{r['text']}"
    for counts in r["op_counts"]:
        assert counts["reduce_scatter"] == (sites, 0) and counts["weave.allreduce_add_rmsnorm"] == (0, sites), label
    assert max(r["errs"]) < tol, f"{label}: {r['errs']}"


@pytest.mark.slow
def test_torchtitan_plan_every_block_boundary_fused_at_batch_1_2_3(seed):
    from weave_compile.testing.sequence_parallel import expected_sequence_parallel_sites

    results = assert_ranks_ok(run_ranks(_titan_2_ranks, 2, args=(seed,), timeout=900))
    sites = expected_sequence_parallel_sites(2)
    for r in results:
        for (compiler, batches), res in zip(TITAN_2_RANKS, r):
            _check_all_fused(res, sites, FP32_NOISE, compiler)
            # One graph per batch size DTensor's own guards tell apart (B == 1, B even, B odd:
            # plain Inductor compiles the same), none per sequence length.
            assert res["graphs"] == len(batches), res["text"]
            # The output projection's gather of the logits is not a site; it stays as written, and says so.
            assert all(c["all_gather"] == (sites + 1, 1) for c in res["op_counts"]), res["op_counts"]
            assert "left as written: 1 all_gather(s) not after a fused norm" in res["text"], res["text"]


TITAN_2_RANKS = [("aot_eager", (1, 2, 3)), ("inductor", (2,))]


def _titan_2_ranks(rank, world_size, seed):
    return [_titan(rank, world_size, seed, (compiler,), batches)[compiler] for compiler, batches in TITAN_2_RANKS]


@pytest.mark.slow
def test_torchtitan_plan_on_3_ranks(seed):
    results = assert_ranks_ok(run_ranks(_titan_3_ranks, 3, args=(seed,), timeout=900))
    for r in results:
        for label, res in r.items():
            _check_all_fused(res, 5, FP32_NOISE, label)


def _titan_3_ranks(rank, world_size, seed):
    return {"nn": _titan(rank, world_size, seed, ("aot_eager",), (2,))["aot_eager"],
            "gemma": _titan(rank, world_size, seed, ("aot_eager",), (1,), norm="gemma")["aot_eager"]}


def test_torchtitan_plan_in_bf16(seed):
    results = assert_ranks_ok(run_ranks(_bf16, 2, args=(seed,), timeout=600))
    for r in results:
        _check_all_fused(r, 5, BF16_NOISE, "bf16")


def _bf16(rank, world_size, seed):
    return _titan(rank, world_size, seed, ("aot_eager",), (2,), dtype=torch.bfloat16)["aot_eager"]


# ----------------------------------------------------------------------------- Megatron-LM's form

MEGATRON = [  # (collectives, norm, bias, residual_multiplier, compiler)
    ("c10d", "hf", True, None, "aot_eager"),
    ("funcol", "functional", False, 0.5, "aot_eager"),
    ("c10d", "gemma", False, None, "aot_eager"),
    ("funcol", "hf", True, None, "inductor"),
]


def _megatron(rank, world_size, seed, cases, seqs):
    from weave_compile.testing.models import LlamaDims
    from weave_compile.testing.sequence_parallel import MegatronSPLlama

    out = []
    for i, (collectives, norm, bias, mult, compiler) in enumerate(cases):
        d = LlamaDims(hidden=48, heads=6, kv_heads=6, intermediate=96, vocab=96, layers=2, norm=norm, bias=bias)
        model = MegatronSPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD, seed=seed + i,
                                collectives=collectives, residual_multiplier=mult)
        out.append(_compile_and_compare(model, _tokens(2, seqs, d.vocab, seed + i), compiler))
    return out


@pytest.mark.slow
def test_megatron_sequence_parallel_forms_fused_and_equal_eager(seed):
    # 2 ranks; S = 8 and 13: a sequence the group size does not divide is padded by the model
    results = assert_ranks_ok(run_ranks(_megatron, 2, args=(seed, MEGATRON, (8, 13)), timeout=900))
    for r in results:
        for case, res in zip(MEGATRON, r):
            _check_all_fused(res, 5, FP32_NOISE, str(case))


@pytest.mark.slow
def test_megatron_sequence_parallel_on_3_ranks(seed):
    cases = [("c10d", "hf", False, None, "aot_eager"), ("funcol", "functional", True, None, "inductor")]
    for r in assert_ranks_ok(run_ranks(_megatron, 3, args=(seed, cases, (9, 10)), timeout=900)):
        for case, res in zip(cases, r):
            _check_all_fused(res, 5, FP32_NOISE, f"3 ranks {case}")


# ----------------------------------------------------------------------------- the split


def test_the_split_declines_sequence_parallel_graphs_with_its_reason_and_stays_correct(seed):
    results = assert_ranks_ok(run_ranks(_split_runs, 2, args=(seed,), timeout=600))
    for r in results:
        for label, res in r.items():
            _check_all_fused(res, 5, FP32_NOISE, label)
            assert res["split"] and all("sequence-parallel sites" in s for s in res["split"]), res["split"]
            assert all(s.startswith("not split") for s in res["split"])


def _split_runs(rank, world_size, seed):
    opts = {"split": True, "split_threshold": 16}
    return {"titan": _titan(rank, world_size, seed, ("aot_eager",), (2,), options=opts)["aot_eager"],
            "megatron": _megatron_split(rank, world_size, seed, opts)}


def _megatron_split(rank, world_size, seed, opts):
    from weave_compile.testing.models import LlamaDims
    from weave_compile.testing.sequence_parallel import MegatronSPLlama

    d = LlamaDims(hidden=48, heads=6, kv_heads=6, intermediate=96, vocab=96, layers=2)
    model = MegatronSPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD, seed=seed)
    return _compile_and_compare(model, _tokens(2, (16, 20), d.vocab, seed), "aot_eager", **opts)
