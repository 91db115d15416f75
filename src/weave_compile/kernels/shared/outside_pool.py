"""Allocate long-lived device buffers outside cudagraph trees' memory pool.

Under ``mode="reduce-overhead"`` cudagraph trees run a graph's warm-up with every allocation *of the
calling thread* routed into the CUDA-graph pool (``torch._C._cuda_beginAllocateCurrentThreadToPool``),
and before recording they check that every live block of the pool is a tracked graph output. A
workspace that a fused op creates or grows lazily during a warm-up (a symbolic token count larger
than the one reserved at compile time) is such a block: it outlives the warm-up in a module-level
cache, and the check fails with "N tensor(s) in the cudagraph pool not tracked as outputs" (see
docs/performance.md, "Pool check"). Running the allocation on a helper thread puts it in the
ordinary caching-allocator pool, which is where a cache that outlives every graph belongs.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def run_outside_graph_pool(fn: Callable[[], T], device: torch.device) -> T:
    """``fn()`` on a helper thread (current device set, same grad/inference modes off), joined.

    The caller blocks, so collectives inside ``fn`` (rendezvous, barriers) run in the same order
    on every rank. Exceptions propagate. Must not be called while capturing a CUDA graph.
    """
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("run_outside_graph_pool called during CUDA graph capture")
    result: list = []
    error: list = []
    index = device.index if device.index is not None else torch.cuda.current_device()

    def work() -> None:
        try:
            torch.cuda.set_device(index)
            with torch.inference_mode(False), torch.no_grad():
                result.append(fn())
            torch.cuda.synchronize(index)  # the buffers are ready before the caller's stream uses them
        except BaseException as e:  # re-raised in the caller
            error.append(e)

    t = threading.Thread(target=work, name="weave-outside-graph-pool")
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0]
