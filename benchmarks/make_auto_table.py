"""Regenerate ``src/weave_compile/kernels/auto_table.py`` (the tables ``kernel="auto"`` picks from).

    python benchmarks/make_auto_table.py [--results benchmarks/results] [--out <path>] [--check]

Only rows measured on today's kernels enter. Each row names the design it timed; the design's
sources (:data:`DESIGN_SOURCES`, files under ``src/weave_compile``) are fingerprinted with their
docstrings and comments left out (:func:`fingerprint`), and a row enters only where that
fingerprint equals today's: from the row's ``source_hash`` column where the benchmark wrote one
(``bench_floor.py`` does), else from the sources at the row's ``git_commit`` read through git (a
commit git does not know, or a ``-dirty`` one, is stale). Every dropped row is counted and named
by design and commit in the output, so a stale measurement is visible, never silently used.

Sources (``--results``; see docs/performance.md):

* ``TABLE`` unsplit: ``allreduce_rmsnorm.csv`` (2x H200), the fused op alone, CUDA graphs, bf16,
  sharded residual: ``fused_symm`` is the p2p push kernel (best over its CTA counts) and
  ``nccl_ar+norm`` (NCCL all_reduce + a compiled add&RMSNorm: a site as written) the plain graph
  ``as written``, at H=8192; the plain graph enters only beside a design;
* ``TABLE`` split: ``split_8b.csv``, ``split_70b.csv`` (2x H200), the split model whose fused sites
  ran ``p2p`` (best over the ``split@N`` CTA variants), ms per layer;
* ``INTERFERENCE`` (the split model of ``kernels/auto.py``): ``interference.csv`` from
  ``bench_interference.py`` (one GPU, ranks emulated): per design and CTA count, the other half's
  layer GEMMs alone (``gemm_alone_us / gemm_reps``: one pass), what the design costs them
  (``slowdown``) and its time per call beside them and alone. Keyed by (world size, hidden size)
  and T = 2 x ``rows`` (``rows`` is one half's tokens). Only ``tp`` = 2 rows enter: the design is
  emulated at 2 ranks whatever the GEMM shapes, so a TP=8 row says nothing of an 8-rank design's
  own time. Both emulated ranks share the GPU, so the designs' times and costs are upper bounds of
  what one GPU of two sees. Without the file ``INTERFERENCE`` is empty and the split falls back to
  ``TABLE`` (the reason says so).
* ``FLOOR`` (the GPU fallback's choice): ``floor.csv`` from ``bench_floor.py`` (one GPU, fake
  process group: communication free), the model rows of each implementation: its ms per layer over
  plain Inductor's on the same model, timed in the same rounds (``ratio_vs_default``), the worst
  over the architectures measured, per (world size, hidden size, T). :func:`floor_table` is also
  what ``bench_floor.py`` installs in-process to time ``auto`` on what it just measured.

Only implementations the fused op can select are entered (baselines such as ``symm_2shot``
and the stand-ins ``standin:...``, ``p2p_barriers``, ``p2p_lowprio`` are not).
"""

from __future__ import annotations

import argparse
import ast
import collections
import csv
import functools
import hashlib
import io
import os
import pprint
import subprocess
import sys
import tokenize
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(HERE, "..", "src", "weave_compile")
OUT = os.path.join(PKG, "kernels", "auto_table.py")
HIDDEN = {"8b": 4096, "70b": 8192}  # bench_interference.py's and bench_floor.py's --dims
INTERFERENCE_WORLD = 2  # the world size bench_interference.py emulates every design at
DESIGNS = ("reference", "p2p", "multimem", "oneshot", "ce", "nccl")  # weave_compile.kernels.names()
AS_WRITTEN = "as written"  # weave_compile.kernels.auto.AS_WRITTEN (this script imports no torch)

# ----------------------------------------------------------------------------- what a design is made of


def _load_sources():
    """``weave_compile/kernels/sources.py`` by path: the package's rule, without importing torch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_weave_sources", os.path.join(PKG, "kernels", "sources.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SOURCES = _load_sources()
DESIGN_SOURCES = _SOURCES.DESIGN_SOURCES
fingerprint = _SOURCES.fingerprint
_expand = _SOURCES.expand


def source_fingerprint(design: str, root: str = PKG) -> str:
    """The fingerprint of ``design``'s sources under ``root`` (a ``weave_compile`` package folder)."""
    return _SOURCES.source_fingerprint(design, root)


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def fingerprint_at(design: str, commit: str) -> Optional[str]:
    """``design``'s fingerprint at ``commit`` (None: git does not know the commit, or it is dirty)."""
    if not commit or "dirty" in commit or _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return None
    top = (_git("rev-parse", "--show-toplevel") or "").strip()
    prefix = os.path.relpath(os.path.abspath(PKG), top).replace(os.sep, "/") if top else "src/weave_compile"

    def listing(folder):
        names = _git("ls-tree", "-r", "--full-tree", "--name-only", commit, f"{prefix}/{folder.rstrip('/')}") or ""
        return [n[len(prefix) + 1:] for n in names.split()]

    texts = {}
    for rel in _expand(listing, design):
        text = _git("show", f"{commit}:{prefix}/{rel}")
        texts[rel] = text if text is not None else ""  # absent then: differs from any file now
    return fingerprint(texts)


