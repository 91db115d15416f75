"""weave::allreduce_add_rmsnorm (reference implementation) and its async form on 2 gloo ranks vs the float64 oracle."""

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from weave_compile import kernels
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.ops import ARG_NAMES, FUSED_OP, START_OP, WAIT_OP, allreduce_add_rmsnorm
from weave_compile.rows import rows_per_rank
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks
from weave_compile.testing.numerics import REL_TOL, rel_err

WORLD = 2
CASES = [
    # (T, H, dtype, residual, bias, weight_mode, in_sharded, out_sharded)
    *[(t, 64, torch.float32, True, False, "w", False, False) for t in (1, 3, 257, 1024)],
    *[(t, 48, dt, True, True, "w_mid", False, False) for t in (5, 64) for dt in (torch.bfloat16, torch.float16)],
    (33, 32, torch.bfloat16, True, False, "gemma", False, False),
    (17, 32, torch.float32, False, False, "none", False, False),
    (17, 32, torch.float32, False, True, "w", False, True),
    (9, 32, torch.float32, True, False, "w", True, True),
    (9, 32, torch.bfloat16, True, True, "w_mid", True, False),
    (13, 32, torch.float32, True, False, "scaled", False, False),
]


def _make(case, seed):
    T, H, dtype, has_res, has_bias, wmode, _, _ = case
    g = torch.Generator().manual_seed(seed)
    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype)
    partials = [rnd(T, H) for _ in range(WORLD)]
    residual = rnd(T, H) if has_res else None
    bias = rnd(H, scale=0.1) if has_bias else None
    weight = None if wmode == "none" else (rnd(H, scale=0.1) + (0 if wmode == "gemma" else 1))
    return partials, residual, bias, weight


def _scale(case):
    return torch.tensor(3.5) if case[5] == "scaled" else None


def _mid(case):
    return case[2] if case[5] == "w_mid" else None


def _offset(case):
    return 1.0 if case[5] == "gemma" else 0.0


def _run_cases(rank, world_size, seed):
    outs = []
    for i, case in enumerate(CASES):
        T, H, dtype, _, _, wmode, in_sh, out_sh = case
        partials, residual, bias, weight = _make(case, seed + i)
        per = rows_per_rank(T, world_size)
        if in_sh and residual is not None:
            padded = torch.nn.functional.pad(residual, (0, 0, 0, per * world_size - T))
            residual = padded[rank * per:(rank + 1) * per].clone()
        normed, res, _ = allreduce_add_rmsnorm(
            x=partials[rank], residual=residual, bias=bias, weight=weight, eps=1e-5, group_name="0",
            residual_dtype=dtype, out_dtype=dtype, mid_dtype=_mid(case), weight_offset=_offset(case),
            residual_in_sharded=in_sh, residual_out_sharded=out_sh, kernel="reference", comm_ctas=16,
            scale=_scale(case))
        outs.append((normed, res))
    return outs


@pytest.fixture(scope="module")
def rank_outputs():
    import random
    seed = random.randrange(2**31)
    results = assert_ranks_ok(run_ranks(_run_cases, WORLD, args=(seed,), timeout=240))
    return seed, results


@pytest.mark.parametrize("idx", range(len(CASES)), ids=[f"T{c[0]}-H{c[1]}-{str(c[2])[6:]}-{c[5]}-sh{int(c[6])}{int(c[7])}" for c in CASES])
def test_reference_matches_float64(rank_outputs, idx):
    seed, results = rank_outputs
    case = CASES[idx]
    T, H, dtype, _, _, wmode, in_sh, out_sh = case
    partials, residual, bias, weight = _make(case, seed + idx)
    ref_normed, ref_res = allreduce_add_rmsnorm_ref(partials, residual, bias, weight, eps=1e-5,
                                                    weight_offset=_offset(case), scale=_scale(case),
                                                    mid_dtype=_mid(case))
    per = rows_per_rank(T, WORLD)
    for rank in range(WORLD):
        normed, res = results[rank][idx]
        assert normed.dtype == dtype and normed.shape == (T, H)
        assert rel_err(normed, ref_normed) < REL_TOL[dtype], f"seed={seed} rank={rank}"
        if out_sh:
            assert res.shape == (per, H)
            rows = ref_res[rank * per: min((rank + 1) * per, T)]
            assert rel_err(res[: rows.shape[0]], rows) < REL_TOL[dtype]
        else:
            assert rel_err(res, ref_res) < REL_TOL[dtype], f"seed={seed} rank={rank}"
    # Every rank sees the same normed output (it was all-gathered).
    assert torch.equal(results[0][idx][0], results[1][idx][0])


