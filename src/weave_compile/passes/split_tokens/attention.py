"""The token split of causal self-attention, the one op that mixes tokens.

Prefix A attends over its own keys (the same attention op on A's q/k/v); suffix B needs A's
keys too: ``weave::causal_suffix_attention`` of B's queries over A's keys (all visible) and B's
own (causal), which takes the halves' keys and values as they are, with their kv heads. A batch
split needs no rewrite: each half runs the same op on whole sequences. An explicit ``[.., S, S]``
mask (how Hugging Face models reach the graph) is checked, on the device and without a host sync,
to be exactly causal (:func:`assert_causal`).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from weave_compile.ops import SUFFIX_ATTENTION

from ..graph_utils import is_call, named_args, val
from .plan import ATTENTION_OPS
from .rules import RuleSet
from .values import Barrier, Split, SplitTuple, is_tensor_node, same

if TYPE_CHECKING:
    from .rewriter import Rewriter

aten = torch.ops.aten


#: The attention ops' rules (this module's).
ATTENTION = RuleSet()


@ATTENTION.rule(*ATTENTION_OPS, tensor_result=False)
def attention(rw: Rewriter, n: fx.Node) -> SplitTuple:
    args = named_args(n)
    q, k, v = args["query"], args["key"], args["value"]
    sq, sk, sv = (rw.env.get(a) for a in (q, k, v))
    if val(q).dim() != 4 or not all(isinstance(s, Split) and same(s.unit, 1) for s in (sq, sk, sv)):
        raise Barrier("attention whose queries, keys and values are not all split")
    if args.get("dropout_p", 0.0):
        raise Barrier("attention with dropout")
    used = {u.args[1] for u in n.users if is_call(u, operator.getitem)}
    if used - {0} or any(not is_call(u, operator.getitem) for u in n.users):
        raise Barrier("attention's auxiliary outputs (log-sum-exp, ...) are used")
    if sq.dim == sk.dim == sv.dim == 0:
        # Batch split: whole sequences per half; a mask with a batch dimension is sliced.
        def arg(a, h):
            if a is q or a is k or a is v:
                return rw.env[a].halves[h]
            return rw.side(a, 0, 1, h) if is_tensor_node(a) and val(a).dim() == 4 else a

        calls = [rw.mk(n.target, tuple(arg(a, h) for a in n.args),
                       {key: arg(a, h) for key, a in n.kwargs.items()}, half=h) for h in (0, 1)]
        outs = tuple(rw.mk(operator.getitem, (c, 0), half=h) for h, c in enumerate(calls))
        return SplitTuple({0: Split(0, outs)})
    if not sq.dim == sk.dim == sv.dim == 2:
        raise Barrier("attention split along heads or head_dim")
    mask_name = "attn_mask" if args.get("attn_mask") is not None else "attn_bias"
    mask = args.get(mask_name)
    if mask is not None:
        if args.get("is_causal"):
            raise Barrier("attention with both a mask and is_causal")
        return _masked(rw, n, sq, sk, sv, mask)
    if not args.get("is_causal"):
        raise Barrier("token split of attention that is neither causal nor masked")
    return _causal_halves(rw, n, sq, sk, sv, {})


def _masked(rw: Rewriter, n: fx.Node, sq: Split, sk: Split, sv: Split, mask: fx.Node) -> SplitTuple:
    """Token split of attention with an explicit ``[.., S, S]`` mask (how Hugging Face models
    reach the graph under torch.compile: a materialized causal mask).

    The halves need a causal mask, which the graph cannot prove an arbitrary mask to be. So
    the mask is dropped for the halves' causal attention and :func:`assert_causal` checks,
    once per mask and call, that it is exactly causal. A mask that is not (padding, sliding
    window) stops the program loudly instead of giving a wrong number; such models should
    compile with ``split=False``.
    """
    tm = val(mask)
    if not isinstance(mask, fx.Node) or mask in rw.env or tm is None or tm.dim() != 4 \
            or not same(tm.shape[-1], rw.total) or not same(tm.shape[-2], rw.total):
        raise Barrier("attention mask of a form other than [.., S, S]")
    if mask not in rw.checked_masks:
        rw.checked_masks.add(mask)
        assert_causal(rw, mask, tm)
    return _causal_halves(rw, n, sq, sk, sv, {"attn_mask": None, "attn_bias": None, "is_causal": True})


#: An additive mask's entry at or below this masks its key. Half of float16's lowest finite value:
#: torch hands cuDNN a boolean mask as 0 / -65504 (cuDNN takes no -inf), which is what a bf16
#: Hugging Face model's causal mask reaches the graph as on a GPU; Hugging Face itself writes the
#: dtype's minimum or -inf. exp(-32752) is 0 in every float dtype: such a key adds nothing.
MASKED_AT_MOST = -32752.0


def assert_causal(rw: Rewriter, mask: fx.Node, tm: torch.Tensor) -> None:
    """An asynchronous device-side assert (no host sync, CUDA-graph safe) that ``mask`` is causal:
    0/True where ``key <= query``, masked (False; or at most :data:`MASKED_AT_MOST`: -inf, the
    dtype's minimum, cuDNN's -65504) elsewhere."""
    pos = rw.mk(torch.ops.prims.iota.default, (rw.total_arg,), {
        "start": 0, "step": 1, "dtype": torch.int64, "device": tm.device, "requires_grad": False})
    causal = rw.mk(aten.le.Tensor, (rw.mk(aten.unsqueeze.default, (pos, 0)),
                                    rw.mk(aten.unsqueeze.default, (pos, 1))))
    if tm.dtype == torch.bool:
        bad = rw.mk(aten.ne.Tensor, (mask, causal))
    else:
        allowed = rw.mk(aten.eq.Scalar, (mask, 0))
        masked = rw.mk(aten.le.Scalar, (mask, MASKED_AT_MOST))
        # Where causal the entry must be 0, elsewhere masked.
        bad = rw.mk(aten.logical_not.default, (rw.mk(aten.where.self, (causal, allowed, masked)),))
    ok = rw.mk(aten.logical_not.default, (rw.mk(aten.any.default, (bad,)),))
    rw.mk(aten._assert_async.msg, (ok, "tokenweave split: the attention mask is not causal (padding? "
                                       "sliding window?); compile with options={'split': False}"))


def unexpanded(node: fx.Node) -> tuple[fx.Node, int]:
    """``(x, rep)`` where ``node`` is ``x`` ([B, Hkv, T, D]) repeated per query head, as
    ``repeat_interleave(rep, dim=1)`` and Hugging Face's ``repeat_kv`` reach the post-grad graph::

        view(clone(expand(unsqueeze(x, 2), [B, Hkv, rep, T, D])), [B, Hkv * rep, T, D])

    ``(node, 1)`` for any other form."""
    if not is_call(node, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        return node, 1
    clone = node.args[0]
    expand = clone.args[0] if is_call(clone, aten.clone.default) else None
    unsq = expand.args[0] if is_call(expand, aten.expand.default) else None
    if not is_call(unsq, aten.unsqueeze.default) or unsq.args[1] not in (2, -3):
        return node, 1
    x = unsq.args[0]
    tx, te, tn = val(x), val(expand), val(node)
    if tx is None or te is None or tn is None or tx.dim() != 4 or te.dim() != 5 or tn.dim() != 4:
        return node, 1
    b, hkv, t, d = tx.shape
    rep = te.shape[2]
    if not isinstance(rep, int) or not all(same(a, e) for a, e in zip((b, hkv, rep, t, d), te.shape)) \
            or not all(same(a, e) for a, e in zip((b, hkv * rep, t, d), tn.shape)):
        return node, 1
    return x, rep


def _causal_halves(rw: Rewriter, n: fx.Node, sq: Split, sk: Split, sv: Split, overrides: dict) -> SplitTuple:
    """A: the same attention op on its own q/k/v; B: ``causal_suffix_attention`` of B's queries over
    A's and B's keys, passed as they are: no ``[K_A; K_B]`` concatenation in the graph, and keys and
    values the model repeated per query head are passed with their kv heads (:func:`unexpanded`;
    the op attends grouped-query), so B's repeated copies are never written and A's repeated copy
    has one reader (a second reader made Inductor write it twice, once per reader's layout)."""
    schema = n.target._schema
    bound = named_args(n)
    bound.update({k: v for k, v in overrides.items() if k in bound})
    bound.update(query=sq.halves[0], key=sk.halves[0], value=sv.halves[0])
    args = tuple(bound[a.name] for a in schema.arguments if not a.kwarg_only)
    kwargs = {a.name: bound[a.name] for a in schema.arguments if a.kwarg_only}
    a_call = rw.mk(n.target, args, kwargs, half=0)
    a_out = rw.mk(operator.getitem, (a_call, 0), half=0)
    kv = [unexpanded(x) for x in (*sk.halves, *sv.halves)]
    if len({rep for _, rep in kv}) > 1:  # repeated unlike each other: pass them as they are
        kv = [(x, 1) for x in (*sk.halves, *sv.halves)]
    (k_a, _), (k_b, _), (v_a, _), (v_b, _) = kv
    b_out = rw.mk(SUFFIX_ATTENTION, (sq.halves[1], k_a, v_a, k_b, v_b, bound.get("scale")), half=1)
    return SplitTuple({0: Split(2, (a_out, b_out))})
