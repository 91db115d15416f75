"""Layout helpers of the split: memory_order."""

import itertools

import pytest
import torch

from weave_compile.passes.split_tokens.values import memory_order


@pytest.mark.parametrize("perm", list(itertools.permutations(range(4))))
def test_memory_order_of_every_permuted_dense_layout_makes_it_contiguous(perm):
    base = torch.empty(2, 3, 5, 7)  # distinct sizes: no ties between strides
    t = base.permute(perm)
    order = memory_order(t)
    if t.is_contiguous():
        assert order is None
    else:
        assert order is not None and t.permute(order).is_contiguous(), (perm, order)
        assert t.permute(order).data_ptr() == base.data_ptr()


def test_memory_order_is_none_for_what_no_permutation_makes_dense():
    assert memory_order(torch.empty(4, 6)[:, :3]) is None  # a column slice: gaps between rows
    assert memory_order(torch.empty(4, 6)[::2]) is None
    assert memory_order(torch.empty(3, 1).expand(3, 5)) is None  # stride 0
    assert memory_order(torch.empty(5)) is None


def test_memory_order_ignores_size_one_dims():
    t = torch.empty(1, 40, 4, 16).transpose(1, 2)  # SDPA's output layout at batch 1
    order = memory_order(t)
    assert order is not None and t.permute(order).is_contiguous()


def test_memory_order_with_symbolic_sizes():
    """Under a symbolic trace (every size a SymInt >= 2) the strides still order."""
    from torch.fx.experimental.proxy_tensor import make_fx

    orders = []

    def f(x):
        t = x.transpose(1, 2)
        assert isinstance(t.shape[2], torch.SymInt)
        orders.append((memory_order(t), memory_order(x)))
        return t

    make_fx(f, tracing_mode="symbolic")(torch.empty(2, 40, 4, 16))
    assert orders == [([0, 2, 1, 3], None)], orders
