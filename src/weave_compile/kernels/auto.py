"""Which implementation a fused site gets, or whether it stays as written: the whole policy, in one place.

:func:`choose` runs at compile time, once per site; the choice is baked into the graph as the op's
``kernel`` argument, with a reason for ``explain()``. It may also answer :data:`AS_WRITTEN`: the
fuse pass then leaves the site's all_reduce, add and RMSNorm as they are, for Inductor (the reason
says why). Everything it knows of an implementation comes from its registry entry
(:mod:`.registry`): what it takes, why it cannot run here, and how ``auto`` ranks it.

The rule under everything: **on a GPU, no site runs an eager chain, and no design is preferred
over the plain graph without a measurement on the current code.** ``reference`` (eager torch ops
inside the compiled graph, measured well slower than plain Inductor at every token count:
docs/performance.md section 8) is the CPU path and the oracle; on a GPU it runs only where forced.

``auto``:

1. takes a *preferred* implementation (``auto_preferred``, best ``auto_rank`` first) wherever it
   can run, its crossover allows the site's token count (``auto_max_bytes``: a static T only) and
   it is ready (``auto_ready``: measured across GPUs; today none is);
2. under the token split, the design with the least predicted phase time by the split model
   (:func:`from_split_model`) over the measured interference table
   (``auto_table.INTERFERENCE``), among those that can run;
3. else the fastest of the designs and the plain graph (:data:`AS_WRITTEN`) measured across GPUs
   on the current kernels for the world size and token count (``auto_table.TABLE``);
4. else the fallback (:func:`fallback_choice`).

A forced name runs that implementation where it can run, else the fallback, with the reason.

The fallback. Off GPUs: ``reference``. On a GPU: compiled work, chosen per site by
:func:`floor_verdict` over ``auto_table.FLOOR`` (``benchmarks/bench_floor.py`` on one GPU with
communication free: every variant's ms per layer against plain Inductor on the same model, the
worst over the architectures measured): the GPU fallback implementation (``nccl``: NCCL
reduce-scatter and all-gather around the shared add+norm kernel, the norm on this rank's 1/N of
the rows) where it was measured at least :data:`MIN_GAIN` faster at every measured token count the
site's can take, else the site as written (decode sizes: one all_reduce and Inductor's fused
add+norm beat two collectives' fixed cost). Under the split, which needs a fused op at every site
it splits, the GPU fallback wherever it can run.

What needs two GPUs. The floor is the local part only (collectives move nothing on the fake
group). Stated rules until the two-GPU runs confirm them: NCCL's all_reduce is a reduce-scatter
plus an all-gather on the wire for the large messages where ``nccl`` is taken, so the floor's
ranking carries over (confirmed by ``torchrun --nproc-per-node 2 benchmarks/bench_floor.py
--comm nccl``); ``p2p``, ``ce`` and ``oneshot`` are taken unsplit only from ``TABLE`` rows measured
across two GPUs on the current kernels (``torchrun --nproc-per-node 2
benchmarks/bench_allreduce_rmsnorm.py``, then ``benchmarks/make_auto_table.py``), which drops every
row whose design's sources changed since the commit that measured it); ``multimem`` and
``oneshot`` wait for their measurement (``auto_ready``).

The capability checks may be collective (a symmetric-memory probe): every rank compiles the same
graphs, so every rank gets here together and in the same order.

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

import hashlib
import math
import pprint
from typing import Optional

import torch

from . import auto_table, registry
from .registry import Implementation, Site
from .shared.common import DEFAULT_COMM_CTAS

#: :func:`choose`'s answer where the site stays as written (no fused op): not an implementation.
AS_WRITTEN = "as written"
#: A design is preferred over the plain graph only where it measured at least this much faster
#: (ratio <= 1 - MIN_GAIN): run-to-run drift of one GPU is a few percent (docs/performance.md
#: section 4, "Run-to-run spread").
MIN_GAIN = 0.02


class BatchInvariantError(RuntimeError):
    """``batch_invariant=True`` and a site where no implementation that adds the partial sums in a
    fixed order can run, whose chain as written is not batch-invariant either."""


def choose(requested: str, site: Site) -> tuple[str, str]:
    """``(implementation name, reason)`` for ``requested`` (``auto`` or a registered name) at ``site``;
    with ``batch_invariant`` a batch-invariant one, or :class:`BatchInvariantError` (:func:`invariant`)."""
    name, why = _choose(requested, site)
    return invariant(name, why, site) if site.batch_invariant else (name, why)


def written_invariant(world_size: int, device: torch.device) -> bool:
    """Whether a site as written is batch-invariant: at two ranks on CPU ranks (``a + b`` is
    ``b + a`` bitwise, whatever order the all_reduce adds them in; Inductor's C++ add and norm
    compute each row alike at every token count: tested), not at more (NCCL's and gloo's reduction
    order change with the message size and the rank), and not on GPUs: there Inductor picks a
    reduction kernel's rows per program, warps and split by the row count (pytorch/pytorch#197311),
    so a row's norm may round differently in another batch."""
    return world_size <= 2 and torch.device(device).type == "cpu"


