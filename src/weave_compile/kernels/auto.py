"""Which implementation a fused site gets: the whole policy, forced and ``auto``, in one place.

:func:`choose` runs at compile time, once per site; the choice is baked into the graph as the op's
``kernel`` argument, with a reason for ``explain()``. Everything it knows of an implementation
comes from its registry entry (:mod:`.registry`): what it takes, why it cannot run here, and how
``auto`` ranks it. ``auto``:

1. takes a *preferred* implementation (``auto_preferred``, best ``auto_rank`` first) wherever it
   can run, its crossover allows the site's token count (``auto_max_bytes``: a static T only) and
   it is ready (``auto_ready``);
2. under the token split, the design with the least predicted phase time by the split model
   (:func:`from_split_model`) over the measured interference table
   (``auto_table.INTERFERENCE``), among those that can run;
3. else the fastest design measured for the world size, token count and split (``auto_table.TABLE``:
   the fused op alone unsplit, the whole split model per layer split), among those that can run;
4. where nothing applicable was measured, the capability order (``auto_rank``);
5. else the fallback.

Only implementations with an ``auto_rank`` or named in a table that applies are considered (an
implementation without a rank is taken only from measured rows). Forcing a name runs that
implementation where it can run, else the fallback, with the reason. The capability checks may be
collective (a symmetric-memory probe): every rank compiles the same graphs, so every rank gets here
together and in the same order.

The split model. Under the split, each half's fused op runs beside the other half's GEMMs: a layer
is four phases, each one op call of one half beside about half of the other half's layer GEMMs
(the attention-side or the MLP-side ones). A phase lasts about ``max(GEMMs beside the design, the
design beside the GEMMs)`` = ``max(gemm_us / 2 * slowdown, comm_us)``, with ``gemm_us`` one pass of
a layer's GEMMs over one half's rows alone, ``slowdown`` what the design costs them and ``comm_us``
one call's time beside them (its time alone where that was not measured), all at the configured
``comm_ctas`` (the nearest measured CTA count): the op runs at that count, so the prediction is
made for it. The design with the least predicted phase wins. The model ranks designs; it does not
predict a layer's latency (attention, pointwise kernels and the phases' unequal sizes are left out).
"""

from __future__ import annotations

import math
from typing import Optional

from . import auto_table, registry
from .registry import Implementation, Site
from .shared.common import DEFAULT_COMM_CTAS


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


# ----------------------------------------------------------------------------- the measured tables


def _nearest_t(ts: list[int], num_tokens: int) -> int:
    return min(ts, key=lambda m: abs(math.log(m / max(1, num_tokens))))


def lookup(world_size: int, num_tokens: Optional[int], split: bool) -> tuple[Optional[dict], str]:
    """``(row, where)``: the row of ``auto_table.TABLE`` that applies (the nearest measured T within a
    factor of 2 of the measured range), with where it was measured, or ``(None, why)``."""
    rows = auto_table.TABLE.get((int(world_size), bool(split)))
    if not rows:
        return None, f"nothing measured at world size {world_size} ({'split' if split else 'unsplit'})"
    ts = sorted(rows)
    if num_tokens is None:
        winners = {min(r, key=r.get) for r in rows.values()}
        if len(winners) != 1:
            return None, "token count unknown at compile time and no design wins at every measured T"
        design = winners.pop()
        return {design: max(r[design] for r in rows.values())}, (
            f"world size {world_size}, token count unknown: {design} fastest at every measured T {ts[0]}..{ts[-1]}")
    if not ts[0] / 2 <= num_tokens <= ts[-1] * 2:
        return None, f"T={num_tokens} outside the measured range {ts[0]}..{ts[-1]} (x2) at world size {world_size}"
    t = _nearest_t(ts, num_tokens)
    return rows[t], f"world size {world_size}, {'split' if split else 'unsplit'}, T={num_tokens} (nearest measured T={t})"


def from_table(runnable: list[Implementation], site: Site) -> tuple[Optional[str], str]:
    """``(name, reason)`` of the fastest measured design among ``runnable``, or ``(None, why)``
    where the table does not decide (nothing measured there, or none of its designs can run)."""
    row, where = lookup(site.world_size, site.num_tokens, site.split)
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


def interference_rows(world_size: int, hidden: int) -> tuple[Optional[dict], str]:
    """``({T: {design: {ctas: entry}}}, where)`` measured at ``world_size`` and the nearest measured
    hidden size within a factor of 2, or ``(None, why)``."""
    keys = [h for (w, h) in auto_table.INTERFERENCE if w == int(world_size)]
    if not keys:
        return None, f"no interference measured at world size {world_size}"
    h = min(keys, key=lambda k: abs(math.log(k / max(1, hidden))))
    if not h / 2 <= hidden <= h * 2:
        return None, f"no interference measured near H={hidden} at world size {world_size} (measured H {sorted(keys)})"
    return auto_table.INTERFERENCE[(int(world_size), h)], f"world size {world_size}, H={h}"


