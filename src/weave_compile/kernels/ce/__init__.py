"""``ce``: copy engines move the bytes, stream memory operations signal, a few CTAs add and norm.

:mod:`.copy_engine` holds the design (protocol, the call, the emulated-rank entry) with
:mod:`.workspace`, :mod:`.program`, :mod:`.watchdog` and :mod:`.memops`; this module is its
registry entry.

LayerNorm (``takes_layernorm``): the add+norm kernel's LayerNorm variant (``IS_LAYERNORM``, the
norm bias after the weight) in each loop kind it runs; a site's reservation loads that variant.

fp8 epilogue (``takes_quant``): the add+norm kernel quantizes this rank's rows
(:mod:`weave_compile.kernels.shared.fp8_rows`, on the row tile) into its ``out`` region's bytes,
codes then row scales (:func:`.workspace.quant_views`: the layout is unchanged), and the pulls
move H + 4 bytes a row instead of 2H; a site's reservation loads the quantizing variant.

Batch invariance (``batch_invariant``): the add+norm kernel adds a row's partials in rank order in
fp32 (this rank's own at its place among the received slots) on one launch shape for every token
count (:func:`weave_compile.kernels.shared.addnorm.add_rmsnorm_rows`, ``rank_order``); the copies
move bytes unchanged, so a row's outputs do not depend on the call's other rows or its owner.
"""

from __future__ import annotations

import logging

import torch

from ..registry import Implementation
from ..shared import addnorm, probe
from ..shared.symm_call import MIN_RESERVED_ROWS
from . import copy_engine, program, workspace

log = logging.getLogger(__name__)


def _check(site) -> str | None:
    why = addnorm.unavailable_reason(site.device, (site.dtype, site.residual_dtype, site.out_dtype), site.hidden)
    if why is None:
        why = copy_engine.unavailable_reason()
    if why is None:
        # Rows of every dtype it stores a multiple of 16 bytes: every row offset keeps its base's
        # alignment, so no token count makes a kernel variant of its own (program.preload_site).
        why = probe.check_hidden(site.hidden, [d for d in (site.residual_in_dtype, site.residual_dtype,
                                                            site.out_dtype) if d is not None]) or None
    if why is None:  # peer copies need peer-mapped symmetric memory (the probe is collective)
        p = probe.probe(site.group_name, site.device, site.dtype, site.hidden)
        why = None if p.mapped else p.reason
    return why


def _reserve(site) -> None:
    """Collective, at compile time: the workspace for the site's token count (at least
    ``MIN_RESERVED_ROWS``), watched by the process's watchdog, and every add+norm variant the
    site's calls can launch compiled and loaded (no load may happen once a stream waits)."""
    tokens = max(site.size_hint or MIN_RESERVED_ROWS, MIN_RESERVED_ROWS)
    ws = workspace.reserve(site.group_name, site.device, site.hidden, (site.dtype, site.out_dtype, site.residual_dtype),
                           tokens)
    terms = site.terms
    scale = (terms.scale if terms is not None and terms.scale is not None else torch.float32) if site.has_scale else None
    n = program.preload_site(ws, residual_dtype=site.residual_in_dtype,
                             terms=None if terms is None else [(terms.bias, terms.weight, terms.mid, terms.norm_bias)],
                             scale_dtype=scale, eps_on_device=site.eps_on_device, norm=site.norm,
                             batch_invariant=site.batch_invariant, quant=site.quant)
    log.info("ce: group %s H=%d: workspace of %d rows per rank, %d add+norm kernels loaded",
             site.group_name, site.hidden, ws.capacity, n)


def _run(rows, spec):
    if not rows.x.is_cuda:
        return None
    return copy_engine.run_ce(rows, spec)


IMPLEMENTATION = Implementation(
    "ce", "copy-engine peer copies, stream-memory-op flags, a few-CTA add+norm: no SM moves or spins",
    _check, _run, reserve=_reserve, workspaces=workspace.WORKSPACES,
    capacity_error=copy_engine.CeCapacityError, takes_scale=True,
    takes_eps_tensor=True, takes_layernorm=True, batch_invariant=True, takes_quant=True,
    # After p2p (2) where nothing measured decides; the measured table (kernels/auto_table.py)
    # picks it where its rows say it is fastest.
    auto_rank=3)
