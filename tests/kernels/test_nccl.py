"""The ``nccl`` fused-op implementation on 2 and 3 gloo ranks (its collectives are functional
collectives, so gloo carries them on CPU; the add+norm runs its torch path there), through the
registered op with ``kernel="nccl"``, against the float64 oracle."""

from __future__ import annotations

import random

import pytest
import torch

from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref as _oracle
from weave_compile.rows import rows_per_rank
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

CASES = [
    # (T, H, dtype, residual, bias, in_sharded, out_sharded, scaled)
    (1, 24, torch.float32, True, False, False, False, False),
    (7, 40, torch.bfloat16, True, True, False, False, False),
    (67, 96, torch.float32, True, False, True, True, False),
    (10, 32, torch.float32, False, True, False, True, True),
    (13, 48, torch.bfloat16, True, False, True, False, False),
]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def allreduce_add_rmsnorm_ref(*args, **kwargs):
    """The one oracle (kernels/reference.py), its outputs (rounded where the contract rounds) as float64."""
    return tuple(t.double() for t in _oracle(*args, **kwargs))


def _make(case, seed, world):
    T, H, dt, has_res, has_bias, *_ = case
    g = torch.Generator().manual_seed(seed)
    partials = [torch.randn(T, H, generator=g).to(dt) for _ in range(world)]
    residual = torch.randn(T, H, generator=g).to(dt) if has_res else None
    bias = torch.randn(H, generator=g).to(dt) if has_bias else None
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dt)
    return partials, residual, bias, weight


def _eps(case: int) -> float:
    return 0.5 if case % 2 else 1e-5


def _run(rank, world, seed):
    from weave_compile.ops import allreduce_add_rmsnorm as op

    outs = []
    for i, case in enumerate(CASES):
        T, H, dt, _, _, in_sh, out_sh, scaled = case
        partials, residual, bias, weight = _make(case, seed + i, world)
        per = rows_per_rank(T, world)
        if in_sh and residual is not None:
            residual = torch.nn.functional.pad(residual, (0, 0, 0, per * world - T))[rank * per:(rank + 1) * per]
        scale = torch.tensor(0.75) if scaled else None
        # Every other case gives eps as a 0-d tensor (as the pass does under dynamic shapes), its
        # float 0, and large enough that reading the float instead would fail.
        eps_t = torch.tensor(_eps(i), dtype=torch.float64) if i % 2 else None
        outs.append(op(partials[rank], residual, bias, weight, 0.0 if i % 2 else _eps(i), "0", dt, dt, None, 0.0,
                       in_sh, out_sh, "nccl", 4, scale, eps_tensor=eps_t)[:2])
    return outs


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_nccl_kernel_matches_float64(world):
    seed = random.randrange(2**31)
    results = assert_ranks_ok(run_ranks(_run, world, args=(seed,), timeout=240))
    for i, case in enumerate(CASES):
        T, H, dt, _, _, in_sh, out_sh, scaled = case
        partials, residual, bias, weight = _make(case, seed + i, world)
        y, acc = allreduce_add_rmsnorm_ref(partials, residual, bias, weight, eps=_eps(i),
                                           scale=torch.tensor(0.75) if scaled else None)
        per = rows_per_rank(T, world)
        for rank, outs in enumerate(results):
            normed, res = outs[i]
            torch.testing.assert_close(normed.double(), y, **TOL[dt], msg=lambda m: f"seed {seed} case {i}: {m}")
            if out_sh:
                n = max(0, min(per, T - rank * per))
                torch.testing.assert_close(res[:n].double(), acc[rank * per:rank * per + n], **TOL[dt])
                assert res.shape == (per, H) and torch.all(res[n:] == 0)
            else:
                torch.testing.assert_close(res.double(), acc, **TOL[dt])


# ----------------------------------------------------------------------------- LayerNorm

LN_CASES = [
    # (T, H, dtype, residual, bias, weight, norm_bias, in_sharded, out_sharded)
    (5, 24, torch.float32, True, False, True, True, False, False),
    (9, 40, torch.bfloat16, True, True, True, True, True, True),
    (3, 32, torch.float32, False, False, False, False, False, True),
    (11, 48, torch.bfloat16, True, False, True, False, False, False),
]


def _ln_inputs(case, seed, world):
    T, H, dt, has_res, has_bias, has_w, has_nb, *_ = case
    g = torch.Generator().manual_seed(seed)
    # In fp32 a large common offset: a variance taken as E[x^2] - mean^2 would cancel there. (In
    # bf16 the reduced sum's own rounding at that magnitude, an ulp of 0.25, would dominate.)
    offset = 50.0 if dt == torch.float32 else 0.0
    partials = [(torch.randn(T, H, generator=g) + offset / world).to(dt) for _ in range(world)]
    residual = torch.randn(T, H, generator=g).to(dt) if has_res else None
    bias = torch.randn(H, generator=g).to(dt) if has_bias else None
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dt) if has_w else None
    norm_bias = (0.1 * torch.randn(H, generator=g)).to(dt) if has_nb else None
    return partials, residual, bias, weight, norm_bias


def _run_ln(rank, world, seed):
    from weave_compile.ops import allreduce_add_rmsnorm as op

    outs = {}
    for kernel in ("reference", "nccl"):
        for i, case in enumerate(LN_CASES):
            T, _, dt, *_, in_sh, out_sh = case
            partials, residual, bias, weight, norm_bias = _ln_inputs(case, seed + i, world)
            per = rows_per_rank(T, world)
            if in_sh and residual is not None:
                residual = torch.nn.functional.pad(residual, (0, 0, 0, per * world - T))[rank * per:(rank + 1) * per]
            outs[kernel, i] = op(partials[rank], residual, bias, weight, 1e-5, "0", dt, dt, None, 0.0, in_sh, out_sh,
                                 kernel, 4, norm="layernorm", norm_bias=norm_bias)[:2]
    return outs


def test_layernorm_of_reference_and_nccl_matches_float64():
    seed = random.randrange(2**31)
    results = assert_ranks_ok(run_ranks(_run_ln, 2, args=(seed,), timeout=240))
    for i, case in enumerate(LN_CASES):
        T, _, dt, *_, out_sh = case
        partials, residual, bias, weight, norm_bias = _ln_inputs(case, seed + i, 2)
        y, acc = allreduce_add_rmsnorm_ref(partials, residual, bias, weight, eps=1e-5, norm="layernorm",
                                           norm_bias=norm_bias)
        per = rows_per_rank(T, 2)
        for rank, outs in enumerate(results):
            for kernel in ("reference", "nccl"):
                normed, res = outs[kernel, i]
                where = f"seed {seed} case {i} {kernel} rank {rank}"
                torch.testing.assert_close(normed.double(), y, **TOL[dt], msg=lambda m, where=where: f"{where}: {m}")
                n = max(0, min(per, T - rank * per))
                got = res[:n] if out_sh else res[rank * per:rank * per + n]
                torch.testing.assert_close(got.double(), acc[rank * per:rank * per + n], **TOL[dt])
