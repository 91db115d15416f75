"""The two-stream schedule: start/wait pairs in TokenWeave's interleaved order."""

import torch

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from .helpers import graph_after_passes


def _schedule(rank, world_size, seed):
    from weave_compile.ops import START_OP, WAIT_OP

    graph = graph_after_passes(rank, world_size, seed, layers=2)
    events, pos = [], {}
    for i, n in enumerate(graph.nodes):
        pos[n] = i
        if n.target in (START_OP, WAIT_OP):
            events.append(("start" if n.target is START_OP else "wait", n.meta["weave_half"]))
    # Every GEMM of a half runs inside the other half's communication window.
    windows = {0: [], 1: []}  # half -> [(start index, wait index)]
    for n in graph.nodes:
        if n.target is WAIT_OP:
            start = n.args[0].args[0]
            windows[n.meta["weave_half"]].append((pos[start], pos[n]))
    uncovered = []
    for n in graph.nodes:
        if n.target is torch.ops.aten.mm.default:
            h = n.meta["weave_half"]
            if not any(a < pos[n] < b for a, b in windows[1 - h]):
                uncovered.append((n.name, h))
    return events, uncovered


def test_schedule_is_tokenweaves_interleaving(seed):
    for events, uncovered in assert_ranks_ok(run_ranks(_schedule, 2, args=(seed,), timeout=300)):
        # 5 sites (embedding, 2 per layer): start A_k, (wait B_k-1), start B_k, wait A_k, ..., wait B_4.
        want = []
        for k in range(5):
            want += [("start", 0)] + ([("wait", 1)] if k else []) + [("start", 1), ("wait", 0)]
        want.append(("wait", 1))
        assert events == want, events
        assert not uncovered, uncovered  # no GEMM runs while its partner half has no comm in flight
