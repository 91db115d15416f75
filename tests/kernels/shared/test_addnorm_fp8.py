"""The shared add+norm kernel's fp8 epilogue (``kernels/shared/fp8_rows.py``) under Triton's interpreter.

The kernel quantizes the normed rows it computes, so its codes and row scales are checked bit for
bit against :func:`weave_compile.quant.quantize_rows` of its own normed rows (the same launch
without the epilogue), and against the float64 oracle (one step at a rounding boundary at most):
``_addnorm_cases.check_quant_rows``. Each form the fuse pass records (per row with fp32 or bf16
quotients, a floor, the reciprocal; static with and without the clamp; e4m3fn and e5m2), in the
tile loops a quantizing launch takes (pipelined, prefetched), RMSNorm and LayerNorm, received
slots or none; drawn shapes; rows spanning ten decades with a NaN and an infinity. The epilogue's fp8
rounding is integer arithmetic on the fp32 bits, on GPUs as here (Triton's conversion put 0.1% of
codes a step off on one H100; ``test_addnorm_fp8_gpu.py`` checks the GPU the same way); a test here
checks the integer rounding itself against torch's cast on every fp32 pattern class. The kernel also
compiles for sm_90 at the default shapes with the epilogue on (no spills), reducing every row in the
layout the kernel without the epilogue reduces it in. Outputs are poisoned before each launch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from weave_compile.kernels.shared import addnorm  # noqa: E402
from weave_compile.quant import QuantSpec  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _interpret(script: str, *args) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script, _ROOT, *map(str, args)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


_CHILD = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, sys.argv[1])
    from tests.kernels.shared._addnorm_cases import check_quant_rows, loop_configs, quant_forms
    from weave_compile.kernels.shared import addnorm

    FORMS = quant_forms()
    assert addnorm.use_triton(torch.device("cpu")), "the interpreter is off"
    g = torch.Generator().manual_seed(int(sys.argv[2]))
    fracs = []
    for name, quant in FORMS.items():
        for H in (40, 64):
            for kind, cfg in loop_configs(H, small=True).items():
                if cfg.chunk:
                    continue
                for norm, slots in (("rmsnorm", 0), ("layernorm", 1)):
                    for extremes in (False, True):
                        # a static scale small enough that the unclamped forms saturate some codes
                        fracs.append(check_quant_rows(cfg, g, quant, hidden=H, n_valid=5, norm=norm, slots=slots,
                                                      static_scale=0.002, extremes=extremes,
                                                      where=f"{name} H={H} {kind} {norm} extremes={extremes}"))
    print("oracle disagreement", max(fracs))
    print("ok")
""")


def test_every_form_bit_exact_to_its_contract_in_the_tile_loops(seed):
    _interpret(_CHILD, seed)


_PROPERTY = textwrap.dedent("""
    import sys
    import torch
    from hypothesis import given, settings, strategies as st
    sys.path.insert(0, sys.argv[1])
    from tests.kernels.shared._addnorm_cases import check_quant_rows, loop_configs, quant_forms

    FORMS = quant_forms()
    @settings(max_examples=int(sys.argv[2]), deadline=None, database=None)
    @given(H=st.integers(1, 96), n=st.integers(0, 9), kind=st.sampled_from(["pipelined", "prefetch"]),
           form=st.sampled_from(sorted(FORMS)), norm=st.sampled_from(["rmsnorm", "layernorm"]),
           slots=st.integers(0, 2), fp32=st.booleans(), extremes=st.booleans(),
           static_scale=st.floats(1e-4, 1.0), seed=st.integers(0, 2**31 - 1))
    def prop(H, n, kind, form, norm, slots, fp32, extremes, static_scale, seed):
        check_quant_rows(loop_configs(H, True)[kind], torch.Generator().manual_seed(seed), FORMS[form], hidden=H,
                         n_valid=n, dtype=torch.float32 if fp32 else torch.bfloat16, norm=norm, slots=slots,
                         static_scale=static_scale, extremes=extremes,
                         where=f"H={H} n={n} {kind} {form} {norm} slots={slots} fp32={fp32}")

    prop()
    print("ok")
""")


