"""``oneshot``: the barrier-free one-shot kernel for decode-sized token counts.

:mod:`.kernel` holds the design (every rank pushes all its rows to every peer, data are their
own flags), the kernel and its launcher; :mod:`.workspace` its buffers. This module is its
registry entry. It takes LayerNorm sites (``takes_layernorm``): the kernel's LayerNorm variant
(the centred row's mean square as the variance, the norm bias after the weight) runs at RMSNorm's
launch shapes, and the RMSNorm kernel is compiled as before.

Batch invariance (``batch_invariant``): every rank adds every row's partials in rank order 0..N-1
in fp32 (the kernel always did), and with the option the launcher runs one-row tiles for every
token count and CTA count (:func:`weave_compile.kernels.oneshot.kernel.invariant_meta`), so a
row's outputs do not depend on the call's other rows.
"""

from __future__ import annotations

from ..registry import Implementation
from ..shared import probe
from ..shared.workspace import SymmCapacityError
from .workspace import WORKSPACES

#: The provisional crossover: ``auto`` may take the one-shot kernel only for a static token count
#: whose message ``T * H * itemsize`` is at most this. Below it the push kernel's fixed cost (its
#: three barriers, whatever H) outweighs one-shot's N-fold local reduce/norm work, which grows
#: with the message: a model over the 2x H200 push-kernel times, not a measured crossover
#: (docs/performance.md, "`oneshot`, `nccl`, `reference`, `multimem`").
ONESHOT_MAX_BYTES = 4 << 20


def _check(site) -> str | None:
    p = probe.probe_site(site)  # peer-mapped symmetric memory, as the push kernel
    return None if p.mapped else p.reason


def _reserve(site) -> None:
    from .workspace import reserve, reserve_rows

    rows = reserve_rows(site.hidden, site.dtype, site.num_tokens or 1, ONESHOT_MAX_BYTES)
    reserve(site.group_name, site.dtype, site.residual_in_dtype or site.dtype, site.hidden, rows, site.device)


def _run(rows, spec):
    if not rows.x.is_cuda:
        return None
    from .kernel import oneshot_allreduce_rmsnorm

    return oneshot_allreduce_rmsnorm(rows, spec)


# auto_ready=False: not until it has run across two GPUs (so far it ran correctly on ranks emulated
# on one H200 only, and auto takes no design whose crossover was never measured).
IMPLEMENTATION = Implementation(
    "oneshot", "every rank pushes all its rows to every peer, data as their own flags: no barrier (decode)",
    _check, _run, reserve=_reserve, workspaces=WORKSPACES,
    capacity_error=SymmCapacityError, takes_eps_tensor=True, takes_layernorm=True, batch_invariant=True, auto_rank=1,
    auto_preferred=True,
    auto_max_bytes=ONESHOT_MAX_BYTES, auto_ready=False)