def test_fake_impl_shapes_including_sharded_and_symbolic(monkeypatch):
    import weave_compile.ops.allreduce_rmsnorm as mod

    monkeypatch.setattr(mod, "group_size", lambda name: 4)
    with FakeTensorMode():
        x = torch.empty(3, 5, 16, dtype=torch.bfloat16)
        w = torch.empty(16)
        for in_sh, out_sh in itertools.product([False, True], repeat=2):
            residual = torch.empty(4, 16) if in_sh else torch.empty(3, 5, 16)
            normed, res, _ = allreduce_add_rmsnorm(
                x, residual, None, w, eps=1e-6, group_name="g", residual_dtype=torch.float32,
                out_dtype=torch.bfloat16, mid_dtype=torch.float32, weight_offset=0.0, residual_in_sharded=in_sh,
                residual_out_sharded=out_sh, kernel="reference", comm_ctas=8)
            assert normed.shape == (3, 5, 16) and normed.dtype == torch.bfloat16
            assert res.dtype == torch.float32
            assert res.shape == ((4, 16) if out_sh else (3, 5, 16))  # ceil(15 / 4) = 4 rows per rank


def test_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown kernel"):
        allreduce_add_rmsnorm(torch.randn(2, 8), None, None, None, eps=1e-6, group_name="0",
                              residual_dtype=torch.float32, out_dtype=torch.float32, mid_dtype=None,
                              weight_offset=0.0, residual_in_sharded=False, residual_out_sharded=False,
                              kernel="nvls", comm_ctas=8)


def test_one_schema_for_the_fused_op_and_its_async_form():
    for op in (FUSED_OP, START_OP):
        assert tuple(a.name for a in op._schema.arguments) == ARG_NAMES
        assert [str(a.type) for a in op._schema.arguments] == [str(a.type) for a in FUSED_OP._schema.arguments]
    quant = ("quant", "quant_dtype", "quant_max", "quant_floor", "quant_reciprocal", "quant_clamp", "quant_scale",
             "quant_scale_dtype")
    assert ARG_NAMES[-14:] == ("scale", "eps_tensor", "out_slot", "norm", "norm_bias", "batch_invariant") + quant
    assert all(arg.has_default_value() for arg in FUSED_OP._schema.arguments[-14:])
    args = {a.name: a for a in FUSED_OP._schema.arguments}
    assert args["out_slot"].default_value == -1  # a fresh output unless a pass says so
    assert args["norm"].default_value == "rmsnorm"  # RMSNorm unless a pass says so
    assert args["batch_invariant"].default_value is False  # the collective's own order unless asked
    assert args["quant"].default_value == ""  # no fp8 epilogue unless a pass says so
    assert len(FUSED_OP._schema.returns) == 3  # normed, residual_out, scales
    assert [a.name for a in WAIT_OP._schema.arguments] == ["normed", "residual_out", "keep_alive", "scales"]
    assert all(WAIT_OP._schema.arguments[i].alias_info.is_write for i in (0, 1, 3))  # readers ordered after it


def _start_then_wait(rank, world_size, seed):
    g = torch.Generator().manual_seed(seed + rank)  # different partial sums per rank
    x, res, w = torch.randn(7, 16, generator=g), torch.randn(7, 16, generator=g), torch.randn(16, generator=g)
    dist.broadcast(res, 0)  # the residual and weight agree across ranks (replicated), x does not
    dist.broadcast(w, 0)
    args = dict(x=x, residual=res, bias=None, weight=w, eps=1e-6, group_name=dist.group.WORLD.group_name,
                residual_dtype=torch.float32, out_dtype=torch.float32, mid_dtype=None, weight_offset=0.0,
                residual_in_sharded=False, residual_out_sharded=False, kernel="reference", comm_ctas=8)
    normed, res_out, _ = START_OP(**args)
    WAIT_OP(normed, res_out, [x, res], None)
    want = FUSED_OP(**args)
    return torch.equal(normed, want[0]) and torch.equal(res_out, want[1])


