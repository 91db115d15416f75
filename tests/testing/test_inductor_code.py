"""inductor_code: two compiles' programs compared; a graph the backend leaves alone is plain Inductor's.

The last test is the CPU form of the floor's premise (``benchmarks/bench_floor.py``,
``code_vs_default``): where every site stays as written, whether by the option ``fuse=False`` or by
the kernel policy's choice, Inductor generates the very program plain ``torch.compile`` gets, so the
backend costs such a graph nothing. Its control, a fused graph, must read as different.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.passes.test_fuse_allreduce_rmsnorm_graphs import group  # noqa: F401  (a fake 2-rank group)
from weave_compile.testing import inductor_code
from weave_compile.testing.inductor_code import compare

pytestmark = pytest.mark.timeout(300, method="thread")

WRAPPER = """# AOT ID: ['0_inference']
# kernel path: /tmp/torchinductor_a/ab/cabcd.py
# Topologically Sorted Source Nodes: [add, x], Original ATen: [aten.add]
cpp_fused_add_0 = async_compile.cpp_pybinding(['float*', 'const float*'], '''...''')
def call(args):
    arg0_1, = args
    buf0 = empty_strided_cpu((4, 16), (16, 1), torch.float32)
    cpp_fused_add_0(buf0, arg0_1)
    return (buf0, )
"""


def test_cache_paths_and_node_names_do_not_make_two_programs_differ():
    other = (WRAPPER.replace("/tmp/torchinductor_a/ab/cabcd.py", "/tmp/torchinductor_b/xy/cxyzw.py")
             .replace("[add, x]", "[add_1, x_2]").replace("0_inference", "3_inference"))
    assert compare([WRAPPER], [other]) == "same"
    assert compare([WRAPPER], [WRAPPER.replace("def call", "# a remark\ndef call")]) == "same but comments"


def test_a_changed_line_is_a_different_program():
    swapped = WRAPPER.replace("cpp_fused_add_0(buf0, arg0_1)", "cpp_fused_add_0(arg0_1, buf0)")
    assert compare([WRAPPER], [swapped]) == "differs: 2 lines"
    assert compare([WRAPPER], [WRAPPER, "def extra():\n    pass\n"]) == "differs: 2 lines"
    text = inductor_code.diff([WRAPPER], [swapped], ("a", "b"))
    assert "-    cpp_fused_add_0(buf0, arg0_1)" in text and "+    cpp_fused_add_0(arg0_1, buf0)" in text


def test_nothing_compiled_is_nothing_to_compare():
    assert compare([], [WRAPPER]) == "" and compare([WRAPPER], []) == ""


@pytest.mark.parametrize("dynamic", [False, True])  # True: each norm's eps is a graph input the passes see
def test_a_graph_the_backend_leaves_as_written_compiles_to_plain_inductors_program(group, monkeypatch,  # noqa: F811
                                                                                  dynamic, tmp_path):
    import torch._inductor.config as inductor_config

    import weave_compile
    from weave_compile.kernels import auto, measured
    from weave_compile.kernels.measured.timing import Stat
    from weave_compile.testing.models import LlamaDims, TPLlama

    d = LlamaDims(hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2, vocab=64)
    model = TPLlama(d, tp=2, rank=0, group=dist.group.WORLD, dtype=torch.float32, device=torch.device("cpu"))
    x = torch.randint(0, d.vocab, (1, 8), generator=torch.Generator().manual_seed(3))

    def compiled(**kw):
        torch._dynamo.reset()
        weave_compile.reset()
        # Generated here, not served from Inductor's FX graph cache: the patched policy below is
        # not part of the cache key (the kernel tables' digest is, and stays the same).
        with inductor_code.captured() as code, torch.no_grad(), inductor_config.patch(fx_graph_cache=False):
            out = torch.compile(model, dynamic=dynamic, **kw)(x)
        sites = [s for g in weave_compile.explain().graphs for s in g.sites]
        return code, out, sites

    plain, want, _ = compiled()
    assert plain, "Inductor generated no code"
    assert dynamic == any("const double*" in code for code in plain), "eps a graph input exactly when dynamic"

    off, got, sites = compiled(backend="tokenweave", options={"fuse": False})
    assert sites and not any(s.fused for s in sites), sites
    assert compare(plain, off) in ("same", "same but comments"), inductor_code.diff(plain, off)[:3000]
    assert torch.equal(got, want)

    # The measured choice keeps every site as written (its timings injected: the site as written
    # fastest): the graph passes through every pass unchanged, and the compile the measurement made
    # of the sites as written is not part of the program.
    measured.set_timer(lambda cand, sig, bucket, rank: Stat(10.0 if cand == measured.AS_WRITTEN else 20.0, 0.0))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    try:
        kept, got, sites = compiled(backend="tokenweave")
    finally:
        measured.set_timer(None)
        measured.forget()
    assert sites and not any(s.fused for s in sites), sites
    assert all("measured (measured now" in s.reason for s in sites), sites[0].reason
    assert compare(plain, kept) in ("same", "same but comments"), inductor_code.diff(plain, kept)[:3000]
    assert torch.equal(got, want)

    # The shipped rules leave every site (as the GPU policy does where no design is measured faster).
    monkeypatch.setattr(auto, "choose", lambda requested, site: (auto.AS_WRITTEN, "left by the test"))
    kept, got, sites = compiled(backend="tokenweave", options={"autotune": False})
    assert sites and not any(s.fused for s in sites), sites
    assert all("left by the test" in s.reason for s in sites), sites[0].reason
    assert compare(plain, kept) in ("same", "same but comments"), inductor_code.diff(plain, kept)[:3000]
    assert torch.equal(got, want)

    monkeypatch.undo()  # control: fused sites (reference on CPU) are a different program
    fused, _, sites = compiled(backend="tokenweave", options={"kernel": "reference"})
    assert sites and all(s.fused for s in sites), sites
    assert compare(plain, fused).startswith("differs: "), compare(plain, fused)
