"""Inductor lowering of the fused ops: the fallback Inductor would make, plus never-reuse outputs.

A fused op whose ``out_slot`` is >= 0 returns a view of the symmetric output ring
(:mod:`weave_compile.passes.output_in_place`). Inductor may let a pointwise kernel write its
result into an input buffer that is dead after it (in-place reuse); done to such an output,
that result would live in the ring and be overwritten by the peers' next push there. So the
lowering is Inductor's own fallback for a custom op (the same layout constraint it would
choose, ``graph.py``) with the normed output of every in-place call added to
``V.graph.never_reuse_buffers``.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

from .allreduce_rmsnorm import ARG_NAMES, FUSED_OP, START_OP

log = logging.getLogger(__name__)

_OUT_SLOT = ARG_NAMES.index("out_slot")


def _never_reuse_in_place_outputs(inner):
    @functools.wraps(inner)
    def lower(*args, **kwargs):
        from torch._inductor.virtualized import V

        out = inner(*args, **kwargs)
        slot = args[_OUT_SLOT] if len(args) > _OUT_SLOT else kwargs.get("out_slot", -1)
        if isinstance(slot, int) and slot >= 0:
            V.graph.never_reuse_buffers.add(out[0].get_name())
        return out

    lower._weave_never_reuse = True
    return lower


def install() -> Optional[str]:
    """Install the lowering of both fused ops (once); None when done, else why it could not be."""
    try:
        from torch._inductor import lowering as L
        from torch._library.utils import get_layout_constraint_tag

        for op in (FUSED_OP, START_OP):
            if op in getattr(L, "user_lowerings", {}):  # Inductor would call that one instead
                return f"a user lowering is registered for {op}"
            if getattr(L.lowerings.get(op), "_weave_never_reuse", False):
                continue
            if op not in L.lowerings:  # what Inductor does on meeting a custom op without one
                tag = get_layout_constraint_tag(op, with_default=True)
                L.make_fallback(op, layout_constraint=L.tag_to_layout_constraint(tag), warn=False)
            L.lowerings[op] = _never_reuse_in_place_outputs(L.lowerings[op])
    except Exception as e:  # an Inductor without these internals: outputs stay copied
        log.warning("tokenweave: could not install the fused op's Inductor lowering (%s: %s); "
                    "fused outputs stay copied under Inductor", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None
