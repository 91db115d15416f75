"""Delays on a CUDA stream that hold no SM: PCIe copies sized to last a given time.

What: :class:`Calibration` holds three measured lines ``time = latency + bytes / rate``: a
device-to-device copy on this GPU (the copy engine path of ``torch`` ``copy_`` between contiguous
tensors), a host-to-device and a device-to-host copy between pinned host memory and the device.
:meth:`Calibration.delay` turns "hold this stream for ``us`` microseconds" into a :class:`Pace`: a
PCIe copy of ``(us - latency) x rate`` bytes; :meth:`Calibration.transfer` turns "this local copy
of ``n`` bytes stands for an NVLink transfer at ``link_gbps``" into the Pace that follows it, so
that local copy + Pace last ``latency_of_a_local_copy + link_latency + n / link_rate``.
:class:`Pacer` owns the pinned and device buffers and enqueues Paces (``cuMemcpyHtoDAsync`` /
``cuMemcpyDtoHAsync``: capturable in CUDA graphs, since the host side is pinned).

Why PCIe copies: the one-GPU rehearsal (``benchmarks/fake_comm.py``) must make a copy
take as long as NVLink would and the emulated peer's add+norm as long as rank 0's, without using
this GPU's SMs. Any kernel that stays resident beside cuBLAS's persistent GEMMs delays them about
8.5% whatever its size (docs/performance.md, section 3), so a spin kernel cannot time anything
here; a copy engine moving a few MB over PCIe (~50 GB/s, about 1% of HBM bandwidth) holds no SM.
Host callbacks (``cudaLaunchHostFunc``) were not used: they serialize on one driver thread and
jitter by tens of microseconds.

Directions: each NVLink direction of the two emulated GPUs maps onto one PCIe direction (rank 0 ->
peer: device-to-host, peer -> rank 0: host-to-device). Two transfers in the same NVLink direction
then share one PCIe direction, as they would share the link, and the two directions do not slow
each other (PCIe is full duplex, as NVLink is).

Error of one delay: a wanted delay of at most half the PCIe latency is left out, one between half
and the whole latency becomes a minimal copy (it lasts about the latency): at most latency / 2
(measured latencies are a few microseconds; :meth:`Calibration.describe` prints them).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
from typing import Optional

import torch

log = logging.getLogger(__name__)

H2D, D2H = "h2d", "d2h"
_ALIGN = 256  # bytes: every Pace copies a multiple of this
_MIN_BYTES = _ALIGN


@dataclasses.dataclass(frozen=True)
class Line:
    """``time_us(n) = latency_us + n / (gbps * 1e3)``: one kind of copy, appended to a busy stream."""

    latency_us: float
    gbps: float

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.latency_us < 0:
            raise ValueError(f"a copy line needs gbps > 0 and latency_us >= 0, got {self}")

    def time_us(self, nbytes: int) -> float:
        return self.latency_us + nbytes / (self.gbps * 1e3)

    def bytes_for(self, us: float) -> float:
        """Bytes whose copy lasts ``us`` (0 where ``us`` is at most the latency)."""
        return max(0.0, us - self.latency_us) * self.gbps * 1e3


def fit_line(sizes: list[int], times_us: list[float]) -> Line:
    """Least-squares ``Line`` through ``(bytes, microseconds)`` points (at least two sizes)."""
    if len(set(sizes)) < 2:
        raise ValueError("fit_line needs at least two distinct sizes")
    mx, my = statistics.fmean(sizes), statistics.fmean(times_us)
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, times_us)) / sxx  # us per byte
    if slope <= 0:
        raise ValueError(f"copy times do not grow with size: {list(zip(sizes, times_us))}")
    return Line(latency_us=max(0.0, my - slope * mx), gbps=1.0 / slope / 1e3)


@dataclasses.dataclass(frozen=True, eq=False)
class Pace:
    """Hold a stream ``us`` microseconds: a PCIe copy of ``nbytes`` in ``direction`` (no SM)."""

    direction: str  # H2D or D2H
    nbytes: int
    us: float  # the time it is to take (the copy lasts about this, see Calibration.delay)
    what: str = ""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured copy lines of one GPU (:func:`calibrate`), or given (tests, a fixed model)."""

    d2d: Line
    h2d: Line
    d2h: Line

    def line(self, direction: str) -> Line:
        if direction not in (H2D, D2H):
            raise ValueError(f"direction must be {H2D!r} or {D2H!r}, got {direction!r}")
        return self.h2d if direction == H2D else self.d2h

    def delay(self, us: float, direction: str, what: str = "") -> Optional[Pace]:
        """The Pace that holds a stream ``us`` microseconds in ``direction``; None where ``us`` is at
        most half the latency (closer to nothing than to one minimal copy)."""
        line = self.line(direction)
        if us <= line.latency_us / 2:
            return None
        nbytes = max(_MIN_BYTES, math.ceil(line.bytes_for(us) / _ALIGN) * _ALIGN)
        return Pace(direction, nbytes, us, what)

    def transfer(self, nbytes: int, link_gbps: float, direction: str, link_latency_us: float = 0.0,
                 what: str = "") -> Optional[Pace]:
        """The Pace after a local copy of ``nbytes`` that stands for an NVLink transfer: the copy and
        the Pace together last ``d2d.latency_us + link_latency_us + nbytes / link_gbps``."""
        if not link_gbps > 0:
            raise ValueError(f"link_gbps must be > 0, got {link_gbps}")
        wanted = link_latency_us + nbytes / (link_gbps * 1e3) - nbytes / (self.d2d.gbps * 1e3)
        return self.delay(wanted, direction, what)

    def describe(self) -> str:
        return ", ".join(f"{name} {line.latency_us:.2f} us + {line.gbps:.1f} GB/s"
                         for name, line in (("local copy", self.d2d), ("h2d", self.h2d), ("d2h", self.d2h)))


