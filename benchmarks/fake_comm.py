"""The ``ce`` design on PyTorch's fake process group: its own cost, and a rehearsal of two GPUs on one.

One-GPU benchmarks run rank 0 of a fake process group (``dist.init_process_group("fake",
store=FakeStore(), rank=0, world_size=N)``): the process compiles rank 0's shard of a TP model and
collectives move nothing. ``ce``'s own setup (a symmetric-memory rendezvous) cannot run there.
:func:`install` puts in place of the registry entry ``ce`` (:mod:`weave_compile.kernels.ce`) one
that runs on such a group, in one of two modes, and makes every symmetric-memory design refuse
fake groups (their probe would try a rendezvous there; ``reference`` and ``nccl`` run on the
group's own collectives, which the fake group answers without moving data); everything else of
the fused op (its dispatch, the split's streams, CUDA graphs) stays the product's.

``local`` -- the product's own cost, communication free
    Rank 0's ``ce`` program (``copy_engine.build_program``) without what writes into a peer or waits
    for one (the push to the peers, every flag signal, wait and reset): the add+norm kernel on rank
    0's rows, reading N-1 receive slots of the real size from a scratch workspace filled once with
    finite values, and every copy into rank 0's outputs: its own rows, and the peers' rows pulled
    from their regions of the emulated workspace, filled once with finite values. So every row of
    the outputs holds real values when the next GEMM reads it: a GEMM's time does depend on them
    (one H100, bf16 [T x 4096] @ [4096 x 14336]: 0.85x the time on zeros at T=4096, 0.83x on freshly
    allocated memory), and an unwritten row holds what the allocator handed out, often zeros. The
    pulls are copy-engine copies here as in production; the data comes from this GPU's memory
    instead of a peer's (one more local read per row).

``rehearse`` -- two GPUs on one (world size 2)
    Rank 0's ``ce`` program as in production, and the peer's program emulated in this process on a
    stream of its own (forked from rank 0's current stream at each call, joined back at its end),
    both from ``copy_engine.build_program`` on ``copy_engine.emulated_workspaces`` (both ranks'
    regions are ordinary allocations on this GPU): rank 0's stream waits resolve when the peer's
    signals would come. Every cross-GPU copy (rank 0's push and pull, the peer's push and pull) is
    a local copy followed by a :class:`pacing.Pace` (a PCIe copy, no SM), so
    that both last as long as the transfer over NVLink at ``link_gbps`` (default 370 GB/s per
    direction: copy engines between two NVLink-4 GPUs). The peer's add+norm kernel does not run: a
    Pace on its stream lasts what rank 0's kernel takes by the model ``bytes / (GB/s per CTA x
    CTAs)`` (bytes the kernel reads and writes; :data:`NORM_GBPS_PER_CTA` measured on one H200, or
    ``norm_gbps_per_cta``). Rank 0's own rows of the outputs are the op's result for partial sums
    (rank 0's ``x``, the peer's ``x``; the peer's partials are rank 0's own unless ``peer_rows``
    gives others); the peer's rows are its ``out``/``res`` regions, filled once with finite values,
    unless ``peer_norm="kernel"`` runs the peer's kernel too (tests; it takes this GPU's SMs).

    Models: rank 0's real kernels, copies, stream-memory flags and joins on the schedule the product
    builds (unsplit or split, CUDA graphs); each transfer's time over the link, per direction (two
    transfers in one direction share one PCIe direction, see pacing.py); the peer's program order
    and the length of its add+norm. Does not model: skew between the ranks (the peer starts each
    call when rank 0 does, plus ``peer_skew_us``); the peer's GEMMs slowing its add+norm (the rate
    is the kernel's alone; with symmetric ranks rank 0's own kernel, which does run beside the
    GEMMs, is the later one); link contention with anything but this op; the latency of a flag
    write across NVLink (local here); where the HBM traffic lands: a cross-GPU copy reads one GPU's
    HBM and writes the other's, here both ends are this GPU (about twice rank 0's share: an upper
    bound on what the GEMMs beside it lose), plus the Paces' own traffic at PCIe rate (~1% of HBM
    bandwidth). The peer's stream joins rank 0's at the end of each call, after the peer's pulls,
    which in production may overlap rank 0's next push: the ranks are symmetric, so this costs at
    most the difference between their pull times.

Issue order: the ranks' programs are enqueued phase by phase (each rank's ops up to its next wait,
in turn), so every wait's signal is enqueued before the wait: two streams sharing one hardware
queue, or a lazy module load that synchronizes the context between two enqueues, cannot deadlock.
Every kernel is loaded before anything is enqueued (``copy_engine.preload``). The emulation's
buffers are allocated when the fused op reserves (compile time) or, outside CUDA-graph capture,
when a call needs more; inside capture that raises :class:`FakeCommCapacityError` (no fallback: a
benchmark must stop rather than time the ``reference`` op).

Usage (one GPU)::

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    with fake_comm.installed("rehearse", link_gbps=370):
        c = torch.compile(model, backend="tokenweave", options={"kernel": "ce", "split": True})
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Callable, Iterator, Optional

import torch

from weave_compile.kernels import registry
from weave_compile.kernels.ce import copy_engine as ce
from weave_compile.kernels.registry import Implementation, Site
from weave_compile.kernels.shared import addnorm
from weave_compile.kernels.shared.outside_pool import run_outside_graph_pool
from weave_compile.kernels.spec import FusedSpec, Rows

import pacing
from pacing import D2H, H2D, Calibration, Pace, Pacer

log = logging.getLogger(__name__)

LOCAL, REHEARSE = "local", "rehearse"
MODES = (LOCAL, REHEARSE)
PEER_NORMS = ("delay", "kernel")

#: GB/s per CTA of ``ce``'s add+norm kernel alone (bytes read + written), one H200, bf16, 4096 rows
#: per rank, by hidden size and CTAs: benchmarks/results/comm_per_cta_ce.csv (design ce, addnorm).
NORM_GBPS_PER_CTA = {4096: {2: 84.0, 4: 83.2, 8: 81.9, 16: 76.6, 32: 68.1},
                     8192: {2: 78.1, 4: 77.6, 8: 76.5, 16: 74.4, 32: 70.5}}


class FakeCommCapacityError(RuntimeError):
    """The emulation's buffers are too small and cannot grow now (CUDA-graph capture)."""


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What ``rehearse`` assumes of the link and the peer (module docstring)."""

    link_gbps: float = 370.0  # per direction
    link_latency_us: float = 0.0  # per transfer, beyond a local copy's own latency
    norm_gbps_per_cta: Optional[float] = None  # None: NORM_GBPS_PER_CTA
    peer_skew_us: float = 0.0  # the peer starts each call this much after rank 0
    peer_norm: str = "delay"  # "kernel": the peer's add+norm runs (on this GPU's SMs; tests)

    def __post_init__(self) -> None:
        if not self.link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps}")
        if self.norm_gbps_per_cta is not None and not self.norm_gbps_per_cta > 0:
            raise ValueError(f"norm_gbps_per_cta must be > 0, got {self.norm_gbps_per_cta}")
        if self.link_latency_us < 0 or self.peer_skew_us < 0:
            raise ValueError("link_latency_us and peer_skew_us must be >= 0")
        if self.peer_norm not in PEER_NORMS:
            raise ValueError(f"peer_norm must be one of {PEER_NORMS}, got {self.peer_norm!r}")


# ----------------------------------------------------------------------------- the peer's add+norm


def _nearest(table: dict, key: float):
    return table[min(table, key=lambda k: abs(math.log(k / max(1, key))))]


def norm_gbps_per_cta(hidden: int, ctas: int) -> float:
    """The measured per-CTA rate at the nearest measured hidden size and CTA count."""
    return _nearest(_nearest(NORM_GBPS_PER_CTA, hidden), ctas)


def norm_bytes(kw: dict) -> int:
    """Bytes the add+norm kernel reads and writes for a ``Norm`` op's arguments."""
    per_row = kw["x"].element_size() + kw["normed"].element_size() + kw["res_out"].element_size()
    if kw["recv"] is not None:
        per_row += kw["recv"].shape[0] * kw["recv"].element_size()
    if kw["residual"] is not None:
        per_row += kw["residual"].element_size()
    return kw["n_valid"] * kw["x"].shape[-1] * per_row


