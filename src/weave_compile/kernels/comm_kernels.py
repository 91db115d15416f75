"""Selection and dispatch of the overlap-oriented fused-op implementations ``ce`` and ``nccl``, and ``auto``.

The fused op (``ops/allreduce_rmsnorm.py``, ``ops/selection.py``) keeps only two small hooks:
:func:`select` at compile time and :func:`dispatch` at run time. ``auto`` picks from the measured
table in ``kernels/auto_table.py``: among measured designs the fastest; where the table has no row
(a world size or token count never measured) the capability order (``p2p``), said so in the
reason. Every pick carries its reason, which ``explain()`` shows.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from . import addnorm, auto_table
from .common import SUPPORTED_DTYPES

log = logging.getLogger(__name__)

KERNELS = ("ce", "nccl")


def _common_reason(device: torch.device, dtypes, hidden: int) -> Optional[str]:
    if device.type != "cuda":
        return f"{device.type} tensors: only the collective-based reference runs there"
    if not addnorm.HAS_TRITON:
        return "triton is not installed (the add+norm kernel is a Triton kernel)"
    bad = [d for d in dtypes if d not in SUPPORTED_DTYPES]
    if bad:
        return f"dtypes {bad} not supported"
    return addnorm.check_hidden(hidden)


def select(requested: str, device: torch.device, dtypes, hidden: int, group_name: str) -> tuple[str, str]:
    """``(kernel, reason)`` for a forced ``ce`` or ``nccl``; ``reference`` with the reason when it cannot run."""
    why = _common_reason(device, dtypes, hidden)
    if why is None and requested == "ce":
        from . import copy_engine

        why = copy_engine.unavailable_reason()
        if why is None:
            why = _symmetric_memory_reason(group_name, device, dtypes[0], hidden)
    if why:
        return "reference", f"requested {requested!r} unavailable: {why}"
    return requested, "requested"


def _symmetric_memory_reason(group_name: str, device, dtype, hidden: int) -> Optional[str]:
    """The copy-engine design needs peer-mapped symmetric memory (the p2p probe checks it, collectively)."""
    from .select import select_symm_variant

    variant, reason = select_symm_variant(group_name, device, dtype, hidden)
    return None if variant is not None else reason


def pick_auto(capable: Optional[str], capable_reason: str, world_size: int, num_tokens: Optional[int],
              split: bool) -> tuple[str, str]:
    """``auto``: the fastest measured design for (world size, tokens, split) among what can run here.

    ``capable`` is what the capability check allows (``p2p``/``multimem``, or None). Measured rows
    name ``p2p`` only today (auto_table.py says from where), so ``ce`` and ``nccl`` are never picked
    by auto; outside the measured world sizes and token range auto keeps the capability order's
    pick (the barrier kernel ran correctly there in tests, its speed is not measured).
    """
    row, why = auto_table.lookup(world_size, num_tokens, split)
    if row is None:
        if capable is None:
            return "reference", f"auto: {capable_reason}"
        return capable, f"auto: {capable_reason}; {why}, so by capability (not by the measured table)"
    runnable = {"p2p"} if capable in ("p2p", "multimem") else set()
    ranked = [(us, design) for design, us in row.items() if design in runnable]
    if not ranked:
        return "reference", f"auto: measured {sorted(row)} at {why}, none can run here ({capable_reason})"
    us, design = min(ranked)
    others = ", ".join(f"{d} {u:.1f} us" for d, u in sorted(row.items()) if d != design)
    return design, f"auto: fastest measured at {why}: {design} {us:.1f} us" + (f" (vs {others})" if others else "") + \
        f" [{auto_table.SOURCE}]"


def dispatch(kernel: str, x, residual, bias, weight, eps, group_name, residual_dtype, out_dtype, mid_dtype,
             weight_offset, residual_in_sharded, residual_out_sharded, comm_ctas, scale):
    """Run ``kernel`` (``ce`` or ``nccl``) for the fused op; None when ``ce`` must fall back (logged)."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    res = None if residual is None else (residual if residual_in_sharded else residual.reshape(-1, hidden))
    kw = dict(eps=eps, group_name=group_name, residual_dtype=residual_dtype, out_dtype=out_dtype,
              mid_dtype=mid_dtype, weight_offset=weight_offset, residual_in_sharded=residual_in_sharded,
              residual_out_sharded=residual_out_sharded, num_ctas=comm_ctas, scale=scale)
    b = None if bias is None else bias.reshape(hidden)
    w = None if weight is None else weight.reshape(hidden)
    if kernel == "nccl":
        from .nccl_allreduce_rmsnorm import fused_allreduce_rmsnorm_nccl

        normed, residual_out = fused_allreduce_rmsnorm_nccl(rows, res, b, w, **kw)
    else:
        from . import copy_engine

        try:
            normed, residual_out = copy_engine.fused_allreduce_rmsnorm_ce(rows, res, b, w, **kw)
        except copy_engine.CeCapacityError as e:  # cannot grow inside graph capture: the collectives can
            _log_fallback_once(str(e))
            return None
    return normed.reshape(x.shape), (residual_out if residual_out_sharded else residual_out.reshape(x.shape))


_logged: set = set()


def _log_fallback_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.warning("weave::allreduce_add_rmsnorm: ce kernel fell back to reference: %s", reason)
