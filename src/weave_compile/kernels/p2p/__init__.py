"""``p2p``: the push kernel over peer-mapped symmetric memory, for any NVLink / P2P machine.

:mod:`.push` holds the kernel (scatter, add + RMSNorm or LayerNorm on this rank's rows, gather;
every cross-rank access a store), :mod:`.launch` its launch shapes and launcher. This module is its
registry entry. It takes LayerNorm sites (``takes_layernorm``): the kernel's LayerNorm variant
(the centred row's mean square as the variance, the norm bias after the weight) runs in every
add+norm loop at RMSNorm's launch shapes, and the RMSNorm kernel is compiled as before.

Batch invariance (``batch_invariant``): the kernel adds a row's partials in rank order 0..N-1 in
fp32, its own at its rank's place (``RANK_ORDER``, a constexpr the launcher passes only with the
option), on one launch shape for every token count and CTA count: the pipelined add+norm loop on
one-row tiles (:func:`weave_compile.kernels.p2p.launch.invariant_meta`). The copy phases move
bytes unchanged, so a row's outputs do not depend on the call's other rows or its owner.

The fp8 epilogue (``takes_quant``): each rank quantizes its own normed rows in the tile loops (the
shared :func:`weave_compile.kernels.shared.fp8_rows.quant_tile`) and pushes the codes and row scales
into the peers' output regions (codes first, the scales after them: the workspace is the one
without the epilogue), H + 4 bytes a row instead of 2H. Not with the output left in the ring
(``output_in_place`` copies such a site's output).
"""

from __future__ import annotations

from ..registry import Implementation
from ..shared import probe
from ..shared.workspace import WORKSPACES, SymmCapacityError


def _check(site) -> str | None:
    p = probe.probe_site(site)
    return None if p.mapped else p.reason


def _reserve(site) -> None:
    from ..shared.symm_call import reserve_for_site

    reserve_for_site(site, ring=site.out_in_place)


def _run(rows, spec):
    if not rows.x.is_cuda:
        return None
    from ..shared.symm_call import run_on_workspace
    from .launch import push_on

    return run_on_workspace(rows, spec, push_on, ring=spec.out_slot >= 0)


IMPLEMENTATION = Implementation(
    "p2p", "push kernel: peer stores into symmetric memory, three block barriers, any NVLink/P2P machine",
    _check, _run, reserve=_reserve, workspaces=WORKSPACES,
    capacity_error=SymmCapacityError, takes_out_slot=True, takes_eps_tensor=True, takes_layernorm=True,
    batch_invariant=True, takes_quant=True, auto_rank=2)
