"""The communication stream of the split schedule, one per device.

The token-split schedule runs each half's fused AllReduce-RMSNorm on this stream while the
other half's GEMMs run on the current stream. It is created with the highest priority so that
its few thread blocks are scheduled as soon as SMs free up, not after the GEMM's whole wave.
Streams are switched only inside the opaque ``weave::allreduce_add_rmsnorm_start`` /
``weave::comm_wait`` ops, never inside Inductor-generated code.
"""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    with _lock:
        s = _streams.get(index)
        if s is None:
            low, high = torch.cuda.Stream.priority_range()
            s = _streams[index] = torch.cuda.Stream(device=index, priority=high)
        return s


def fork(device: torch.device) -> torch.cuda.Stream:
    """The comm stream, after it waits for all work enqueued so far on the current stream."""
    s = comm_stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    return s


def join(device: torch.device) -> None:
    """The current stream waits for all work enqueued so far on the comm stream."""
    torch.cuda.current_stream(device).wait_stream(comm_stream(device))
