"""What the backend found and did, for ``weave_compile.explain()``.

Every all_reduce and reduce_scatter site the passes look at gets a :class:`SiteReport`: fused or not and why, the
kernel chosen and why, whether its residual stays sharded, whether it is split. The split pass's
summary of a graph is a :class:`SplitSummary`. A :class:`GraphReport` groups one compiled graph's
sites. The passes return these as plain values; the pass manager assembles them (no pass keeps a
report object in the graph). A graph whose ranks disagreed runs with its collectives as written
(:mod:`weave_compile.agreement`): its report keeps what the passes found and says why it does not
run them. A graph that Dynamo ended at a graph break says why (Dynamo's reason and the user's
line), and a site whose all_reduce result leaves it before any RMSNorm reads as cut by that break:
its norm is in the next graph. Reports accumulate in this process until :func:`reset`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
import threading
from typing import Optional


@dataclasses.dataclass
class SiteReport:
    node: str  # name of the all_reduce (or reduce_scatter) node in the post-grad graph
    group: str
    fused: bool
    reason: str  # the matched form if fused, why not otherwise
    kernel: str = "-"
    kernel_reason: str = ""
    residual: str = "-"  # "full" | "in sharded" | "out sharded" | "in+out sharded" | "sharded by the model"
    split: str = "not split"
    output: str = "-"  # "ring slot k" (left where the peers pushed it) | "copied (why)"
    #: the collectives the site is written with: "all_reduce", or "reduce_scatter/all_gather"
    #: (sequence parallel); the "form / reason" cell names them too
    form: str = "all_reduce"

    def row(self, as_written: bool = False) -> list[str]:
        if as_written:
            # The graph runs its collectives as written: no kernel, residual, split or output
            # choice of the passes applies, whatever they had chosen.
            return [self.node, self.group, "no (as written)" if self.fused else "no", self.reason,
                    "-", "-", "-", "-"]
        return [self.node, self.group, "yes" if self.fused else "no", self.reason,
                f"{self.kernel} ({self.kernel_reason})" if self.kernel_reason else self.kernel,
                self.residual, self.split, self.output]


@dataclasses.dataclass
class SplitSummary:
    """What the token split did to one graph."""

    applied: bool = False
    reason: str = ""  # why not, when not applied
    tokens: str = "-"
    split_at: str = "-"
    halves: int = 0  # ops computed per half
    barriers: list[str] = dataclasses.field(default_factory=list)
    #: the sites (their all_reduce node names) whose fused op runs per half on the comm stream
    sites: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if not self.applied:
            return f"not split: {self.reason}"
        text = f"split {self.tokens} at {self.split_at}: {self.halves} ops per half"
        if self.barriers:
            text += f"; {len(self.barriers)} barrier(s): " + "; ".join(self.barriers)
        return text


@dataclasses.dataclass
class GraphReport:
    graph_id: int
    compiler: str
    note: str = ""
    sites: list[SiteReport] = dataclasses.field(default_factory=list)
    #: ``{"all_reduce": (before, after), "weave.allreduce_add_rmsnorm": (before, after)}``
    op_counts: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    #: the split pass's summary, None if it did not run
    split: Optional[SplitSummary] = None
    #: why the graph runs with its collectives as written (the ranks disagreed), "" if rewritten
    as_written: str = ""
    #: what the caller compiled this graph for (e.g. "decode batch=8"), shown after its id
    label: str = ""
    #: what merging sibling linears did (``passes.split_tokens.merge_projections``), "" if it did not run
    projections: str = ""
    #: all-gathers that are no fused site's (e.g. a vocab-parallel output's logits), by node name
    other_gathers: list[str] = dataclasses.field(default_factory=list)
    #: how many all_reduces each merge of the merge pass made one (MoE routed + shared experts):
    #: the all_reduce sites are the all_reduces before the passes less ``sum(merged) - len(merged)``
    merged: list[int] = dataclasses.field(default_factory=list)
    #: all_reduces and reduce_scatters whose result leaves the graph before any RMSNorm (a graph output)
    leaves: list[str] = dataclasses.field(default_factory=list)
    #: per process group, the measured choice (``kernels/measured``: its source, reason and the
    #: timings per signature and token count), empty where it did not run
    measured: list[dict] = dataclasses.field(default_factory=list)
    #: why Dynamo ended this graph before the end of the frame (a graph break), "" if it did not;
    #: :data:`UNKNOWN_BREAK` where Dynamo gave no reason
    graph_break: str = ""

    @property
    def matched_count(self) -> int:
        """Sites that run fused."""
        return 0 if self.as_written else sum(s.fused for s in self.sites)

    def cut(self, site: SiteReport) -> bool:
        """The site was not fused because the graph break that ends this graph cut it from its norm."""
        return bool(self.graph_break) and not site.fused and site.node in self.leaves

    def rows(self) -> list[list[str]]:
        rows = [s.row(bool(self.as_written)) for s in self.sites]
        for s, r in zip(self.sites, rows):
            if self.cut(s):
                r[3] = "cut by the graph break below"  # (its result leaves the graph before any norm)
        return rows

    def op_line(self) -> str:
        """The op counts before -> after the passes ("" if none), the merge pass's share named; of
        a graph that runs as written, the counts as written."""
        if self.as_written:
            written = ", ".join(f"{k} {a}" for k, (a, _) in self.op_counts.items() if a)
            return f"ops as written: {written}" if written else ""
        parts = []
        for k, (a, b) in self.op_counts.items():
            if (a, b) == (0, 0):
                continue
            merged = f" ({sum(self.merged)} merged into {len(self.merged)} first)" if k == "all_reduce" \
                and self.merged else ""
            parts.append(f"{k} {a}->{b}{merged}")
        return "ops before->after: " + ", ".join(parts) if parts else ""


#: The report before any graph was compiled (or after :func:`reset`): torch.compile returns at once
#: and compiles at the model's first call, so a report asked for right after it is empty.
NOTHING_COMPILED = ("tokenweave: 0 graph(s): nothing compiled yet.\n"
                    "  torch.compile(model, backend=\"tokenweave\") compiles at the model's first call: call the\n"
                    "  compiled model, then explain() lists each graph and site (weave_compile.reset() forgets them).")


@dataclasses.dataclass
class WeaveReport:
    graphs: list[GraphReport] = dataclasses.field(default_factory=list)

    @property
    def sites(self) -> list[SiteReport]:
        return [s for g in self.graphs for s in g.sites]

    @property
    def matched_count(self) -> int:
        return sum(g.matched_count for g in self.graphs)

    @property
    def as_written(self) -> list[GraphReport]:
        """Graphs that run with their collectives as written because their ranks disagreed."""
        return [g for g in self.graphs if g.as_written]

    def __str__(self) -> str:
        if not self.graphs:
            return NOTHING_COMPILED
        header = ["site", "group", "fused", "form / reason", "kernel", "residual", "split", "output"]
        lines = [f"tokenweave: {len(self.graphs)} graph(s), {_count_sites(self.sites)}, {self.matched_count} fused"]
        for g in self.graphs:
            lines.append(f"graph {g.graph_id}" + (f" {g.label}" if g.label else "") + f" [{g.compiler}]"
                         + (f": {g.note}" if g.note else ""))
            if g.op_line():
                lines.append("  " + g.op_line())
            if g.as_written:
                lines.append(f"  runs with its collectives as written, like plain Inductor: {g.as_written}")
            if g.projections:
                lines.append("  " + g.projections)
            if g.other_gathers:
                lines.append(f"  left as written: {len(g.other_gathers)} all_gather(s) not after a fused norm "
                             f"({', '.join(g.other_gathers)})")
            if g.split is not None and not g.as_written:
                lines.append("  " + g.split.describe())
            for m in g.measured:
                lines += _measured_lines(m)
            lines += _site_table(header, g.rows())
            if g.graph_break:
                lines.append(textwrap.fill(f"ends at a graph break: {g.graph_break}", 100, initial_indent="  ",
                                           subsequent_indent="    ", break_long_words=False,
                                           break_on_hyphens=False))
        return "\n".join(lines)


def _measured_lines(m: dict) -> list[str]:
    """One group's measured choice: where the answer came from, the verdict, and every candidate's
    time (median per call over the ranks' rounds, the largest over the ranks) and spread."""
    lines = [textwrap.fill(f"measured choice, group {m['group']} ({m['source']}): {m['reason']}", 100,
                           initial_indent="  ", subsequent_indent="    ", break_long_words=False)]
    for design, why in sorted(m.get("excluded", {}).items()):
        lines.append(f"    {design} did not compete: {why}")
    if m.get("checked"):
        lines.append(f"    checked: {m['checked']}")
    if m.get("freed"):
        lines.append(f"    workspaces freed after the timing (won nowhere): {', '.join(m['freed'])}")
    rows = m.get("rows", [])
    if rows:
        cands = list(dict.fromkeys(c for r in rows for c in r["times"]))
        table = [["signature", "sites", "T", *cands, "best fused"]]
        table += [[r["signature"], str(r["sites"]), str(r["T"]), *(r["times"].get(c, "-") for c in cands), r["best"]]
                  for r in rows]
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        lines += ["    " + "  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    return lines


def _count_sites(sites: list[SiteReport]) -> str:
    """"5 all_reduce site(s)" where every site has one form, else "7 site(s) (5 all_reduce, 2 ...)"."""
    forms = {f: sum(s.form == f for s in sites) for f in dict.fromkeys(s.form for s in sites)}
    if len(forms) <= 1:
        return f"{len(sites)} {next(iter(forms), 'all_reduce')} site(s)"
    return f"{len(sites)} site(s) (" + ", ".join(f"{n} {f}" for f, n in forms.items()) + ")"


#: columns whose cells may end in "(why)": in a table, the why becomes a numbered note under it
_NOTED = ("kernel", "residual", "output")
_WHY = re.compile(r"^(.+?) \((.+)\)$")


def _site_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The sites as a table, kept narrow: a column with one value at every site (of two or more) is
    listed once above it, and a "(why)" in a kernel, residual or output cell is a note below it."""
    if not rows:
        return []
    same = [i for i in range(1, len(header)) if len(rows) > 1 and len({r[i] for r in rows}) == 1]
    width = max((len(header[i]) for i in same), default=0)
    notes: dict[str, int] = {}

    def cell(i: int, text: str) -> str:
        why = _WHY.match(text) if header[i] in _NOTED else None
        if why is None:
            return text
        return f"{why.group(1)} [{notes.setdefault(_shared_prefix_once(why.group(2)), len(notes) + 1)}]"

    # a long shared value (a measured reason) wraps at 100 columns under its own start
    lines = (["  same at every site:"] if same else []) + [
        textwrap.fill(cell(i, rows[0][i]), 100, initial_indent=f"    {header[i].ljust(width)}  ",
                      subsequent_indent=" " * (width + 6), break_long_words=False, break_on_hyphens=False)
        for i in same]

    keep = [i for i in range(len(header)) if i not in same]
    table = [[header[i] for i in keep]] + [[cell(i, r[i]) for i in keep] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keep))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    # notes wrap at 100 columns (a reason can name several implementations' reasons)
    return lines + [textwrap.fill(why, 100, initial_indent=f"  [{n}] ", subsequent_indent=" " * (len(str(n)) + 5),
                                  break_long_words=False, break_on_hyphens=False) for why, n in notes.items()]


def _shared_prefix_once(why: str) -> str:
    """``"cpu tensors: a; cpu tensors: b"`` as ``"cpu tensors: a; b"``: a reason joined from several
    implementations' reasons names their shared cause once."""
    parts = why.split("; ")
    out = parts[:1]
    for prev, part in zip(parts, parts[1:]):
        head = prev.split(": ", 1)[0] + ": " if ": " in prev else None
        out.append(part[len(head):] if head and part.startswith(head) and len(part) > len(head) else part)
    return "; ".join(out)


def graph_to_json(g: GraphReport) -> dict:
    return {"sites": [dataclasses.asdict(s) for s in g.sites], "op_counts": g.op_counts,
            "split": dataclasses.asdict(g.split) if g.split is not None else None, "projections": g.projections,
            "other_gathers": g.other_gathers, "merged": g.merged, "leaves": g.leaves, "measured": g.measured}


def graph_from_json(compiler: str, note: str, payload: dict) -> GraphReport:
    """A recorded graph report, re-registered (for graphs Inductor serves from its cache)."""
    g = new_graph(compiler, note)
    g.sites = [SiteReport(**s) for s in payload["sites"]]
    g.op_counts = {k: tuple(v) for k, v in payload["op_counts"].items()}
    if payload.get("split"):
        g.split = SplitSummary(**payload["split"])
    g.projections = payload.get("projections", "")
    g.other_gathers = payload.get("other_gathers", [])
    g.merged, g.leaves = list(payload.get("merged", [])), list(payload.get("leaves", []))
    g.measured = list(payload.get("measured", []))
    return g


def dumps(graphs: list[GraphReport]) -> str:
    return json.dumps([graph_to_json(g) for g in graphs])


_lock = threading.Lock()
_report = WeaveReport()


def new_graph(compiler: str, note: str = "") -> GraphReport:
    with _lock:
        g = GraphReport(graph_id=len(_report.graphs), compiler=compiler, note=note)
        _report.graphs.append(g)
        return g


#: what a graph report says of a graph break Dynamo gave no reason for
UNKNOWN_BREAK = ("Dynamo gave no reason; compile with fullgraph=True to stop there with its message, or set "
                 "TORCH_LOGS=graph_breaks")


def mark_graph_break(graphs: list[GraphReport], why: str) -> None:
    """These graphs (one Dynamo graph's) end where Dynamo broke the frame, because ``why``."""
    with _lock:
        for g in graphs:
            g.graph_break = why or UNKNOWN_BREAK


def mark_as_written(graphs: list[GraphReport], reason: str) -> None:
    """These graphs (one Dynamo graph's) run with their collectives as written, because ``reason``."""
    with _lock:
        for g in graphs:
            g.as_written = reason


def explain() -> WeaveReport:
    """The report of every graph compiled by the tokenweave backend since the last :func:`reset`."""
    with _lock:
        return WeaveReport(graphs=list(_report.graphs))


def reset() -> None:
    with _lock:
        _report.graphs.clear()