class Freshness:
    """Which rows were measured on today's sources of their design; counts what it drops."""

    def __init__(self, root: str = PKG):
        self.root = root
        self.dropped: collections.Counter = collections.Counter()
        self._now: dict[str, str] = {}

    def now(self, design: str) -> str:
        if design not in self._now:
            self._now[design] = source_fingerprint(design, self.root)
        return self._now[design]

    def __call__(self, design: str, row: dict) -> bool:
        """True where ``row`` (with ``git_commit`` and maybe ``source_hash``) timed today's ``design``."""
        if design == AS_WRITTEN:
            return True  # the plain graph: none of this package's code
        got = row.get("source_hash") or fingerprint_at(design, row.get("git_commit", ""))
        if got == self.now(design):
            return True
        self.dropped[(design, row.get("git_commit", "?"))] += 1
        return False

    def report(self) -> str:
        if not self.dropped:
            return "no stale rows"
        return "dropped (sources changed since): " + ", ".join(
            f"{d} @ {c} x{n}" for (d, c), n in sorted(self.dropped.items()))


# ----------------------------------------------------------------------------- tables


def _rows(results: str, name: str) -> Optional[list[dict]]:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return list(csv.DictReader(f))


def unsplit_and_split(results: str, fresh: Freshness) -> tuple[dict, set]:
    """``TABLE`` and the commits it comes from (the 2x H200 measurements of the whole op and model)."""
    best: dict = {}
    commits: dict = collections.defaultdict(set)
    names = {"fused_symm": "p2p", "nccl_ar+norm": AS_WRITTEN}
    for r in _rows(results, "allreduce_rmsnorm.csv") or []:
        design = names.get(r["variant"])
        if design is None or r["dtype"] != "bf16" or r["mode"] != "graph" or r["H"] != "8192":
            continue
        if not fresh(design, r):
            continue
        key = (int(r["world_size"]), False, int(r["T"]))
        best.setdefault(key, {})
        best[key][design] = min(best[key].get(design, float("inf")), float(r["us"]))
        commits[key].add(r["git_commit"])
    for name in ("split_8b.csv", "split_70b.csv"):
        for r in _rows(results, name) or []:
            if not (r["variant"] == "split" or r["variant"].startswith("split@")):  # not the forced sweep
                continue
            if not fresh("p2p", r):
                continue
            key = (int(r["world_size"]), True, int(r["T"]))
            best.setdefault(key, {})
            best[key]["p2p"] = min(best[key].get("p2p", float("inf")), float(r["ms_per_layer"]) * 1e3)
            commits[key].add(r["git_commit"])
    table: dict = collections.defaultdict(dict)
    used: set = set()
    for (ws, split, t), row in best.items():
        if set(row) - {AS_WRITTEN}:  # the plain graph alone decides nothing
            table[(ws, split)][t] = {d: round(us, 2) for d, us in sorted(row.items())}
            used |= commits[(ws, split, t)]
    return {k: dict(sorted(v.items())) for k, v in sorted(table.items())}, used


def interference(results: str, fresh: Freshness) -> tuple[dict, str]:
    """``INTERFERENCE`` and its source line (module doc); the last row of a repeated point wins."""
    rows = _rows(results, "interference.csv")
    if rows is None:
        return {}, "not measured yet (run benchmarks/bench_interference.py, then this script)"
    table: dict = {}
    gpus, commits = set(), set()
    for r in rows:
        if r["design"] not in DESIGNS or int(r["tp"]) != INTERFERENCE_WORLD or r["dims"] not in HIDDEN:
            continue
        if not fresh(r["design"], r):
            continue
        entry = {"gemm_us": round(float(r["gemm_alone_us"]) / int(r["gemm_reps"]), 1),
                 "slowdown": float(r["slowdown"]), "comm_alone_us": float(r["comm_alone_us"]),
                 "comm_with_gemm_us": float(r["comm_with_gemm_us"]) if r["comm_with_gemm_us"] else None}
        per_t = table.setdefault((INTERFERENCE_WORLD, HIDDEN[r["dims"]]), {}).setdefault(2 * int(r["rows"]), {})
        per_t.setdefault(r["design"], {})[int(r["ctas"])] = entry
        gpus.add(r["gpu"])
        commits.add(r["git_commit"])
    table = {k: {t: {d: dict(sorted(c.items())) for d, c in sorted(v.items())} for t, v in sorted(ts.items())}
             for k, ts in sorted(table.items())}
    if not table:
        return {}, "no interference row measured on today's kernels (run benchmarks/bench_interference.py)"
    source = (f"{', '.join(sorted(gpus))} results/interference.csv, 2 ranks emulated on one GPU "
              f"(designs' times and costs are upper bounds), commits {', '.join(sorted(commits))}")
    return table, source


