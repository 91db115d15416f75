"""The residual stays sharded only between fused sites; any other reader gets a full residual."""

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
            got = torch.compile(m, backend="tokenweave", options={"compiler": "aot_eager"})(x, r)
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