@pytest.mark.slow
def test_start_then_wait_equals_the_fused_op_on_cpu(seed):
    """On CPU start computes synchronously and wait is a no-op."""
    assert all(assert_ranks_ok(run_ranks(_start_then_wait, 2, args=(seed,), timeout=120)))


def test_an_implementation_gets_every_argument_as_rows_and_spec_and_a_full_workspace_falls_back(caplog):
    """The op's dispatch (on CPU, with a registered stand-in for a GPU kernel): the 2-D rows and one
    spec with every argument; the outputs back in the input's shape; a capacity error -> the fallback."""
    import logging

    import weave_compile.ops.allreduce_rmsnorm as mod
    from weave_compile import kernels

    class Full(RuntimeError):
        pass

    calls = []

    def run(rows, spec):
        calls.append((rows, spec))
        if spec.out_slot == 1:
            raise Full("workspace too small during capture")
        return torch.zeros(rows.x.shape), torch.ones(rows.residual.shape)

    kernels.register(kernels.Implementation(name="standin", summary="test", check=lambda site: None, run=run,
                                            capacity_error=Full, takes_out_slot=True))
    try:
        x, res, w = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8)
        args = dict(eps=1e-5, group_name="g", residual_dtype=torch.float32, out_dtype=torch.bfloat16, mid_dtype=None,
                    weight_offset=1.0, residual_in_sharded=False, residual_out_sharded=False, kernel="standin",
                    comm_ctas=4)
        normed, res_out, _ = mod._fused(x, res, None, w, out_slot=2, eps_tensor=torch.tensor(1e-3), **args)
        assert normed.shape == (2, 3, 8) and res_out.shape == (2, 3, 8)  # back to the input's shape
        assert torch.equal(normed, torch.zeros(2, 3, 8)) and torch.equal(res_out, torch.ones(2, 3, 8))
        (rows, spec), = calls
        assert rows.x.shape == (6, 8) and rows.residual.shape == (6, 8) and rows.bias is None
        assert rows.weight.shape == (8,) and rows.scale is None
        assert rows.eps_tensor is None  # it does not take one: the (CPU) tensor's value became eps
        assert spec == kernels.FusedSpec(residual_dtype=torch.float32, out_dtype=torch.bfloat16,
                                         eps=pytest.approx(1e-3), group_name="g", mid_dtype=None, weight_offset=1.0,
                                         residual_in_sharded=False, residual_out_sharded=False, comm_ctas=4,
                                         out_slot=2)
        fallback = []
        real = kernels.fallback()
        kernels.registry.replace(dataclasses.replace(real, run=lambda rows, spec: fallback.append(spec) or (
            torch.full(rows.x.shape, 3.0), torch.full(rows.x.shape, 4.0))))
        try:
            with caplog.at_level(logging.WARNING, logger=mod.__name__):
                normed, res_out, _ = mod._fused(x, res, None, w, out_slot=1, **args)
        finally:
            kernels.registry.replace(real)
        assert len(fallback) == 1 and torch.equal(normed, torch.full((2, 3, 8), 3.0))  # the fallback's result
        assert "standin kernel fell back to reference: workspace too small" in caplog.text
        # The split's start op runs beside the model's kernels: its spec says so (local kernels
        # then keep to comm_ctas), the plain op's does not.
        calls.clear()
        mod._start(x, res, None, w, out_slot=2, **args)
        assert [spec.beside_compute for _, spec in calls] == [True]
        assert not spec.beside_compute
    finally:
        kernels.unregister("standin")


def test_the_add_norm_grid_keeps_to_comm_ctas_only_beside_other_work():
    from weave_compile.kernels import FusedSpec
    from weave_compile.kernels.shared import addnorm

    spec = FusedSpec(residual_dtype=torch.bfloat16, out_dtype=torch.bfloat16, comm_ctas=4)
    assert addnorm.ctas_for(dataclasses.replace(spec, beside_compute=True)) == 4
    assert addnorm.ctas_for(spec) is None  # the whole device: at least a CTA per SM (addnorm.plan)


