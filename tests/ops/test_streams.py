"""The comm stream's bookkeeping, on CPU with stand-ins for CUDA streams and events.

What a GPU run shows (overlap) is in benchmarks; here: one high-priority stream per device,
``fork`` orders it after the current stream, and each ``join`` waits for *its* start only.
"""

import logging
from dataclasses import dataclass, field

import pytest
import torch

from weave_compile.ops import streams


@dataclass
class FakeStream:
    device: int
    priority: int = 0
    waited_streams: list = field(default_factory=list)
    waited_events: list = field(default_factory=list)

    priority_range = staticmethod(lambda: (0, -5))  # (lowest, greatest), as CUDA reports them

    def wait_stream(self, other):
        self.waited_streams.append(other)

    def wait_event(self, ev):
        self.waited_events.append(ev)


class FakeEvent:
    def __init__(self):
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream


@dataclass
class FakeTensor:
    ptr: int
    device: torch.device = torch.device("cuda", 1)

    def data_ptr(self):
        return self.ptr


@pytest.fixture
def fake_cuda(monkeypatch):
    current = {}

    def make_stream(device, priority=0):
        return FakeStream(device, priority)

    make_stream.priority_range = FakeStream.priority_range
    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: current.setdefault(torch.device(device).index, FakeStream(-1)))
    monkeypatch.setattr(streams, "_streams", {})
    monkeypatch.setattr(streams, "_pending", {})
    return current


def test_one_greatest_priority_stream_per_device(fake_cuda):
    s1 = streams.comm_stream(torch.device("cuda", 1))
    assert s1.device == 1 and s1.priority == -5
    assert streams.comm_stream(torch.device("cuda", 1)) is s1
    s0 = streams.comm_stream(torch.device("cuda"))  # no index: the current device
    assert s0.device == 0 and s0 is not s1


def test_fork_orders_the_comm_stream_after_the_current_one(fake_cuda):
    s = streams.fork(torch.device("cuda", 1))
    assert s.waited_streams == [fake_cuda[1]]


def test_each_join_waits_for_its_own_start_only(fake_cuda):
    a, b = FakeTensor(100), FakeTensor(200)
    streams.mark_done(a)
    streams.mark_done(b)
    ev_a, ev_b = streams._pending[100], streams._pending[200]
    assert ev_a.recorded_on is streams.comm_stream(a.device) and ev_a is not ev_b
    streams.join(a)
    current = fake_cuda[1]
    assert current.waited_events == [ev_a] and current.waited_streams == []
    assert 100 not in streams._pending and 200 in streams._pending
    streams.join(b)
    assert current.waited_events == [ev_a, ev_b] and not streams._pending


def test_join_without_a_start_waits_for_the_whole_stream_and_says_so(fake_cuda, caplog):
    with caplog.at_level(logging.WARNING, logger="weave_compile.ops.streams"):
        streams.join(FakeTensor(300))
    current = fake_cuda[1]
    assert current.waited_streams == [streams.comm_stream(torch.device("cuda", 1))]
    assert "no pending communication" in caplog.text