def norm_us(kw: dict, model: Rehearsal) -> float:
    """The add+norm kernel's time by the model ``bytes / (GB/s per CTA x CTAs)``."""
    ctas = int(kw["num_ctas"])
    rate = model.norm_gbps_per_cta or norm_gbps_per_cta(kw["x"].shape[-1], ctas)
    return norm_bytes(kw) / (rate * ctas * 1e3)


# ----------------------------------------------------------------------------- program transforms


def owner(ws: ce.CeWorkspace, t: torch.Tensor) -> Optional[int]:
    """The rank whose regions hold ``t``'s first element, None for memory outside every region
    (a call's inputs and outputs: the issuing rank's)."""
    ptr = t.data_ptr()
    for p, reg in enumerate(ws.regions):
        for r in (reg.flags, reg.recv, reg.out, reg.res):
            if r.data_ptr() <= ptr < r.data_ptr() + r.numel() * r.element_size():
                return p
    return None


def copy_ranks(ws: ce.CeWorkspace, op: ce.Copy) -> tuple[int, int]:
    """``(rank the bytes come from, rank they go to)`` of a copy in rank ``ws.rank``'s program."""
    src, dst = owner(ws, op.src), owner(ws, op.dst)
    return (ws.rank if src is None else src), (ws.rank if dst is None else dst)


