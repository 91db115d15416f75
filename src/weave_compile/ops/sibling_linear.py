"""``weave::sibling_linear``: linear layers that read one input, as one GEMM.

``sibling_linear(x, [W_1 .. W_n], [b_1 .. b_n])`` is ``cat([x @ W_i.T + b_i], -1)``: one GEMM of
``x`` with the weights stacked, ``[..., sum(N_i)]``. A Hugging Face layer has five such linears
where a served one has two (one QKV, one gate/up GEMM), and a token-split half pays each small
GEMM's fixed cost again; merged, the halves' GEMMs cost about what the whole's do
(docs/performance.md, "Its GEMM cost, and the split point").

The GEMM reads the stacked weights in place when they are one buffer: ``W_{i+1}`` starts where
``W_i`` ends in the same storage, each contiguous (the pass that puts this op into graphs,
:mod:`weave_compile.passes.split_tokens.merge_projections`, re-points the parameters so). The op checks
that at every call, on the pointers (no GPU work), because a user may replace a parameter after
the compile: then the weights are stacked by a copy (correct, slower) and a warning says which.
Biases likewise. ``sibling_linear_ref`` is the plain per-linear computation.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_WARNED: set[str] = set()


def stacked_view(parts: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """``cat(parts)`` as a view of ``parts[0]``'s storage when the parts lie there back to back
    (each contiguous, same dtype and device), else None."""
    first = parts[0]
    rest = first.shape[1:]
    if not all(p.is_contiguous() and p.dtype == first.dtype and p.device == first.device
               and p.shape[1:] == rest for p in parts):
        return None
    storage, esize = first.untyped_storage(), first.element_size()
    end = first.data_ptr()
    for p in parts:
        if p.data_ptr() != end or p.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += p.numel() * esize
    rows = sum(p.shape[0] for p in parts)
    if (first.storage_offset() + rows * math.prod(rest)) * esize > storage.nbytes():
        return None
    return first.as_strided((rows, *rest), first.stride())


def _stacked(parts: list[torch.Tensor], what: str) -> torch.Tensor:
    view = stacked_view(parts)
    if view is not None:
        return view
    key = f"{what} {[tuple(p.shape) for p in parts]}"
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("tokenweave: sibling linears' %s are not one buffer any more (a parameter replaced "
                    "after the compile?): they are copied together at every call; recompile "
                    "(torch._dynamo.reset()) to merge them again", key)
    return torch.cat(parts)


@torch.library.custom_op("weave::sibling_linear", mutates_args=())
def sibling_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """``cat([F.linear(x, W_i, b_i)], -1)`` as one GEMM (see the module docstring); ``biases`` empty
    or one per weight."""
    _check(x, weights, biases)
    w = _stacked(weights, "weights")
    b = _stacked(biases, "biases") if biases else None
    return F.linear(x, w, b)


@sibling_linear.register_fake
def _(x, weights, biases):
    _check(x, weights, biases)
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _check(x, weights, biases) -> None:
    if not weights:
        raise ValueError("sibling_linear: no weights")
    if any(w.dim() != 2 or w.shape[1] != x.shape[-1] for w in weights):
        raise ValueError(f"sibling_linear: weights {[tuple(w.shape) for w in weights]} do not all take "
                         f"{x.shape[-1]} input features")
    if biases and (len(biases) != len(weights)
                   or any(b.shape != (w.shape[0],) for b, w in zip(biases, weights))):
        raise ValueError("sibling_linear: one bias of each weight's output size, or none")


def sibling_linear_ref(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]) -> torch.Tensor:
    """One linear per weight, concatenated: what the op must equal."""
    bs = biases or [None] * len(weights)
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, bs)], -1)


SIBLING_LINEAR = torch.ops.weave.sibling_linear.default
