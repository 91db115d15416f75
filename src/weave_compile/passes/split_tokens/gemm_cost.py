"""Time of the layer's own GEMMs at candidate row counts: measured with cuBLAS, cached on disk.

The split chooser (:mod:`.smart_split`) needs, for every token-wise GEMM of the
graph (``[M, K] @ [K, N]``, the weight stored ``[N, K]`` as ``nn.Linear`` keeps it), its time at
the row counts ``M`` a split could give each half. A tile formula does not describe the kernels
cuBLAS picks per ``M`` (its split point measured off the best one: docs/performance.md, "Its
GEMM cost, and the split point"), so on a GPU
the curve is measured, at compile time, with the call Inductor makes for these shapes (``mm(x, w.t())``,
cuBLAS), and kept on disk:

* **Key.** One JSON file per (device name, torch version, cuBLAS version and preferred BLAS
  library, N, K, dtype), under ``$WEAVE_COMPILE_CACHE_DIR`` if set, else Inductor's cache dir
  (``gemm_cost/``). It holds the measured points ``{M: us}``; a later compile measures only the
  row counts it lacks and adds them. A cache hit measures nothing.
* **Writes** go to a temporary file in the same folder, then ``os.replace`` (atomic: a reader
  sees the old file or the new one). A file that does not parse, or whose key does not match,
  is logged and recomputed: the cache can make a compile slower, never fail.
* **Timing.** Per row count: one warm-up call (cuBLAS's heuristics, first-call costs), then the
  minimum of ``repeats`` timed calls by CUDA events; every call is enqueued behind a short
  device-side sleep so the GPU never waits for the host between calls. The minimum, because the
  curve is a cost model for ranking split points, not a latency claim: the least disturbed run
  ranks best.
* **Off-GPU** (CPU tests) and with ``split_cost="formula"``, :func:`formula_us` stands in: the
  SM-count wave formula (128x128 tiles, every wave costs a full tile's FLOPs at a nominal
  throughput).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from typing import Iterable, Optional

import torch

log = logging.getLogger(__name__)

#: Nominal dense bf16 throughput of one H100/H200 SM behind the wave formula (a nominal 700 TFLOP/s
#: over 132 SMs). Only the formula uses it; measured curves replace it on a GPU.
FORMULA_FLOPS_PER_SM = 700e12 / 132


@dataclasses.dataclass(frozen=True)
class GemmKey:
    """What a measured curve depends on."""

    device: str
    torch: str
    blas: str
    n: int
    k: int
    dtype: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:24]


@dataclasses.dataclass
class Curve:
    """Time in microseconds of one GEMM shape at row counts ``M``.

    ``source``: ``measured`` (timed in this compile), ``cached`` (every point read from disk),
    or ``formula`` (the SM wave formula)."""

    n: int
    k: int
    points: dict[int, float]
    source: str

    def at(self, m: int) -> float:
        if m <= 0:
            return 0.0
        if m in self.points:
            return self.points[m]
        # Between grid points (the chooser asks for grid points; this is for explain/what-if).
        ms = sorted(self.points)
        lo = max((x for x in ms if x < m), default=None)
        hi = min((x for x in ms if x > m), default=None)
        if lo is None:
            return self.points[hi] * m / hi
        if hi is None:
            return self.points[lo] * m / lo
        w = (m - lo) / (hi - lo)
        return self.points[lo] * (1 - w) + self.points[hi] * w


def formula_us(m: int, n: int, k: int, num_sms: int, tile_m: int = 128, tile_n: int = 128) -> float:
    """The SM-count formula: waves of ``tile_m x tile_n`` output tiles, each wave a full tile's
    ``2 * tile_m * tile_n * K`` FLOPs on one SM at :data:`FORMULA_FLOPS_PER_SM`."""
    if m <= 0:
        return 0.0
    waves = math.ceil(math.ceil(m / tile_m) * math.ceil(n / tile_n) / num_sms)
    return waves * 2.0 * tile_m * tile_n * k / FORMULA_FLOPS_PER_SM * 1e6


def formula_curve(n: int, k: int, rows: Iterable[int], num_sms: int) -> Curve:
    return Curve(n, k, {m: formula_us(m, n, k, num_sms) for m in rows}, "formula")


# ----------------------------------------------------------------------------- the disk cache


def cache_dir() -> str:
    if os.environ.get("WEAVE_COMPILE_CACHE_DIR"):
        return os.path.join(os.environ["WEAVE_COMPILE_CACHE_DIR"], "gemm_cost")
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
    except ImportError:  # torch < 2.5 kept it elsewhere
        try:
            from torch._inductor.runtime.runtime_utils import cache_dir as inductor_cache_dir
        except ImportError:
            return os.path.join(os.path.expanduser("~"), ".cache", "weave_compile", "gemm_cost")
    return os.path.join(inductor_cache_dir(), "weave_compile", "gemm_cost")


def _path(key: GemmKey, folder: Optional[str] = None) -> str:
    return os.path.join(folder or cache_dir(), f"{key.digest()}.json")


def load(key: GemmKey, folder: Optional[str] = None) -> dict[int, float]:
    """The cached points of ``key``; ``{}`` when there are none or the file is unusable."""
    path = _path(key, folder)
    try:
        with open(path) as f:
            payload = json.load(f)
        if payload.get("key") != dataclasses.asdict(key):
            raise ValueError("key mismatch")
        points = {int(m): float(us) for m, us in payload["points"].items()}
        if any(not (us > 0 and math.isfinite(us)) or m <= 0 for m, us in points.items()):
            raise ValueError("non-positive or non-finite point")
        return points
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:  # corrupt: recompute
        log.warning("tokenweave: GEMM cost cache %s unusable (%s); measuring again", path, e)
        return {}


def store(key: GemmKey, points: dict[int, float], folder: Optional[str] = None) -> None:
    """Write ``points`` for ``key`` atomically; a failure is logged, never raised."""
    path = _path(key, folder)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        payload = {"key": dataclasses.asdict(key), "points": {str(m): us for m, us in sorted(points.items())}}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("tokenweave: could not write the GEMM cost cache %s: %s", path, e)


# ----------------------------------------------------------------------------- measuring


def blas_version() -> str:
    """cuBLAS's version as far as it can be named, and the BLAS library torch prefers."""
    version = f"cuda{torch.version.cuda}"
    try:
        import importlib.metadata as md

        for dist in ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12"):
            try:
                version = f"cublas{md.version(dist)}"
                break
            except md.PackageNotFoundError:
                continue
    except ImportError:
        pass
    try:
        preferred = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    except Exception:  # older torch
        preferred = "default"
    return f"{version}/{preferred}"


