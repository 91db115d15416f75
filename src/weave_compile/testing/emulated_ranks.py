"""N ranks of a symmetric-memory kernel emulated in ONE process, on ONE GPU (or on the CPU).

Two processes cannot share one GPU through PyTorch symmetric memory (rendezvous refuses
"allocations from overlapping devices"), and only a 1-GPU machine may be available.  So every
rank's buffers (input / output / residual regions, signal pad, status word) are ordinary
``torch.empty`` allocations, every rank's pointer table is built from them by the same
:func:`weave_compile.kernels.shared.workspace.build_ptr_table` the real workspace uses, and every
rank's launch goes on its own CUDA stream.  The kernels' CTA-pairwise barriers need every grid
resident at once: :meth:`EmulatedRanks.check_coresident` raises unless ``grid * N`` fits the
SM count (one CTA per SM is then always possible).  A "peer" access is a local HBM access
here, not NVLink: bandwidths measured this way are SM-side limits, not link limits.

Generic on purpose: :class:`EmulatedRanks` holds per-rank :class:`SymmWorkspace` objects and
streams, and :meth:`EmulatedRanks.run` runs any per-rank launch function concurrently, so the
copy-engine and one-shot kernels can use it too.  :func:`push_allreduce_rmsnorm` is the push
kernel's driver.

CPU: under ``TRITON_INTERPRET=1`` one process cannot run ranks concurrently (the interpreter
runs one program at a time and keeps global state), so :meth:`EmulatedRanks.run_phased` runs
one phase of every rank after another with the barriers compiled out (the host orders the
phases).  That checks data movement, addressing and math; the barriers themselves are
simulated by the multi-process test (tests/kernels/p2p/test_launch.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from weave_compile.kernels.p2p import launch
from weave_compile.kernels.shared.common import MAX_CTAS, OUT_RING_SLOTS, interpreting
from weave_compile.kernels.shared.sync import pad_offset_for
from weave_compile.kernels.shared.workspace import SymmWorkspace, build_ptr_table, ring_output
from weave_compile.kernels.spec import FusedSpec, Rows

PAD_WORDS = (32 + 8 * MAX_CTAS) * 8  # channels 0..7 for up to 8 ranks


def interpreter_compat() -> None:
    """Let ``tl.range`` with run-time bounds run under Triton 3.6's CPU interpreter.

    With numpy >= 2.3 the interpreter's ``int(tensor)`` fails on its 1-element scalars
    ("only 0-dimensional arrays can be converted", seen 2026-12-01 with triton 3.6.0 and numpy
    2.4): take the single element instead.  Idempotent; a no-op if the internals moved."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:  # pragma: no cover - no triton
        return
    orig = getattr(ti, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_weave_compat", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._weave_compat = True
    ti._patch_lang_tensor = patched


@dataclass(eq=False)
class EmulatedRanks:
    """Per-rank workspaces (regions, pads, pointer tables) and streams of N emulated ranks."""

    workspaces: list
    streams: list  # one CUDA stream per rank (None on the CPU)
    pads: list
    device: torch.device
    extra: dict = field(default_factory=dict)  # room for other kernels' per-rank state

    @classmethod
    def create(cls, world_size: int, hidden: int, max_tokens: int, *, dtype: torch.dtype,
               out_dtype: Optional[torch.dtype] = None,
               residual_dtype: Optional[torch.dtype] = None, channel: int = 0,
               device: Any = "cuda") -> "EmulatedRanks":
        """Buffers for up to ``max_tokens`` rows (padded to whole rows per rank), poisoned."""
        device = torch.device(device)
        out_dtype, residual_dtype = out_dtype or dtype, residual_dtype or dtype
        capacity = math.ceil(max(1, max_tokens) / world_size) * world_size

        def region(dt, slots=1):
            t = torch.empty((slots, capacity, hidden), dtype=dt, device=device)
            return t.fill_(float("nan"))

        # The output region is a ring of OUT_RING_SLOTS regions, as in a real workspace.
        rings = [region(out_dtype, OUT_RING_SLOTS) for _ in range(world_size)]
        regions = [[region(dtype)[0] for _ in range(world_size)], [t[0] for t in rings],
                   [region(residual_dtype)[0] for _ in range(world_size)]]
        pads = [torch.zeros(PAD_WORDS, dtype=torch.int32, device=device) for _ in range(world_size)]
        table = build_ptr_table([[t.data_ptr() for t in ts] for ts in regions],
                                [p.data_ptr() for p in pads], device=device)
        wss = []
        for r in range(world_size):
            wss.append(SymmWorkspace(
                group_name="emulated", device=device, in_dtype=dtype, out_dtype=out_dtype,
                res_dtype=residual_dtype, hidden=hidden, channel=channel, capacity=capacity,
                rank=r, world_size=world_size, buffer=regions[0][r], handle=None,
                inp=regions[0][r], out=regions[1][r], res=regions[2][r],
                # every rank reads the same table (its own row of it by ``rank``), as each
                # real rank's table lists every peer's mapping of the same buffers
                ptr_table=table.clone(), status=torch.zeros(1, dtype=torch.int32, device=device),
                multicast_ptr=0, pad_offset=pad_offset_for(channel, world_size), out_ring=rings[r]))
        streams = [torch.cuda.Stream(device) if device.type == "cuda" else None
                   for _ in range(world_size)]
        return cls(wss, streams, pads, device)

    @property
    def world_size(self) -> int:
        return len(self.workspaces)

    def check_coresident(self, grid: int) -> None:
        """Raise unless every rank's grid of ``grid`` CTAs can be resident at once."""
        if self.device.type != "cuda":
            return
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if grid * self.world_size > sms:
            raise ValueError(f"{self.world_size} emulated ranks x {grid} CTAs > {sms} SMs: the "
                             "grids could not all be resident and the barriers would hang")

    def run(self, fn: Callable[[int, SymmWorkspace], Any]) -> list:
        """``fn(rank, workspace)`` for every rank, each on its own stream, all enqueued before
        any is awaited; the current stream waits for all of them.  Capturable in a CUDA graph."""
        if self.device.type != "cuda":
            raise RuntimeError("concurrent emulated ranks need CUDA; use run_phased on the CPU")
        cur = torch.cuda.current_stream(self.device)
        outs = []
        for r, (ws, s) in enumerate(zip(self.workspaces, self.streams)):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                outs.append(fn(r, ws))
        for s in self.streams:
            cur.wait_stream(s)
        return outs

    def run_phased(self, fn: Callable[[int, SymmWorkspace, int], Any],
                   phases: Sequence[int]) -> list:
        """``fn(rank, workspace, phase)`` for each phase, every rank, in order (no barriers)."""
        outs = [None] * self.world_size
        for ph in phases:
            for r, ws in enumerate(self.workspaces):
                outs[r] = fn(r, ws, ph)
        return outs

    def barrier_state(self) -> tuple[int, int]:
        """``(timeouts, non-zero pad slots)`` summed over ranks (synchronises)."""
        return (sum(int(ws.status.item()) for ws in self.workspaces),
                sum(int((p != 0).sum().item()) for p in self.pads))


def push_allreduce_rmsnorm(ranks: EmulatedRanks, xs: Sequence[torch.Tensor],
                           residuals: Sequence[Optional[torch.Tensor]], bias=None, weight=None, *,
                           residual_out_sharded: bool = False, comm_ctas: int = 8,
                           outputs: Optional[list] = None, out_slot: int = -1, meta=None, phases: int = 7,
                           num_warps: Optional[int] = None, eps_tensor: Optional[torch.Tensor] = None,
                           norm_bias: Optional[torch.Tensor] = None, quant=None,
                           quant_scale: Optional[torch.Tensor] = None, **spec_kw) -> list:
    """The push kernel on every emulated rank: ``[(normed, residual_out)]`` per rank, with
    ``quant`` (a :class:`weave_compile.quant.QuantSpec`: the fp8 epilogue; ``quant_scale`` its
    static scale) ``[(fp8 rows, residual_out, row scales [T, 1] or None)]``.

    ``residuals[r]`` is rank r's residual input ([T, H], or its [S, H] shard with
    ``residual_in_sharded=True``).  ``outputs`` (from an earlier call) are written in place
    (CUDA-graph replays); ``out_slot >= 0`` leaves each rank's normed output in that slot of its
    output ring (the outputs' normed is the ring view); ``meta``, ``phases`` and ``num_warps``
    go to :func:`weave_compile.kernels.p2p.launch.launch_push`, ``spec_kw`` (``eps``,
    ``mid_dtype``, ``weight_offset``, ``residual_in_sharded``, ``batch_invariant``: then
    :func:`~weave_compile.kernels.p2p.launch.invariant_meta`'s shape unless ``meta``) to the
    :class:`~weave_compile.kernels.spec.FusedSpec` (``norm="layernorm"`` too); ``eps_tensor`` (0-d,
    on the ranks' device) replaces ``eps`` and is read there; ``norm_bias`` [H] is a LayerNorm's
    bias, added after the weight."""
    T, H = xs[0].shape
    N = ranks.world_size
    S = math.ceil(T / N)
    ws0 = ranks.workspaces[0]
    if S * N > ws0.capacity:
        raise ValueError(f"{T} rows need capacity {S * N}, emulated workspace has {ws0.capacity}")
    if outputs is None:
        outputs = [(ring_output(ws, out_slot, T) if out_slot >= 0 else
                    torch.empty((T, H), dtype=ws0.out_dtype if quant is None else quant.dtype, device=ranks.device),
                    torch.empty((S if residual_out_sharded else T, H), dtype=ws0.res_dtype,
                                device=ranks.device)) for ws in ranks.workspaces]
        if quant is not None:
            outputs = [o + (torch.empty((T, 1), device=ranks.device) if quant.kind == "row" else None,)
                       for o in outputs]
    spec = FusedSpec(residual_dtype=ws0.res_dtype, out_dtype=ws0.out_dtype, group_name="emulated",
                     residual_out_sharded=residual_out_sharded, comm_ctas=comm_ctas, out_slot=out_slot,
                     quant=quant, **spec_kw)
    meta = meta or launch.push_meta(H, S, comm_ctas, N, xs[0].dtype.itemsize, ws0.res_dtype.itemsize, num_warps,
                                    spec.batch_invariant, quant is not None)
    ranks.check_coresident(meta.grid)

    def one(r, ws, phases=phases, sync=True, compile_only=False):
        normed, res_out = outputs[r][:2]
        launch.launch_push(ws, Rows(xs[r], residuals[r], bias, weight, eps_tensor=eps_tensor, norm_bias=norm_bias,
                                    quant_scale=quant_scale),
                           spec, normed, res_out, meta=meta, phases=phases, sync=sync, compile_only=compile_only,
                           scales=outputs[r][2] if quant is not None else None)
        return outputs[r]

    if interpreting() or ranks.device.type != "cuda":
        interpreter_compat()
        return ranks.run_phased(lambda r, ws, ph: one(r, ws, phases=ph, sync=False), (1, 2, 4))
    for r, ws in enumerate(ranks.workspaces):  # compile before any rank starts to spin
        one(r, ws, compile_only=True)
    return ranks.run(one)
