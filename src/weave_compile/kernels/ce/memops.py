"""Driver calls of the ``ce`` design: stream memory operations, copies, host-mapped words, rescue streams.

cuda-python is an optional dependency (the ``ce`` extra, ``pip install 'weave_compile[ce]'``): its
``cuda.bindings.driver`` module gives ``cuStreamWriteValue32`` / ``cuStreamWaitValue32``, which
PyTorch does not expose. :func:`unavailable_reason` says why ``ce`` cannot run in this process.

Nothing here launches a kernel, so nothing here loads a module: every call is safe while another
stream of the context is blocked in a wait-value (a first-time module load may synchronize the
context, see :mod:`.copy_engine`). The watchdog's rescue path (:mod:`.watchdog`) is built from
these calls only for that reason.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any, Optional, Union

import torch

from ..shared.common import HAS_TRITON

#: Default and largest number of hardware work queues per device (``CUDA_DEVICE_MAX_CONNECTIONS``).
_DEFAULT_CONNECTIONS, _MAX_CONNECTIONS = 8, 32


@functools.lru_cache(maxsize=1)
def driver():
    """cuda-python's driver bindings (ImportError when the ``ce`` extra is not installed)."""
    from cuda.bindings import driver as cu

    return cu


def unavailable_reason() -> Optional[str]:
    """Why the copy-engine design cannot run in this process (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not HAS_TRITON:
        return "triton is not installed (the add+norm kernel is a Triton kernel)"
    try:
        driver()
    except Exception as e:
        return ("cuda-python is not installed: ce signals between ranks with stream memory operations "
                "(cuStreamWriteValue32 / cuStreamWaitValue32 from cuda.bindings.driver), which torch does not "
                f"expose; install it with pip install 'weave_compile[ce]' ({type(e).__name__}: {e})")
    return None


def check(result, what: str) -> Any:
    """The value of a driver call's ``(CUresult, value...)`` result; RuntimeError naming the call."""
    err = result[0] if isinstance(result, tuple) else result
    cu = driver()
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    if isinstance(result, tuple) and len(result) > 1:
        return result[1] if len(result) == 2 else result[1:]
    return None


Stream = Union[torch.cuda.Stream, int, Any]


def _handle(stream: Stream):
    cu = driver()
    if isinstance(stream, torch.cuda.Stream):
        return cu.CUstream(stream.cuda_stream)
    if isinstance(stream, int):
        return cu.CUstream(stream)
    return stream  # a CUstream already


def write(stream: Stream, ptr: int, value: int, *, fence: bool = True) -> None:
    """Enqueue ``*ptr = value`` (32 bit) on ``stream``; no SM. With ``fence`` (the default) the
    write is preceded by a memory fence: whoever sees the value sees every write stream-ordered
    before it. Without, nothing is ordered by it (the watchdog's progress marks)."""
    cu = driver()
    flags = cu.CUstreamWriteValue_flags
    check(cu.cuStreamWriteValue32(_handle(stream), cu.CUdeviceptr(ptr), value,
                                  flags.CU_STREAM_WRITE_VALUE_DEFAULT if fence
                                  else flags.CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER),
          "cuStreamWriteValue32")


