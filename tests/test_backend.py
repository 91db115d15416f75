"""The backend as users meet it: found by name, options validated, identical to Inductor when idle."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks


def test_backend_found_by_name_in_a_fresh_interpreter_without_importing_the_package():
    code = ("import sys, torch\n"
            "out = torch.compile(lambda x: x + 1, backend='tokenweave')(torch.ones(2))\n"
            "assert out.tolist() == [2.0, 2.0], out\n"
            "assert 'tokenweave' in torch._dynamo.list_backends()\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def _compile_and_call(options, fullgraph=False):
    torch._dynamo.reset()
    return torch.compile(nn.Linear(4, 4), backend="tokenweave", options=options, fullgraph=fullgraph)(torch.ones(3, 4))


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("options,error,message", [
    ({"kernel": "bogus"}, ValueError, "option 'kernel' must be one of ["),
    ({"comm_ctas": 0}, ValueError, "option 'comm_ctas' must be in [1, 32], got 0"),
    ({"comm_ctas": "8"}, TypeError, "option 'comm_ctas' must be int, got str '8'"),
    ({"split": "yes"}, TypeError, "option 'split' must be bool, got str 'yes'"),
    ({"comm_cta": 4}, TypeError, "unknown tokenweave option(s) ['comm_cta'] ('comm_cta': did you mean 'comm_ctas'?)"),
])
def test_a_bad_dict_raises_the_options_own_error_at_the_first_call(options, error, message, fullgraph):
    """Not Dynamo's BackendCompilerFailed: the ValueError/TypeError Options(...) raises, same message."""
    from weave_compile.config import Options

    with pytest.raises(error) as built:
        Options(**options)  # the keyword form: the same mistake, the same exception type
    with pytest.raises(error):
        Options.from_options(options)
    with pytest.raises(error) as compiled:
        _compile_and_call(options, fullgraph)
    assert not isinstance(compiled.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(compiled.value) == str(built.value) and message in str(compiled.value), str(compiled.value)
    # The traceback ends in the backend's check, not in Dynamo's frames.
    assert compiled.traceback[-1].frame.code.name == "_config"


def test_options_object_reaches_the_backend_through_torch_compile():
    """torch.compile hands a non-dict options object to the backend as it is (no copy, no iteration)."""
    import weave_compile

    weave_compile.reset()
    out = _compile_and_call(weave_compile.Options(compiler="aot_eager", kernel="reference"))
    assert out.shape == (3, 4)
    graphs = weave_compile.explain().graphs
    assert [g.compiler for g in graphs] == ["aot_eager"], graphs
    weave_compile.reset()
    _compile_and_call({"compiler": "aot_eager"})  # a plain dict still works
    assert [g.compiler for g in weave_compile.explain().graphs] == ["aot_eager"]


class NoCollectives(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.w = nn.Parameter(torch.randn(32))

    def forward(self, x):
        h = self.lin(x) + x
        hf = h.float()
        return self.w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6))


def _same_as_inductor():
    import weave_compile

    torch.manual_seed(0)
    m = NoCollectives()
    x = torch.randn(7, 32)
    with torch.no_grad():
        torch._dynamo.reset()
        weave_compile.reset()
        ours = torch.compile(m, backend="tokenweave")(x)
        torch._dynamo.reset()
        default = torch.compile(m)(x)
    return ours, default, weave_compile.explain()


def test_no_process_group_is_plain_inductor():
    ours, default, report = _same_as_inductor()
    assert torch.equal(ours, default)
    assert report.graphs[0].note.startswith("no process group")


def _same_as_inductor_on_ranks(rank, world_size):
    ours, default, report = _same_as_inductor()
    return torch.equal(ours, default), report.matched_count, len(report.sites)


def test_model_without_all_reduce_equals_default_inductor_on_2_ranks():
    for equal, matched, sites in assert_ranks_ok(run_ranks(_same_as_inductor_on_ranks, 2, timeout=300)):
        assert equal and matched == 0 and sites == 0


def test_pass_manager_uuid_covers_config():
    from weave_compile.config import TokenWeaveConfig
    from weave_compile.passes.pass_manager import WeavePassManager

    a = WeavePassManager(TokenWeaveConfig()).uuid()
    assert a == WeavePassManager(TokenWeaveConfig()).uuid()
    assert a != WeavePassManager(TokenWeaveConfig(comm_ctas=4)).uuid()
    assert a != WeavePassManager(TokenWeaveConfig(kernel="reference")).uuid()


def _compile_twice_with_fx_cache(rank, world_size):
    import weave_compile
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(layers=1)
    model = TPLlama(d, tp=world_size, rank=rank, group=dist.group.WORLD)
    tokens = torch.randint(0, d.vocab, (1, 6), generator=torch.Generator().manual_seed(0))
    reports = []
    with torch.no_grad():
        for _ in range(2):  # the second compile is served from Inductor's FX graph cache
            weave_compile.reset()
            torch._dynamo.reset()
            # The oracle op forced: what is checked is a fused graph's report after a cache hit (on
            # CPU ranks the default measured choice keeps the sites as written).
            torch.compile(model, backend="tokenweave", options={"kernel": "reference"})(tokens)
            rep = weave_compile.explain()
            reports.append(([g.note for g in rep.graphs], [(s.node, s.fused, s.reason, s.residual) for s in rep.sites]))
    return reports


