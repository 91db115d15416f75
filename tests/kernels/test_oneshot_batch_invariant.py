"""The one-shot kernel (``oneshot``) with ``batch_invariant``: a row's outputs are bitwise the same whatever the call.

Under ``TRITON_INTERPRET=1`` (a subprocess running this file as a script) the kernel runs on 2-4 ranks
emulated in one process, one after another: every rank's buffer is an ordinary allocation, and before
the first launch slot 0 of each holds what the peers' pushes of that call leave there (their rows, -0.0
sent as +0.0; with a sharded residual the owners' residual rows), so no rank waits on a launch that has
not run (the protocol's waits and pushes still run: the pushes rewrite the same bytes). One row whose
partials cancel in part (``tests/kernels/_batch_invariant_cases.py``) is run alone and at positions owned
by every rank in calls of other T (below the rank count, not divisible by it) and CTA counts, full and
sharded residual: its normed and residual rows must be bitwise equal on every rank, and its fp32
residual the rank-order fp32 sum.

The kernel's natural order is rank order already (every rank adds every row's partials 0..N-1), so
turning the option off does not change a row's bits here: the one choice the option pins is the rows
per tile, whose effect (the layout a row's sum of squares is reduced over) exists on the GPU only,
not in the interpreter's numpy sums. The discrimination is shown on the sum itself instead
(``test_the_sum_check_tells_the_orders_apart``): the same rows added in each owner's order (its own
first, as the push kernel does without the option) miss the rank-order sum for some owner, which the
check compares bit for bit. In-process: the invariant shape does not move with T or the CTA count.
The GPU runs (concurrent ranks, H=4096/8192, T up to 4099): tests/kernels/test_oneshot_gpu.py.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import pytest
import torch

THIS_FILE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE))))  # script mode

from tests.kernels import _batch_invariant_cases as bic  # noqa: E402
from tests.kernels._symm_cases import run_script  # noqa: E402
from weave_compile.kernels.oneshot import kernel as oneshot_kernel  # noqa: E402

pytestmark = pytest.mark.skipif(not oneshot_kernel.HAS_TRITON, reason="triton not installed")
H = 40
BF16 = torch.bfloat16


def oneshot_rows(world, xs, residual, weight, *, invariant: bool, sharded: bool, ctas: int):
    """Every emulated rank's one-shot launch (module doc): rank 0's normed rows and the full residual
    (the shards joined where it stays sharded; its dtype ``residual``'s); every rank must have computed
    the same rows."""
    from weave_compile.kernels.oneshot import workspace as oneshot_ws
    from weave_compile.kernels.spec import FusedSpec, Rows

    T = xs[0].shape[0]
    S = math.ceil(T / world)
    rdt = residual.dtype
    cap = S * world + 2 * world  # more room than T: the slots' regions do not end at T
    lay = oneshot_ws.layout(cap, world, H, BF16, rdt)
    bufs = [torch.zeros(lay.total, dtype=torch.uint8) for _ in range(world)]
    wss = [oneshot_ws.workspace_from_buffers(bufs, r, hidden=H, in_dtype=BF16, res_dtype=rdt, capacity=cap)
           for r in range(world)]
    padded = torch.nn.functional.pad(residual, (0, 0, 0, S * world - T))
    for p in range(world):  # slot 0 as the peers' pushes of call 0 leave it
        for q in range(world):
            if q != p:
                region = bufs[p][q * lay.src_bytes:q * lay.src_bytes + T * H * 2].view(BF16).view(T, H)
                region.copy_(xs[q] + 0.0)  # -0.0 goes as +0.0
        if sharded:
            n = T * H * rdt.itemsize
            bufs[p][lay.res_off:lay.res_off + n].view(rdt).view(T, H).copy_(residual + 0.0)
    outs = []
    spec = FusedSpec(residual_dtype=rdt, out_dtype=BF16, comm_ctas=ctas, residual_in_sharded=sharded,
                     residual_out_sharded=sharded, batch_invariant=invariant)
    for r in range(world):
        normed = torch.full((T, H), float("nan"), dtype=BF16)
        res_out = torch.full((S if sharded else T, H), float("nan"), dtype=rdt)
        res_in = padded[r * S:(r + 1) * S] if sharded else residual
        oneshot_kernel.launch(wss[r], Rows(xs[r], res_in, None, weight), spec, normed, res_out)
        assert wss[r].timeouts() == 0, f"rank {r} waited for rows that were not there"
        outs.append((normed, res_out))
    for r, (normed, res) in enumerate(outs[1:], 1):
        assert bic.same_bits(normed, outs[0][0]) if rdt == BF16 else torch.equal(normed, outs[0][0]), r
        if not sharded:
            assert torch.equal(res.view(torch.uint8), outs[0][1].view(torch.uint8)), f"rank {r}'s residual"
    res = torch.cat([o[1][:max(0, min(S, T - r * S))] for r, o in enumerate(outs)]) if sharded else outs[0][1]
    return outs[0][0], res


def same_as_alone(world, row_seed, T, pos, ctas, sharded, others, weight, invariant) -> tuple[bool, list[str]]:
    """Whether the row gives the same bits at ``pos`` of a T-row call on ``ctas`` CTAs as alone on one
    CTA; and what else is wrong (its fp32 residual in the same call not the rank-order fp32 sum)."""
    parts, res_row = bic.row_partials(row_seed, world, H)
    n1, r1 = oneshot_rows(world, [p[None] for p in parts], res_row[None], weight, invariant=invariant,
                          sharded=sharded, ctas=1)
    xs, residual = bic.batch_with_row(parts, res_row, T, pos, others)
    normed, res = oneshot_rows(world, xs, residual, weight, invariant=invariant, sharded=sharded, ctas=ctas)
    _, res32 = oneshot_rows(world, xs, residual.float(), weight, invariant=invariant, sharded=sharded, ctas=ctas)
    errs = [] if torch.equal(res32[pos], bic.rank_order_residual(parts, res_row)) else [
        "the fp32 residual is not the rank-order fp32 sum"]
    return bic.same_bits(normed[pos], n1[0]) and bic.same_bits(res[pos], r1[0]), errs


def _main(world: int, seed: int) -> int:
    weight = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed))).to(BF16)
    return bic.check_placements(world, seed, same_as_alone, weight, "ONESHOT-INVARIANT OK")


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_oneshot_rows_do_not_depend_on_the_batch_in_cpu_interpreter(world, seed):
    env = dict(os.environ, TRITON_INTERPRET="1", WEAVE_SYMM_SPIN_LIMIT=str(1 << 10))
    rc, out = run_script(THIS_FILE, ["--world", str(world), "--seed", str(seed % 10**6)], timeout=600, env=env)
    assert rc == 0 and "ONESHOT-INVARIANT OK" in out, out[-8000:]


def test_the_sum_check_tells_the_orders_apart(seed):
    """The row's partials added as a rank that takes its own first would (then the others from rank + 1
    on): at 3 and 4 ranks some owner misses the rank-order fp32 sum the check above compares bit for bit,
    so a kernel adding in its owner's order would fail it."""
    for world in (3, 4):
        missed = []
        for k in range(4):
            parts, res_row = bic.row_partials(seed + k, world, H)
            want = bic.rank_order_residual(parts, res_row)
            for own in range(world):
                order = [(own + q) % world for q in range(world)]
                acc = parts[order[0]].float()
                for p in order[1:]:
                    acc = acc + parts[p].float()
                missed.append(not torch.equal(acc + res_row.float(), want))
        assert any(missed), f"{world} ranks: every owner's order gives the rank-order sum: the check proves nothing"


