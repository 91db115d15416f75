"""Tests for testing/emulated_ranks.py: pointer tables, and the push kernel through it on the CPU.

Under ``TRITON_INTERPRET=1`` (a subprocess running this file as a script) the push kernel runs
for 2, 3 and 4 emulated ranks, one phase of every rank at a time, and is compared with the
float64 oracle; outputs and regions are NaN-poisoned first. Every case runs with fresh outputs
(in the default launch shape, the same with 64-bit index arithmetic forced, the pipelined
add+norm loop, the prefetched one with 1-row tiles unrolled twice and the one-warp-per-row loop
in two chunk sizes), and with the normed output left in a slot of the output ring (``out_slot``;
the default shape and the one-warp-per-row loop), where the result must be the ring view itself
and the other ring slots (the staging slot 0 included) must stay untouched. Two cases give eps as
a 0-d tensor (their float eps 0.0), which the kernel must read (``EPS_PTR``) in every launch
shape. The GPU runs (concurrent ranks, real barriers) are in tests/kernels/p2p/test_push.py.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from unittest import mock

import pytest
import torch

THIS_FILE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(THIS_FILE))))  # script mode

from tests.kernels._symm_cases import (DTYPES, case_name, check_outputs, eps_args, make_case,  # noqa: E402
                                       make_inputs, reference, run_script, shard_rows, sharding)
from weave_compile.kernels.p2p import launch  # noqa: E402
from weave_compile.kernels.shared.common import HAS_TRITON, OUT_RING_SLOTS  # noqa: E402
from weave_compile.testing.emulated_ranks import EmulatedRanks, push_allreduce_rmsnorm  # noqa: E402

CASES = [
    make_case(7, 64, "bf16", seed=1),
    make_case(1, 64, "fp32", res="none", bias=False, seed=2),  # T < world
    # eps as a device tensor (torch.compile(dynamic=True)), read by the kernel in every launch shape
    make_case(37, 32, "fp16", res="shard_both", mid="bf16", woff=1.0, ctas=4, seed=3, eps_tensor=True),
    make_case(40, 48, "fp32", out_dtype="bf16", res_dtype="fp32", res="shard_in", ctas=3, seed=4,
              eps_tensor=True),
    make_case(23, 64, "bf16", res="shard_out", weight=False, ctas=2, seed=5),
    make_case(24, 64, "bf16", res="first", ctas=2, seed=7),  # no residual in, this rank's rows out
    # no bias: the shard's rows past T must come out zero without the residual store's select
    make_case(13, 32, "bf16", res="shard_both", bias=False, ctas=2, seed=6),
]


def test_pointer_tables_list_every_ranks_regions_and_pads():
    ranks = EmulatedRanks.create(3, 16, 7, dtype=torch.bfloat16, residual_dtype=torch.float32,
                                 device="cpu")
    N = ranks.world_size
    assert ranks.workspaces[0].capacity == 9  # padded to whole rows per rank
    for ws in ranks.workspaces:
        t = ws.ptr_table.tolist()
        assert len(t) == 4 * N + 3 and t[4 * N:] == [0, 0, 0]  # no multicast, ever
        for p, peer in enumerate(ranks.workspaces):
            assert t[p] == peer.inp.data_ptr() and t[N + p] == peer.out.data_ptr()
            assert t[2 * N + p] == peer.res.data_ptr() and t[3 * N + p] == ranks.pads[p].data_ptr()
        assert torch.isnan(ws.inp).all() and ws.res.dtype == torch.float32
        assert ws.out_ring.shape == (OUT_RING_SLOTS, 9, 16) and ws.out_ring[0].data_ptr() == ws.out.data_ptr()
    assert ranks.barrier_state() == (0, 0)
    with pytest.raises(RuntimeError, match="CUDA"):
        ranks.run(lambda r, ws: None)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("world", [2, 3, 4])  # 4: the peers' tile of the prefetch loop is padded (3 -> 4)
def test_push_kernel_through_emulated_ranks_in_cpu_interpreter(world):
    env = dict(os.environ, TRITON_INTERPRET="1")
    rc, out = run_script(THIS_FILE, ["--world", str(world)], timeout=600, env=env)
    assert rc == 0, out[-8000:]
    assert "EMULATED-PUSH OK" in out, out[-8000:]


def _shapes(c, world: int, out_slot: int, dt, rdt):
    """(name, launch meta) to run a case with: the default (the register-prefetched add+norm where
    it fits); with fresh outputs also the default with 64-bit indices forced, the pipelined
    add+norm loop, the prefetched one with two tiles per iteration (NORM_UNROLL=2) and the
    one-warp-per-row loop in two chunk sizes; with the output in the ring the one-warp-per-row
    loop too."""
    import dataclasses

    yield "default", None
    if out_slot < 0:
        # the 64-bit index arithmetic (the launcher picks it only past 2**31 elements, which
        # no CPU case reaches): forced, so both index widths are checked
        yield "default_int64", None
        S = math.ceil(c["T"] / world)
        args = (c["H"], S, c["ctas"], world, dt.itemsize, rdt.itemsize)
        yield "pipelined", launch.pipelined_meta(*args)
        # 1-row tiles: several unrolled iterations per CTA, so a wrong next-tile offset shows
        yield "prefetch_unroll2", dataclasses.replace(launch.push_meta(*args), block_rows=1, norm_unroll=2,
                                                      norm_prefetch=True)
        # one warp per row (rownorm.rowwise_group): groups of 2 x 1-row tiles in 16-column
        # chunks loaded 2 ahead (H=48: 3 chunks), and 32-column chunks (H=48: the last one
        # half masked) loaded 1 ahead
        yield "rowwise_c16", dataclasses.replace(launch.push_meta(*args), block_rows=1, norm_unroll=2,
                                                 norm_chunk=16, norm_depth=2)
        yield "rowwise_c32", dataclasses.replace(launch.push_meta(*args), block_rows=1, norm_unroll=2,
                                                 norm_chunk=32, norm_depth=1)
    else:  # the normed rows pushed to the peers' ring slots by global row, one warp per row
        S = math.ceil(c["T"] / world)
        args = (c["H"], S, c["ctas"], world, dt.itemsize, rdt.itemsize)
        yield "rowwise_c16", dataclasses.replace(launch.push_meta(*args), block_rows=1, norm_unroll=2,
                                                 norm_chunk=16, norm_depth=2)


def _main(world: int) -> int:
    torch.set_num_threads(1)
    fails = 0
    ring_slots = range(1, OUT_RING_SLOTS)  # slot 0 is the copying launches' staging
    runs = [(c, s, shape) for k, c in enumerate(CASES) for s in (-1, ring_slots[k % len(ring_slots)])
            for shape in _shapes(c, world, s, DTYPES[c["dtype"]],
                                 DTYPES[c["res_dtype"]] if c["res_dtype"] else DTYPES[c["dtype"]])]
    for c, out_slot, (shape, meta) in runs:
        xs, residual, bias, weight = make_inputs(c, world, "cpu")
        dt = xs[0].dtype
        rdt = DTYPES[c["res_dtype"]] if c["res_dtype"] else dt
        odt = DTYPES[c["out_dtype"]] if c["out_dtype"] else dt
        in_sh, out_sh = sharding(c)
        # Room for more rows than T: the peers' slots ([N, capacity / N]) then start elsewhere
        # than the global rows, and an output in the ring must be addressed by global row.
        ranks = EmulatedRanks.create(world, c["H"], c["T"] + 5 * world, dtype=dt, out_dtype=odt,
                                     residual_dtype=rdt, device="cpu")
        S = math.ceil(c["T"] / world)
        outputs = [(torch.full((c["T"], c["H"]), float("nan"), dtype=odt),
                    torch.full((S if out_sh else c["T"], c["H"]), float("nan"), dtype=rdt))
                   for _ in range(world)]
        res_in = [None if residual is None else (shard_rows(residual, world, r) if in_sh else residual)
                  for r in range(world)]
        if in_sh and residual is not None:  # a shard's rows past T must never be read: poisoned
            for r in range(world):
                res_in[r][max(0, min(S, c["T"] - r * S)):] = float("nan")
        with mock.patch.object(launch, "needs_int64", lambda *extents: True) if shape.endswith("int64") \
                else contextlib.nullcontext():
            outs = push_allreduce_rmsnorm(ranks, xs, res_in, bias, weight, residual_out_sharded=out_sh,
                                          residual_in_sharded=in_sh, comm_ctas=c["ctas"],
                                          mid_dtype=DTYPES[c["mid"]] if c["mid"] else None,
                                          weight_offset=c["woff"], out_slot=out_slot,
                                          outputs=None if out_slot >= 0 else outputs, meta=meta,
                                          **eps_args(c, "cpu"))
        ref_n, ref_r = reference(c, xs, residual, bias, weight)
        for r, (n, ro) in enumerate(outs):
            ok, en, er, msg = check_outputs(c, world, r, n, ro, ref_n, ref_r)
            ring = ranks.workspaces[r].out_ring
            if out_slot >= 0:
                written = [k for k in range(OUT_RING_SLOTS) if k != out_slot and not torch.isnan(ring[k]).all()]
                if n.data_ptr() != ring[out_slot].data_ptr():
                    ok, msg = False, f"normed is not ring slot {out_slot}"
                elif written:  # no staging copy, no stray store
                    ok, msg = False, f"ring slot(s) {written} written"
            print(f"[rank {r}] {case_name(c):60s} out_slot={out_slot:2d} {shape:16s} "
                  f"{'ok' if ok else 'FAIL'} {msg}", flush=True)
            fails += not ok
    print("EMULATED-PUSH OK" if fails == 0 else f"{fails} failures")
    return 1 if fails else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1")
    sys.exit(_main(int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else 2))