def local_program(ws: ce.CeWorkspace, prog: list) -> list:
    """``local``: the ops of ``prog`` that neither write into a peer nor wait for one (the add+norm
    and every copy into this rank's memory: its own rows, and the pulls of the peers' rows)."""
    return [op for op in prog if isinstance(op, ce.Norm)
            or (isinstance(op, ce.Copy) and copy_ranks(ws, op)[1] == ws.rank)]


def rehearse_program(ws: ce.CeWorkspace, prog: list, model: Rehearsal, cal: Calibration, *, peer: bool) -> list:
    """``rehearse``: ``prog`` with a Pace after every cross-GPU copy (rank 0 -> peer on the
    device-to-host direction, peer -> rank 0 on host-to-device); for the peer (``peer``) also its
    skew first and, unless ``model.peer_norm == "kernel"``, its add+norm replaced by a Pace."""
    out: list = []

    def pace(p: Optional[Pace]) -> None:
        if p is not None:  # None: shorter than half the PCIe latency, closer to nothing
            out.append(p)

    if peer and model.peer_skew_us > 0:
        pace(cal.delay(model.peer_skew_us, H2D, "peer skew"))
    for op in prog:
        if isinstance(op, ce.Norm) and peer and model.peer_norm == "delay":
            pace(cal.delay(norm_us(op.kwargs, model), H2D, "peer add+norm"))
            continue
        out.append(op)
        if isinstance(op, ce.Copy):
            src, dst = copy_ranks(ws, op)
            if src != dst:
                nbytes = op.src.numel() * op.src.element_size()
                pace(cal.transfer(nbytes, model.link_gbps, D2H if src == 0 else H2D, model.link_latency_us,
                                  f"rank {src} -> {dst}: {nbytes} B"))
    return out


def phases(prog: list) -> list[list]:
    """``prog`` cut before every wait: each piece can run once the peers' earlier pieces have."""
    out: list[list] = [[]]
    for op in prog:
        if isinstance(op, ce.Wait) and out[-1]:
            out.append([])
        out[-1].append(op)
    return out


def issue_order(programs: list[list]) -> list[tuple[int, list]]:
    """``(rank, ops)`` in the order to enqueue them: phase k of every rank before phase k+1 of any."""
    cut = [phases(p) for p in programs]
    return [(r, c[k]) for k in range(max(map(len, cut))) for r, c in enumerate(cut) if k < len(c)]


# ----------------------------------------------------------------------------- the emulation


