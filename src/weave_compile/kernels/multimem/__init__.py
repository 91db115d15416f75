"""``multimem``: the pull kernel through NVLink SHARP (``multimem.ld_reduce`` / ``multimem.st``).

TokenWeave's own design, for machines whose symmetric memory has a multicast object. Never
launched in this project (multicast stays off on the shared machines): :mod:`.ptx` holds the
instructions, compile-checked for sm_90, :mod:`.pull` the kernel (which without multicast reads
the peers with plain loads: a measurement hook), :mod:`.launch` its launcher. This module is
its registry entry. It takes LayerNorm sites (``takes_layernorm``): the kernel's LayerNorm variant
(the centred row's mean square as the variance, the norm bias after the weight) at RMSNorm's launch
shapes, compiled for sm_90 and never run, as the rest of this design; the RMSNorm kernel compiles to
the PTX it did before the variant existed.
"""

from __future__ import annotations

from ..registry import Implementation
from ..shared import probe
from ..shared.workspace import WORKSPACES, SymmCapacityError


def _check(site) -> str | None:
    p = probe.probe_site(site)
    return None if p.multicast else p.reason


def _note(site) -> str:
    return probe.probe_site(site).reason


def _reserve(site) -> None:
    from ..shared.symm_call import reserve_for_site

    reserve_for_site(site)


def _run(rows, spec):
    if not rows.x.is_cuda:
        return None
    from ..shared.symm_call import run_on_workspace
    from .launch import pull_on

    return run_on_workspace(rows, spec, pull_on)


# Preferred where multicast exists (TokenWeave's own design), but auto_ready=False: auto takes no
# design over the plain graph without a measurement on this code, and it has never run here
# (multicast stays off on the machines this project measures on). Force it with kernel="multimem".
IMPLEMENTATION = Implementation(
    "multimem", "pull kernel: multimem.ld_reduce / multimem.st through NVLink SHARP (multicast machines)",
    _check, _run, reserve=_reserve, workspaces=WORKSPACES,
    capacity_error=SymmCapacityError, takes_layernorm=True, note=_note, auto_rank=0, auto_preferred=True,
    auto_ready=False)
