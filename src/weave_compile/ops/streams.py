"""The communication stream of the split schedule, one per device, and its per-op joins.

The token-split schedule runs each half's fused AllReduce-RMSNorm on this stream while the
other half's GEMMs run on the current stream. It is created with the highest priority so that
its few thread blocks are scheduled as soon as SMs free up, not after a GEMM's whole wave.
Streams are switched only inside the opaque ``weave::allreduce_add_rmsnorm_start`` /
``weave::comm_wait`` ops, never inside Inductor-generated code.

A wait must join *its* start only: by the time A's wait runs, B's next communication is often
already enqueued behind it on the same stream, and waiting for the whole stream would
serialize the schedule again. So each start records an event after its kernels, keyed by its
result's address (alive until the wait, which takes the result), and the wait waits for that
event. Events recorded and waited on inside CUDA-graph capture become the graph's fork/join
edges.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}
_pending: dict[int, torch.cuda.Event] = {}  # result data_ptr -> event after its start's kernels


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    with _lock:
        s = _streams.get(index)
        if s is None:
            _, greatest = torch.cuda.Stream.priority_range()
            s = _streams[index] = torch.cuda.Stream(device=index, priority=greatest)
        return s


def fork(device: torch.device) -> torch.cuda.Stream:
    """The comm stream, after it waits for all work enqueued so far on the current stream."""
    s = comm_stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    return s


def mark_done(result: torch.Tensor) -> None:
    """Record, on the comm stream, the point after the kernels that produce ``result``."""
    ev = torch.cuda.Event()
    ev.record(comm_stream(result.device))
    with _lock:
        _pending[result.data_ptr()] = ev


def join(result: torch.Tensor) -> None:
    """The current stream waits for the kernels that produce ``result`` (see :func:`mark_done`)."""
    with _lock:
        ev = _pending.pop(result.data_ptr(), None)
    current = torch.cuda.current_stream(result.device)
    if ev is None:  # not expected; waiting for the whole stream is correct, only slower
        log.warning("tokenweave: no pending communication for this result; joining the whole comm stream")
        current.wait_stream(comm_stream(result.device))
    else:
        current.wait_event(ev)