def phase_prediction(entry: dict) -> tuple[float, str]:
    """``(predicted phase us, how)`` of one design at one (T, CTA count) by the split model."""
    gemm = entry["gemm_us"] / 2 * entry["slowdown"]
    comm, which = entry["comm_with_gemm_us"], "beside them"
    if not comm:
        comm, which = entry["comm_alone_us"], "alone (not measured beside them)"
    return max(gemm, comm), (f"max(GEMMs {entry['gemm_us'] / 2:.0f} us x {entry['slowdown']:.3f}, "
                             f"{comm:.0f} us {which})")


def _predict(rows: dict, t: int, names: set, ctas: int) -> list[tuple[float, str, int, str]]:
    """``(phase us, design, measured CTA count, how)`` for every design of ``names`` measured at ``t``."""
    out = []
    for design, per_ctas in rows[t].items():
        if design in names and per_ctas:
            c = min(per_ctas, key=lambda k: abs(math.log(k / max(1, ctas))))
            us, how = phase_prediction(per_ctas[c])
            out.append((us, design, c, how))
    return sorted(out)


def from_split_model(runnable: list[Implementation], site: Site) -> tuple[Optional[str], str]:
    """Under the split: ``(name, reason)`` of the design with the least predicted phase time (module
    doc) among ``runnable``, or ``(None, why)`` where the interference table does not decide."""
    rows, where = interference_rows(site.world_size, site.hidden)
    if rows is None:
        return None, where
    names = {e.name for e in runnable}
    ctas = site.comm_ctas or DEFAULT_COMM_CTAS
    ts = sorted(rows)
    if site.num_tokens is None:
        winners = {t: _predict(rows, t, names, ctas) for t in ts}
        best = {p[0][1] for p in winners.values() if p}
        if len(best) != 1:
            return None, (f"split model at {where}: token count unknown at compile time and no design has the least "
                          f"predicted phase at every measured T ({sorted(best) or 'none that can run'})")
        design = best.pop()
        return design, (f"split model at {where}, {ctas} CTAs, token count unknown: {design} has the least predicted "
                        f"phase at every measured T {ts[0]}..{ts[-1]} [{auto_table.INTERFERENCE_SOURCE}]")
    if not ts[0] / 2 <= site.num_tokens <= ts[-1] * 2:
        return None, f"split model: T={site.num_tokens} outside the measured range {ts[0]}..{ts[-1]} (x2) at {where}"
    t = _nearest_t(ts, site.num_tokens)
    preds = _predict(rows, t, names, ctas)
    if not preds:
        return None, f"split model: measured {sorted(rows[t])} at {where}, T={t}, none of them can run here"
    shown = "; ".join(f"{d}@{c} {us:.0f} us = {how}" for us, d, c, how in preds)
    return preds[0][1], (f"least predicted split phase at {where}, T={site.num_tokens} (nearest measured T={t}, "
                         f"{t // 2} rows per half), {ctas} CTAs: {shown} [{auto_table.INTERFERENCE_SOURCE}]")


def _measured_names(site: Site) -> set:
    """Every design named in a table that applies to ``site`` (an unranked one can be taken only there)."""
    names = {d for row in auto_table.TABLE.get((int(site.world_size), bool(site.split)), {}).values() for d in row}
    if site.split:
        names |= {d for (w, _), rows in auto_table.INTERFERENCE.items() if w == int(site.world_size)
                  for row in rows.values() for d in row}
    return names


# ----------------------------------------------------------------------------- auto


def _rank(impl: Implementation) -> float:
    return math.inf if impl.auto_rank is None else impl.auto_rank


def _preferred() -> list[Implementation]:
    return sorted((e for e in registry.implementations() if e.auto_preferred), key=_rank)


def _auto(site: Site) -> tuple[str, str]:
    measured = _measured_names(site)
    candidates = sorted((e for e in registry.implementations()
                         if (e.auto_rank is not None or e.name in measured) and not e.fallback), key=_rank)
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
    split_why = ""
    if site.split:
        name, split_why = from_split_model(runnable, site)
        if name is not None:
            return name, f"auto: {split_why}{tail}"
        split_why += "; "
    name, why = from_table(runnable, site)
    if name is not None:
        return name, f"auto: {split_why}{why}{tail}"
    ranked = [e for e in runnable if e.auto_rank is not None]
    if not ranked:
        return registry.fallback().name, f"auto: {split_why}{why}; no ranked implementation can run here{tail}"
    return ranked[0].name, f"auto: {split_why}{why}, so by capability (not by the measured table){tail}"
