"""ops/lowering.py: Inductor never reuses the memory of a fused output left in the symmetric ring.

On 2 gloo ranks, Inductor (CPU) compiles ``normed * 2 + 1`` after the fused op, the normed
output's last use, which Inductor turns into an in-place kernel writing into the fused op's
output buffer (a ``reuse`` line in the generated code). With ``out_slot >= 0`` that buffer would
be the ring, so the lowering must stop it; with ``out_slot=-1`` the reuse is expected (which
shows the test would see one). The ``reference`` kernel ignores ``out_slot`` (fresh outputs), so
both compiled results are checked against eager as well.
"""

import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks


def _compile(rank, world_size):
    import re

    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    import weave_compile  # noqa: F401  (registers the ops)
    from weave_compile.ops import lowering

    assert lowering.install() is None
    group = dist.group.WORLD.group_name
    out = {}
    for slot in (-1, 1):
        def f(x, res, w):
            normed, r, _ = torch.ops.weave.allreduce_add_rmsnorm(
                x, res, None, w, 1e-6, group, torch.float32, torch.float32, None, 0.0, False, False,
                "reference", 8, None, None, slot)
            return normed * 2 + 1, r
        g = torch.Generator().manual_seed(3 + rank)
        x, res, w = torch.randn(9, 32, generator=g), torch.randn(9, 32), torch.randn(32)
        torch._dynamo.reset()
        (got, _), codes = run_and_get_code(torch.compile(f, backend="inductor"), x, res, w)
        ref, _ = f(x, res, w)
        code = "\n".join(codes)
        out[slot] = (bool(re.search(r"#\s*reuse", code)), (got - ref).abs().max().item())
    return out


def test_in_place_outputs_are_never_reused_by_inductor():
    for r in assert_ranks_ok(run_ranks(_compile, 2, timeout=600)):
        reused_fresh, err_fresh = r[-1]
        reused_ring, err_ring = r[1]
        assert reused_fresh, "Inductor did not reuse a fresh output here: the test shows nothing"
        assert not reused_ring, "a ring output's buffer was reused by an in-place kernel"
        assert err_fresh < 1e-5 and err_ring < 1e-5, (err_fresh, err_ring)
