"""One add+norm kernel launch on fresh random rows, checked against the float64 oracle.

Shared by the interpreter tests (test_addnorm.py, CPU tensors under ``TRITON_INTERPRET=1``) and
the GPU test (test_addnorm_gpu.py): :func:`check_rows` draws the inputs, poisons the outputs (NaN),
runs :func:`weave_compile.kernels.shared.addnorm.add_rmsnorm_rows` with a forced launch shape and
checks, against :func:`weave_compile.kernels.reference.allreduce_add_rmsnorm_ref`:

- the residual rows: the oracle's float64 sum rounded once, within one ulp of the residual dtype
  and the rounding of the kernel's fp32 adds (Triton's interpreter also rounds to bf16 its own way);
- the normed rows: the oracle's norm of the kernel's own residual rows, to the output (or mid)
  dtype's rounding, so a residual an ulp apart does not hide the norm's error (in fp32 a large
  common offset makes a variance taken as E[x^2] - mean^2 miss the tolerance tenfold);
- the padding rows: the residual's rows past ``n_valid`` are +0, the normed rows past it untouched.
"""

from __future__ import annotations

from typing import Optional

import torch

from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.kernels.shared import addnorm

EPS = 1e-5


def loop_configs(hidden: int, small: bool) -> dict[str, addnorm.LaunchConfig]:
    """Every loop kind of the kernel, forced: the launch shapes :func:`addnorm.launch_config` gives at
    ``hidden`` (``small=False``: the GPU's), or tiny ones for the interpreter, whose one-warp-per-row
    chunks leave the last one half masked at H=40 and look ahead past the last chunk."""
    if small:
        return {"pipelined": addnorm.LaunchConfig(2, 2, 4), "prefetch": addnorm.LaunchConfig(2, 1, 4, True),
                "rowwise": addnorm.LaunchConfig(2, 1, 4, chunk=16, depth=2),
                "rowwise-deep": addnorm.LaunchConfig(4, 1, 4, chunk=32, depth=3)}
    return {"pipelined": addnorm.launch_config(hidden, prefetch=False),
            "prefetch": addnorm.launch_config(hidden, prefetch=True),
            "rowwise": addnorm.LaunchConfig(addnorm.ROWWISE_WARPS, 1, addnorm.ROWWISE_WARPS, False,
                                            addnorm.ROWWISE_CHUNK, addnorm.ADDNORM_ROWWISE_DEPTH)}


def _residual_ok(got: torch.Tensor, want: torch.Tensor, terms: list, dtype: torch.dtype) -> bool:
    """``got`` within one ulp of ``dtype`` of the oracle's ``want`` plus the kernel's fp32 adds' rounding
    (half an fp32 ulp of the running sum's magnitude per add of ``terms``, the added values)."""
    magnitude = sum(t.double().abs() for t in terms)
    bound = torch.finfo(dtype).eps * want.double().abs() + len(terms) * 2.0 ** -24 * magnitude
    return bool(((got.double() - want.double()).abs() <= bound).all())


