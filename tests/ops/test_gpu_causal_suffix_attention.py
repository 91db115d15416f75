"""weave::causal_suffix_attention on one GPU: the two-call path (SDPA's own backend per call, merged by
log-sum-exp) against the float64 oracle, at awkward lengths and split points, in CUDA graphs and compiled.

Run: ``python -m pytest -m gpu tests/ops/test_gpu_causal_suffix_attention.py``
"""

import importlib

import pytest
import torch

from weave_compile.ops.causal_suffix_attention import causal_suffix_attention, causal_suffix_attention_ref

csa = importlib.import_module("weave_compile.ops.causal_suffix_attention")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: max |out - float64| allowed: attention outputs are convex combinations of V ~ N(0, 1); the
#: kernels round P to the input dtype for the P @ V product and each part's output once more.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
#: (T, prefix lengths): T = 1 has no prefix (the op's own keys only); 1 and T - 1 give cuDNN a key
#: length of 1 in one of the calls (it refuses; SDPA picks flash there).
SPLITS = [(1, (0,)), (3, (1, 2)), (257, (1, 128, 256)), (4099, (1, 2048, 4098))]
KV_HEADS = 2


def _inputs(t, p, rep, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = KV_HEADS * rep
    # The split's layouts: q/k/v are views of projection outputs ([B, T, H, D] memory).
    q = torch.randn(1, t, h, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, t, KV_HEADS, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, t, KV_HEADS, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    return q[:, :, p:], k[:, :, :p], v[:, :, :p], k[:, :, p:], v[:, :, p:]


def _check(out, args, dtype, scale=None):
    ref = causal_suffix_attention_ref(*args, scale)
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max |out - float64| = {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rep", [1, 4, 8])
@pytest.mark.parametrize("t,splits", SPLITS)
def test_matches_float64_on_the_fast_path(t, splits, rep, d, dtype):
    for i, p in enumerate(splits):
        args = _inputs(t, p, rep, d, dtype, seed=1000 * t + 10 * p + rep)
        attend, how = csa.plan(*args, None)
        assert attend is not None, f"fell back for T={t} P={p}: {how}"
        out = causal_suffix_attention(*args, 0.1 if i == 1 else None)
        assert out.stride() == csa._out_like(args[0], args[2]).stride()
        _check(out, args, dtype, 0.1 if i == 1 else None)


def test_runs_the_kernels_the_whole_attention_runs():
    """Both calls use the backend SDPA picks for the unsplit layer's causal attention."""
    t, p = 4096, 2048
    args = _inputs(t, p, 4, 128, torch.bfloat16, seed=5)
    q = torch.cat([torch.randn_like(args[0]), args[0]], 2)
    k, v = torch.cat([args[1], args[3]], 2), torch.cat([args[2], args[4]], 2)
    whole = csa.BACKEND_NAMES[int(torch._fused_sdp_choice(q, k, v, None, 0.0, True, enable_gqa=True))]
    _, how = csa.plan(*args, None)
    print("whole:", whole, "| suffix:", how)
    assert how.count(whole) == 2, (whole, how)


def test_merge_kernel_writes_every_position(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, tq, d = 2, 16, 4099, 128
    o1 = torch.randn(b, tq, h, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    o2 = torch.randn(b, tq, h, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    lse1, lse2 = (torch.randn(b, h, tq, 1, device="cuda", generator=g)[..., 0] * 5 for _ in range(2))
    out = torch.full((b, tq, h, d), float("nan"), device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    csa.combine(o1, lse1, o2, lse2, out)
    assert not out.isnan().any()
    want = csa.combine_torch(o1, lse1, o2, lse2, torch.empty(b, h, tq, d, device="cuda"))
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


def test_cuda_graph_replay_with_new_data():
    args = _inputs(1536, 768, 4, 128, torch.bfloat16, seed=7)
    static = [a.clone() for a in args]
    causal_suffix_attention(*static, None)  # first call: each backend's one-time check
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = causal_suffix_attention(*static, None)
    for seed in (8, 9):
        fresh = _inputs(1536, 768, 4, 128, torch.bfloat16, seed=seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        g.replay()
        torch.cuda.synchronize()
        _check(out, fresh, torch.bfloat16)


def test_first_use_inside_capture_is_correct(monkeypatch):
    """Unchecked backends cannot be checked during capture: that call takes the fallback."""
    monkeypatch.setattr(csa, "_CHECKED", {})
    args = _inputs(640, 300, 4, 64, torch.float16, seed=11)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        out = causal_suffix_attention(*args, None)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    _check(out, args, torch.float16)


def test_compiled_equals_eager_and_keeps_the_promised_layout():
    args = _inputs(2053, 1030, 8, 128, torch.bfloat16, seed=13)
    eager = causal_suffix_attention(*args, None)
    compiled = torch.compile(lambda *a: causal_suffix_attention(*a, None), fullgraph=True)(*args)
    assert compiled.stride() == eager.stride()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    _check(eager, args, torch.bfloat16)
