"""Bounded waits for ``ce``: a host thread that turns a peer that never signals into a clear error.

Why a thread. ``cuStreamWaitValue32`` has no timeout, and a bounded wait on the device would be a
kernel that spins: SMs held beside the other token half's GEMMs, which is what ``ce`` exists to
avoid.

What it watches. Every call on a watched workspace writes progress marks into one word of
page-locked host memory (:func:`.program.build_program`): before each wait an odd value naming
the call, the phase and the peer, after its last wait an even one. They are stream writes without
a memory fence: constants in the stream (a captured graph replays them), no host sync, no SM. The
thread reads the words with plain loads every ``poll_s``; a stream blocked on a peer shows as an
odd mark that does not change. When one has not changed for ``timeout_s`` the watchdog fires.
(A value seen at two polls may come from two replays of one graph: the timeout is exact to one
poll interval.)

Firing, in this order:

1. an ERROR log naming the group, the rank, the peer, the flag and the call, and ``failed`` set
   on every watched workspace of the group: every later ``ce`` call on it raises
   :class:`.workspace.CeAbortedError`;
2. poison: NaN copied over every rank's ``out`` and ``res`` regions (own and peer-mapped), then
   every rank's ``abort`` word set (the add+norm kernel then writes NaN);
3. release: 1 written into every flag word this rank waits on, so the blocked wait passes.

Steps 2-3 are enqueued in that order on each of several new streams, one per hardware queue (a
stream sharing the blocked stream's queue would wait behind it), as copies and stream writes
only: no kernel, since a first-time module load may synchronize the context, i.e. wait for the
blocked stream. While a failed workspace's stream waits again (calls enqueued before the failure)
each poll releases it again; a wait that outlives a release by ``timeout_s`` is logged as
CRITICAL once (the release could not run: restart the process).

Outcome: the blocked stream drains within about ``timeout_s + poll_s``; every output row that
depends on the missing peer is NaN (rows finished before the stall keep their correct values);
the host learns at its next ``ce`` call (an exception) or from the log. A CUDA graph replayed
after the failure computes NaN (each of its waits released within a poll) and cannot raise: watch
the log. A peer that was only late finds its abort word set, computes NaN from then on, and times
out on its own. Cost on the fast path: per call 2(N-1)+1 stream writes without a fence and one
load of the abort word per CTA of the add+norm kernel; nothing on the host.

``WEAVE_CE_TIMEOUT_S``: seconds (default 600, PyTorch's default NCCL timeout); 0 turns the
watchdog off (waits unbounded, no marks, no abort word read).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from . import memops
from .program import decode_mark
from .workspace import AG, RS, CeWorkspace

log = logging.getLogger(__name__)

ENV_TIMEOUT = "WEAVE_CE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
#: NaN copied over the regions in chunks of this many bytes: 0x7FC0 is a NaN as bf16 and fp16,
#: and two of them (0x7FC07FC0) as fp32.
_NAN_CHUNK_BYTES = 8 << 20
_NAN_HALF = 0x7FC0
_PHASES = {RS: ("RS", "reduce-scatter ('my partials are pushed')"),
           AG: ("AG", "all-gather ('my rows are normed')")}


def timeout_from_env() -> float:
    """``WEAVE_CE_TIMEOUT_S`` in seconds (default 600); 0 (or less): no watchdog."""
    raw = os.environ.get(ENV_TIMEOUT, "")
    if not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; using %s", ENV_TIMEOUT, raw, DEFAULT_TIMEOUT_S)
        return DEFAULT_TIMEOUT_S


@dataclass(eq=False)
class _Watched:
    ws: CeWorkspace
    mark: int
    since: float  # when ``mark`` was first seen
    released: Optional[float] = None  # first release
    stuck_logged: bool = False


class _DeviceRescue:
    """Poison and release on one device: copies and stream writes on one new stream per hardware
    queue, prepared (and each path run once) before any stall."""

    def __init__(self, device: torch.device):
        self.device = device
        self.context = memops.primary_context(device)
        self.streams = memops.new_streams(device, memops.connections())
        with torch.cuda.device(device):
            self.nan = torch.full((_NAN_CHUNK_BYTES // 2,), _NAN_HALF, dtype=torch.int16, device=device)
            self._scratch = torch.zeros(2, dtype=torch.int32, device=device)
            self._filled = torch.cuda.Event()
            self._filled.record()
            for s in self.streams:  # ordered after the fill; each path enqueued once (no host sync)
                memops.wait_event(s, self._filled)
                memops.copy(s, self._scratch.data_ptr(), self.nan.data_ptr(), 4)
                memops.write(s, self._scratch.data_ptr() + 4, 1)

    def __call__(self, ws: CeWorkspace) -> None:
        memops.make_current(self.context)  # (on the watchdog's thread)
        for s in self.streams:
            for reg in ws.regions:
                for t in (reg.out, reg.res):
                    base, nbytes = t.data_ptr(), t.numel() * t.element_size()
                    for off in range(0, nbytes, _NAN_CHUNK_BYTES):
                        memops.copy(s, base + off, self.nan.data_ptr(), min(_NAN_CHUNK_BYTES, nbytes - off))
            for reg in ws.regions:
                memops.write(s, reg.abort.data_ptr(), 1)
            me = ws.regions[ws.rank]
            for p in range(ws.world_size):
                if p != ws.rank:
                    for phase in (RS, AG):
                        memops.write(s, me.flags[phase, p:p + 1].data_ptr(), 1)


_RESCUES: dict = {}
_RESCUES_LOCK = threading.Lock()


def _device_rescue(device: torch.device) -> _DeviceRescue:
    """The process's rescue of ``device`` (made on first use: at a watch, never in a stall)."""
    with _RESCUES_LOCK:
        if device not in _RESCUES:
            _RESCUES[device] = _DeviceRescue(device)
        return _RESCUES[device]