def test_epilogue_property_bit_exact_on_drawn_shapes():
    """Drawn H 1..96 (odd, below a warp, past a power of two), 0..9 rows, forms, loops, dtypes."""
    _interpret(_PROPERTY, 30)


_ROUNDING = textwrap.dedent("""
    import sys
    import torch
    import triton
    import triton.language as tl
    sys.path.insert(0, sys.argv[1])
    from weave_compile.kernels.shared.fp8_rows import fp8_bits

    @triton.jit
    def k(Q, C, N: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(C + i, fp8_bits(tl.load(Q + i), MBITS, BIAS))

    # every fp8 code's value, the midpoints between neighbours (ties: to even), a hair either side of
    # them, subnormals, zeros of both signs, and random values across the range
    for dtype, mbits, bias in ((torch.float8_e4m3fn, 3, 7), (torch.float8_e5m2, 2, 15)):
        top = torch.finfo(dtype).max
        vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        vals = vals[vals.isfinite() & (vals.abs() <= top)].unique()
        mids = (vals[1:] + vals[:-1]) / 2
        near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                          torch.nextafter(mids, torch.full_like(mids, -1e9))])
        g = torch.Generator().manual_seed(int(sys.argv[2]))
        rand = (torch.rand(4096, generator=g) * 2 - 1) * top * torch.logspace(-9, 0, 4096)
        q = torch.cat([vals, near, -near, torch.tensor([0.0, -0.0, 2.0 ** -30, -(2.0 ** -30)]), rand])
        q = q.clamp(-top, top)
        n = triton.next_power_of_2(q.numel())
        q = torch.cat([q, torch.zeros(n - q.numel())])
        codes = torch.empty(n, dtype=torch.int32)
        k[(1,)](q, codes, n, mbits, bias)
        want = q.to(dtype).view(torch.uint8).to(torch.int32)
        bad = (codes != want).nonzero().flatten()
        assert not len(bad), (dtype, [(q[i].item(), codes[i].item(), want[i].item()) for i in bad[:8]])
    print("ok")
""")


def test_the_integer_rounding_equals_torchs_cast(seed):
    """Every code, every midpoint (ties to even) and a hair either side, subnormals, signed zeros."""
    _interpret(_ROUNDING, seed)


def test_bad_epilogue_arguments_are_named():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    q = QuantSpec("row", torch.float8_e4m3fn, 448.0)
    codes = torch.empty(4, 8, dtype=torch.float8_e4m3fn)
    kw = dict(n_valid=4, eps=1e-5, mid_dtype=None, weight_offset=0.0, num_ctas=1, quant=q)
    with pytest.raises(ValueError, match="needs out_dtype"):
        addnorm.add_rmsnorm_rows(x, None, None, None, None, None, codes, torch.empty_like(x),
                                 row_scales=torch.empty(4, 1), **kw)
    with pytest.raises(ValueError, match="normed must be"):
        addnorm.add_rmsnorm_rows(x, None, None, None, None, None, torch.empty_like(x), torch.empty_like(x),
                                 row_scales=torch.empty(4, 1), out_dtype=x.dtype, **kw)
    with pytest.raises(ValueError, match="needs row_scales"):
        addnorm.add_rmsnorm_rows(x, None, None, None, None, None, codes, torch.empty_like(x), out_dtype=x.dtype,
                                 **kw)
    kw["quant"] = QuantSpec("static", torch.float8_e4m3fn, 448.0)
    with pytest.raises(ValueError, match="one-element quant_scale"):
        addnorm.add_rmsnorm_rows(x, None, None, None, None, None, codes, torch.empty_like(x), out_dtype=x.dtype,
                                 **kw)


