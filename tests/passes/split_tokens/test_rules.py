"""The op rules: a token-mixing op is a barrier, with a correct result and a recorded reason."""

import torch
import torch.distributed as dist
import torch.nn as nn

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import THRESHOLD


class CumsumBetween(nn.Module):
    """Two fused sites with a token-mixing op (cumsum over tokens) between them."""

    def __init__(self, h):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(h, h) / h ** 0.5), nn.Parameter(torch.randn(h, h) / h ** 0.5)
        self.nw = nn.Parameter(1 + 0.1 * torch.randn(h))

    def norm(self, x):
        return self.nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x, res):
        y = x @ self.w1
        dist.all_reduce(y)
        res = res + y
        h = self.norm(res)
        h = torch.cumsum(h, dim=1) / 10  # mixes tokens: the split must end here
        y = h @ self.w2
        dist.all_reduce(y)
        res = res + y
        return self.norm(res)


def _barrier(rank, world_size, seed):
    import weave_compile
    from weave_compile.testing.numerics import rel_err

    torch.manual_seed(seed)
    m = CumsumBetween(32)
    x, r = torch.randn(1, 40, 32), torch.randn(1, 40, 32)
    weave_compile.reset()
    with torch.no_grad():
        got = torch.compile(m, backend="tokenweave", options={"split": True, "split_threshold": THRESHOLD})(x, r)
        err = rel_err(got, m(x, r))
    return err, weave_compile.explain().graphs[0].split.describe()


def test_token_mixing_op_ends_the_split_with_a_correct_result(seed):
    for err, text in assert_ranks_ok(run_ranks(_barrier, 2, args=(seed,), timeout=300)):
        assert err < 1e-5
        assert "1 barrier(s)" in text and "aten.cumsum.default): operates along the token dimension" in text, text