def test_the_invariant_shape_does_not_move_with_t_or_the_cta_count():
    """One-row tiles and warps from H alone at every T and CTA count; the default shape moves."""
    for H_ in (40, 1024, 4096, 8192):
        metas = [oneshot_kernel.invariant_meta(H_, rows, ctas) for rows in (1, 3, 8, 64, 4099) for ctas in (1, 8, 32)]
        assert {(m.block_rows, m.num_warps, m.block_h) for m in metas} == {(1, metas[0].num_warps, metas[0].block_h)}
    assert len({oneshot_kernel.launch_meta(4096, rows, 8).block_rows for rows in (1, 64, 4099)}) > 1


def test_the_launcher_takes_the_invariant_shape_only_with_the_option(monkeypatch):
    """The launch's BLOCK_ROWS: 1 with the option at every T, the default shape's without (the kernel's
    keywords are otherwise the same). The kernel is stubbed: nothing runs."""
    from weave_compile.kernels.oneshot import workspace as oneshot_ws
    from weave_compile.kernels.spec import FusedSpec, Rows

    seen = []

    class _Stub:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw)

    monkeypatch.setattr(oneshot_kernel, "_oneshot_allreduce_rmsnorm_kernel", _Stub())
    cap = 96
    lay = oneshot_ws.layout(cap, 3, H, BF16, BF16)
    bufs = [torch.zeros(lay.total, dtype=torch.uint8) for _ in range(3)]
    ws = oneshot_ws.workspace_from_buffers(bufs, 0, hidden=H, in_dtype=BF16, res_dtype=BF16, capacity=cap)
    for T in (1, 5, 96):
        got = {}
        for inv in (False, True):
            seen.clear()
            spec = FusedSpec(residual_dtype=BF16, out_dtype=BF16, comm_ctas=4, batch_invariant=inv)
            x = torch.randn(T, H).to(BF16)
            oneshot_kernel.launch(ws, Rows(x), spec, torch.empty(T, H, dtype=BF16), torch.empty(T, H, dtype=BF16))
            (got[inv],) = seen
        assert got[True]["BLOCK_ROWS"] == 1
        assert got[False]["BLOCK_ROWS"] == oneshot_kernel.launch_meta(H, -(-T // 3) * 3, 4).block_rows
        assert {k: v for k, v in got[True].items() if k != "BLOCK_ROWS"} == \
            {k: v for k, v in got[False].items() if k != "BLOCK_ROWS"}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    sys.exit(_main(a.world, a.seed))