def test_a_quantizing_launch_never_takes_the_one_warp_per_row_loop():
    assert addnorm.launch_config(4096, slots=1, rows_per_cta=64).chunk > 0
    assert addnorm.launch_config(4096, slots=1, rows_per_cta=64, quant=True).chunk == 0


@pytest.mark.parametrize("H", [4096, 8192])
@pytest.mark.parametrize("kind", ["row", "static"])
def test_the_epilogue_compiles_for_sm90_without_spills(H, kind):
    """nccl's default shapes (no received slot; few rows per CTA and many) with the epilogue on."""
    from tests.kernels.shared.test_addnorm import _ptxas_report

    bf = torch.bfloat16
    quant = QuantSpec(kind, torch.float8_e4m3fn, 448.0, 1e-12 if kind == "row" else 0.0, kind == "row")
    for rows_per_cta in (1, 64):
        cfg = addnorm.launch_config(H, slots=0, rows_per_cta=rows_per_cta, quant=True)
        rows = 16
        tensors = (torch.empty(rows, H, dtype=bf), None, torch.empty(rows, H, dtype=bf), None, torch.empty(H, dtype=bf),
                   None, None, torch.empty(rows, H, dtype=torch.float8_e4m3fn), torch.empty(rows, H, dtype=bf))
        args, kw = addnorm.kernel_args(tensors, rows, rows, 1e-5, None, 0.0, cfg, 0, quant=quant,
                                       quant_scale=torch.ones(1), row_scales=torch.empty(rows, 1), out_dtype=bf)
        assert kw["QUANT"] == (1 if kind == "row" else 2)
        report = _ptxas_report(args, kw)
        assert "Used" in report and " 0 bytes spill stores" in report, (cfg, report)


_BLOCKED = re.compile(r"#ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
                      r"warpsPerCTA = \[([\d, ]+)\], order = \[([\d, ]+)\]\}>")
_SLICE = re.compile(r"#ttg\.slice<\{dim = (\d+), parent = (#ttg\.blocked<\{[^}]*\}>)\}>")


def _blocked(spt, tpw, wpc, order) -> str:
    def f(v):
        return ", ".join(map(str, v))

    return (f"#ttg.blocked<{{sizePerThread = [{f(spt)}], threadsPerWarp = [{f(tpw)}], warpsPerCTA = [{f(wpc)}], "
            f"order = [{f(order)}]}}>")


def _unslice(m) -> str:
    """A slice of a blocked layout whose sliced dim has one element, lane and warp is that blocked
    layout without the dim: the same element -> (register, lane, warp) map, so the same reduction."""
    dim, parent = int(m.group(1)), _BLOCKED.fullmatch(m.group(2))
    spt, tpw, wpc, order = ([int(v) for v in parent.group(i).split(",")] for i in range(1, 5))
    if (spt[dim], tpw[dim], wpc[dim]) != (1, 1, 1):
        return m.group(0)
    drop = [i for i in range(len(spt)) if i != dim]
    return _blocked([spt[i] for i in drop], [tpw[i] for i in drop], [wpc[i] for i in drop],
                    [o - (o > dim) for o in order if o != dim])