@dataclasses.dataclass(eq=False)
class _Slot:
    """The emulation of one (device, H, dtypes): the ranks' workspaces; for ``rehearse`` the peer's
    outputs (never read) and its stream."""

    wss: list
    peer_normed: Optional[torch.Tensor] = None
    peer_res: Optional[torch.Tensor] = None
    stream: Optional[torch.cuda.Stream] = None

    @property
    def capacity(self) -> int:
        return self.wss[0].capacity


def _fill_finite(t: torch.Tensor, gen: torch.Generator) -> None:
    t.copy_(torch.randn(t.shape, generator=gen, device=t.device).mul_(0.01))


def _contiguous(rows: Rows) -> Rows:
    """``rows`` with x contiguous and the residual's rows unit-strided (what the ``ce`` program takes)."""
    x = rows.x if rows.x.is_contiguous() else rows.x.contiguous()
    residual = rows.residual
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    return dataclasses.replace(rows, x=x, residual=residual)


def _backend(group_name: str) -> str:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return str(dist.get_backend(_resolve_process_group(group_name)))
    except Exception as e:  # noqa: BLE001 - the reason is what the caller reports
        return f"unknown ({type(e).__name__}: {e})"


class FakeComm:
    """One installed mode: the registry entry's check, reserve and run, and the emulation's state."""

    def __init__(self, mode: str, world_size: int, model: Rehearsal, calibration: Optional[Calibration],
                 pacer: Optional[Pacer], peer_rows: Optional[Callable[[Rows], Rows]]):
        self.mode, self.world_size, self.model = mode, world_size, model
        self.calibration, self.pacer, self.peer_rows = calibration, pacer, peer_rows
        self.slots: dict[tuple, _Slot] = {}
        self.retired: list[_Slot] = []  # a captured graph may point at them: kept alive
        self.calls = 0  # run() calls that enqueued work (eager, warm-up and capture; replays are not calls)
        self.original: Optional[Implementation] = None
        self.others: list[Implementation] = []  # the other entries as they were before install

    def describe(self) -> str:
        if self.mode == LOCAL:
            return (f"fake_comm local (world size {self.world_size}): ce's add+norm and copies into rank 0's "
                    "outputs (the peers' rows from local regions), no transfer")
        m = self.model
        return (f"fake_comm rehearse: peer emulated, link {m.link_gbps:g} GB/s per direction"
                f"{f' + {m.link_latency_us:g} us' if m.link_latency_us else ''}, peer add+norm "
                f"{'run' if m.peer_norm == 'kernel' else 'paced'}"
                f"{f', peer skew {m.peer_skew_us:g} us' if m.peer_skew_us else ''}; "
                f"{self.calibration.describe() if self.calibration else 'not calibrated'}")

    def entry(self, original: Implementation) -> Implementation:
        return dataclasses.replace(original, summary=f"{original.summary} [{self.describe()}]", check=self.check,
                                   run=self.run, reserve=self.reserve, capacity_error=None)

    # -- the registry entry

    def check(self, site: Site) -> Optional[str]:
        why = addnorm.unavailable_reason(site.device, (site.dtype, site.residual_dtype, site.out_dtype), site.hidden)
        if why:
            return why
        if site.world_size != self.world_size:
            return f"fake_comm {self.mode} emulates world size {self.world_size}, the group has {site.world_size}"
        backend = _backend(site.group_name)
        if backend != "fake":
            return f"fake_comm {self.mode} runs on a fake process group only; {site.group_name!r} is {backend!r}"
        return None

    def reserve(self, site: Site) -> None:
        tokens = site.num_tokens or site.size_hint
        if not tokens:
            log.info("fake_comm: no token count at compile time; buffers grow at the first call")
            return
        self._slot(site.device, site.hidden, (site.dtype, site.out_dtype, site.residual_dtype), tokens)

    def run(self, rows: Rows, spec: FusedSpec) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if not rows.x.is_cuda:
            return None
        with torch.cuda.device(rows.x.device):
            normed, residual_out, programs = self.programs(rows, spec)
            for prog in programs:
                ce.preload([op for op in prog if not isinstance(op, Pace)])
            cur = torch.cuda.current_stream()
            if self.mode == LOCAL:
                ce.execute(programs[0], cur)
            else:
                peer = self._slot_of(rows, spec).stream
                peer.wait_stream(cur)
                streams = [cur, peer]
                for rank, ops in issue_order(programs):
                    self._enqueue(ops, streams[rank])
                cur.wait_stream(peer)
        self.calls += 1
        return normed, residual_out

    # -- programs

    def programs(self, rows: Rows, spec: FusedSpec) -> tuple[torch.Tensor, torch.Tensor, list[list]]:
        """Rank 0's outputs and every emulated rank's ops of one call, not enqueued (``local``: rank
        0's only; ``rehearse``: rank 0's, then the peer's)."""
        rows = _contiguous(rows)
        slot = self._slot_of(rows, spec)
        normed, residual_out, prog = ce.ce_call(slot.wss[0], rows, spec, run=False)
        if self.mode == LOCAL:
            return normed, residual_out, [local_program(slot.wss[0], prog)]
        peer = _contiguous(self.peer_rows(rows)) if self.peer_rows else rows
        ce.check_args(slot.wss[1], peer, spec)
        T = rows.x.shape[0]
        res_rows = math.ceil(T / self.world_size) if spec.residual_out_sharded else T
        peer_prog = ce.build_program(slot.wss[1], peer, spec, slot.peer_normed[:T], slot.peer_res[:res_rows])
        if self.calibration is None:
            raise RuntimeError("fake_comm rehearse: no calibration (install it on a CUDA device, or pass one)")
        return normed, residual_out, [
            rehearse_program(slot.wss[0], prog, self.model, self.calibration, peer=False),
            rehearse_program(slot.wss[1], peer_prog, self.model, self.calibration, peer=True)]

    def _enqueue(self, ops: list, stream: torch.cuda.Stream) -> None:
        batch: list = []
        for op in ops:
            if isinstance(op, Pace):
                if batch:
                    ce.execute(batch, stream)
                    batch = []
                self.pacer.enqueue(op, stream)
            else:
                batch.append(op)
        if batch:
            ce.execute(batch, stream)

    # -- buffers

    def _slot_of(self, rows: Rows, spec: FusedSpec) -> _Slot:
        x = rows.x
        return self._slot(x.device, x.shape[-1], (x.dtype, spec.out_dtype, spec.residual_dtype), x.shape[0])

    def _slot(self, device, hidden: int, dtypes: tuple, tokens: int) -> _Slot:
        """The emulation for ``tokens`` tokens; grows (1.5x at least) outside CUDA-graph capture."""
        device = torch.device(device)
        key = (device.type, device.index, int(hidden), tuple(dtypes))
        per_rank = math.ceil(max(1, tokens) / self.world_size)
        slot = self.slots.get(key)
        if slot is not None and per_rank <= slot.capacity:
            return slot
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise FakeCommCapacityError(
                f"fake_comm: no room for {tokens} tokens (H={hidden}) and no growing during CUDA-graph capture; "
                "compile with a static token count (the fused op reserves at compile time) or run once eagerly")
        if slot is not None:
            per_rank = max(per_rank, math.ceil(slot.capacity * 1.5))
            self.retired.append(slot)
        capacity = -(-per_rank // 256) * 256

        def make() -> _Slot:
            return self._new_slot(device, int(hidden), tuple(dtypes), capacity)

        self.slots[key] = slot = run_outside_graph_pool(make, device) if device.type == "cuda" else make()
        log.info("fake_comm %s: emulation for H=%d %s, %d rows per rank", self.mode, hidden, dtypes, capacity)
        return slot

    def _new_slot(self, device: torch.device, hidden: int, dtypes: tuple, capacity: int) -> _Slot:
        N = self.world_size
        wss = ce.emulated_workspaces(N, capacity, hidden, dtypes, device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        _fill_finite(wss[0].regions[0].recv, gen)  # local: the peers' partials (rehearse: pushed over it)
        for peer in wss[0].regions[1:]:  # what rank 0 pulls as the peers' rows (local: always; rehearse:
            _fill_finite(peer.out, gen)  # where the peer's kernel does not run)
            _fill_finite(peer.res, gen)
        if self.mode == LOCAL:
            return _Slot(wss)
        _, out_dt, res_dt = dtypes
        return _Slot(wss, peer_normed=torch.empty((N * capacity, hidden), dtype=out_dt, device=device),
                     peer_res=torch.empty((N * capacity, hidden), dtype=res_dt, device=device),
                     stream=torch.cuda.Stream(device) if device.type == "cuda" else None)


# ----------------------------------------------------------------------------- install / uninstall


_active: Optional[FakeComm] = None
NOT_EMULATED = "not emulated on the fake process group (benchmarks/fake_comm.py emulates ce only)"
#: Designs that run on the process group's own collectives: the fake group answers them.
ON_COLLECTIVES = ("nccl",)


def _not_on_fake_groups(impl: Implementation) -> Implementation:
    """``impl`` whose check refuses fake groups before anything else: the symmetric-memory designs'
    probe would try a rendezvous the fake group cannot do (its store has no keys)."""
    def check(site: Site) -> Optional[str]:
        return NOT_EMULATED if _backend(site.group_name) == "fake" else impl.check(site)

    return dataclasses.replace(impl, check=check)


def install(mode: str, *, world_size: int = 2, device=None, calibration: Optional[Calibration] = None,
            peer_rows: Optional[Callable[[Rows], Rows]] = None, **model) -> FakeComm:
    """Replace the registry entry ``ce`` by ``mode`` (``local`` or ``rehearse``) until
    :func:`uninstall`. ``model``: :class:`Rehearsal`'s fields (``rehearse`` only). ``rehearse`` on
    a CUDA device measures the pacing's copy lines now (:func:`pacing.calibrate`, under a second)
    unless ``calibration`` is given; without CUDA it needs one (CPU tests build its programs)."""
    global _active
    if mode not in MODES:
        raise ValueError(f"fake_comm mode must be one of {MODES}, got {mode!r}")
    if _active is not None:
        raise RuntimeError(f"fake_comm is already installed ({_active.mode}); uninstall() first")
    if world_size < 2:
        raise ValueError(f"world_size must be >= 2, got {world_size}")
    if mode == LOCAL and (model or calibration is not None or peer_rows is not None):
        raise ValueError("fake_comm local takes no link, peer or calibration arguments (rehearse does)")
    if mode == REHEARSE and world_size != 2:
        raise ValueError(f"fake_comm rehearse emulates one peer (world size 2), got world_size={world_size}")
    rehearsal = Rehearsal(**model)
    pacer = None
    if mode == REHEARSE and torch.cuda.is_available():
        try:
            pacing.driver()
        except ImportError as e:
            raise RuntimeError("fake_comm rehearse needs cuda-python (stream memory operations and the pacing "
                               f"copies): {e}") from e
        pacer = Pacer(torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device()))
        calibration = calibration or pacing.calibrate(pacer)
    elif mode == REHEARSE and calibration is None:
        raise RuntimeError("fake_comm rehearse: no CUDA device to calibrate the pacing on; pass calibration=")
    fc = FakeComm(mode, world_size, rehearsal, calibration, pacer, peer_rows)
    fc.original = registry.replace(fc.entry(registry.get("ce")))
    fc.others = [registry.replace(_not_on_fake_groups(e)) for e in registry.implementations()
                 if e.name != "ce" and not e.fallback and e.name not in ON_COLLECTIVES]
    _active = fc
    log.info("installed %s", fc.describe())
    return fc


def uninstall() -> None:
    """Put the original entries back (no-op when nothing is installed)."""
    global _active
    if _active is not None:
        for impl in [_active.original, *_active.others]:
            registry.replace(impl)
        _active = None


@contextlib.contextmanager
def installed(mode: str, **kwargs) -> Iterator[FakeComm]:
    """:func:`install` for the ``with`` block, :func:`uninstall` after it (also on an exception)."""
    fc = install(mode, **kwargs)
    try:
        yield fc
    finally:
        uninstall()


def active() -> Optional[FakeComm]:
    """The installed mode, or None."""
    return _active