@functools.lru_cache(maxsize=1)
def driver():
    from cuda.bindings import driver as cu  # cuda-python

    return cu


def _check(result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if err != driver().CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")


class Pacer:
    """Pinned host and device scratch buffers of ``chunk`` bytes each, and the Paces' copies.

    A Pace longer than one chunk is copied in several chunks back to back (each adds about the
    PCIe latency: a few microseconds on delays of more than a chunk's time, ~0.7 ms at 32 MiB)."""

    def __init__(self, device: torch.device, chunk: int = 32 << 20):
        self.device = torch.device(device)
        self.chunk = -(-chunk // _ALIGN) * _ALIGN
        self.host = torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(self.chunk, dtype=torch.uint8, device=self.device)

    def enqueue(self, pace: Pace, stream: torch.cuda.Stream) -> None:
        """The Pace's copies on ``stream`` (the driver's copy, not torch's: no event is recorded,
        so it captures into a CUDA graph as a plain memcpy node)."""
        cu = driver()
        s = cu.CUstream(stream.cuda_stream)
        host, dev = self.host.data_ptr(), cu.CUdeviceptr(self.dev.data_ptr())
        left = pace.nbytes
        while left > 0:
            n = min(left, self.chunk)
            if pace.direction == H2D:
                _check(cu.cuMemcpyHtoDAsync(dev, host, n, s), "cuMemcpyHtoDAsync")
            else:
                _check(cu.cuMemcpyDtoHAsync(host, dev, n, s), "cuMemcpyDtoHAsync")
            left -= n


def _median_copy_us(fn, stream: torch.cuda.Stream, iters: int = 10, repeats: int = 5) -> float:
    """Median time of one ``fn()`` among ``iters`` back to back on ``stream`` (what a copy adds to a
    busy stream: latency included, the host's launch time not)."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(iters):
                fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _fit_measured(sizes: tuple, copy, stream: torch.cuda.Stream, attempts: int = 3) -> Line:
    """The line through ``copy(n)``'s median times at ``sizes``, measured again (up to ``attempts``
    times) where the times do not grow with size: other work on the GPU (another test process, a
    benchmark) can stretch one size's median; a line that never fits raises."""
    for attempt in range(1, attempts + 1):
        times = [_median_copy_us(lambda n=n: copy(n), stream) for n in sizes]
        try:
            return fit_line(list(sizes), times)
        except ValueError:
            if attempt == attempts:
                raise
            log.info("pacing calibration: times %s do not grow with size; measuring again", times)


def calibrate(pacer: Pacer, local_sizes: tuple = (1 << 20, 8 << 20, 32 << 20),
              pcie_sizes: tuple = (64 << 10, 1 << 20, 4 << 20)) -> Calibration:
    """Measure the three copy lines on ``pacer``'s device (well under a second)."""
    if max(pcie_sizes) > pacer.chunk:
        raise ValueError(f"calibration sizes up to {max(pcie_sizes)} B need a pacer chunk that large")
    stream = torch.cuda.Stream(pacer.device)
    src = torch.empty(max(local_sizes), dtype=torch.uint8, device=pacer.device).fill_(1)
    dst = torch.empty_like(src)
    d2d = _fit_measured(local_sizes, lambda n: dst[:n].copy_(src[:n]), stream)
    lines = {direction: _fit_measured(pcie_sizes, lambda n, d=direction: pacer.enqueue(Pace(d, n, 0.0), stream),
                                      stream)
             for direction in (H2D, D2H)}
    cal = Calibration(d2d=d2d, h2d=lines[H2D], d2h=lines[D2H])
    log.info("pacing calibration on %s: %s", torch.cuda.get_device_name(pacer.device), cal.describe())
    return cal
