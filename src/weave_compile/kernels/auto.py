"""Which implementation a fused site gets: the whole policy, forced and ``auto``, in one place.

:func:`choose` runs at compile time, once per site; the choice is baked into the graph as the op's
``kernel`` argument, with a reason for ``explain()``. Everything it knows of an implementation
comes from its registry entry (:mod:`.registry`): what it takes, why it cannot run here, and how
``auto`` ranks it. ``auto``:

1. takes a *preferred* implementation (``auto_preferred``, best ``auto_rank`` first) wherever it
   can run, its crossover allows the site's token count (``auto_max_bytes``: a static T only) and
   it is ready (``auto_ready``);
2. else the fastest design measured for the world size, token count and split (the committed
   table :mod:`.auto_table`, rows per design) among those that can run;
3. where nothing applicable was measured, the capability order (``auto_rank``);
4. else the fallback.

Forcing a name runs that implementation where it can run, else the fallback, with the reason.
The capability checks may be collective (a symmetric-memory probe): every rank compiles the same
graphs, so every rank gets here together and in the same order.
"""

from __future__ import annotations

import math
from typing import Optional

from . import auto_table, registry
from .registry import Implementation, Site


def choose(requested: str, site: Site) -> tuple[str, str]:
    """``(implementation name, reason)`` for ``requested`` (``auto`` or a registered name) at ``site``."""
    if requested == registry.AUTO:
        return _auto(site)
    impl = registry.get(requested)
    if impl.fallback:
        return impl.name, "requested"
    why = unavailable(impl, site)
    if why:
        return registry.fallback().name, f"requested {impl.name!r} unavailable: {why}"
    better = [e.name for e in _preferred() if _rank(e) < _rank(impl)
              and unavailable(e, site) is None and verdict(e, site)[0]]
    return impl.name, "requested" + (f" ({', '.join(better)} also available)" if better else "")


def unavailable(impl: Implementation, site: Site) -> Optional[str]:
    """Why ``impl`` cannot run at ``site`` (None if it can): what it takes, then its own check."""
    if site.has_scale and not impl.takes_scale:
        takers = [e.name for e in registry.implementations() if e.takes_scale]
        return f"scaled site: only {', '.join(takers)} take a scale"
    if site.eps_on_device and not impl.takes_eps_tensor:
        takers = [e.name for e in registry.implementations() if e.takes_eps_tensor]
        return f"eps is a device tensor: only {', '.join(takers)} read it there (the others read it on the host)"
    return impl.check(site)


def verdict(impl: Implementation, site: Site) -> tuple[bool, str]:
    """Whether ``auto`` takes ``impl``, which can run at ``site``, ahead of the measured table (its
    crossover and its readiness allow it), and why."""
    fits = ""
    if impl.auto_max_bytes is not None:
        if site.num_tokens is None:
            return False, "symbolic token count (it needs a static T below its crossover)"
        nbytes = site.num_tokens * site.hidden * site.dtype.itemsize
        if nbytes > impl.auto_max_bytes:
            return False, f"T*H*b = {nbytes} B > {impl.auto_max_bytes} B crossover"
        fits = f"T*H*b = {nbytes} B <= {impl.auto_max_bytes} B (its crossover)"
    if not impl.auto_ready:
        return False, (f"{fits or 'it'} fits, but auto waits for its measurement across GPUs "
                       f"(force kernel={impl.name!r} to use it)")
    return True, fits


def from_table(runnable: list[Implementation], site: Site) -> tuple[Optional[str], str]:
    """``(name, reason)`` of the fastest measured design among ``runnable``, or ``(None, why)``
    where the table does not decide (nothing measured there, or none of its designs can run)."""
    row, where = auto_table.lookup(site.world_size, site.num_tokens, site.split)
    if row is None:
        return None, where
    names = {e.name for e in runnable}
    ranked = [(us, design) for design, us in row.items() if design in names]
    if not ranked:
        return None, f"measured {sorted(row)} at {where}, none of them can run here"
    us, design = min(ranked)
    others = ", ".join(f"{d} {u:.1f} us" for d, u in sorted(row.items()) if d != design)
    return design, (f"fastest measured at {where}: {design} {us:.1f} us" + (f" (vs {others})" if others else "")
                    + f" [{auto_table.SOURCE}]")


def _rank(impl: Implementation) -> float:
    return math.inf if impl.auto_rank is None else impl.auto_rank


def _preferred() -> list[Implementation]:
    return sorted((e for e in registry.implementations() if e.auto_preferred), key=_rank)


def _auto(site: Site) -> tuple[str, str]:
    candidates = sorted((e for e in registry.implementations() if e.auto_rank is not None and not e.fallback),
                        key=_rank)
    failed: dict[str, str] = {}
    skipped: list[str] = []
    runnable: list[Implementation] = []
    for impl in candidates:
        why = unavailable(impl, site)
        if why:
            failed[impl.name] = why
            continue
        if impl.auto_preferred:
            takes, why = verdict(impl, site)
            if takes:
                note = impl.note(site) if impl.note else ""
                return impl.name, "auto: " + (note or why or f"{impl.name} preferred where it can run")
            skipped.append(f"not {impl.name}: {why}")
            continue
        runnable.append(impl)
    tail = "".join(f"; {s}" for s in skipped)
    if not runnable:
        # (the reasons usually agree: e.g. one symmetric-memory probe behind every candidate)
        why = "; ".join(dict.fromkeys(failed.values())) or "no other implementation can run here"
        return registry.fallback().name, why + tail
    name, why = from_table(runnable, site)
    if name is not None:
        return name, f"auto: {why}{tail}"
    return runnable[0].name, f"auto: {why}, so by capability (not by the measured table){tail}"
