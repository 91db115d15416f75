"""Tests for kernels/shared/common.py: the index-width rule of the push kernel's launcher.

(The rest of the module, dtype tables and the register model, is tested through its users:
tests/kernels/p2p/test_launch.py and tests/testing/test_ptx.py.)
"""

from __future__ import annotations

import torch

from weave_compile.kernels.shared.common import extent, needs_int64


def test_index_width_is_64_bit_exactly_when_an_offset_can_reach_2_pow_31():
    """The push kernel indexes in 32 bits only where every element offset fits (its launcher's
    choice: tests/kernels/p2p/test_launch.py; the CPU interpreter runs the kernel at both widths:
    tests/testing/test_emulated_ranks.py forces 64)."""
    assert not needs_int64(2 ** 31 - 1, 5) and needs_int64(7, 2 ** 31)
    assert not needs_int64()


def test_extent_is_the_span_from_the_base_to_the_last_element():
    x = torch.empty(3, 10)
    assert extent(x) == 30 and extent(x[:, :4]) == 24  # the last row ends at 2 * 10 + 4
    assert extent(torch.empty(0, 8)) == 0
    assert extent(torch.empty(4, 100)[::2, :10]) == 210  # a strided view spans its strides
    assert extent(torch.empty(2, 3, 5)[:, 1:]) == 2 * 3 * 5 - 5  # [k, rows, H] slot tensors too
