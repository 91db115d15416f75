"""The shared add+RMSNorm kernel reads eps from a 0-d tensor as it reads a number.

Under ``torch.compile(dynamic=True)`` eps reaches the op as a device tensor (the fuse pass copies
the host graph input there), and the kernel loads it once per CTA (``EPS_PTR``). The real kernel
runs under Triton's interpreter in a fresh process (``TRITON_INTERPRET`` is read when triton
decorates the kernel), on fresh random rows with an eps large enough to move every output, with
outputs poisoned first; the float64 formula is the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

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
