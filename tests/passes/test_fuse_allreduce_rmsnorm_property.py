"""Hypothesis-generated TP programs: compiled == eager, and exactly the matchable sites fused.

Hypothesis runs *inside* the 2 ranks. Both ranks use the same seed (drawn fresh in the test
process each run) and no example database, so they generate the same programs in the same
order; the verdict of each example is agreed by an all_reduce before asserting, so shrinking
stays in lockstep too.
"""

import dataclasses
import random

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

WORLD = 2
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    norm: str  # hf | functional | gemma | noweight | layernorm
    bias: bool
    residual: bool
    extra: str  # none | between (breaks the site) | after (does not)
    collective: str  # inplace | funcol
    reduce_op: str  # sum | avg

    @property
    def matchable(self) -> bool:
        return self.norm != "layernorm" and self.extra != "between" and self.reduce_op == "sum"


@dataclasses.dataclass(frozen=True)
class Program:
    layers: tuple
    hidden: int
    tokens: int
    dtype: torch.dtype
    eps: float
    data_seed: int


class GeneratedTP(nn.Module):
    """x [T, H] -> per layer: row-parallel matmul, all_reduce, [bias], [extra], [+residual], norm."""

    def __init__(self, prog: Program, rank: int, world: int):
        super().__init__()
        self.prog, self.rank, self.world = prog, rank, world
        g = torch.Generator().manual_seed(prog.data_seed)
        h = prog.hidden
        shard = h // world
        self.w = nn.ParameterList()
        self.b = nn.ParameterList()
        self.nw = nn.ParameterList()
        for _ in prog.layers:
            full = torch.randn(h, h, generator=g) / h ** 0.5
            self.w.append(nn.Parameter(full[rank * shard:(rank + 1) * shard].clone()))
            self.b.append(nn.Parameter(torch.randn(h, generator=g) * 0.1))
            self.nw.append(nn.Parameter(1 + torch.randn(h, generator=g) * 0.1))
        self.to(prog.dtype)

    def _norm(self, spec, i, h):
        eps = self.prog.eps
        if spec.norm == "functional":
            return F.rms_norm(h, (h.shape[-1],), self.nw[i], eps)
        if spec.norm == "layernorm":
            return F.layer_norm(h, (h.shape[-1],), self.nw[i], None, eps)
        hf = h.float()
        y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        if spec.norm == "gemma":
            return (y * (1.0 + self.nw[i].float())).type_as(h)
        if spec.norm == "noweight":
            return y.to(h.dtype)
        return self.nw[i] * y.to(h.dtype)

    def forward(self, x):
        shard = self.prog.hidden // self.world
        residual = x
        for i, spec in enumerate(self.prog.layers):
            y = x[:, self.rank * shard:(self.rank + 1) * shard] @ self.w[i]
            if spec.collective == "funcol" or spec.reduce_op != "sum":
                y = funcol.all_reduce(y, spec.reduce_op, dist.group.WORLD)
            else:
                dist.all_reduce(y)
            if spec.bias:
                y = y + self.b[i]
            if spec.extra == "between":
                y = torch.tanh(y)
            if spec.residual:
                y = residual + y
            residual = y
            x = self._norm(spec, i, y)
            if spec.extra == "after":
                x = F.gelu(x)
        return x


def _strategy():
    from hypothesis import strategies as st

    layer = st.builds(
        LayerSpec,
        norm=st.sampled_from(["hf", "functional", "gemma", "noweight", "layernorm"]),
        bias=st.booleans(), residual=st.booleans(),
        extra=st.sampled_from(["none", "none", "between", "after"]),
        collective=st.sampled_from(["inplace", "funcol"]),
        reduce_op=st.sampled_from(["sum", "sum", "sum", "avg"]),
    )
    return st.builds(
        Program,
        layers=st.lists(layer, min_size=1, max_size=4).map(tuple),
        hidden=st.sampled_from([16, 32, 48, 64]),
        tokens=st.integers(1, 300),
        dtype=st.sampled_from([torch.float32, torch.bfloat16]),
        eps=st.sampled_from([1e-5, 1e-6, 1e-8, 0.1]),
        data_seed=st.integers(0, 2**31 - 1),
    )


def _check_program(prog: Program, rank: int, world: int, compiler: str) -> str:
    """Empty string if the property holds, else what failed."""
    import weave_compile

    weave_compile.reset()
    torch._dynamo.reset()
    model = GeneratedTP(prog, rank, world)
    x = torch.randn(prog.tokens, prog.hidden, generator=torch.Generator().manual_seed(prog.data_seed + 1))
    x = x.to(prog.dtype)
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend="tokenweave", options={"compiler": compiler})(x)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    problems = []
    if not err < TOL[prog.dtype]:
        problems.append(f"compiled vs eager error {err:.3g}")
    sites = weave_compile.explain().sites
    fused = [s.fused for s in sites]
    expected = [spec.matchable for spec in prog.layers]
    if fused != expected:
        problems.append(f"fused {fused} != matchable {expected}: {[s.reason for s in sites]}")
    return "; ".join(problems)


def _property(rank, world, seed, compiler, max_examples):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hyp_seed

    checked = []

    @hyp_seed(seed)
    @settings(max_examples=max_examples, database=None, deadline=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(prog=_strategy())
    def prop(prog):
        problem = _check_program(prog, rank, world, compiler)
        ok = torch.tensor([0.0 if problem else 1.0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # both ranks take the same branch
        checked.append(prog)
        assert ok.item() == 1.0, f"{prog}: {problem or 'failed on the other rank'}"

    prop()
    return len(checked)


def test_generated_programs_aot_eager():
    seed = random.randrange(2**31)
    counts = assert_ranks_ok(run_ranks(_property, WORLD, args=(seed, "aot_eager", 40), timeout=600))
    assert counts[0] >= 40, f"seed={seed}: only {counts[0]} examples ran"


def test_generated_programs_inductor():
    seed = random.randrange(2**31)
    counts = assert_ranks_ok(run_ranks(_property, WORLD, args=(seed, "inductor", 4), timeout=600))
    assert counts[0] >= 4, f"seed={seed}: only {counts[0]} examples ran"