def invariant(name: str, why: str, site: Site) -> tuple[str, str]:
    """``(name, why)`` checked for ``batch_invariant``: an implementation that claims it on the
    site's device, or the site as written where that is invariant (:func:`written_invariant`), or on
    a GPU the GPU fallback where it runs (``nccl``: what a site the floor leaves as written, or a
    forced design that is not invariant there, gets); else :class:`BatchInvariantError` naming the
    site's group and why."""
    from .measured import dispatch

    if name != AS_WRITTEN:
        lacking = [r for r in (registry.invariant_on(registry.get(n), site.device) for n in dispatch.designs(name))
                   if r is not None]
        if not lacking:
            return name, f"{why}; batch-invariant: partial sums added in rank order in fp32"
        why = f"{why}; {'; '.join(lacking)}"
    if written_invariant(site.world_size, site.device):
        return AS_WRITTEN, (f"{why}; batch-invariant as written: 2 CPU ranks (the sum of two partials has one "
                            "order)")
    gpu = registry.gpu_fallback()  # on a GPU the site as written never is: the GPU fallback where it runs
    if (site.device.type == "cuda" and gpu is not None and name != gpu.name
            and registry.invariant_on(gpu, site.device) is None and unavailable(gpu, site) is None):
        return gpu.name, (f"{why}; the site as written is not batch-invariant on a GPU: GPU fallback {gpu.name}, "
                          "batch-invariant: partial sums added in rank order in fp32")
    written = (f"an all_reduce of {site.world_size} ranks adds the partial sums in an order that changes with "
               "the message size" if site.world_size > 2 else
               f"on {site.device.type} Inductor picks the norm's reduction kernel shape by the row count")
    raise BatchInvariantError(
        f"batch_invariant=True: the site (process group {site.group_name!r}, {site.world_size} ranks, "
        f"H={site.hidden}, {site.dtype}, {site.device.type}) would stay as written ({why}), and {written}; no "
        "batch-invariant implementation can run here")


def _choose(requested: str, site: Site) -> tuple[str, str]:
    if requested == registry.AUTO:
        return _auto(site)
    impl = registry.get(requested)
    if impl.fallback:
        return impl.name, "requested"
    why = unavailable(impl, site)
    if why:
        return fallback_choice(site, f"requested {impl.name!r} unavailable: {why}")
    better = [e.name for e in _preferred() if _rank(e) < _rank(impl)
              and unavailable(e, site) is None and verdict(e, site)[0]]
    return impl.name, "requested" + (f" ({', '.join(better)} also available)" if better else "")


def unavailable(impl: Implementation, site: Site) -> Optional[str]:
    """Why ``impl`` cannot run at ``site`` (None if it can): what it takes, then its own check
    (which may be collective: a symmetric-memory probe)."""
    return takes(impl, site) or impl.check(site)


def takes(impl: Implementation, site: Site) -> Optional[str]:
    """Why ``impl`` does not compute the site's form (None if it does): its capability flags alone,
    never collective."""
    if site.has_scale and not impl.takes_scale:
        takers = [e.name for e in registry.implementations() if e.takes_scale]
        return f"scaled site: only {', '.join(takers)} take a scale"
    if site.eps_on_device and not impl.takes_eps_tensor:
        takers = [e.name for e in registry.implementations() if e.takes_eps_tensor]
        return f"eps is a device tensor: only {', '.join(takers)} read it there (the others read it on the host)"
    not_invariant = site.batch_invariant and registry.invariant_on(impl, site.device)
    if not_invariant:
        return f"{not_invariant}; batch-invariant here: {', '.join(registry.invariant_takers(site.device))}"
    if site.norm == "layernorm" and not impl.takes_layernorm:
        takers = [e.name for e in registry.implementations() if e.takes_layernorm]
        return f"LayerNorm site: only {', '.join(takers)} compute a LayerNorm (the others RMSNorm only)"
    if site.quant is not None and not impl.takes_quant:
        takers = [e.name for e in registry.implementations() if e.takes_quant]
        return f"{site.quant.describe()} epilogue: only {', '.join(takers)} quantize inside the op"
    return None


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
    """``(name or AS_WRITTEN, reason)`` of the fastest measured among ``runnable`` and the plain
    graph (where its row has it), or ``(None, why)`` where the table does not decide (nothing
    measured there, or none of its designs can run)."""
    row, where = lookup(site.world_size, site.num_tokens, site.split)
    if row is None:
        return None, where
    names = {e.name for e in runnable} | {AS_WRITTEN}
    ranked = [(us, design) for design, us in row.items() if design in names]
    if not ranked or all(d == AS_WRITTEN for _, d in ranked):
        return None, f"measured {sorted(row)} at {where}, none of them can run here"
    us, design = min(ranked)
    others = ", ".join(f"{d} {u:.1f} us" for d, u in sorted(row.items()) if d != design)
    return design, (f"fastest measured at {where}: {design} {us:.1f} us" + (f" (vs {others})" if others else "")
                    + f" [{auto_table.SOURCE}]")


