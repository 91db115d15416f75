"""The explain report: rows, text, the JSON round trip (FX-graph-cache hits) and the process-wide list."""

import dataclasses
import json

import pytest

from weave_compile import report


@pytest.fixture(autouse=True)
def _clean():
    report.reset()
    yield
    report.reset()


def _graph():
    g = report.new_graph("aot_eager", note="a note")
    g.sites = [
        report.SiteReport(node="all_reduce", group="0", fused=True, reason="all_reduce +residual -> rmsnorm",
                          kernel="reference", kernel_reason="requested", residual="out sharded",
                          split="per half, comm stream", output="copied (output_in_place off)"),
        report.SiteReport(node="all_reduce_1", group="0", fused=False, reason="reduce op 'max' is not sum"),
    ]
    g.op_counts = {"all_reduce": (2, 1), "weave.allreduce_add_rmsnorm": (0, 1)}
    g.split = report.SplitSummary(applied=True, tokens="40 tokens", split_at="20 (smart split)", halves=7,
                                  barriers=["cumsum (aten.cumsum.default): operates along the token dimension"],
                                  sites=["all_reduce"])
    return g


def test_site_row_names_kernel_and_reason():
    fused, unfused = _graph().sites
    assert fused.row() == ["all_reduce", "0", "yes", "all_reduce +residual -> rmsnorm", "reference (requested)",
                           "out sharded", "per half, comm stream", "copied (output_in_place off)"]
    assert unfused.row() == ["all_reduce_1", "0", "no", "reduce op 'max' is not sum", "-", "-", "not split", "-"]


def test_split_summary_describes_what_happened():
    assert report.SplitSummary(reason="split disabled by option").describe() == "not split: split disabled by option"
    text = _graph().split.describe()
    assert text == ("split 40 tokens at 20 (smart split): 7 ops per half; 1 barrier(s): "
                    "cumsum (aten.cumsum.default): operates along the token dimension")


def test_explain_text_lists_graphs_counts_split_and_sites():
    _graph()
    report.new_graph("inductor", note="no process group initialized: passes not run")
    rep = report.explain()
    assert len(rep.graphs) == 2 and [g.graph_id for g in rep.graphs] == [0, 1]
    assert rep.matched_count == 1 and len(rep.sites) == 2
    lines = str(rep).splitlines()
    assert lines[0] == "tokenweave: 2 graph(s), 2 all_reduce site(s), 1 fused"
    assert lines[1] == "graph 0 [aot_eager]: a note"
    assert lines[2] == "  ops before->after: all_reduce 2->1, weave.allreduce_add_rmsnorm 0->1"
    assert lines[3].startswith("  split 40 tokens at 20")
    # Both sites are in group 0: that column is listed once above the table.
    assert lines[4:6] == ["  same at every site:", "    group  0"]
    assert lines[6].split() == ["site", "fused", "form", "/", "reason", "kernel", "residual", "split", "output"]
    assert lines[7].split() == ["all_reduce", "yes", "all_reduce", "+residual", "->", "rmsnorm", "reference", "[1]",
                                "out", "sharded", "per", "half,", "comm", "stream", "copied", "[2]"]
    assert lines[8].split()[:2] == ["all_reduce_1", "no"]
    # A cell's "(why)" is a numbered note under the table.
    assert lines[9:11] == ["  [1] requested", "  [2] output_in_place off"]
    assert lines[11] == "graph 1 [inductor]: no process group initialized: passes not run"
    # Columns line up: every row's second column starts where the header's does.
    col = lines[6].index("fused")
    assert all(line[col - 2:col] == "  " and line[col] != " " for line in lines[7:9])


def test_all_gathers_of_no_site_are_listed_as_written():
    g = _graph()
    g.other_gathers = ["all_gather_into_tensor_5"]
    lines = str(report.explain()).splitlines()
    assert "  left as written: 1 all_gather(s) not after a fused norm (all_gather_into_tensor_5)" in lines
    assert report.graph_from_json("inductor", "", json.loads(report.dumps([g]))[0]).other_gathers == g.other_gathers


