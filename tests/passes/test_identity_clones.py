"""Eval-mode dropout's clones after a reduction (passes/identity_clones.py) on traced ATen graphs:
dropped where a site runs through them, kept where a clone is not the identity or not on a site.

Graphs are traced with ``make_fx`` over a fake 2-rank process group in this process (no spawn).
"""

import torch
import torch.nn.functional as F

from weave_compile.passes.identity_clones import drop_identity_clones

ar_op = torch.ops._c10d_functional.all_reduce
wait = torch.ops._c10d_functional.wait_tensor
clone = torch.ops.aten.clone.default
T, H = 6, 16


def _trace(fn, n_inputs):
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    shapes = [(T, H)] * (n_inputs - 2) + [(H,), (H,)]
    # AOT's decompositions: F.layer_norm as var_mean, as the passes see it
    traced = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")
    return traced(*[torch.randn(*s) for s in shapes])


def _clones(gm):
    return [n for n in gm.graph.nodes if n.target == clone]


def _passes(gm):
    from weave_compile.config import TokenWeaveConfig
    from weave_compile.passes.pass_manager import WeavePassManager

    pm = WeavePassManager(TokenWeaveConfig(kernel="reference"), compiler="aot_eager")
    pm(gm.graph)
    return pm.graph_reports[0]


def test_a_parallel_blocks_dropout_clones_go_and_the_block_fuses(group):
    """GPT-NeoX's form: each sublayer's reduced output + its bias, through an eval dropout (a
    clone), summed with the residual, then a LayerNorm. Without the clones' removal neither the
    merge nor the site walk gets past them."""
    def block(a, b, r, bias, w):
        xa = torch.ops.aten.clone(wait(ar_op(a, "sum", group)) + bias)
        xb = torch.ops.aten.clone(wait(ar_op(b, "sum", group)) + bias)
        return F.layer_norm(xa + xb + r, (H,), w, None, 1e-5)

    gm = _trace(block, 5)
    assert len(_clones(gm)) == 2
    rep = _passes(gm)
    assert _clones(gm) == [] and rep.matched_count == 1, str(rep)
    assert "merged" in rep.sites[0].reason and "+bias +residual -> layernorm" in rep.sites[0].reason


def test_clones_that_are_not_the_identity_or_not_on_a_site_stay(group):
    def fn(a, b, r, bias, w):
        y = wait(ar_op(a, "sum", group))
        kept_input = torch.ops.aten.clone(r)  # a graph input: a later copy_ may write it
        kept_layout = torch.ops.aten.clone(y, memory_format=torch.contiguous_format)
        kept_far = torch.ops.aten.clone(b * 2)  # no reduction before it
        returned = torch.ops.aten.clone(y + bias)  # a graph output
        return kept_input + kept_layout + kept_far, returned

    gm = _trace(fn, 5)
    assert drop_identity_clones(gm.graph) == 0
    assert len(_clones(gm)) == 4


def test_the_dropped_clone_readers_read_its_input(group):
    def fn(a, b, r, bias, w):
        y = torch.ops.aten.clone(wait(ar_op(a, "sum", group)))
        return y * w + y

    gm = _trace(fn, 5)
    (c,) = _clones(gm)
    src = c.args[0]
    assert drop_identity_clones(gm.graph) == 1
    gm.graph.lint()
    assert all(any(a is src for a in n.args) for n in src.users if n.op != "output")
    assert len(src.users) == 2
