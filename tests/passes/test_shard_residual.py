"""The residual stays sharded only between fused sites; any other reader gets a full residual."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks


class ThreeSites(nn.Module):
    """Three all_reduce -> +residual -> RMSNorm sites; ``leak`` makes site 1's residual a model output."""

    def __init__(self, h, leak):
        super().__init__()
        self.leak = leak
        self.w = nn.ParameterList(nn.Parameter(torch.randn(h, h) / h ** 0.5) for _ in range(3))
        self.nw = nn.ParameterList(nn.Parameter(1 + 0.1 * torch.randn(h)) for _ in range(3))

    def forward(self, x, residual):
        leaked = None
        for i in range(3):
            y = x @ self.w[i]
            dist.all_reduce(y)
            residual = residual + y
            if i == 1:
                leaked = residual
            hf = residual.float()
            x = self.nw[i] * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return (x, leaked * 3) if self.leak else x


def _run(rank, world_size, seed):
    import weave_compile

    out = {}
    for leak in (False, True):
        torch.manual_seed(seed)
        m = ThreeSites(32, leak)
        x, r = torch.randn(11, 32), torch.randn(11, 32)  # 11 rows: not divisible by 2 ranks
        weave_compile.reset()
        torch._dynamo.reset()
        with torch.no_grad():
            ref = m(x, r)
            got = torch.compile(m, backend="tokenweave", options={"compiler": "aot_eager", "kernel": "reference"})(x, r)
        ref, got = (ref, got) if leak else ((ref,), (got,))
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref))
        out[leak] = ([s.residual for s in weave_compile.explain().sites], err)
    return out


def test_sharding_stops_where_something_else_reads_the_residual(seed):
    for r in assert_ranks_ok(run_ranks(_run, 2, args=(seed,), timeout=300)):
        residuals, err = r[False]
        assert residuals == ["out sharded", "in+out sharded", "in+out sharded"]
        assert err < 1e-5
        residuals, err = r[True]
        assert residuals[0] == "out sharded"
        assert residuals[1] == "in sharded, out full (read by aten.mul.Tensor)"
        assert residuals[2] == "out sharded"  # its input is full again, its own output unread
        assert err < 1e-5


def _alternating_groups(rank, world_size, options):
    """Sites alternate between two groups that share ranks: row -> column -> row of a 2x2 mesh, or
    WORLD(3) -> {0,1} | {2} -> WORLD(3). Returns (max |compiled - float64 eager|, residual labels)."""
    import weave_compile
    from weave_compile.testing.chains import SiteChain, eager_float64

    if world_size == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2))
        row, col = mesh.get_group(1), mesh.get_group(0)
        groups = [row, col, row]
    else:
        pair, single = dist.new_group([0, 1]), dist.new_group([2])
        groups = [None, pair if rank < 2 else single, None]
    m = SiteChain(32, groups)  # the same weights on every rank: the residual is replicated
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(11, 32, generator=g), torch.randn(11, 32, generator=g)
    ref = eager_float64(m, x, r)
    out = {}
    for opts in ({}, {"shard_residual": False}):
        weave_compile.reset()
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(m, backend="tokenweave", options={"compiler": "aot_eager", "kernel": "reference", **opts})(x, r)
        out[bool(opts)] = ((got.double() - ref).abs().max().item(), [s.residual for s in weave_compile.explain().sites])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 3])
def test_residual_is_gathered_between_sites_over_different_ranks(world_size):
    """Issue 13: the 2x2 mesh gave max error 1.7, the 3-rank chain a collective size mismatch.

    The 3-rank chain is also a case of tests/test_reliability.py (it shares ranks with others
    there); here both are checked with and without sharding and explain()'s reasons."""
    for rank, r in enumerate(assert_ranks_ok(run_ranks(_alternating_groups, world_size, args=({},), timeout=300))):
        for unsharded in (False, True):
            err, residuals = r[unsharded]
            assert err < 1e-5, (rank, unsharded, err)
        err, residuals = r[False]
        fused_two_groups = world_size == 4 or rank < 2
        if fused_two_groups:  # site 0 -> 1 and 1 -> 2 change ranks: gathered, and explain() says why
            assert all("the ranks own different rows there" in s for s in residuals[:2]), residuals
        else:  # rank 2's middle site has a group of size 1: not fused, it reads the full residual
            assert residuals[0] == "full (read by aten.add.Tensor)" and residuals[1] == "-", residuals
        assert residuals[2] == "out sharded", residuals  # the last residual is read by nobody
