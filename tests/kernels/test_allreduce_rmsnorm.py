"""The reference implementation of weave::allreduce_add_rmsnorm on 2 gloo ranks vs a float64 oracle."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from weave_compile.testing.numerics import REL_TOL, rel_err
from weave_compile.kernels.allreduce_rmsnorm import (
    allreduce_add_rmsnorm,
    allreduce_add_rmsnorm_ref,
    rows_per_rank,
)
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

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


def _run_cases(rank, world_size, seed):
    from weave_compile.kernels.allreduce_rmsnorm import allreduce_add_rmsnorm as op

    outs = []
    for i, case in enumerate(CASES):
        T, H, dtype, _, _, wmode, in_sh, out_sh = case
        partials, residual, bias, weight = _make(case, seed + i)
        per = rows_per_rank(T, world_size)
        if in_sh and residual is not None:
            padded = torch.nn.functional.pad(residual, (0, 0, 0, per * world_size - T))
            residual = padded[rank * per:(rank + 1) * per].clone()
        normed, res = op(partials[rank], residual, bias, weight, 1e-5, "0", dtype, dtype,
                         dtype if wmode == "w_mid" else None, 1.0 if wmode == "gemma" else 0.0,
                         in_sh, out_sh, "reference", 16, _scale(case))
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
                                                    weight_offset=1.0 if wmode == "gemma" else 0.0,
                                                    scale=_scale(case))
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
    import weave_compile.kernels.allreduce_rmsnorm as mod

    monkeypatch.setattr(mod, "group_size", lambda name: 4)
    with FakeTensorMode():
        x = torch.empty(3, 5, 16, dtype=torch.bfloat16)
        w = torch.empty(16)
        for in_sh, out_sh in itertools.product([False, True], repeat=2):
            residual = torch.empty(4, 16) if in_sh else torch.empty(3, 5, 16)
            normed, res = allreduce_add_rmsnorm(x, residual, None, w, 1e-6, "g", torch.float32,
                                                torch.bfloat16, torch.float32, 0.0, in_sh, out_sh, "reference", 8)
            assert normed.shape == (3, 5, 16) and normed.dtype == torch.bfloat16
            assert res.dtype == torch.float32
            assert res.shape == ((4, 16) if out_sh else (3, 5, 16))  # ceil(15 / 4) = 4 rows per rank


def test_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown kernel"):
        allreduce_add_rmsnorm(torch.randn(2, 8), None, None, None, 1e-6, "0", torch.float32,
                              torch.float32, None, 0.0, False, False, "nvls", 8)
