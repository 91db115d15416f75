"""GPU tests for kernels/oneshot/ with emulated ranks on ONE GPU (``-m gpu``).

Two GPU processes cannot share one GPU through symmetric memory, so the ranks live in this
process: every rank's buffer is an ordinary allocation, every rank's pointer table lists all of
them, and every rank's launch goes on its own stream (the grids, at most 3 x 32 CTAs, are
co-resident on an H200). Outputs are poisoned with NaN before every call and compared with the
float64 reference. ``WEAVE_SYMM_SPIN_LIMIT`` turns a lost row into a counted failure, not a hang.
The LayerNorm variant runs here too, at 2 and 3 ranks (its CPU interpreter test: test_oneshot.py).
A last test (2 GPUs, skipped here) runs the real symmetric-memory path through the fused op.

(A minimal harness local to this file: the generic one, ``weave_compile.testing.emulated_ranks``,
had not landed when this was written.)
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels import _layernorm_cases as lc
from tests.kernels.test_oneshot import (
    TOL, case, dtypes, expected, flags, launch_rank, make_inputs, mismatches, poisoned_outputs, rank_args)
from weave_compile.kernels.oneshot import kernel as oneshot_kernel
from weave_compile.kernels.oneshot import workspace as oneshot_ws
from weave_compile.kernels.spec import FusedSpec, Rows

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _spin_limit(monkeypatch):
    monkeypatch.setenv("WEAVE_SYMM_SPIN_LIMIT", str(1 << 20))


class EmulatedRanks:
    """``world`` ranks of one one-shot workspace in this process, one stream each."""

    def __init__(self, world: int, hidden: int, in_dtype, res_dtype, capacity: int):
        lay = oneshot_ws.layout(capacity, world, hidden, in_dtype, res_dtype)
        bufs = [torch.empty(lay.total, dtype=torch.uint8, device=DEV) for _ in range(world)]
        self.ws = [oneshot_ws.workspace_from_buffers(bufs, r, hidden=hidden, in_dtype=in_dtype, res_dtype=res_dtype,
                                                  capacity=capacity) for r in range(world)]
        self.bufs = bufs
        self.world = world
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        torch.cuda.synchronize()  # every rank's poison lands before any push

    def call(self, c, per_rank):
        """``per_rank[r] = (x, res_in, bias, weight, normed, res_out)``; all ranks' launches at once."""
        self.run(lambda r, ws: launch_rank(ws, c, *per_rank[r]))

    def run(self, launch):
        """``launch(rank, workspace)`` for every rank, each on its own stream, all enqueued before any is
        awaited; the current stream waits for all of them."""
        cur = torch.cuda.current_stream()
        for r, s in enumerate(self.streams):
            s.wait_stream(cur)
        for r, s in enumerate(self.streams):
            with torch.cuda.stream(s):
                launch(r, self.ws[r])
        for s in self.streams:
            cur.wait_stream(s)

    def check_state(self, calls: int):
        for w in self.ws:
            st = w.state.tolist()
            assert st[5] == 0, f"rank {w.rank}: {st[5]} spin-limit trips"
            assert st[0] == calls and st[1] == 0, f"rank {w.rank}: state {st} after {calls} calls"


def _prepare(c, world):
    xs, residual, bias, weight = make_inputs(c, world, DEV)
    per_rank = []
    for r in range(world):
        x, res_in = rank_args(c, world, r, xs, residual)
        per_rank.append((x, res_in, bias, weight, *poisoned_outputs(c, world, DEV)))
    return (xs, residual, bias, weight), per_rank


def _check(c, world, per_rank, inputs):
    ref = expected(c, *inputs)
    errs = []
    for r in range(world):
        errs += [f"rank {r}: {e}" for e in mismatches(c, world, r, per_rank[r][4], per_rank[r][5], *ref)]
    # Every rank computes every row from the same data in the same order: bit-identical normed rows.
    for r in range(1, world):
        if not torch.equal(per_rank[r][4].view(torch.uint8), per_rank[0][4].view(torch.uint8)):
            errs.append(f"rank {r}: normed differs from rank 0's")
    return errs


RES_MODES = ("full", "shard_both", "shard_in", "shard_out", "none", "first")


