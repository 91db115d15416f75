"""``ce``: copy engines move the bytes, stream memory operations signal, a few CTAs add and norm.

:mod:`.copy_engine` holds the design (protocol, workspace, the program of one call); this
module is its registry entry.
"""

from __future__ import annotations

from ..registry import Implementation
from ..shared import addnorm, probe
from . import copy_engine


def _check(site) -> str | None:
    why = addnorm.unavailable_reason(site.device, (site.dtype, site.residual_dtype, site.out_dtype), site.hidden)
    if why is None:
        why = copy_engine.unavailable_reason()
    if why is None:  # peer copies need peer-mapped symmetric memory (the probe is collective)
        p = probe.probe(site.group_name, site.device, site.dtype, site.hidden)
        why = None if p.mapped else p.reason
    return why


def _run(rows, spec):
    if not rows.x.is_cuda:
        return None
    return copy_engine.run_ce(rows, spec)


IMPLEMENTATION = Implementation(
    "ce", "copy-engine peer copies, stream-memory-op flags, a few-CTA add+norm: no SM moves or spins",
    _check, _run, capacity_error=copy_engine.CeCapacityError, takes_scale=True)
