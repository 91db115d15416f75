"""What every benchmark script shares: multicast kept off, run metadata, CUDA-graph timing, CSV.

Import it first (``sys.path`` holds this folder when a script runs from it)::

    from common import Timer, meta, write_csv   # sets the no-multicast variables on import

* The commit comes from ``WEAVE_COMMIT`` when set (the device machine's copy of the tree has no
  ``.git``), else ``git rev-parse --short HEAD`` (+ ``-dirty``), else ``unknown``.
* :class:`Timer` times CUDA-graph replays of ``iters`` back-to-back calls (GPU time without host
  launch overhead, as serving engines run it), median over repeats, max over ranks when a process
  group is up.
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess
import sys

# No benchmark needs NVLink multicast, and running it can take shared GPUs out of service:
# keep torch, NCCL and NVSHMEM from creating it, before torch is imported by the caller.
for _var in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
    os.environ[_var] = "0" if _var == "NCCL_NVLS_ENABLE" else "1"

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# The Hugging Face model zoo lives beside the example that builds its models (examples/hf_models.py).
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "examples"))


def commit() -> str:
    if os.environ.get("WEAVE_COMMIT"):
        return os.environ["WEAVE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "none"


def meta(device=None) -> dict:
    """``gpu, torch, triton, git_commit, date`` for a CSV row."""
    gpu = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton_version(), git_commit=commit(),
                date=datetime.date.today().isoformat())


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class Timer:
    """Median per-call time in microseconds of ``fn`` over ``repeats`` timings of ``iters`` calls.

    ``graph=True`` captures the ``iters`` calls in one CUDA graph and times its replays; ``False``
    times eager launches (host overhead included). With a process group every repeat starts
    after a barrier and the result is the max over ranks."""

    def __init__(self, repeats: int = 5, warmup: int = 3, graph: bool = True):
        self.repeats, self.warmup, self.graph = repeats, warmup, graph

    def __call__(self, fn, iters: int) -> float:
        dist = _dist()
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        run = lambda: [fn() for _ in range(iters)]  # noqa: E731
        if self.graph:
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            if dist:
                dist.barrier()
            with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
                run()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            run = g.replay
        per_call = []
        for _ in range(self.repeats):
            if dist:
                dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) * 1e3 / iters)
        us = statistics.median(per_call)
        if dist:
            t = torch.tensor([us], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            us = float(t.item())
        return us


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (with a line saying why) where matplotlib
    is missing: a benchmark still writes its CSV."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"# matplotlib unavailable ({e}); no plot")
        return None
    return plt


def write_csv(path: str, rows: list[dict], columns: list[str]) -> None:
    """Write ``rows`` (every column present) to ``path``, replacing it; call after every point so
    a run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