def check_rows(cfg: addnorm.LaunchConfig, g: torch.Generator, *, hidden: int, n_valid: int, dtype: torch.dtype,
               norm: str = "layernorm", weight: bool = True, norm_bias: bool = True,
               mid_dtype: Optional[torch.dtype] = None, slots: int = 1, bias: bool = False, scale: bool = False,
               weight_offset: float = 0.0, offset: Optional[float] = None, device: str = "cpu",
               where: str = "") -> None:
    """Run the kernel once on fresh rows (``offset`` added to x: a common mean the LayerNorm removes and
    RMSNorm does not; default 200 in fp32, 3 in 16 bits) and check it (module doc); ``where`` names the
    case in failures."""
    H, n = hidden, n_valid
    if offset is None:
        offset = 200.0 if dtype == torch.float32 else 3.0

    def draw(*shape):
        return torch.randn(*shape, generator=g, device=device)

    x = (draw(n + 2, H) + offset).to(dtype)[1:n + 1]  # a view: its row stride is the kernel's to honour
    recv = draw(slots, n, H).to(dtype) if slots else None
    residual = draw(n, H).to(dtype)
    b = draw(H).to(dtype) if bias else None
    s = torch.tensor([-1.5], device=device) if scale else None  # negative: a padding row's 0 must stay +0
    w = (1 + 0.5 * draw(H)).to(dtype) if weight else None
    nb = draw(H).to(dtype) if norm_bias else None
    normed = torch.full((n + 1, H), float("nan"), dtype=dtype, device=device)
    res_out = torch.full((n + 2, H), float("nan"), dtype=dtype, device=device)  # a sharded residual's padding
    addnorm.add_rmsnorm_rows(x, recv, residual, b, w, s, normed, res_out, n_valid=n, eps=EPS, mid_dtype=mid_dtype,
                             weight_offset=weight_offset, num_ctas=2, config=cfg, norm=norm, norm_bias=nb)
    partials = [x] + (list(recv) if recv is not None else [])
    _, want_res = allreduce_add_rmsnorm_ref(partials, residual, b, w, eps=EPS, weight_offset=weight_offset, scale=s,
                                            mid_dtype=mid_dtype, norm=norm, norm_bias=nb)
    got_res = res_out[:n]
    terms = [p.double() * (s.double().abs() if s is not None else 1) for p in partials] + \
        [t for t in (b, residual) if t is not None]
    assert _residual_ok(got_res, want_res, terms, dtype), f"{where}: residual rows off by more than one ulp"
    assert bool((res_out[n:] == 0).all()) and not bool(torch.signbit(res_out[n:]).any()), f"{where}: padding rows"
    assert bool(normed[n:].isnan().all()), f"{where}: a normed row past n_valid was written"
    if n == 0:
        return
    want, _ = allreduce_add_rmsnorm_ref([got_res], None, None, w, eps=EPS, weight_offset=weight_offset,
                                        out_dtype=torch.float64, mid_dtype=mid_dtype, norm=norm, norm_bias=nb)
    rounded = mid_dtype is not None or dtype != torch.float32
    # A 16-bit rounding (two with a mid dtype), or fp32's sums: at an offset of 200 (H <= 80, under the
    # interpreter) the two-pass variance's normed rows measured within 2e-5 of float64's, E[x^2] - mean^2's
    # 5e-4 and more off.
    tol = 2 ** -6 if rounded else 5e-5
    # Relative to the terms before the norm bias's add (|y * w| <= |normed| + |norm_bias|): a mid
    # dtype rounds y, and the bias may cancel most of y * w.
    size = 1 + want.abs() + (nb.double().abs() if nb is not None else 0)
    bound = tol * size
    if norm == "layernorm":
        # The row's fp32 mean is a few ulps of |mean| off, which moves the centred row by that
        # against its spread: where the spread is tiny next to the mean (H=2, two close values) that
        # is no longer small. E[x^2] - mean^2 errs by the square of that ratio.
        r = got_res.double()
        mean = r.mean(-1, keepdim=True)
        spread = ((r - mean).pow(2).mean(-1, keepdim=True) + EPS).sqrt()
        gain = (w.double() + weight_offset).abs() if w is not None else 1
        bound = bound + 4 * 2.0 ** -24 * mean.abs() / spread * gain
    err = (normed[:n].double() - want).abs()
    assert bool((err <= bound).all()), f"{where}: normed rows off by up to {(err / bound).max().item():.3g} x the bound"
    if norm == "layernorm" and offset >= 1 and H >= 8:  # the check above tells LayerNorm from RMSNorm here
        rms, _ = allreduce_add_rmsnorm_ref([got_res], None, None, w, eps=EPS, weight_offset=weight_offset,
                                           out_dtype=torch.float64, mid_dtype=mid_dtype, norm_bias=nb)
        assert ((rms - want).abs() / size).max() > 10 * tol, where


def quant_forms() -> dict:
    """The fp8 epilogue forms the fuse pass records, as the kernel tests draw them: vLLM's per-token
    (reciprocal, floor), torchao's per-row (its quotient in bf16), e5m2, and the static forms with
    and without the clamp (those without saturate)."""
    from weave_compile.quant import QuantSpec

    e4, e5, bf = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    return {
        "vllm-per-token": QuantSpec("row", e4, 448.0, 1e-12, True, True),
        "torchao-per-row-bf16": QuantSpec("row", e4, 448.0, 1e-12, False, True, bf),
        "per-row-e5m2": QuantSpec("row", e5, 57344.0, 0.0, False, True),
        "static-div": QuantSpec("static", e4, 448.0, 0.0, False, True),
        "static-recip-noclamp": QuantSpec("static", e4, 448.0, 0.0, True, False),
        "static-e5m2-noclamp": QuantSpec("static", e5, 57344.0, 0.0, False, False),
    }


