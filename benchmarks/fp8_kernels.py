"""Which kernels one call of each ``bench_fp8.py`` variant runs on ONE GPU, and for how long.

    python benchmarks/fp8_kernels.py

The three variants of :func:`bench_fp8.runners` (``inductor``, ``op_then_quant``, ``epilogue``) on
PyTorch's fake process group of 8 ranks (collectives written: :mod:`fake_group`), at H=4096 and
8192 with T=1024 and at H=4096 with T=4096: ten calls captured in one CUDA graph, one replay
profiled (CUDA activity only: CUPTI reports the kernels inside a graph one by one). Prints per
variant the kernels per call, the span from the first kernel's start to the last one's end and
the summed kernel time per call, then each kernel's count and mean time. A diagnostic for
``bench_fp8.py``'s ratios (which kernel a variant's time goes to), not a target: it writes no
CSV.
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import common  # noqa: F401,E402  (keeps NVLink multicast off)
import bench_fp8  # noqa: E402
import fake_group  # noqa: E402
import weave_compile.ops  # noqa: F401,E402  (the op)
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> None:
    for world, dev, group_name in fake_group.each_world([8]):
        for H, T in ((4096, 1024), (8192, 1024), (4096, 4096)):
            run, _ = bench_fp8.runners(T, H, world, group_name, dev)
            for name, fn in run.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
                    for _ in range(10):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                g.replay()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as p:
                    g.replay()
                    torch.cuda.synchronize()
                ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                ev.sort(key=lambda e: e.time_range.start)
                span = (ev[-1].time_range.end - ev[0].time_range.start) / 10 if ev else 0
                busy = sum(e.time_range.end - e.time_range.start for e in ev) / 10
                print(f"H={H} T={T} {name}: {len(ev)/10:.1f} kernels/call, span {span:.2f} us/call, "
                      f"busy {busy:.2f} us/call")
                per = {}
                for e in ev:
                    per.setdefault(e.name[:90], []).append(e.time_range.end - e.time_range.start)
                for k, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
                    print(f"    {len(v)/10:4.1f}x {sum(v)/len(v):7.2f} us  {k}")


if __name__ == "__main__":
    main()