@pytest.mark.parametrize("world,H,dtype", [(2, 2048, "bf16"), (2, 4096, "bf16"), (2, 8192, "bf16"),
                                           (3, 4096, "bf16"), (2, 4096, "fp32"), (3, 8192, "fp32")])
def test_matrix_back_to_back(world, H, dtype, seed):
    """T in (1, 3, 64, 257), every residual layout, -0.0 in the data, eps a device tensor in a third of
    the calls, all on one workspace."""
    Ts = (1, 3, 64, 257)
    rdt = "fp32" if dtype == "fp32" else None
    calls = []
    for i, T in enumerate(Ts):
        for j, res in enumerate(RES_MODES):
            calls.append(case(T, H, dtype, res=res, rdt=rdt, neg_zero=(i + j) % 2 == 0, bias=j != 3,
                              mid="bf16" if j == 2 and dtype == "bf16" else None, woff=1.0 if j == 1 else 0.0,
                              ctas=32, seed=seed % 10**6 + 10 * i + j, eps_tensor=(i + j) % 3 == 0))
    dt, rd, _ = dtypes(calls[0])
    em = EmulatedRanks(world, H, dt, rd, capacity=math.ceil(max(Ts) / world) * world)
    errs = []
    for c in calls:
        inputs, per_rank = _prepare(c, world)
        em.call(c, per_rank)
        torch.cuda.synchronize()
        errs += [f"T={c['T']} {c['res']}: {e}" for e in _check(c, world, per_rank, inputs)]
    em.check_state(len(calls))
    assert not errs, "\n".join(errs)


def test_1000_back_to_back_calls(seed):
    """1000 calls, no host sync in between; 8 input sets in turn (a stale slot shows as another set's data)."""
    world, H = 2, 4096
    sets = [case(T, H, "bf16", res=res, ctas=32, neg_zero=i % 3 == 0, seed=seed % 10**6 + i)
            for i, (T, res) in enumerate([(1, "shard_both"), (3, "full"), (64, "shard_both"), (257, "shard_in"),
                                          (8, "shard_out"), (64, "full"), (128, "shard_both"), (2, "none")])]
    em = EmulatedRanks(world, H, torch.bfloat16, torch.bfloat16, capacity=258)
    prepared = [_prepare(c, world) for c in sets]
    refs = [expected(c, *inp) for c, (inp, _) in zip(sets, prepared)]
    bad = torch.zeros((), dtype=torch.int64, device=DEV)
    n_calls = 1000
    for i in range(n_calls):
        k = i % len(sets)
        c, (inp, per_rank) = sets[k], prepared[k]
        for r in range(world):
            per_rank[r][4].fill_(float("nan"))
            per_rank[r][5].fill_(float("nan"))
        em.call(c, per_rank)
        ref_n = refs[k][0]
        atol, rtol = TOL[ref_n.dtype]
        for r in range(world):
            o, want = per_rank[r][4].float(), ref_n.float()
            bad += (~((o - want).abs() <= atol + rtol * want.abs())).sum()
            _, out_sh = flags(c)
            if not out_sh:
                o, want = per_rank[r][5].float(), refs[k][1].float()
                bad += (~((o - want).abs() <= atol + rtol * want.abs())).sum()
    torch.cuda.synchronize()
    em.check_state(n_calls)
    assert int(bad) == 0, f"{int(bad)} wrong elements over {n_calls} calls"
    # The last round's full check, residual shards included.
    errs = []
    for k, c in enumerate(sets):
        inp, per_rank = prepared[k]
        errs += _check(c, world, per_rank, inp)
    assert not errs, errs


