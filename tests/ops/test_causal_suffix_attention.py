"""weave::causal_suffix_attention against its float64 oracle and full causal attention (CPU).

The op's CUDA path (two LSE-returning attention calls merged by :func:`combine`) is exercised
here with explicit-score parts (``attend_math``) and with PyTorch's CPU flash kernel, and the
Triton merge kernel under ``TRITON_INTERPRET=1``; on the GPU by
``tests/ops/test_gpu_causal_suffix_attention.py``.
"""

import importlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from weave_compile.ops.causal_suffix_attention import causal_suffix_attention, causal_suffix_attention_ref

# The module (``weave_compile.ops.causal_suffix_attention`` the attribute is the op itself).
csa = importlib.import_module("weave_compile.ops.causal_suffix_attention")


def _inputs(g, b, kv, rep, p, tq, d, dv=None, dtype=torch.float32):
    dv = dv or d

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    # Queries laid out as the split's are ([B, T, H, D] memory), keys/values contiguous.
    q = rnd(b, tq, kv * rep, d).transpose(1, 2)
    return q, rnd(b, kv, p, d), rnd(b, kv, p, dv), rnd(b, kv, tq, d), rnd(b, kv, tq, dv)


def _cpu_flash(q, k, v, causal, scale):
    """PyTorch's CPU flash kernel as a part: its log-sum-exp comes back [B, H, Tq] with [B, Tq, H] strides."""
    rep = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), 0.0, causal, scale=scale)
    return out, lse