def _host_rescue(ws: CeWorkspace) -> None:
    """The same on CPU tensors (the simulation)."""
    for reg in ws.regions:
        reg.out.fill_(float("nan"))
        reg.res.fill_(float("nan"))
    for reg in ws.regions:
        reg.abort.fill_(1)
    me = ws.regions[ws.rank]
    for p in range(ws.world_size):
        if p != ws.rank:
            me.flags[:, p].fill_(1)


class Watchdog:
    """Watches workspaces' progress marks; see the module doc. ``check()`` is one poll (the thread
    of :meth:`start` calls it every ``poll_s``); ``clock`` and ``rescue`` (poison and release of a
    workspace) can be replaced, e.g. by a test."""

    def __init__(self, timeout_s: float, poll_s: Optional[float] = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 rescue: Optional[Callable[[CeWorkspace], None]] = None):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s) if poll_s is not None else min(1.0, self.timeout_s / 10)
        self._clock = clock
        self._rescue = rescue
        self._watched: list[_Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def watch(self, wss: Iterable[CeWorkspace]) -> None:
        """Watch ``wss`` from now on: their calls write marks, their add+norm reads the abort word.
        Call outside CUDA-graph capture, before the workspaces' first call (the programs built
        before are not watched)."""
        for ws in wss:
            me = ws.regions[ws.rank]
            dev = me.flags.device
            if self._rescue is None and dev.type == "cuda":
                _device_rescue(dev)
            if ws.mark is None:
                ws.mark = memops.HostWords(1, dev)
            with self._lock:
                self._watched.append(_Watched(ws, ws.mark.read(), self._clock()))

    def unwatch(self, ws: CeWorkspace) -> None:
        """Stop watching ``ws`` (a workspace dropped: nothing runs on it any more)."""
        with self._lock:
            self._watched = [e for e in self._watched if e.ws is not ws]

    def _rescue_of(self, ws: CeWorkspace) -> Callable[[CeWorkspace], None]:
        if self._rescue is not None:
            return self._rescue
        dev = ws.regions[ws.rank].flags.device
        return _device_rescue(dev) if dev.type == "cuda" else _host_rescue

    def check(self) -> list[str]:
        """One poll: fire on stalls past the timeout, release the waits of failed workspaces;
        returns the error messages of this poll's firings."""
        now = self._clock()
        with self._lock:
            entries = list(self._watched)
        fired = []
        for e in entries:
            value = e.ws.mark.read()
            if value != e.mark:
                e.mark, e.since = value, now
            if not value & 1:
                continue  # not waiting
            if e.ws.failed is None:
                if now - e.since < self.timeout_s:
                    continue
                msg = self._message(e.ws, value, now - e.since)
                log.error("%s", msg)
                fired.append(msg)
                for other in entries:  # the whole group (every rank of it in this process)
                    if other.ws.group_name == e.ws.group_name and other.ws.failed is None:
                        other.ws.failed = msg if other is e else (
                            f"ce: group {e.ws.group_name!r} rank {other.ws.rank}: aborted ({msg})")
            self._rescue_of(e.ws)(e.ws)
            if e.released is None:
                e.released = now
            elif (now - max(e.since, e.released) >= self.timeout_s and not e.stuck_logged):
                e.stuck_logged = True
                log.critical("ce: group %r rank %d: its stream is still blocked %.0f s after the watchdog released "
                             "it (the release could not run: a stream shares the blocked one's hardware queue?); "
                             "restart the process", e.ws.group_name, e.ws.rank, now - e.released)
        return fired

    def _message(self, ws: CeWorkspace, value: int, waited: float) -> str:
        seq, phase, peer = decode_mark(value)
        flag, what = _PHASES[phase]
        return (f"ce: group {ws.group_name!r} rank {ws.rank} of {ws.world_size}: no {what} signal from rank {peer} "
                f"for {waited:.1f} s (flag {flag}[{peer}] of rank {ws.rank}, call #{seq}; timeout {self.timeout_s:g} s, "
                f"{ENV_TIMEOUT}). The peer died, hangs, or issued other calls than this rank. This call's outputs, "
                "and those of every ce call already enqueued, are NaN and its stream was released; every later ce "
                "call on this group raises.")

    def start(self) -> "Watchdog":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="weave-ce-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 * self.poll_s + 1)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # a poll that failed must not end the watching
                log.exception("ce watchdog: poll failed")


_DEFAULT: Optional[Watchdog] = None
_DEFAULT_LOCK = threading.Lock()


def default() -> Optional[Watchdog]:
    """The process's watchdog (started on first use), or None where ``WEAVE_CE_TIMEOUT_S`` is 0."""
    global _DEFAULT
    timeout = timeout_from_env()
    if timeout <= 0:
        return None
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Watchdog(timeout).start()
        return _DEFAULT


def watch_default(ws: CeWorkspace) -> None:
    """Watch a new workspace with the process's watchdog; where that fails its waits stay
    unbounded, with the reason logged."""
    wd = default()
    if wd is None:
        log.info("ce: %s=0: waits on peers are unbounded (group %s)", ENV_TIMEOUT, ws.group_name)
        return
    try:
        wd.watch([ws])
    except Exception as e:
        log.warning("ce: group %s rank %d is not watched, its waits on peers are unbounded: %s: %s",
                    ws.group_name, ws.rank, type(e).__name__, e)


def unwatch_default(ws: CeWorkspace) -> None:
    """Stop watching ``ws`` with the process's watchdog, where one runs."""
    if _DEFAULT is not None:
        _DEFAULT.unwatch(ws)