@pytest.mark.parametrize("world", [2, 3])
def test_cuda_graph_replay_with_new_data(world, seed):
    """Both ranks' launches captured in one graph; replays with new data rotate slots on the device."""
    H = 4096
    c = case(64, H, "bf16", res="shard_both", ctas=32, seed=seed % 10**6)
    em = EmulatedRanks(world, H, torch.bfloat16, torch.bfloat16, capacity=66)
    inputs, per_rank = _prepare(c, world)
    em.call(c, per_rank)  # eager warm-up call (compiles the kernel outside capture)
    torch.cuda.synchronize()
    assert not _check(c, world, per_rank, inputs)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        em.call(c, per_rank)
    torch.cuda.synchronize()
    calls = 1  # capture does not run the kernels
    errs = []
    for rep in range(12):
        new = dict(c, seed=c["seed"] + 1 + rep, neg_zero=rep % 2 == 1)
        new_inputs, fresh = _prepare(new, world)
        for r in range(world):  # static inputs (x, residual, bias, weight) get the new data, outputs are poisoned
            for k in (0, 1, 2, 3):
                per_rank[r][k].copy_(fresh[r][k])
            per_rank[r][4].fill_(float("nan"))
            per_rank[r][5].fill_(float("nan"))
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        calls += 1
        errs += [f"replay {rep}: {e}" for e in _check(new, world, per_rank, new_inputs)]
        assert int(em.ws[0].state[0]) == calls
    em.check_state(calls)
    assert not errs, "\n".join(errs)


def _ln_calls(H, dtype, rdt, seed):
    """LayerNorm calls on one workspace: T in (1, 3, 64, 257), every residual layout, weight, norm bias,
    pre-norm bias, mid dtype, Gemma's offset and eps from a tensor rotating; an RMSNorm with a norm bias."""
    options = [dict(res="full", bias=True), dict(res="shard_both", weight=False),
               dict(res="shard_in", norm_bias=False, mid="bf16", woff=1.0), dict(res="shard_out", eps_tensor=True),
               dict(res="none", weight=False, norm_bias=False), dict(res="first")]
    calls = [lc.ln_case(T, H, dtype, res_dtype=rdt, ctas=32, seed=seed + 10 * i + j, **options[(i + j) % 6])
             for i, T in enumerate((1, 3, 64, 257)) for j in range(3)]
    return calls + [lc.ln_case(64, H, dtype, res_dtype=rdt, ctas=32, norm="rmsnorm", offset=0.0, seed=seed + 99)]


@pytest.mark.parametrize("world,H,dtype,rdt", [(2, 2048, "bf16", None), (2, 4096, "bf16", None),
                                               (2, 8192, "bf16", None), (3, 4096, "bf16", None),
                                               (2, 4096, "fp32", None), (3, 5120, "bf16", "fp32")])
def test_layernorm_matrix_back_to_back(world, H, dtype, rdt, seed):
    """The LayerNorm variant (IS_LAYERNORM, HAS_NORM_BIAS) on concurrent emulated ranks, every call on one
    workspace: fresh rows with a common offset, outputs NaN-poisoned, the float64 oracle's LayerNorm of the
    kernel's own residual (``tests/kernels/_layernorm_cases.check``: RMSNorm would fail it), every rank's
    normed rows bit-identical."""
    calls = _ln_calls(H, dtype, rdt, seed % 10**6)
    dt, rd, _ = lc.dtypes(calls[0])
    em = EmulatedRanks(world, H, dt, rd, capacity=math.ceil(257 / world) * world)
    errs = []
    for c in calls:
        inputs = lc.make_inputs(c, world, DEV)
        xs, residual, bias, weight, nb = inputs
        outs = lc.poisoned_outputs(c, world, DEV)
        kw = lc.spec_kwargs(c, DEV)
        eps_t = kw.pop("eps_tensor", None)
        _, c_rdt, c_odt = lc.dtypes(c)
        spec = FusedSpec(residual_dtype=c_rdt, out_dtype=c_odt, comm_ctas=c["ctas"], **kw)
        em.run(lambda r, ws: oneshot_kernel.launch(
            ws, Rows(xs[r], lc.rank_residual(c, world, r, residual), bias, weight, eps_tensor=eps_t, norm_bias=nb),
            spec, *outs[r]))
        torch.cuda.synchronize()
        errs += [f"{lc.case_name(c)}: {e}" for e in lc.check(c, world, outs, inputs)]
    em.check_state(len(calls))
    assert not errs, "\n".join(errs)


# ----------------------------------------------------------------------------- real symmetric memory