@settings(max_examples=40, deadline=None)
@given(tq=st.integers(1, 40), p=st.integers(0, 40), b=st.integers(1, 2), kv=st.sampled_from([1, 2]),
       rep=st.sampled_from([1, 3]), d=st.sampled_from([8, 16]), scaled=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_op_matches_float64_oracle(tq, p, b, kv, rep, d, scaled, seed):
    """The op as it runs on CPU (the fallback: SDPA with a lower-right causal mask)."""
    args = _inputs(torch.Generator().manual_seed(seed), b, kv, rep, p, tq, d)
    scale = 0.3 if scaled else None
    out = causal_suffix_attention(*args, scale)
    ref = causal_suffix_attention_ref(*args, scale)
    assert out.shape == ref.shape == (b, kv * rep, tq, d)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(tq=st.integers(1, 40), p=st.integers(0, 40), b=st.integers(1, 2), kv=st.sampled_from([1, 2]),
       rep=st.sampled_from([1, 4]), d=st.sampled_from([8, 24]), dv=st.sampled_from([8, 16]),
       seed=st.integers(0, 2**31 - 1))
def test_two_parts_merged_by_log_sum_exp_equal_the_oracle(tq, p, b, kv, rep, d, dv, seed):
    """The CUDA path's math: explicit-score parts with their LSEs, merged, in float64."""
    args = _inputs(torch.Generator().manual_seed(seed), b, kv, rep, p, tq, d, dv, dtype=torch.float64)
    out = torch.full_like(csa._out_like(args[0], args[2]), float("nan"))
    csa.by_parts(*args, None, csa.attend_math, out)
    torch.testing.assert_close(out, causal_suffix_attention_ref(*args), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tq,p", [(1, 1), (1, 9), (5, 0), (17, 1), (33, 64)])
def test_parts_from_a_real_flash_kernel_merge_with_strided_log_sum_exp(seed, tq, p):
    """The CPU flash kernel's LSE layout is not [B, H, Tq]-contiguous; the merge reads any strides."""
    args = _inputs(torch.Generator().manual_seed(seed), 2, 2, 4, p, tq, 16)
    _, lse = _cpu_flash(*args[:3] if p else args[:1] + args[3:], False, None)
    assert not lse.is_contiguous() or tq == 1  # the layout this test is about
    out = torch.full_like(csa._out_like(args[0], args[2]), float("nan"))
    csa.by_parts(*args, None, _cpu_flash, out)
    torch.testing.assert_close(out.double(), causal_suffix_attention_ref(*args), rtol=1e-5, atol=1e-5)


def test_merge_is_exact_where_one_part_dominates():
    """sigmoid weights: a log-sum-exp difference of +-1e4 or inf selects one part, no NaN."""
    o1, o2 = torch.randn(1, 2, 4, 8, dtype=torch.float64), torch.randn(1, 2, 4, 8, dtype=torch.float64)
    lse1 = torch.tensor([[[1e4, -1e4, float("inf"), 0.0]] * 2], dtype=torch.float64)
    lse2 = torch.tensor([[[0.0, 0.0, 0.0, float("-inf")]] * 2], dtype=torch.float64)
    out = csa.combine_torch(o1, lse1, o2, lse2, torch.empty_like(o1))
    for t, src in ((0, o1), (1, o2), (2, o1), (3, o1)):
        torch.testing.assert_close(out[:, :, t], src[:, :, t], rtol=0, atol=1e-12)


def test_suffix_rows_of_full_causal_attention():
    """The split identity the pass relies on: causal attention's last rows == suffix attention."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g) for _ in range(3))
    for s, scale in ((1, None), (10, 0.3), (36, None)):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[:, :, s:]
        halves = (q[:, :, s:], k[:, :, :s], v[:, :, :s], k[:, :, s:], v[:, :, s:])
        torch.testing.assert_close(causal_suffix_attention(*halves, scale), want, rtol=1e-5, atol=1e-5)
        out = csa._out_like(halves[0], halves[2])
        torch.testing.assert_close(csa.by_parts(*halves, scale, csa.attend_math, out), want, rtol=1e-5, atol=1e-5)


def test_fake_layout_matches_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _inputs(torch.Generator().manual_seed(0), 1, 2, 2, 4, 5, 8)
    real = causal_suffix_attention(*args, None)
    with FakeTensorMode() as mode:
        fake = causal_suffix_attention(*(mode.from_tensor(a) for a in args), None)
    assert fake.shape == real.shape and fake.stride() == real.stride()
    assert real.transpose(1, 2).is_contiguous()  # [B, Tq, H, D] memory, what o_proj's reshape reads


def test_bad_shapes_are_named():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="as many positions"):
        causal_suffix_attention(q, k, k, k[:, :, :3], k, None)
    with pytest.raises(ValueError, match="prefix keys"):
        causal_suffix_attention(q, k, k[:, :, :2], k, k, None)
    with pytest.raises(ValueError, match="kv heads"):
        causal_suffix_attention(torch.randn(1, 3, 5, 8), k, k, k, k, None)
    with pytest.raises(ValueError, match="head_dim"):
        causal_suffix_attention(q, torch.randn(1, 2, 5, 4), k, k, k, None)
    with pytest.raises(ValueError, match="dtype"):
        causal_suffix_attention(q, k.double(), k.double(), k, k, None)


def test_cpu_tensors_take_the_fallback_with_a_reason():
    args = _inputs(torch.Generator().manual_seed(0), 1, 1, 2, 3, 4, 8)
    attend, why = csa.plan(*args, None)
    assert attend is None and why == "cpu tensors"


@pytest.mark.parametrize("picked,gqa,usable", [(csa.CUDNN, True, True), (csa.FLASH, True, True),
                                               (csa.EFFICIENT, False, True), (csa.EFFICIENT, True, False),
                                               (0, False, False), (-1, False, False)])
def test_choose_keeps_sdpas_pick_where_it_returns_a_log_sum_exp(monkeypatch, picked, gqa, usable):
    seen = {}

    def fake_choice(q, k, v, mask, dropout, causal, *, scale=None, enable_gqa=False):
        seen.update(causal=causal, enable_gqa=enable_gqa, scale=scale)
        return picked

    monkeypatch.setattr(torch, "_fused_sdp_choice", fake_choice)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2 if gqa else 4, 3, 8)
    if usable:
        assert csa.choose(q, k, k, True, 0.5) == picked
    else:
        with pytest.raises(csa.NoFastPath, match=csa.BACKEND_NAMES[picked]):
            csa.choose(q, k, k, True, 0.5)
    assert seen == dict(causal=True, enable_gqa=gqa, scale=0.5)


def test_backend_check_rejects_a_wrong_log_sum_exp_or_a_refusal():
    dev, dt = torch.device("cpu"), torch.float32
    assert csa.check_backend(csa.attend_math, dt, 16, 8, 4, dev) is None

    def log2_lse(q, k, v, causal, scale):  # right output, LSE in base 2
        out, lse = csa.attend_math(q, k, v, causal, scale)
        return out, lse / torch.log(torch.tensor(2.0))

    def refuses(q, k, v, causal, scale):
        raise RuntimeError("no kernel for this shape")

    assert "lse" in csa.check_backend(log2_lse, dt, 16, 8, 4, dev)
    assert "no kernel" in csa.check_backend(refuses, dt, 16, 8, 1, dev)


_INTERP_SCRIPT = r"""
import importlib, sys, torch
csa = importlib.import_module("weave_compile.ops.causal_suffix_attention")
assert csa.HAS_TRITON
g = torch.Generator().manual_seed(int(sys.argv[1]))
for b, h, tq, d, dtype in [(1, 1, 1, 8, torch.float32), (2, 3, 37, 24, torch.bfloat16), (1, 2, 70, 64, torch.float16),
                           (1, 2, 5, 128, torch.bfloat16)]:
    o1 = torch.randn(b, tq, h, d, generator=g).to(dtype).transpose(1, 2)   # the backends' [B, Tq, H, D] memory
    o2 = torch.randn(b, h, tq, d, generator=g).to(dtype)
    lse1 = (torch.randn(b, tq, h, generator=g) * 4).transpose(1, 2)         # strided, as the CPU flash kernel's
    lse2 = torch.randn(b, h, tq + 3, generator=g)[:, :, :tq] * 4            # padded rows, as efficient's
    lse1[..., 0] = 1e4                                                      # one part dominates
    lse2[..., -1] = float("inf")
    out = torch.full((b, tq, h, d), float("nan"), dtype=dtype).transpose(1, 2)
    csa.combine(o1, lse1, o2, lse2, out)
    want = csa.combine_torch(o1, lse1, o2, lse2, torch.empty(b, h, tq, d, dtype=torch.float32))
    assert not out.isnan().any(), "positions left unwritten"
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
print("interp ok")
"""


@pytest.mark.skipif(not csa.HAS_TRITON, reason="triton not installed")
def test_triton_merge_kernel_in_the_interpreter(seed):
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT, str(seed)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and "interp ok" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.skipif(not csa.HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("dtype,d", [("bf16", 128), ("fp16", 64), ("fp32", 128), ("bf16", 24)])
def test_merge_kernel_compiles_for_sm90(dtype, d):
    """What the interpreter does not check: the kernel through Triton's compiler and ptxas (no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = csa._combine_kernel
    ptrs = {"O1": f"*{dtype}", "O2": f"*{dtype}", "OUT": f"*{dtype}", "L1": "*fp32", "L2": "*fp32"}
    block_d = 1 << (d - 1).bit_length()
    consts = {"BLOCK_T": max(1, min(64, 4096 // block_d)), "BLOCK_D": block_d}
    signature = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    compiled = csa.triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "num_stages": 1})
    assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 0