def test_sites_of_two_forms_are_counted_apart():
    g = _graph()
    g.sites[1] = dataclasses.replace(g.sites[1], node="reduce_scatter_tensor", form="reduce_scatter/all_gather")
    assert str(report.explain()).splitlines()[0] == (
        "tokenweave: 1 graph(s), 2 site(s) (1 all_reduce, 1 reduce_scatter/all_gather), 1 fused")


def test_op_counts_absent_before_and_after_are_left_out():
    g = _graph()
    g.op_counts["weave.allreduce_add_rmsnorm_start"] = (0, 0)
    assert str(report.explain()).splitlines()[2] == (
        "  ops before->after: all_reduce 2->1, weave.allreduce_add_rmsnorm 0->1")


def test_columns_shared_by_every_site_are_listed_once_and_a_label_follows_the_id():
    g = _graph()
    g.label = "decode batch=8"
    g.sites[1] = dataclasses.replace(g.sites[0], node="all_reduce_1", residual="in+out sharded")
    text = str(report.explain())
    lines = text.splitlines()
    assert lines[1].startswith("graph 0 decode batch=8 [aot_eager]: a note")
    shared = lines[lines.index("  same at every site:") + 1:]
    assert [line.split()[0] for line in shared[:6]] == ["group", "fused", "form", "kernel", "split", "output"]
    # a shared cell's "(why)" is a numbered note under the table too (reasons can be long)
    assert shared[3] == "    kernel         reference [1]"
    assert shared[6].split() == ["site", "residual"]
    assert shared[7].split() == ["all_reduce", "out", "sharded"] and shared[8].split()[0] == "all_reduce_1"
    assert "  [1] requested" in shared
    # A single site keeps every column in its row.
    g.sites = g.sites[:1]
    assert "same at every site" not in str(report.explain())


def test_json_round_trip_keeps_sites_counts_and_the_typed_split():
    g = _graph()
    payload = json.loads(report.dumps([g]))
    report.reset()
    back = report.graph_from_json("inductor", "served from Inductor's FX graph cache", payload[0])
    assert back.sites == g.sites
    assert back.op_counts == g.op_counts and isinstance(back.op_counts["all_reduce"], tuple)
    assert isinstance(back.split, report.SplitSummary) and back.split == g.split
    assert report.explain().graphs == [back]
    # A graph without a split summary stays without one.
    g.split = None
    assert report.graph_from_json("inductor", "", json.loads(report.dumps([g]))[0]).split is None


def test_explain_is_a_snapshot_and_reset_clears():
    _graph()
    snap = report.explain()
    report.new_graph("inductor")
    assert len(snap.graphs) == 1 and len(report.explain().graphs) == 2
    report.reset()
    assert report.explain().graphs == [] and str(report.explain()).startswith("tokenweave: 0 graph(s)")


def test_a_graph_run_as_written_says_why_and_counts_no_fused_site():
    g = _graph()
    other = report.new_graph("aot_eager")
    report.mark_as_written([g], "process group [0, 1]: its ranks compiled different graphs")
    rep = report.explain()
    assert rep.as_written == [g] and other.as_written == ""
    assert g.matched_count == 0 and rep.matched_count == 0 and len(rep.sites) == 2  # the sites stay listed
    lines = str(rep).splitlines()
    assert lines[0] == "tokenweave: 2 graph(s), 2 all_reduce site(s), 0 fused"
    assert lines[3] == ("  runs with its collectives as written, like plain Inductor: process group [0, 1]: "
                        "its ranks compiled different graphs")
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0].startswith("all_reduce")}
    assert rows["all_reduce"].split()[1:4] == ["no", "(as", "written)"]  # fused, but run as written
    assert rows["all_reduce_1"].split()[1] == "no"  # never fused


def test_a_long_note_wraps_within_100_columns():
    g = _graph()
    why = "; ".join(f"reason number {i} why this implementation cannot run at this site" for i in range(4))
    g.sites[0] = dataclasses.replace(g.sites[0], kernel_reason=why)
    lines = str(report.explain()).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  [1] "))
    note = lines[start:start + 3]
    assert all(len(line) <= 100 for line in note) and all(line.startswith("      ") for line in note[1:]), note
    wrapped = [note[0][6:]] + [line.strip() for line in note[1:]]
    assert " ".join(wrapped).startswith(why)  # the whole reason, in order


