"""Tests for kernels/shared/sync.py: the signal-pad slot ranges of every channel.

The barriers themselves run in the multi-process CPU simulation (tests/kernels/p2p/test_launch.py)
and on GPUs (tests/kernels/p2p/test_push.py, test_launch.py).
"""

from weave_compile.kernels.shared.common import MAX_CTAS
from weave_compile.kernels.shared.sync import pad_offset_for


def test_signal_pad_budget():
    for world in (1, 2, 4, 8):
        def end(ch):
            return (pad_offset_for(ch, world) + MAX_CTAS * world) * 4

        assert end(0) <= 2048  # older PyTorch's fixed 2048-byte pad: channel 0 fits
        assert end(1) <= 9216 and end(7) <= 9216  # newer default (32 * 72 * 4 bytes)
        # above PyTorch's own slots (block * N + rank, up to 32 blocks); no overlap
        assert pad_offset_for(0, world) >= 32 * world
        assert pad_offset_for(1, world) >= pad_offset_for(0, world) + 32 * world