def check_quant_rows(cfg: addnorm.LaunchConfig, g: torch.Generator, quant, *, hidden: int, n_valid: int,
                     dtype: torch.dtype = torch.bfloat16, norm: str = "rmsnorm", slots: int = 0,
                     static_scale: float = 0.02, extremes: bool = False, device: str = "cpu",
                     where: str = "") -> float:
    """The kernel's fp8 epilogue (``quant``, a :class:`weave_compile.quant.QuantSpec`) against its
    contract, bit for bit: the same fresh rows run once without the epilogue (the kernel's own
    normed rows) and once with it; the codes and row scales must equal
    :func:`weave_compile.quant.quantize_rows` of those normed rows exactly (a NaN code may differ in
    its sign: torch leaves it unspecified), the residual rows must not change, and no code or scale
    past ``n_valid`` may be written (poisoned before). ``extremes``: one row gets a NaN and one an
    infinity (their codes NaN or the row's other codes 0, as the contract gives), and the rows span
    ten decades (scales near the floor, codes in the subnormals). Returns the fraction of codes
    checked against the float64 oracle (:func:`weave_compile.quant.quotient_ref`) that differ from
    it, by one step at a rounding boundary at most, a second check that does not depend on
    ``quantize_rows``."""
    from weave_compile.quant import quantize_rows, quotient_ref
    from weave_compile.testing.numerics import codes_agree

    H, n = hidden, n_valid

    def draw(*shape):
        return torch.randn(*shape, generator=g, device=device)

    spread = torch.logspace(-6, 4, max(n, 1), device=device)[:n, None] if extremes else 1.0
    x = (draw(n, H) * spread).to(dtype)
    recv = draw(slots, n, H).to(dtype) if slots else None
    residual = (draw(n, H) * spread).to(dtype)
    if extremes and n >= 3:
        residual[1, H // 2] = float("nan")
        residual[2, 0] = float("inf")
    w = (1 + 0.5 * draw(H)).to(dtype)
    nb = draw(H).to(dtype) if norm == "layernorm" else None
    qs = torch.tensor([static_scale], device=device) if quant.kind == "static" else None
    kw = dict(n_valid=n, eps=EPS, mid_dtype=None, weight_offset=0.0, num_ctas=2, config=cfg, norm=norm,
              norm_bias=nb)
    normed = torch.full((n + 1, H), float("nan"), dtype=dtype, device=device)
    res_plain = torch.full((n + 2, H), float("nan"), dtype=dtype, device=device)
    addnorm.add_rmsnorm_rows(x, recv, residual, None, w, None, normed, res_plain, **kw)
    codes = torch.full((n + 1, H), 0x5A, dtype=torch.uint8, device=device).view(quant.dtype)
    scales = torch.full((n + 1, 1), float("nan"), device=device)
    res_q = torch.full((n + 2, H), float("nan"), dtype=dtype, device=device)
    addnorm.add_rmsnorm_rows(x, recv, residual, None, w, None, codes, res_q, quant=quant, quant_scale=qs,
                             row_scales=scales, out_dtype=dtype, **kw)
    as_int = {2: torch.int16, 4: torch.int32}[res_q.element_size()]  # bitwise: a NaN row is one too
    assert torch.equal(res_q.view(as_int), res_plain.view(as_int)), f"{where}: the epilogue changed the residual"
    assert bool((codes[n:].view(torch.uint8) == 0x5A).all()), f"{where}: a code past n_valid was written"
    if quant.kind == "row":
        assert bool(scales[n:].isnan().all()), f"{where}: a row scale past n_valid was written"
    if n == 0:
        return 0.0
    want_q, want_s = quantize_rows(normed[:n], quant, qs)
    got, want = codes[:n].float(), want_q.float()
    same = ((got == want) & (torch.signbit(got) == torch.signbit(want))) | (got.isnan() & want.isnan())
    assert bool(same.all()), (f"{where}: {int((~same).sum())} codes differ from quantize_rows of the kernel's own "
                              f"normed rows, e.g. {got[~same][:4].tolist()} for {want[~same][:4].tolist()}")
    if quant.kind == "row":
        s_ok = (scales[:n] == want_s) | (scales[:n].isnan() & want_s.isnan())
        assert bool(s_ok.all()), f"{where}: scales {scales[:n][~s_ok][:4].tolist()} for {want_s[~s_ok][:4].tolist()}"
    finite = ~(normed[:n].float().isnan().any(-1) | normed[:n].float().isinf().any(-1))
    if not finite.any():
        return 0.0
    exact, _ = quotient_ref(normed[:n][finite], quant, qs)
    ref = exact.to(quant.dtype)
    frac, bad = codes_agree(codes[:n][finite].cpu(), ref.cpu(), exact.cpu())
    assert not bad, f"{where}: against the float64 oracle, {bad}"
    return frac
