"""Plot prefill latency of a Hugging Face TP model per variant from examples/hf_tp.py CSVs.

    python benchmarks/plot_hf_tp.py benchmarks/results/hf_tp_llama8b.csv \\
        --tag a0aa763=16-ctas --tag 6d55ba0=32-ctas --out benchmarks/results/hf_tp_llama8b.png

Runs with different options are told apart by their commit (``hf_tp.py --csv`` appends every run
to one file): ``--tag COMMIT=TAG`` appends TAG to that commit's tokenweave label; without a tag,
a tokenweave label gets its commit wherever the rows hold more than one. ``CSV:TAG`` tags a whole
file instead. Prints the table the plot shows (ms, and each variant over torch.compile default).
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csvs", nargs="+")
    ap.add_argument("--tag", action="append", default=[], metavar="COMMIT=TAG",
                    help="label that commit's tokenweave rows (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tags = dict(t.split("=", 1) for t in args.tag)
    series: dict[str, dict[int, float]] = defaultdict(dict)
    decode: dict[str, float] = {}
    meta = None
    files = []
    for spec in args.csvs:
        path, _, tag = spec.partition(":")
        with open(path) as f:
            files.append((list(csv.DictReader(f)), tag))
    several = len({row["commit"] for rows, _ in files for row in rows}) > 1
    for rows, file_tag in files:
        for row in rows:
            meta = meta or row
            tag = file_tag or tags.get(row["commit"]) or (row["commit"] if several else "")
            name = row["variant"] + (f" ({tag})" if tag and row["variant"] == "tokenweave" else "")
            if row["phase"] == "prefill":
                series[name][int(row["tokens"])] = float(row["ms"])
            else:
                decode[name] = float(row["ms"])
    ts = sorted({t for s in series.values() for t in s})
    base = series.get("default", {})
    print("prefill ms (x = over torch.compile default)")
    print(f"{'variant':24s}" + "".join(f"{t:>16d}" for t in ts))
    for name, s in series.items():
        cells = "".join(f"{s[t]:9.1f} ({s[t] / base[t]:.2f}x)" if t in s and t in base else f"{s.get(t, float('nan')):16.1f}"
                        for t in ts)
        print(f"{name:24s}{cells}")
    for name, ms in decode.items():
        print(f"decode step {name}: {ms:.1f} ms")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in series.items():
        xs = sorted(s)
        ax.plot(xs, [s[t] / t * 1e3 for t in xs], "-o", label=name, ms=4)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill tokens T")
    ax.set_ylabel("latency per 1000 tokens (ms)")
    ax.set_title(f"{meta['arch']} {meta['size']} dims, {meta['layers']} layers, TP={meta['world']}, "
                 f"{meta['dtype'].replace('torch.', '')}, {meta['gpu']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
