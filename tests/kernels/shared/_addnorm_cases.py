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