def key_for(n: int, k: int, dtype: torch.dtype, device: torch.device) -> GemmKey:
    return GemmKey(device=torch.cuda.get_device_name(device), torch=torch.__version__, blas=blas_version(),
                   n=int(n), k=int(k), dtype=str(dtype).replace("torch.", ""))


def _time_rows(n: int, k: int, rows: list[int], dtype: torch.dtype, device: torch.device,
               repeats: int) -> dict[int, float]:
    """Minimum over ``repeats`` of one ``mm(x[:m], w.t())`` per row count, in microseconds."""
    with torch.cuda.device(device):
        return _time_rows_here(n, k, rows, dtype, device, repeats)


def _time_rows_here(n: int, k: int, rows: list[int], dtype: torch.dtype, device: torch.device,
                    repeats: int) -> dict[int, float]:
    top = max(rows)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(top, k, device=device, dtype=dtype, generator=gen)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=gen)
    out = torch.empty(top, n, device=device, dtype=dtype)
    wt = w.t()
    stream = torch.cuda.current_stream(device)
    for m in rows:  # warm-up: cuBLAS's heuristic and workspace for every M
        torch.mm(x[:m], wt, out=out[:m])
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(repeats)] for _ in rows]
    torch.cuda._sleep(1_000_000)  # ~1 ms head start: the queue stays ahead of the GPU
    for r in range(repeats):
        for m, evs in zip(rows, events):
            start, end = evs[r]
            start.record(stream)
            torch.mm(x[:m], wt, out=out[:m])
            end.record(stream)
    torch.cuda.synchronize(device)
    return {m: min(s.elapsed_time(e) for s, e in evs) * 1e3 for m, evs in zip(rows, events)}


def measured_curves(shapes: Iterable[tuple[int, int]], rows: Iterable[int], dtype: torch.dtype,
                    device: torch.device, repeats: int = 2, folder: Optional[str] = None
                    ) -> tuple[dict[tuple[int, int], Curve], float]:
    """Curves of every ``(N, K)`` at every row count in ``rows``; the seconds spent measuring.

    Points on disk are reused; the missing ones are timed and written back."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    rows = sorted({int(m) for m in rows if m > 0})
    curves: dict[tuple[int, int], Curve] = {}
    spent = 0.0
    for n, k in dict.fromkeys((int(n), int(k)) for n, k in shapes):
        key = key_for(n, k, dtype, device)
        points = load(key, folder)
        missing = [m for m in rows if m not in points]
        source = "cached"
        if missing:
            t0 = time.perf_counter()
            # The post-grad pass may run under Inductor's fake mode: these tensors must be real.
            with unset_fake_temporarily(), torch.no_grad():
                points.update(_time_rows(n, k, missing, dtype, device, repeats))
            spent += time.perf_counter() - t0
            store(key, points, folder)
            source = "measured"
        curves[(n, k)] = Curve(n, k, {m: points[m] for m in rows}, source)
    return curves, spent
