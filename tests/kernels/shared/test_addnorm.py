"""The shared add+norm kernel: eps from a 0-d tensor, and its LayerNorm variant in every loop kind.

Under ``torch.compile(dynamic=True)`` eps reaches the op as a device tensor (the fuse pass copies
the host graph input there), and the kernel loads it once per CTA (``EPS_PTR``). The LayerNorm
variant (``IS_LAYERNORM``, ``HAS_NORM_BIAS``) is checked in each loop kind, forced, against the
float64 oracle (``_addnorm_cases.check_rows``), with RMSNorm beside it; it also compiles for sm_90
here (Triton and its ptxas, no GPU needed) without spilling at the default launch shapes. The real
kernel runs under Triton's interpreter in a fresh process (``TRITON_INTERPRET`` is read when triton
decorates the kernel), on fresh random rows, with outputs poisoned first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from weave_compile.kernels.shared import addnorm  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CHILD = textwrap.dedent("""
    import torch
    from weave_compile.kernels.shared import addnorm
    from weave_compile.rows import norm_rows

    assert addnorm.use_triton(torch.device("cpu")), "the interpreter is off"
    g = torch.Generator().manual_seed(int(__import__("sys").argv[1]))
    T, H, eps = 5, 48, 0.37  # eps of the order of the rows' mean square: it moves every output
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    res = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(torch.bfloat16)
    want_res = (x.double() + res.double())
    want = norm_rows(want_res.to(torch.bfloat16), w, eps, torch.float64, None, 0.0)
    outs = {}
    for name, e in (("float", eps), ("fp64 tensor", torch.tensor(eps, dtype=torch.float64)),
                    ("fp32 tensor", torch.tensor(eps, dtype=torch.float32))):
        normed = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
        res_out = torch.full((T, H), float("nan"), dtype=torch.bfloat16)
        addnorm.add_rmsnorm_rows(x, None, res, None, w, None, normed, res_out, n_valid=T, eps=e,
                                 mid_dtype=None, weight_offset=0.0, num_ctas=2)
        assert not normed.isnan().any() and not res_out.isnan().any(), name
        err = ((normed.double() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, (name, err)
        assert ((res_out.double() - want_res).abs() <= 2 ** -7 * want_res.abs()).all(), name  # one bf16 rounding
        outs[name] = normed
    assert torch.equal(outs["float"], outs["fp64 tensor"]) and torch.equal(outs["float"], outs["fp32 tensor"])
    # A wrong eps is seen: the check above is not blind to it.
    other = torch.empty_like(outs["float"])
    addnorm.add_rmsnorm_rows(x, None, res, None, w, None, other, torch.empty_like(res), n_valid=T,
                             eps=torch.tensor(1e-6), mid_dtype=None, weight_offset=0.0, num_ctas=2)
    assert not torch.equal(other, outs["float"])
    print("ok")
""")


def test_eps_from_a_tensor_equals_eps_as_a_number(seed):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(seed)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def _interpret(script: str, *args) -> None:
    """``script`` in a fresh process under Triton's interpreter (the repository root importable)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script, _ROOT, *map(str, args)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


_LAYERNORM_CHILD = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from tests.kernels.shared._addnorm_cases import check_rows, loop_configs
    from weave_compile.kernels.shared import addnorm

    assert addnorm.use_triton(torch.device("cpu")), "the interpreter is off"
    g = torch.Generator().manual_seed(int(sys.argv[2]))
    BF16 = torch.bfloat16
    OPTIONS = [dict(),  # weight and norm bias
               dict(weight=False, norm_bias=False),
               dict(norm_bias=False, mid_dtype=BF16),
               dict(weight=False, slots=0, bias=True, scale=True),
               dict(slots=2, bias=True, mid_dtype=BF16, weight_offset=1.0)]
    for H in (40, 64):  # BLOCK_H 64 with 24 padding columns; a power of two
        for kind, cfg in loop_configs(H, small=True).items():
            for dtype in (BF16, torch.float32):
                for opts in OPTIONS:
                    check_rows(cfg, g, hidden=H, n_valid=5, dtype=dtype,
                               where=f"LayerNorm H={H} {kind} {dtype} {opts}", **opts)
                for opts in (dict(norm_bias=False), dict(slots=0, bias=True, scale=True, mid_dtype=BF16)):
                    check_rows(cfg, g, hidden=H, n_valid=5, dtype=dtype, norm="rmsnorm",
                               where=f"RMSNorm H={H} {kind} {dtype} {opts}", **opts)
    print("ok")
""")


def test_layernorm_in_every_loop_kind_matches_float64(seed):
    _interpret(_LAYERNORM_CHILD, seed)


_PROPERTY_CHILD = textwrap.dedent("""
    import sys
    import torch
    from hypothesis import given, settings, strategies as st
    sys.path.insert(0, sys.argv[1])
    from tests.kernels.shared._addnorm_cases import check_rows, loop_configs

    @settings(max_examples=int(sys.argv[2]), deadline=None, database=None)
    @given(H=st.integers(1, 80), n=st.integers(0, 9), kind=st.sampled_from(sorted(loop_configs(8, True))),
           fp32=st.booleans(), norm=st.sampled_from(["layernorm", "rmsnorm"]), weight=st.booleans(),
           norm_bias=st.booleans(), mid=st.booleans(), slots=st.integers(0, 2), bias=st.booleans(),
           scale=st.booleans(), seed=st.integers(0, 2**31 - 1))
    def prop(H, n, kind, fp32, norm, weight, norm_bias, mid, slots, bias, scale, seed):
        dtype = torch.float32 if fp32 else torch.bfloat16
        check_rows(loop_configs(H, True)[kind], torch.Generator().manual_seed(seed), hidden=H, n_valid=n,
                   dtype=dtype, norm=norm, weight=weight, norm_bias=norm_bias,
                   mid_dtype=torch.bfloat16 if mid else None, slots=slots, bias=bias, scale=scale,
                   where=f"H={H} n={n} {kind} {dtype} {norm}")

    prop()
    print("ok")
""")


def test_layernorm_property_against_float64():
    """Drawn shapes (H 1..80, 0..9 valid rows), loop kinds, dtypes and options, RMSNorm and LayerNorm."""
    _interpret(_PROPERTY_CHILD, 40)


def compile_sm90(args, kwargs, kernel=None) -> dict:
    """``kernel``'s (default: the add+norm kernel's) compiled stages (``asm``: ttgir, ptx, ...) for
    sm_90 with its launch's ``(args, kwargs)`` (``kernel_args``' for the add+norm kernel), on any
    machine (Triton compiles without a GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    k = kernel or addnorm._add_rmsnorm_rows_kernel
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    bound, spec, opts = create_function_from_signature(k.signature, k.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = k._pack_args(backend, kwargs, bound, spec, opts)
    return triton.compile(ASTSource(k, signature, constexprs, attrs), target=target, options=options.__dict__).asm


def _ptxas_report(args, kwargs, kernel=None) -> str:
    """ptxas -v's report for ``kernel`` (default: the add+norm kernel) compiled for sm_90 with its
    launch's ``(args, kwargs)``."""
    import tempfile

    import triton

    ptx = compile_sm90(args, kwargs, kernel)["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([triton.knobs.nvidia.ptxas.path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    return out.stderr


@pytest.mark.parametrize("H", [4096, 5120])
def test_layernorm_compiles_for_sm90_without_spills_at_the_default_shapes(H):
    """nccl's default shapes (no received slots; one row per CTA and many) and the one-warp-per-row
    loop where it is the default (H=4096, one slot), with every option on; RMSNorm's keywords carry
    none of the variant's (its kernel is the one it was)."""
    bf = torch.bfloat16
    cases = [(0, addnorm.launch_config(H, slots=0, rows_per_cta=1)),
             (0, addnorm.launch_config(H, slots=0, rows_per_cta=64))]
    if H == 4096:
        cases.append((1, addnorm.launch_config(H, slots=1, rows_per_cta=64)))
        assert cases[-1][1].chunk > 0
    for slots, cfg in cases:
        rows = 16
        tensors = (torch.empty(rows, H, dtype=bf), torch.empty(slots, rows, H, dtype=bf) if slots else None,
                   torch.empty(rows, H, dtype=bf), torch.empty(H, dtype=bf), torch.empty(H, dtype=bf),
                   torch.empty(1), None, torch.empty(rows, H, dtype=bf), torch.empty(rows, H, dtype=bf))
        _, rms = addnorm.kernel_args(tensors, rows, rows, 1e-5, bf, 0.0, cfg, slots)
        assert not {"NORM_BIAS", "IS_LAYERNORM", "HAS_NORM_BIAS"} & set(rms)
        args, kw = addnorm.kernel_args(tensors, rows, rows, 1e-5, bf, 0.0, cfg, slots, norm="layernorm",
                                       norm_bias=torch.empty(H, dtype=bf))
        assert kw["IS_LAYERNORM"] and kw["HAS_NORM_BIAS"]
        report = _ptxas_report(args, kw)
        assert "Used" in report and " 0 bytes spill stores" in report, (cfg, report)