def _by_hidden(table: dict, what: str, world_size: int, hidden: int) -> tuple[Optional[dict], str]:
    """``(table[(world_size, h)], where)`` for the nearest measured ``h`` within a factor of 2 of
    ``hidden``, or ``(None, why)``."""
    keys = [h for (w, h) in table if w == int(world_size)]
    if not keys:
        return None, f"no {what} measured at world size {world_size}"
    h = min(keys, key=lambda k: abs(math.log(k / max(1, hidden))))
    if not h / 2 <= hidden <= h * 2:
        return None, f"no {what} measured near H={hidden} at world size {world_size} (measured H {sorted(keys)})"
    return table[(int(world_size), h)], f"world size {world_size}, H={h}"


def interference_rows(world_size: int, hidden: int) -> tuple[Optional[dict], str]:
    """``({T: {design: {ctas: entry}}}, where)`` measured at ``world_size`` and the nearest measured
    hidden size within a factor of 2, or ``(None, why)``."""
    return _by_hidden(auto_table.INTERFERENCE, "interference", world_size, hidden)


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
        return fallback_choice(site, why + tail)
    split_why = ""
    if site.split:
        name, split_why = from_split_model(runnable, site)
        if name is not None:
            return name, f"auto: {split_why}{tail}"
        split_why += "; "
    name, why = from_table(runnable, site)
    if name is not None:
        return name, f"auto: {split_why}{why}{tail}"
    return fallback_choice(site, f"auto: {split_why}{why}{tail}")


# ----------------------------------------------------------------------------- a kernel argument


def implementation_for(kernel: str, num_tokens: int) -> Implementation:
    """The implementation that runs a call of ``num_tokens`` tokens for the op's ``kernel`` argument:
    a registered name, or a table by token count (:mod:`.measured.dispatch`)."""
    from .measured import dispatch

    return registry.get(dispatch.resolve(kernel, num_tokens))


def reservations(kernel: str, site: Site) -> list[tuple[Implementation, Optional[int]]]:
    """``(implementation, token count to reserve for)`` for every design ``kernel`` can run at
    ``site``: a plain name for the site's size hint; each design of a table for the top of its
    token range (the last one for the site's largest count: its bound, else the largest bucket)."""
    from .measured import dispatch
    from .measured.signature import max_bucket

    table = dispatch.decode(kernel)
    if table is None:
        return [(registry.get(kernel), site.size_hint)]
    hi = site.token_range[1] if site.token_range is not None and site.token_range[1] is not None else None
    last = max(site.size_hint or 0, hi if hi is not None else max_bucket(site.device.type))
    tops: dict[str, int] = {}
    for top, design in table:
        tops[design] = max(tops.get(design, 0), top if top is not None else last)
    return [(registry.get(d), t) for d, t in tops.items() if registry.get(d).reserve is not None]


# ----------------------------------------------------------------------------- the fallback


def fallback_choice(site: Site, why: str) -> tuple[str, str]:
    """``(name or AS_WRITTEN, reason)`` where nothing chosen runs at ``site`` (``why`` says why).

    Off GPUs ``reference``. On a GPU the GPU fallback implementation where :func:`floor_verdict`
    takes it (always under the split, which needs a fused op), else the site as written."""
    if site.device.type != "cuda":
        return registry.fallback().name, why
    gpu = registry.gpu_fallback()
    if gpu is None:
        return AS_WRITTEN, f"{why}; left as written (no GPU fallback is registered)"
    cannot = unavailable(gpu, site)
    if cannot:
        return AS_WRITTEN, f"{why}; left as written ({gpu.name}, the GPU fallback, cannot run here either: {cannot})"
    if site.split:
        return gpu.name, f"{why}; GPU fallback {gpu.name} (the split needs a fused op at the sites it splits)"
    takes, floor_why = floor_verdict(gpu.name, site)
    if takes:
        return gpu.name, f"{why}; GPU fallback {gpu.name}: {floor_why}"
    return AS_WRITTEN, f"{why}; left as written: {floor_why}"


