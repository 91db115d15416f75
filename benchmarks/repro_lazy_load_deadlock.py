"""Reproducer: CUDA lazy module loading deadlocks a one-process emulation of stream wait-values.

    CUDA_DEVICE_MAX_CONNECTIONS=32 python benchmarks/repro_lazy_load_deadlock.py

The steps of ``tests/kernels/test_copy_engine_gpu.py::test_stream_memops_cross_stream_in_graph``,
each printed and flushed; faulthandler's C watchdog dumps every thread's stack after 40 s without
needing the GIL.  On one H200 (torch 2.11.0+cu130, 2026-12-01, session 5) step 1 passes and step 2
blocks the HOST in the first launch of ``torch.cuda._sleep``: a wait-value is already enqueued on
stream b, and the kernel's lazy load synchronizes the context, i.e. waits for b, which waits for
the flag that very launch was to produce.  With every kernel loaded first (what the test and
``weave_compile.kernels.copy_engine.preload`` now do) the same sequence completes.
"""
import faulthandler, os, sys, time
faulthandler.dump_traceback_later(40, exit=True)
def say(*a):
    print(f"[{time.monotonic() - T0:7.3f}]", *a, flush=True)
T0 = time.monotonic()
say("CUDA_DEVICE_MAX_CONNECTIONS", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
import torch
say("torch", torch.__version__)
from weave_compile.kernels import copy_engine as ce
say("unavailable:", ce.unavailable_reason())
cu = ce._driver()
import cuda.bindings
say("cuda.bindings", getattr(cuda.bindings, "__version__", "?"))
dev = torch.device("cuda")
flag = torch.zeros(1, dtype=torch.int32, device=dev)
torch.cuda.synchronize()
say("flag allocated", hex(flag.data_ptr()))
err, can = cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR, 0)
say("wait NOR attr", err, can)
a, b = torch.cuda.Stream(), torch.cuda.Stream()
say("streams", hex(a.cuda_stream), hex(b.cuda_stream))

def wait_ev(what, deadline=8.0):
    ev = torch.cuda.Event(); ev.record(); t = time.monotonic()
    while not ev.query():
        if time.monotonic() - t > deadline:
            say("TIMEOUT waiting for", what); return False
        time.sleep(0.001)
    say("done:", what); return True

# 1. writer first, then waiter: the simplest order
ce.stream_write(a, flag.data_ptr(), 1); say("write enqueued on a")
ce.stream_wait(b, flag.data_ptr(), 1); say("wait enqueued on b")
torch.cuda.current_stream().wait_stream(a); torch.cuda.current_stream().wait_stream(b)
wait_ev("step 1 (write then wait)")
say("flag", flag.item())
flag.zero_(); torch.cuda.synchronize()
# 2. waiter first (the test's order), writer after a sleep
main = torch.cuda.current_stream()
a.wait_stream(main); b.wait_stream(main)
ce.stream_wait(b, flag.data_ptr(), 1); say("wait enqueued on b")
ce.stream_write(b, flag.data_ptr(), 0); say("reset enqueued on b")
with torch.cuda.stream(a):
    torch.cuda._sleep(2_000_000)
say("sleep enqueued on a")
ce.stream_write(a, flag.data_ptr(), 1); say("write enqueued on a")
main.wait_stream(a); main.wait_stream(b)
ok = wait_ev("step 2 (wait first)")
if ok:
    say("flag", flag.item())
# 3. capture
g = torch.cuda.CUDAGraph()
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    say("capture begin")
    g.capture_begin()
    m = torch.cuda.current_stream()
    a.wait_stream(m); b.wait_stream(m)
    ce.stream_wait(b, flag.data_ptr(), 1); say("captured wait")
    ce.stream_write(b, flag.data_ptr(), 0); say("captured reset")
    ce.stream_write(a, flag.data_ptr(), 1); say("captured write")
    m.wait_stream(a); m.wait_stream(b)
    g.capture_end()
    say("capture end")
torch.cuda.current_stream().wait_stream(side)
for i in range(3):
    g.replay(); say("replay", i)
    if not wait_ev(f"replay {i}"):
        break
    say("flag", flag.item())
say("ALL DONE")
faulthandler.cancel_dump_traceback_later()