@pytest.mark.slow  # 2 ranks compile with Inductor twice, cold cache first: ~50 s on 2 cores
def test_explain_survives_an_fx_graph_cache_hit(tmp_path):
    env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    for first, second in assert_ranks_ok(run_ranks(_compile_twice_with_fx_cache, 2, timeout=400, env=env)):
        assert first[0] == [""] and len(first[1]) == 3 and all(s[1] for s in first[1])
        assert "FX graph cache" in second[0][0], second
        assert second[1] == first[1]  # the same sites, as recorded when compiled


class _BrokenBlock(nn.Module):
    """A row-parallel projection whose all_reduce -> +residual -> RMSNorm a graph break cuts apart."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.proj, self.norm = nn.Linear(8, hidden, bias=False), nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, x, residual):
        y = self.proj(x)
        dist.all_reduce(y)
        h = y + residual
        if h.sum() > 0:  # data-dependent branching: Dynamo ends the graph here
            h = h * 2
        return self.norm(h), h


def _graph_break_cuts_a_site(rank, world_size, seed):
    import weave_compile

    torch.manual_seed(seed)  # the same weights on both ranks
    model = _BrokenBlock()
    x, residual = torch.randn(5, 8), torch.randn(5, 16)
    weave_compile.reset()
    with torch.no_grad():
        out, h = torch.compile(model, backend="tokenweave", options={"compiler": "aot_eager"})(x, residual)
        ref, ref_h = model(x, residual)
    rep = weave_compile.explain()
    return {"text": str(rep), "graphs": [(g.graph_break, [(s.node, s.fused) for s in g.sites]) for g in rep.graphs],
            "err": (out - ref).abs().max().item() + (h - ref_h).abs().max().item()}


def test_explain_names_the_graph_break_that_cut_a_site(seed):
    for res in assert_ranks_ok(run_ranks(_graph_break_cuts_a_site, 2, args=(seed,), timeout=300)):
        assert res["err"] == 0, res["err"]
        (brk, sites), (after, later_sites) = res["graphs"]
        assert sites == [("all_reduce", False)] and later_sites == [] and after == "", res["text"]
        assert brk.startswith("data-dependent branching (an if on a tensor's value) (test_backend.py:"), brk
        assert brk.endswith(" in forward)"), brk
        lines = res["text"].splitlines()
        row = next(line for line in lines if line.lstrip().startswith("all_reduce "))
        assert "cut by the graph break below" in row, res["text"]
        assert f"ends at a graph break: {brk}" in " ".join(res["text"].split()), res["text"]  # (wrapped)


def test_graph_break_reason_names_the_break_and_where():
    import traceback

    from torch._dynamo.output_graph import GraphCompileReason

    from weave_compile.backend import graph_break

    class G:
        pass

    gm = G()
    assert graph_break(gm) is None  # nothing recorded: not a break
    frame = traceback.FrameSummary("/x/modeling_qwen3.py", 80, "forward")
    gm.compile_subgraph_reason = GraphCompileReason("return_value", [frame], graph_break=False)
    assert graph_break(gm) is None  # the graph reached the end of its frame
    gm.compile_subgraph_reason = GraphCompileReason(
        "Module-level backwards hooks require compiled autograd.\n  Explanation: \n  Hint: Enable compiled "
        "autograd.\n  Hint: Please report an issue to PyTorch.", [frame])
    assert graph_break(gm) == ("Module-level backwards hooks require compiled autograd. (modeling_qwen3.py:80 "
                               "in forward) Hint: Enable compiled autograd.")
    gm.compile_subgraph_reason = GraphCompileReason("", [])
    assert graph_break(gm) == ""  # a break without a reason: the report gives the advice


def _funcol_site(x):
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(x, "sum", "0") + x  # a group by name, as a traced DTensor program carries it
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_a_collective_without_a_process_group_is_named_as_such(compiler):
    """Not Inductor's "Could not resolve the process group registered under the name 0" (or, with
    aot_eager, the same at the first call): the caller's missing init_process_group, by name."""
    from weave_compile.backend import MissingProcessGroupError

    assert not torch.distributed.is_initialized()
    torch._dynamo.reset()
    with pytest.raises(MissingProcessGroupError) as e:
        torch.compile(_funcol_site, backend="tokenweave", options={"compiler": compiler})(torch.randn(4, 8))
    assert isinstance(e.value, RuntimeError) and not isinstance(e.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(e.value).startswith("tokenweave: the model calls all_reduce (process group '0'), but no process "
                                   "group is initialized: call torch.distributed.init_process_group()"), str(e.value)
