"""The explain report: rows, text, the JSON round trip (FX-graph-cache hits) and the process-wide list."""

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
    assert lines[1] == ("graph 0 [aot_eager]: a note (all_reduce 2->1, weave.allreduce_add_rmsnorm 0->1)")
    assert lines[2].startswith("  split 40 tokens at 20")
    assert lines[3].split() == ["site", "group", "fused", "form", "/", "reason", "kernel", "residual", "split",
                                "output"]
    assert lines[4].split()[:3] == ["all_reduce", "0", "yes"]
    assert lines[5].split()[:3] == ["all_reduce_1", "0", "no"]
    assert lines[6] == "graph 1 [inductor]: no process group initialized: passes not run"
    # Columns line up: every row's second column starts where the header's does.
    col = lines[3].index("group")
    assert all(line[col - 2:col] == "  " for line in lines[4:6])


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
    assert lines[2] == ("  runs with its collectives as written, like plain Inductor: process group [0, 1]: "
                        "its ranks compiled different graphs")
    assert lines[5].split()[:5] == ["all_reduce", "0", "no", "(as", "written)"]
    assert lines[6].split()[:3] == ["all_reduce_1", "0", "no"]