def runtime_fallback(device: torch.device) -> Implementation:
    """What the op runs where its implementation cannot run now (tensors on a device it does not
    run on; buffers that cannot grow inside CUDA-graph capture): on CUDA tensors the GPU
    fallback, compiled work (``nccl`` takes everything the symmetric-memory designs take, so no
    site that chose one can hold what it cannot run), elsewhere ``reference``."""
    if torch.device(device).type == "cuda":
        gpu = registry.gpu_fallback()
        if gpu is None:
            raise RuntimeError("weave::allreduce_add_rmsnorm: no GPU fallback implementation is registered, and "
                               "the reference fallback's eager chain does not run on CUDA tensors unless forced")
        return gpu
    return registry.fallback()


def _token_bounds(site: Site) -> tuple[Optional[int], Optional[int]]:
    """``(lowest, highest)`` token count of the site (None where unknown or unbounded)."""
    if site.num_tokens is not None:
        return site.num_tokens, site.num_tokens
    if site.token_range is not None:
        return site.token_range
    return None, None


def floor_rows(world_size: int, hidden: int) -> tuple[Optional[dict], str]:
    """``({T: {design: ratio}}, where)`` of ``auto_table.FLOOR`` at ``world_size`` and the nearest
    measured hidden size within a factor of 2, or ``(None, why)``."""
    return _by_hidden(auto_table.FLOOR, "floor", world_size, hidden)


def floor_verdict(design: str, site: Site) -> tuple[bool, str]:
    """Whether ``design`` runs ``site`` rather than the plain graph, by the measured floor, and why.

    Taken where its ms per layer over plain Inductor's (the worst over the architectures measured)
    is at most ``1 - MIN_GAIN`` at every measured T from the site's lowest token count on, and the
    site's highest is at most twice the largest measured T: between two measured T that both win
    it wins, and nothing is extrapolated further. A symbolic token count without such bounds keeps
    the plain graph, and so does a sequence-parallel site: its plain graph is already reduce-scatter,
    norm on this rank's rows, all-gather, and on one GPU (communication free) the fused op measured
    no faster than it by the margin (docs/performance.md section 0); what a design saves on the wire
    there needs two GPUs."""
    if site.sequence_parallel:
        return False, ("sequence-parallel site: its plain graph already norms this rank's rows only; with "
                       f"communication free the fused op measured 0.98-1.00x of it, not {MIN_GAIN:.0%} faster "
                       "(results/sequence_parallel_titan_8b.csv); force a kernel to fuse it")
    rows, where = floor_rows(site.world_size, site.hidden)
    if rows is None:
        return False, f"{where} (plain Inductor is kept where no measurement says otherwise)"
    ts = sorted(rows)
    ratio = {t: rows[t].get(design) for t in ts}
    wins = {t: r is not None and r <= 1 - MIN_GAIN for t, r in ratio.items()}
    cross = next((t for i, t in enumerate(ts) if all(wins[u] for u in ts[i:])), None)
    src = f"[{auto_table.FLOOR_SOURCE}]"

    def shown(t):
        return f"{design} {ratio[t]:.2f}x at T={t}" if ratio[t] is not None else f"{design} not measured at T={t}"

    slower = f"plain Inductor measured faster, or {design} less than {MIN_GAIN:.0%} faster,"
    if cross is None:
        return False, f"{slower} up to T={ts[-1]} ({shown(ts[-1])}), {where} {src}"
    lo, hi = _token_bounds(site)
    losers = [t for t in ts if t < cross]
    if lo is None:
        return False, (f"token count unknown at compile time; {design} wins only from T={cross} on"
                       + (f" ({slower} at T<={losers[-1]})" if losers else "") + f", {where} {src}")
    if lo < cross:
        near = min(losers, key=lambda t: abs(math.log(t / max(1, lo))))
        return False, f"{slower} at T<={losers[-1]} ({shown(near)}); {design} only from T={cross} on, {where} {src}"
    if hi is None or hi > 2 * ts[-1]:
        return False, (f"T up to {'unbounded' if hi is None else hi} exceeds twice the largest measured T={ts[-1]} "
                       f"({design} wins from T={cross} on), {where} {src}")
    near = min((t for t in ts if t >= cross), key=lambda t: abs(math.log(t / max(1, lo))))
    return True, f"{shown(near)} of plain Inductor (wins from T={cross} on), {where} {src}"


def tables_digest() -> str:
    """A digest of every table ``auto`` reads, for the compile cache key: a graph compiled under
    other tables (a benchmark installs the floor it just measured) must not be served from cache."""
    text = pprint.pformat((auto_table.TABLE, auto_table.INTERFERENCE, auto_table.FLOOR, MIN_GAIN), width=200)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