@pytest.mark.parametrize("hidden,rows,quant,slots", [
    (4096, 128, False, 1), (4096, 128, True, 1), (8192, 128, False, 1), (4096, 3, False, 1), (4096, 129, False, 1),
    (4096, 2048, True, 1), (8192, 4096, False, 1),
    (4096, 128, False, 0), (4096, 512, True, 0), (4096, 2048, False, 0), (8192, 1024, True, 0)])  # 0: nccl's
def test_the_whole_device_add_norm_grid_has_a_cta_per_sm_while_row_blocks_last(hidden, rows, quant, slots):
    """Nothing beside it: the shape picked for a CTA per 8 rows (the one-warp-per-row loop keeps its
    8-row blocks and grid where it ran before), on at least a CTA per SM while there are row
    blocks for them (a CTA's blocks run one after another, each waiting on its rows' sums), and
    no more (past that the loop's prefetch beats more waves). Beside other work: at most
    ``comm_ctas`` CTAs, each looping."""
    from weave_compile.kernels.shared import addnorm

    sms = 132
    cfg, grid = addnorm.plan(hidden, rows, None, slots=slots, quant=quant, sms=sms)
    per8 = -(-rows // addnorm.ROWWISE_WARPS)
    assert cfg == addnorm.launch_config(hidden, slots=slots, rows_per_cta=-(-rows // per8), quant=quant)
    blocks = -(-rows // cfg.block_rows)
    assert bool(cfg.chunk) == (slots == 1 and not quant and hidden <= 4096 and rows >= addnorm.ROWWISE_WARPS)
    if cfg.chunk:  # the one-warp-per-row loop: a CTA per 8-row block, as before
        assert grid == per8 == blocks
    else:
        assert grid == min(blocks, max(per8, sms))
        assert grid > per8 or blocks <= per8 or per8 >= sms  # more CTAs than 8 rows a CTA gave, where it counts
    assert addnorm.plan(hidden, rows, None, slots=slots, quant=quant)[1] == min(per8, blocks)  # no SMs: 8 rows a CTA
    few, few_grid = addnorm.plan(hidden, rows, 4, slots=slots, quant=quant, sms=sms)
    assert few_grid == min(4, -(-rows // few.block_rows))


def test_the_symm_kernels_take_no_scale():
    with pytest.raises(ValueError, match="take no scale"):
        allreduce_add_rmsnorm(torch.randn(2, 8), None, None, None, eps=1e-6, group_name="0",
                              residual_dtype=torch.float32, out_dtype=torch.float32, mid_dtype=None,
                              weight_offset=0.0, residual_in_sharded=False, residual_out_sharded=False,
                              kernel="p2p", comm_ctas=8, scale=torch.tensor(2.0))


def test_the_rmsnorm_only_kernels_take_no_layernorm():
    """Every built-in implementation takes a LayerNorm: a registered stand-in that does not is refused one
    (and a norm bias), the takers named; its run is never called."""
    kernels.register(kernels.Implementation("rmsonly", "a test stand-in that computes RMSNorm only",
                                            lambda site: None, lambda rows, spec: pytest.fail("ran")))
    try:
        for kw in (dict(norm="layernorm"), dict(norm_bias=torch.randn(8))):
            with pytest.raises(ValueError, match=r"kernel 'rmsonly' computes RMSNorm only.*'multimem'"):
                allreduce_add_rmsnorm(torch.randn(2, 8), None, None, None, eps=1e-6, group_name="0",
                                      residual_dtype=torch.float32, out_dtype=torch.float32, mid_dtype=None,
                                      weight_offset=0.0, residual_in_sharded=False, residual_out_sharded=False,
                                      kernel="rmsonly", comm_ctas=8, **kw)
    finally:
        kernels.unregister("rmsonly")


def test_batch_invariant_runs_on_the_implementations_that_claim_it_only():
    """The claimants (``Implementation.batch_invariant``): every one but multimem; the op refuses the
    option on multimem, naming them."""
    assert {e.name for e in kernels.implementations() if e.batch_invariant} == \
        {"reference", "nccl", "ce", "p2p", "oneshot"}
    with pytest.raises(ValueError, match=r"kernel 'multimem': batch_invariant: multimem does not add the partial "
                                         r"sums in a fixed order.*batch-invariant on cpu: .*'reference'.*'p2p'"):
        allreduce_add_rmsnorm(torch.randn(2, 8), None, None, None, eps=1e-6, group_name="0",
                              residual_dtype=torch.float32, out_dtype=torch.float32, mid_dtype=None,
                              weight_offset=0.0, residual_in_sharded=False, residual_out_sharded=False,
                              kernel="multimem", comm_ctas=8, batch_invariant=True)


def test_reference_claims_batch_invariance_on_cpu_only():
    """``reference``'s norm on a GPU is torch's CUDA reductions, whose layout per row follows the row
    count: its claim holds on CPU ranks, where it is tested; on CUDA the option names the others."""
    from weave_compile.kernels.registry import invariant_on

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    ref = kernels.registry.get("reference")
    assert invariant_on(ref, cpu) is None
    why = invariant_on(ref, cuda)
    assert why is not None and "cpu only" in why and "nccl" in why
    assert [e.name for e in kernels.implementations() if invariant_on(e, cuda) is None] == \
        [e.name for e in kernels.implementations() if e.batch_invariant and e.name != "reference"]
    assert "does not add the partial sums" in invariant_on(kernels.registry.get("multimem"), cpu)
    # the op itself, on (fake) CUDA tensors: refused before anything runs, naming the GPU's takers
    import weave_compile.ops.allreduce_rmsnorm as mod

    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda")
        with pytest.raises(ValueError, match=r"kernel 'reference': batch_invariant on cuda: reference is "
                                             r"batch-invariant on cpu only.*batch-invariant on cuda: \[.*'nccl'"):
            mod._fused(x, None, None, None, eps=1e-6, group_name="0", residual_dtype=torch.float32,
                       out_dtype=torch.float32, mid_dtype=None, weight_offset=0.0, residual_in_sharded=False,
                       residual_out_sharded=False, kernel="reference", comm_ctas=8, batch_invariant=True)


#: The symmetric-memory kernels that take a LayerNorm (``takes_layernorm``): on CPU tensors they run the
#: fallback (reference), which must compute it.
LAYERNORM_SYMM_KERNELS = ("p2p", "multimem", "oneshot")


def _forced_layernorm(rank, world_size, seed):
    g = torch.Generator().manual_seed(seed)
    T, H = 5, 16  # T not divisible by the ranks
    partials = [torch.randn(T, H, generator=g) + 3 for _ in range(world_size)]  # a mean the LayerNorm removes
    residual = torch.randn(T, H, generator=g)
    weight, norm_bias = 1 + torch.randn(H, generator=g), torch.randn(H, generator=g)
    return {kernel: allreduce_add_rmsnorm(
        partials[rank], residual, None, weight, eps=1e-5, group_name="0", residual_dtype=torch.float32,
        out_dtype=torch.float32, mid_dtype=None, weight_offset=0.0, residual_in_sharded=False,
        residual_out_sharded=False, kernel=kernel, comm_ctas=8, norm="layernorm", norm_bias=norm_bias)[:2]
        for kernel in LAYERNORM_SYMM_KERNELS}, (partials, residual, weight, norm_bias)


def test_the_layernorm_symm_kernels_take_it_and_run_the_fallback_on_cpu_ranks():
    """A LayerNorm forced to a symmetric-memory kernel that takes it is not refused; on CPU tensors (2 gloo
    ranks) the op runs the fallback, whose LayerNorm matches the float64 oracle (and not its RMSNorm)."""
    import random

    seed = random.randrange(2**31)
    results = assert_ranks_ok(run_ranks(_forced_layernorm, WORLD, args=(seed,), timeout=240))
    (_, (partials, residual, weight, norm_bias)) = results[0]
    want, want_res = allreduce_add_rmsnorm_ref(partials, residual, None, weight, eps=1e-5, norm="layernorm",
                                               norm_bias=norm_bias)
    rms, _ = allreduce_add_rmsnorm_ref(partials, residual, None, weight, eps=1e-5, norm_bias=norm_bias)
    for rank, (outs, _) in enumerate(results):
        for kernel, (normed, res) in outs.items():
            where = f"seed={seed} rank={rank} {kernel}"
            assert rel_err(normed, want) < REL_TOL[torch.float32] < rel_err(normed, rms), where
            assert rel_err(res, want_res) < REL_TOL[torch.float32], where