def wait(stream: Stream, ptr: int, value: int) -> None:
    """Make ``stream`` wait until ``*ptr >= value`` (32 bit, unsigned compare); no SM."""
    cu = driver()
    check(cu.cuStreamWaitValue32(_handle(stream), cu.CUdeviceptr(ptr), value,
                                 cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
          "cuStreamWaitValue32")


def copy(stream: Stream, dst: int, src: int, nbytes: int) -> None:
    """Enqueue a copy of ``nbytes`` between two device (or peer-mapped) addresses; a copy engine."""
    cu = driver()
    check(cu.cuMemcpyAsync(cu.CUdeviceptr(dst), cu.CUdeviceptr(src), nbytes, _handle(stream)), "cuMemcpyAsync")


def connections() -> int:
    """Hardware work queues per device: streams beyond it share one (in creation order), and a
    stream blocked in a wait-value blocks every stream that shares its queue."""
    try:
        n = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", _DEFAULT_CONNECTIONS))
    except ValueError:
        n = _DEFAULT_CONNECTIONS
    return max(1, min(_MAX_CONNECTIONS, n))


def primary_context(device: torch.device):
    """``device``'s primary context (retained): what a thread of our own makes current
    (:func:`make_current`) before driver calls; torch's device guard would not bind it where the
    thread's current device already reads as that index."""
    cu = driver()
    return check(cu.cuDevicePrimaryCtxRetain(cu.CUdevice(device.index or 0)), "cuDevicePrimaryCtxRetain")


def make_current(ctx) -> None:
    check(driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def wait_event(stream: Stream, event: torch.cuda.Event) -> None:
    """Make ``stream`` wait for ``event`` (recorded on a torch stream); no host sync."""
    cu = driver()
    check(cu.cuStreamWaitEvent(_handle(stream), cu.CUevent(event.cuda_event), 0), "cuStreamWaitEvent")


def new_streams(device: torch.device, count: int) -> list:
    """``count`` new non-blocking streams of ``device``'s primary context at the greatest priority,
    created back to back (so, queues being handed out in turn, they cover ``count`` queues)."""
    cu = driver()
    with torch.cuda.device(device):
        torch.cuda.current_stream()  # the primary context is current on this thread
        _, greatest = check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        return [check(cu.cuStreamCreateWithPriority(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), greatest),
                      "cuStreamCreateWithPriority") for _ in range(count)]


class HostWords:
    """``n`` int32 words of page-locked host memory that the device writes (stream write-values)
    and the host reads with plain loads: a view that no stream, and so no blocked stream, delays.
    On CPU (the simulation) an ordinary tensor.

    Whether a stream write-value may target host memory depends on the platform (one H200 in a
    VM answered ``CUDA_ERROR_INVALID_VALUE`` for ``cuMemHostAlloc`` memory), so the words are
    probed when made: memory from ``cuMemHostAlloc``, then ordinary memory pinned with
    ``cuMemHostRegister``, each written once from a stream and read back; the first that works is
    kept, and where none does the constructor raises (the caller then leaves the waits unbounded,
    with the reason logged)."""

    def __init__(self, n: int, device: torch.device):
        self._host = None
        if device.type != "cuda":
            self.tensor = torch.zeros(n, dtype=torch.int32)
            self.device_ptr = self.tensor.data_ptr()
            return
        failures = []
        with torch.cuda.device(device):
            torch.cuda.current_stream()  # the primary context is current on this thread
            for make in (self._allocated, self._registered):
                try:
                    host, self.device_ptr, self._keep = make(n)
                    self._host = (ctypes.c_int32 * n).from_address(host)
                    self._probe(device)
                    break
                except RuntimeError as e:
                    failures.append(f"{make.__name__.strip('_')}: {e}")
                    self._host = None
            else:
                raise RuntimeError("no host-mapped word the device can write with a stream write-value ("
                                   + "; ".join(failures) + ")")
        self.tensor = torch.frombuffer(self._host, dtype=torch.int32)
        self.tensor.zero_()

    @staticmethod
    def _allocated(n: int):
        cu = driver()
        # cuda.h: CU_MEMHOSTALLOC_PORTABLE 0x01, CU_MEMHOSTALLOC_DEVICEMAP 0x02
        flags = getattr(cu, "CU_MEMHOSTALLOC_PORTABLE", 0x01) | getattr(cu, "CU_MEMHOSTALLOC_DEVICEMAP", 0x02)
        host = int(check(cu.cuMemHostAlloc(4 * n, flags), "cuMemHostAlloc"))
        return host, int(check(cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer")), None

    @staticmethod
    def _registered(n: int):
        cu = driver()
        page = 4096
        buf = (ctypes.c_char * (2 * page + 4 * n))()  # kept alive by the object
        host = (ctypes.addressof(buf) + page - 1) // page * page
        # cuda.h: CU_MEMHOSTREGISTER_PORTABLE 0x01, CU_MEMHOSTREGISTER_DEVICEMAP 0x02
        check(cu.cuMemHostRegister(host, page, 0x01 | 0x02), "cuMemHostRegister")
        return host, int(check(cu.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer")), buf

    def _probe(self, device: torch.device) -> None:
        self._host[0] = 0
        s = torch.cuda.Stream(device)
        write(s, self.device_ptr, 0x5A5A, fence=False)
        s.synchronize()
        if self._host[0] != 0x5A5A:
            raise RuntimeError(f"a stream write-value did not reach the host word (read {self._host[0]})")

    def read(self, i: int = 0) -> int:
        return int(self.tensor[i])