def test_a_graph_run_as_written_lists_no_kernel_residual_split_or_output():
    g = _graph()
    report.mark_as_written([g], "process group [0, 1]: its ranks compiled different graphs")
    fused, unfused = g.rows()
    assert fused == ["all_reduce", "0", "no (as written)", "all_reduce +residual -> rmsnorm", "-", "-", "-", "-"]
    assert unfused[2:] == ["no", "reduce op 'max' is not sum", "-", "-", "-", "-"]
    text = str(report.explain())
    assert "reference" not in text and "sharded" not in text and "per half" not in text, text
    assert "  ops as written: all_reduce 2" in text.splitlines(), text  # not what the passes would have left


def test_a_note_joined_from_reasons_with_one_cause_names_it_once():
    g = _graph()
    g.sites[0] = dataclasses.replace(g.sites[0], kernel_reason="cpu tensors: symmetric memory needs CUDA; "
                                     "cpu tensors: the add+norm kernel needs CUDA; not p2p: cpu tensors: x")
    lines = str(report.explain()).splitlines()
    start = lines.index("  [1] cpu tensors: symmetric memory needs CUDA; the add+norm kernel needs CUDA; not p2p: cpu")
    assert lines[start + 1] == "      tensors: x", lines  # (wrapped at 100 columns; another prefix stays)


def test_ops_line_names_what_the_merge_pass_made_one_so_the_counts_agree():
    g = _graph()
    g.sites = [dataclasses.replace(g.sites[0], reason="... (merged)"), g.sites[1]]
    g.op_counts = {"all_reduce": (3, 1), "weave.allreduce_add_rmsnorm": (0, 1)}
    g.merged = [2]
    lines = str(report.explain()).splitlines()
    assert lines[0] == "tokenweave: 1 graph(s), 2 all_reduce site(s), 1 fused"
    assert lines[2] == "  ops before->after: all_reduce 3->1 (2 merged into 1 first), weave.allreduce_add_rmsnorm 0->1"
    # 3 all_reduces - 2 merged + 1 = 2 sites, as the header says
    assert sum(g.op_counts["all_reduce"][:1]) - sum(g.merged) + len(g.merged) == len(g.sites)


def test_a_site_cut_by_a_graph_break_says_so_and_the_break_is_named():
    g = _graph()
    g.leaves = ["all_reduce_1"]
    rows = g.rows()
    assert rows[1][3] == "reduce op 'max' is not sum"  # the graph ended at its frame's end: no cut
    report.mark_graph_break([g], "Call to `torch._dynamo.graph_break()` (model.py:12 in forward)")
    assert [r[3] for r in g.rows()] == ["all_reduce +residual -> rmsnorm", "cut by the graph break below"]
    lines = str(report.explain()).splitlines()
    assert lines[-1] == "  ends at a graph break: Call to `torch._dynamo.graph_break()` (model.py:12 in forward)"
    report.mark_graph_break([g], "")  # Dynamo gave no reason: the advice instead
    assert str(report.explain()).splitlines()[-2].startswith("  ends at a graph break: Dynamo gave no reason; "
                                                             "compile with fullgraph=True")


def test_json_keeps_merges_and_what_leaves_the_graph():
    g = _graph()
    g.merged, g.leaves = [2], ["all_reduce_1"]
    back = report.graph_from_json("inductor", "", json.loads(report.dumps([g]))[0])
    assert back.merged == [2] and back.leaves == ["all_reduce_1"]


def test_explain_before_any_compile_says_nothing_was_compiled_and_how_to_get_a_report():
    import torch

    report.reset()
    torch.compile(torch.nn.Linear(4, 4), backend="tokenweave")  # returns at once: compiles at the first call
    text = str(report.explain())
    assert text.startswith("tokenweave: 0 graph(s): nothing compiled yet"), text
    assert "first call: call the\n  compiled model" in text and "0 all_reduce site(s)" not in text, text