#: floor.csv rows that enter FLOOR: one GPU, communication free, whole-model rows.
FLOOR_COMM = "fake"
FLOOR_SCOPE = "model"


def designs_of(label: str) -> set:
    """The implementations a bench_floor ``kernel`` label names (``"nccl x4+as written x1"`` ->
    ``{"nccl"}``): sites the matcher does not fuse stay as written under every variant."""
    return {part.split(" x")[0] for part in label.split("+") if part} - {AS_WRITTEN}


def floor_table(rows: list[dict], fresh: Callable[[str, dict], bool]) -> tuple[dict, str]:
    """``FLOOR[(world_size, hidden)][T][design]``: the design's ms per layer over plain Inductor's,
    the worst over the architectures measured, from ``bench_floor.py`` rows of implementations
    measured on today's sources; and its source line."""
    worst: dict = {}
    gpus, commits, archs = set(), set(), set()
    for r in rows:
        if (r.get("comm") != FLOOR_COMM or r.get("scope") != FLOOR_SCOPE or r["variant"] not in DESIGNS
                or designs_of(r.get("kernel", "")) != {r["variant"]} or not r.get("ratio_vs_default")):
            continue
        if not fresh(r["variant"], r):
            continue
        key = (int(r["world_size"]), int(r["hidden"]))
        per_t = worst.setdefault(key, {}).setdefault(int(r["T"]), {})
        per_t[r["variant"]] = round(max(per_t.get(r["variant"], 0.0), float(r["ratio_vs_default"])), 4)
        gpus.add(r["gpu"])
        commits.add(r["git_commit"])
        archs.add(r["arch"])
    table = {k: dict(sorted(v.items())) for k, v in sorted(worst.items())}
    if not table:
        return {}, "not measured on today's kernels (run benchmarks/bench_floor.py, then this script)"
    return table, (f"{', '.join(sorted(gpus))} results/floor.csv, fake process group (communication free), worst "
                   f"of {', '.join(sorted(archs))}, commits {', '.join(sorted(commits))}")


def render(table: dict, commits: set, inter: dict, inter_source: str, floor: dict, floor_source: str) -> str:
    source = (f"2x H200 results/allreduce_rmsnorm.csv, split_8b.csv, split_70b.csv "
              f"(commits {', '.join(sorted(commits))})" if table else "no two-GPU row measured on today's kernels (see benchmarks/make_auto_table.py)")
    return f'''"""Measured tables for ``kernel="auto"``: generated by benchmarks/make_auto_table.py, do not edit.

Only rows measured on today's sources of their design are here (make_auto_table.py says how that
is checked). ``TABLE[(world_size, split)][T]`` maps an implementation, or ``"as written"`` (the plain
graph), to its measured time in microseconds: the fused op alone per call when ``split`` is False,
the split TP Llama per layer (8B/70B dims, the faster of the two) when True.
``INTERFERENCE[(world_size, hidden)][T][design][ctas]`` holds, for a layer of T tokens split in
halves, one half's layer GEMMs alone (``gemm_us``), what the design running beside them costs them
(``slowdown``) and its time per call beside them and alone: the split model of
``kernels/auto.py`` reads it. ``FLOOR[(world_size, hidden)][T][design]`` is a design's ms per layer
over plain Inductor's on one GPU with communication free, the worst over the architectures
measured: the GPU fallback's choice. How they are read: ``kernels/auto.py``.
"""

SOURCE = {source!r}

TABLE = {pprint.pformat(table, width=110, sort_dicts=False)}

INTERFERENCE_SOURCE = {inter_source!r}

INTERFERENCE = {pprint.pformat(inter, width=110, sort_dicts=False)}

FLOOR_SOURCE = {floor_source!r}

FLOOR = {pprint.pformat(floor, width=110, sort_dicts=False)}
'''


def generate(results: str, root: str = PKG) -> tuple[str, Freshness]:
    """The module text ``auto_table.py`` should hold for ``results``, and what was dropped."""
    fresh = Freshness(root)
    table, commits = unsplit_and_split(results, fresh)
    inter, inter_source = interference(results, fresh)
    floor, floor_source = floor_table(_rows(results, "floor.csv") or [], fresh)
    return render(table, commits, inter, inter_source, floor, floor_source), fresh


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs from what would be written")
    args = ap.parse_args(argv)
    text, fresh = generate(args.results)
    print(fresh.report())
    if args.check:
        with open(args.out) as f:
            same = f.read() == text
        print(f"{args.out} is {'up to date' if same else 'NOT what the results give: regenerate it'}")
        if not same:
            sys.exit(1)
        return
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