def _symm_rank(rank, world):
    import torch.distributed as dist

    import weave_compile.ops as ar

    group = dist.group.WORLD.group_name
    errs = []
    for i, (T, res) in enumerate([(1, "shard_both"), (64, "full"), (257, "shard_in"), (3, "none")] * 3):
        c = case(T, 4096, "bf16", res=res, ctas=32, seed=100 + i)
        xs, residual, bias, weight = make_inputs(c, world, torch.device("cuda", rank))
        x, res_in = rank_args(c, world, rank, xs, residual)
        in_sh, out_sh = flags(c)
        normed, res_out, _ = ar.allreduce_add_rmsnorm(x, res_in, bias, weight, 1e-6, group, torch.bfloat16,
                                                   torch.bfloat16, None, 0.0, in_sh, out_sh, "oneshot", 32)
        errs += mismatches(c, world, rank, normed, res_out, *expected(c, xs, residual, bias, weight))
    return errs


@pytest.mark.parametrize("N", [3, 4])
@pytest.mark.parametrize("H", [4096, 8192])
def test_oneshot_batch_invariant_rows_on_the_gpu(N, H, seed):
    """``batch_invariant`` on concurrent emulated ranks, back to back on one workspace: one row whose
    partials cancel in part (``tests/kernels/_batch_invariant_cases.py``) run alone and at positions
    owned by every rank in calls of 2..4099 rows on 1, 8 and 32 CTAs, full and sharded residual: its
    normed and residual rows bitwise the same on every rank (one-row tiles for every T), and the
    residual the rank-order fp32 sum rounded once, which an owner-first order misses for these rows
    (``test_oneshot_batch_invariant.py::test_the_sum_check_tells_the_orders_apart``): the kernel's own
    order is rank order already, so turning the option off shows no owner to discriminate by."""
    from tests.kernels import _batch_invariant_cases as bic

    bf = torch.bfloat16
    em = EmulatedRanks(N, H, bf, bf, capacity=math.ceil(4099 / N) * N)
    parts, res_row = bic.row_partials(seed, N, H, "cuda")
    weight = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(seed))).to(bf).cuda()
    want_res = bic.rank_order_residual(parts, res_row).to(bf)
    calls = 0

    def row(T, pos, ctas, sharded):
        nonlocal calls
        S = math.ceil(T / N)
        xs, residual = bic.batch_with_row(parts, res_row, T, pos, seed + T + pos, "cuda")
        padded = torch.nn.functional.pad(residual, (0, 0, 0, S * N - T))
        spec = FusedSpec(residual_dtype=bf, out_dtype=bf, comm_ctas=ctas, residual_in_sharded=sharded,
                         residual_out_sharded=sharded, batch_invariant=True)
        outs = [(torch.full((T, H), float("nan"), dtype=bf, device=DEV),
                 torch.full((S if sharded else T, H), float("nan"), dtype=bf, device=DEV)) for _ in range(N)]
        em.run(lambda r, ws: oneshot_kernel.launch(
            ws, Rows(xs[r], padded[r * S:(r + 1) * S] if sharded else residual, None, weight), spec, *outs[r]))
        torch.cuda.synchronize()
        calls += 1
        for normed, _ in outs[1:]:
            assert bic.same_bits(normed, outs[0][0]), "the ranks computed other rows"
        owner, j = pos // S, pos % S
        return outs[0][0][pos], (outs[owner][1][j] if sharded else outs[0][1][pos])

    for sharded in (False, True):
        n1, r1 = row(1, 0, 1, sharded)
        assert bic.same_bits(r1, want_res), "not the rank-order fp32 sum"
        for T, pos in ((2, 1), (N - 1, N - 2), (5, 4), (257, 128), (257, 256), (4099, 0), (4099, 2050), (4099, 4098)):
            for ctas in (1, 8, 32):
                n, r = row(T, pos, ctas, sharded)
                assert bic.same_bits(n, n1) and bic.same_bits(r, r1), (T, pos, bic.owner(T, pos, N), ctas, sharded)
    em.check_state(calls)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (symmetric memory across processes)")
def test_fused_op_oneshot_on_two_gpus():
    from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

    for rank, errs in enumerate(assert_ranks_ok(run_ranks(_symm_rank, 2, backend="nccl", timeout=300))):
        assert not errs, f"rank {rank}: {errs}"
