"""Where one forward's GPU time goes, from a torch.profiler trace: busy, idle and per kind of kernel.

    from kernel_timeline import profile_once
    row = profile_once(lambda: compiled(x))     # one call, CUDA activity only

A split layer is slower than the unsplit one for two different reasons that a wall-clock ratio
cannot tell apart: its compute kernels take longer (the halves' GEMMs, attention, communication
kernels beside them) or its compute streams wait (communication the other half did not cover).
:func:`summarize` separates them. From the trace's kernel and copy events it reports:

* ``wall_us``: first GPU activity to last;
* ``busy_us``: the union of every kernel that is not communication (what the compute streams do);
  ``idle_us = wall_us - busy_us``: time when no compute kernel ran, the exposed communication;
* ``<kind>_us`` and ``<kind>_n``: summed durations and counts by kind, from the kernel's name
  (:data:`KINDS`, first match wins): ``attention``, ``gemm``, ``comm`` (the fused op's kernels),
  ``other`` kernels, and ``memcpy`` (copy-engine copies and sets, no SM).

Kernels inside CUDA graph replays are reported one by one by CUPTI, so this works under
``mode="reduce-overhead"``.
"""

from __future__ import annotations

import json
import os
import tempfile

# First match wins: cuDNN's attention kernels contain "sm90" as GEMMs do.
KINDS = (
    ("attention", ("fmha", "flash", "sdpa", "attention", "_combine_kernel")),  # + the suffix's merge
    ("comm", ("add_rmsnorm_rows", "allreduce_rmsnorm", "nccl")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_")),
)
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")
COLUMNS = ["wall_us", "busy_us", "idle_us"] + [f"{k}_{s}" for k in ("gemm", "attention", "comm", "other", "memcpy")
                                               for s in ("us", "n")]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(events: list[dict]) -> dict:
    """The row described in the module docstring, from Chrome-trace events (``cat``, ``name``,
    ``ts`` and ``dur`` in microseconds); events that are neither kernels nor copies are ignored."""
    row = {f"{k}_{s}": 0 for k in ("gemm", "attention", "comm", "other", "memcpy") for s in ("us", "n")}
    spans, compute = [], []
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel",) + COPY_CATEGORIES:
            continue
        a, d = float(e["ts"]), float(e.get("dur", 0.0))
        kind = "memcpy" if cat in COPY_CATEGORIES else kind_of(e.get("name", ""))
        row[f"{kind}_us"] += d
        row[f"{kind}_n"] += 1
        spans.append((a, a + d))
        if kind not in ("comm", "memcpy"):
            compute.append((a, a + d))
    if not spans:
        raise ValueError("the trace holds no GPU kernel or copy: was CUDA activity recorded?")
    wall = max(b for _, b in spans) - min(a for a, _ in spans)
    busy = _union(compute)
    row.update(wall_us=wall, busy_us=busy, idle_us=wall - busy)
    return {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}


def by_name(events: list[dict], top: int = 10) -> list[tuple[str, str, float, int]]:
    """The ``top`` kernels and copies by summed duration: (kind, name, microseconds, count)."""
    sums: dict[str, list] = {}
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel",) + COPY_CATEGORIES:
            continue
        name = e.get("name", "")
        kind = "memcpy" if cat in COPY_CATEGORIES else kind_of(name)
        entry = sums.setdefault(name, [kind, 0.0, 0])
        entry[1] += float(e.get("dur", 0.0))
        entry[2] += 1
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][1])[:top]
    return [(kind, name, round(us, 1), n) for name, (kind, us, n) in ranked]


def profile_once(fn, top: int = 0) -> dict:
    """Run ``fn()`` once under torch.profiler (CUDA activity) and :func:`summarize` its trace;
    with ``top``, the row's ``"top"`` holds :func:`by_name`'s list (not a CSV column)."""
    import torch

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    row = summarize(events)
    if top:
        row["top"] = by_name(events, top)
    return row
