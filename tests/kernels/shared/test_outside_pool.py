"""GPU test for kernels/shared/outside_pool.py: a lazily grown cache under cudagraph trees (one GPU).

The mechanism behind the "tensors in the cudagraph pool not tracked as outputs" failure with a
symbolic token count: a custom op that grows a module-level device buffer when a larger token
count arrives does so inside cudagraph trees' warm-up, where this thread's allocations go to the
graph pool. Grown through ``run_outside_graph_pool`` the buffer lives in the ordinary pool and
recording succeeds (docs/performance.md, section 6, has the diagnosis).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
_CACHE: dict = {}


@torch.library.custom_op("weave_test::grow_scale", mutates_args=())
def grow_scale(x: torch.Tensor) -> torch.Tensor:
    from weave_compile.kernels.shared.outside_pool import run_outside_graph_pool

    n = x.shape[0]
    buf = _CACHE.get("buf")
    if buf is None or buf.shape[0] < n:
        assert not torch.cuda.is_current_stream_capturing(), "grown during capture: the test is wrong"
        buf = run_outside_graph_pool(lambda: torch.full((n,), 2.0, device=x.device), x.device)
        _CACHE["buf"] = buf
    return x * buf[:n, None]


@grow_scale.register_fake
def _(x):
    return torch.empty_like(x)


def test_cache_grown_in_warmup_passes_the_pool_check():
    torch._dynamo.reset()
    _CACHE.clear()
    w = torch.randn(64, 64, device="cuda")
    c = torch.compile(lambda x: grow_scale(x @ w) + 1, mode="reduce-overhead")
    sizes = []
    for t in (8, 16, 32, 24):
        x = torch.randn(t, 64, device="cuda")
        torch._dynamo.mark_dynamic(x, 0)
        for _ in range(3):  # warm-up (grows), record, replay
            out = c(x)
        torch.testing.assert_close(out, (x @ w) * 2 + 1, rtol=1e-4, atol=1e-4)
        sizes.append(_CACHE["buf"].shape[0])
    assert sizes == [8, 16, 32, 32]  # it did grow at run time


def test_exceptions_propagate():
    def boom():
        raise ValueError("inner")

    from weave_compile.kernels.shared.outside_pool import run_outside_graph_pool

    with pytest.raises(ValueError, match="inner"):
        run_outside_graph_pool(boom, torch.device("cuda"))


def _grow_in_warmup_rank(rank, world, kernel):
    """TPLlama under reduce-overhead with a symbolic T that outgrows the compile-time reservation."""
    import torch.distributed as dist

    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2, vocab=512)
    dev = torch.device("cuda", rank)
    model = TPLlama(d, tp=world, rank=rank, group=dist.group.WORLD, dtype=torch.bfloat16, device=dev)
    ref = TPLlama(d, tp=world, rank=rank, group=dist.group.WORLD, dtype=torch.bfloat16, device=dev)
    c = torch.compile(model, backend="tokenweave", options={"kernel": kernel, "mode": "reduce-overhead"})
    errs = []
    with torch.no_grad():
        for t in (64, 9000, 12000):  # 9000 > the 8192 rows (p2p) / 4096 rows (oneshot) reserved
            tokens = torch.randint(0, d.vocab, (1, t), device=dev)
            torch._dynamo.mark_dynamic(tokens, 1)
            for _ in range(3):  # warm-up (grows), record, replay
                out = c(tokens)
            want = ref(tokens)
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            if not err < 3e-2:
                errs.append(f"T={t}: rel err {err:.3g}")
    kernels = {s.kernel for s in weave_compile.explain().sites if s.fused}
    return errs, sorted(kernels)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (symmetric memory across processes)")
@pytest.mark.parametrize("kernel", ["p2p", "oneshot"])
def test_workspace_growth_under_reduce_overhead_with_symbolic_tokens(kernel):
    """The failure the pool check reported (issue 15), with the real workspaces."""
    from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

    for errs, kernels in assert_ranks_ok(run_ranks(_grow_in_warmup_rank, 2, args=(kernel,), backend="nccl",
                                                   timeout=600)):
        assert not errs, errs
        assert kernels == [kernel], kernels
