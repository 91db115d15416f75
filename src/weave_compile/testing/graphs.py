"""CUDA-graph capture for GPU tests: one way to capture, so every test replays what it meant to."""

from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn()`` captured in a CUDA graph on a side stream that starts after, and is joined back
    into, the current stream (capture never runs on the legacy default stream); returns the graph
    and what ``fn`` returned (its outputs are the graph's static outputs). Warm ``fn`` up first:
    a first call that compiles or allocates belongs outside the capture."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(g, stream=side):
        out = fn()
    torch.cuda.current_stream().wait_stream(side)
    return g, out
