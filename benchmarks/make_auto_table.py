"""Regenerate ``src/weave_compile/kernels/auto_table.py`` (the tables ``kernel="auto"`` picks from).

    python benchmarks/make_auto_table.py [--results benchmarks/results] [--out <path>]

Sources (``--results``; see docs/performance.md):

* ``TABLE`` unsplit: ``allreduce_rmsnorm.csv`` (2x H200), the fused op alone, CUDA graphs, bf16,
  sharded residual: ``fused_symm`` is the p2p push kernel (best over its CTA counts), at H=8192;
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

Only implementations the fused op can select are entered (baselines such as ``nccl_ar+norm``,
``symm_2shot`` and the stand-ins ``standin:...``, ``p2p_barriers``, ``p2p_lowprio`` are not).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import pprint
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "src", "weave_compile", "kernels", "auto_table.py")
HIDDEN = {"8b": 4096, "70b": 8192}  # bench_interference.py's --dims
INTERFERENCE_WORLD = 2  # the world size bench_interference.py emulates every design at
DESIGNS = ("reference", "p2p", "multimem", "oneshot", "ce", "nccl")  # weave_compile.kernels.names()


def _rows(results: str, name: str) -> Optional[list[dict]]:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return list(csv.DictReader(f))


def unsplit_and_split(results: str) -> tuple[dict, set]:
    """``TABLE`` and the commits it comes from (the 2x H200 measurements of the whole op and model)."""
    table: dict = collections.defaultdict(dict)
    commits: set = set()
    best: dict = {}
    for r in _rows(results, "allreduce_rmsnorm.csv") or []:
        if r["variant"] != "fused_symm" or r["dtype"] != "bf16" or r["mode"] != "graph" or r["H"] != "8192":
            continue
        key = (int(r["world_size"]), False, int(r["T"]))
        best[key] = min(best.get(key, float("inf")), float(r["us"]))
        commits.add(r["git_commit"])
    for (ws, split, t), us in best.items():
        table[(ws, split)][t] = {"p2p": round(us, 2)}
    split_best: dict = {}
    for name in ("split_8b.csv", "split_70b.csv"):
        for r in _rows(results, name) or []:
            if not (r["variant"] == "split" or r["variant"].startswith("split@")):  # not the forced sweep
                continue
            key = (int(r["world_size"]), True, int(r["T"]))
            split_best[key] = min(split_best.get(key, float("inf")), float(r["ms_per_layer"]) * 1e3)
            commits.add(r["git_commit"])
    for (ws, split, t), us in split_best.items():
        table[(ws, split)][t] = {"p2p": round(us, 1)}
    return {k: dict(sorted(v.items())) for k, v in sorted(table.items())}, commits


def interference(results: str) -> tuple[dict, str]:
    """``INTERFERENCE`` and its source line (module doc); the last row of a repeated point wins."""
    rows = _rows(results, "interference.csv")
    if rows is None:
        return {}, "not measured yet (run benchmarks/bench_interference.py, then this script)"
    table: dict = {}
    gpus, commits = set(), set()
    for r in rows:
        if r["design"] not in DESIGNS or int(r["tp"]) != INTERFERENCE_WORLD or r["dims"] not in HIDDEN:
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
    source = (f"{', '.join(sorted(gpus)) or 'no rows'} results/interference.csv, 2 ranks emulated on one GPU "
              f"(designs' times and costs are upper bounds), commits {', '.join(sorted(commits)) or '-'}")
    return table, source


def render(table: dict, commits: set, inter: dict, inter_source: str) -> str:
    return f'''"""Measured tables for ``kernel="auto"``: generated by benchmarks/make_auto_table.py, do not edit.

``TABLE[(world_size, split)][T]`` maps an implementation to its measured time in microseconds: the
fused op alone per call when ``split`` is False, the split TP Llama per layer (8B/70B dims, the
faster of the two) when True. ``INTERFERENCE[(world_size, hidden)][T][design][ctas]`` holds, for a
layer of T tokens split in halves, one half's layer GEMMs alone (``gemm_us``), what the design
running beside them costs them (``slowdown``) and its time per call beside them and alone: the
split model of ``kernels/auto.py`` reads it. How they are read: ``kernels/auto.py``.
"""

SOURCE = "2x H200 results/allreduce_rmsnorm.csv, split_8b.csv, split_70b.csv (commits {", ".join(sorted(commits))})"

TABLE = {pprint.pformat(table, width=110, sort_dicts=False)}

INTERFERENCE_SOURCE = {inter_source!r}

INTERFERENCE = {pprint.pformat(inter, width=110, sort_dicts=False)}
'''


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    table, commits = unsplit_and_split(args.results)
    inter, inter_source = interference(args.results)
    with open(args.out, "w") as f:
        f.write(render(table, commits, inter, inter_source))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