def _reduce_layouts(ttgir: str) -> list[str]:
    """Each ``tt.reduce``'s operand type in ``ttgir`` with its layout spelled out (aliases are
    numbered per module; a slice that maps elements as a blocked layout does is written as that
    one), in program order."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    types = re.findall(r"^\s*\}\) : \((tensor<[^)]*>)\) -> ", ttgir, re.M)
    out = []
    for t in types:
        t = re.sub(r"#\w+", lambda a: aliases.get(a.group(0), a.group(0)), t)
        out.append(_SLICE.sub(_unslice, t))
    return out


@pytest.mark.parametrize("H,rows_per_cta,slots,dts,norm", [
    (8192, 1, 0, ("bf16", "bf16", "bf16"), "rmsnorm"),  # nccl at 70B, a few rows a CTA (one-row tiles)
    (8192, 64, 0, ("bf16", "fp32", "bf16"), "layernorm"),
    (4096, 64, 0, ("bf16", "bf16", "bf16"), "rmsnorm"),  # two-row tiles
    (4096, 1, 1, ("bf16", "bf16", "bf16"), "rmsnorm"),  # ce: a received slot
    (5120, 64, 0, ("fp32", "fp32", "bf16"), "rmsnorm"),  # pipelined, fp32 rows
    (2048, 8, 0, ("bf16", "bf16", "fp32"), "layernorm"),  # normed in fp32 before the codes
])
def test_the_epilogue_reduces_each_row_as_the_kernel_without_it(H, rows_per_cta, slots, dts, norm):
    """The epilogue's codes are the quantized normed rows of the same launch without it, bit for
    bit, only if both reduce a row's sums (mean, square) in one order: the same layout for each
    reduction compiled for sm_90 (one byte a code would otherwise widen the whole tile's layout:
    seen as codes a step off at 70B on one H100). Checked on the ttgir of both kernels."""
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    x_dt, res_dt, out_dt = (dt[d] for d in dts)
    cfg = addnorm.launch_config(H, slots=slots, rows_per_cta=rows_per_cta, quant=True, elem_bytes=x_dt.itemsize,
                                res_bytes=res_dt.itemsize)
    assert cfg.chunk == 0
    rows = 16
    base = (torch.empty(rows, H, dtype=x_dt), torch.empty(slots, rows, H, dtype=x_dt) if slots else None,
            torch.empty(rows, H, dtype=res_dt), None, torch.empty(H, dtype=x_dt), None, None)
    variant = dict(norm=norm, norm_bias=torch.empty(H, dtype=x_dt) if norm == "layernorm" else None)
    from tests.kernels.shared.test_addnorm import compile_sm90

    plain = compile_sm90(*addnorm.kernel_args(base + (torch.empty(rows, H, dtype=out_dt),
                                                      torch.empty(rows, H, dtype=res_dt)),
                                              rows, rows, 1e-5, None, 0.0, cfg, slots, **variant))["ttgir"]
    for kind in ("row", "static"):
        quant = QuantSpec(kind, torch.float8_e4m3fn, 448.0, 1e-12 if kind == "row" else 0.0, kind == "row")
        q = compile_sm90(*addnorm.kernel_args(base + (torch.empty(rows, H, dtype=torch.float8_e4m3fn),
                                                      torch.empty(rows, H, dtype=res_dt)),
                                              rows, rows, 1e-5, None, 0.0, cfg, slots, quant=quant,
                                              quant_scale=torch.ones(1), row_scales=torch.empty(rows, 1),
                                              out_dtype=out_dt, **variant))["ttgir"]
        want, got = _reduce_layouts(plain), _reduce_layouts(q)
        assert len(want) >= (2 if norm == "layernorm" else 1), want  # (the slots' sum,) (the mean,) the squares
        assert got[:len(want)] == want, (kind, want, got)


def test_the_code_store_hint_only_where_the_rows_are_aligned():
    """``Q_VEC`` (the codes' store: as many a thread as the normed rows' store) only where the codes'
    base and row stride are 16-byte aligned, where Triton would otherwise give them 16 a thread; a
    misaligned base or stride gets none (a hint there would claim an alignment the rows lack)."""
    from weave_compile.kernels.shared.fp8_rows import code_vector

    buf = torch.empty(64 * 80 + 16, dtype=torch.uint8)
    off = (-buf.data_ptr()) % 16
    aligned = buf[off:off + 8 * 64].view(torch.float8_e4m3fn).view(8, 64)
    assert code_vector(aligned, torch.bfloat16) == 8 and code_vector(aligned, torch.float32) == 4
    assert code_vector(buf[off + 1:off + 1 + 8 * 64].view(torch.float8_e4m3fn).view(8, 64), torch.bfloat16) == 0
    assert code_vector(buf[off:off + 8 * 40].view(torch.float8_e4m3fn).view(8, 40), torch.bfloat16) == 0
