"""testing/graphs.py on a GPU: a captured call replays on new data into its static outputs."""

import pytest
import torch

from weave_compile.testing.graphs import capture

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120, method="thread"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_capture_replays_on_new_inputs_into_its_static_output(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(257, 129, device="cuda", generator=g)
    fn = lambda: x * 3 + 1  # noqa: E731
    fn()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph, out = capture(fn)
    for _ in range(2):
        x.copy_(torch.randn(257, 129, device="cuda", generator=g))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, x * 3 + 1)
