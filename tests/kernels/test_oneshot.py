"""Tests for kernels/oneshot/ (barrier-free one-shot fused all-reduce + RMSNorm).

CPU: the real kernel under Triton's interpreter (``TRITON_INTERPRET=1``), one spawned process per
rank (gloo only for the start/end barriers), every rank's buffer a shared file mapped by every
process (the CPU stand-in for symmetric memory; the interpreter's volatile 2-byte loads made whole,
as the GPU's are: ``weave_compile.testing.interpreter_memory``). Back-to-back calls with changing T rotate the
slots past 3 and re-poison slots of different sizes; inputs hold -0.0 (the sentinel pattern).
GPU (``test_oneshot_gpu.py``): emulated ranks on one GPU, sharing this file's case machinery.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from weave_compile import kernels
from weave_compile.kernels.oneshot import kernel as oneshot_kernel
from weave_compile.kernels.oneshot import workspace as oneshot_ws
from weave_compile.kernels.spec import FusedSpec, Rows
from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref
from weave_compile.testing.interpreter_memory import single_copy_volatile_loads
from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks

from . import _layernorm_cases as lc
from ._symm_cases import DTYPES as DT
from ._symm_cases import EPS_TENSOR_VALUE, shard_rows, stub_workspace_allocation

requires_triton = pytest.mark.skipif(not oneshot_kernel.HAS_TRITON, reason="triton not installed")
# Elementwise |out - ref| <= atol + rtol * |ref| against the float64 reference (which rounds where
# the contract rounds), by output dtype.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


# ----------------------------------------------------------------------------- case machinery


def case(T, H, dtype="bf16", *, res="full", bias=True, weight=True, mid=None, woff=0.0, rdt=None, odt=None,
         neg_zero=False, ctas=8, seed=0, eps_tensor=False):
    """res: none | full | shard_in | shard_out | shard_both | first (no residual in, this rank's rows out:
    a sequence-parallel model's first site); rdt: residual dtype; odt: output dtype; eps_tensor: eps
    as a 0-d float64 tensor on the device (``EPS_TENSOR_VALUE``, the spec's float 0.0)."""
    return dict(T=T, H=H, dtype=dtype, res=res, bias=bias, weight=weight, mid=mid, woff=woff, rdt=rdt, odt=odt,
                neg_zero=neg_zero, ctas=ctas, seed=seed, eps_tensor=eps_tensor)


def eps_of(c) -> float:
    return EPS_TENSOR_VALUE if c["eps_tensor"] else 1e-6


def flags(c):
    return c["res"] in ("shard_in", "shard_both"), c["res"] in ("shard_out", "shard_both", "first")


def dtypes(c):
    dt = DT[c["dtype"]]
    rdt = DT[c["rdt"]] if c["rdt"] else dt
    return dt, rdt, DT[c["odt"]] if c["odt"] else dt


def make_inputs(c, world, device):
    """Every rank's partial sum, the full residual, bias, weight: the same on every rank (seeded)."""
    g = torch.Generator(device="cpu").manual_seed(int(c["seed"]))
    T, H = c["T"], c["H"]
    dt, rdt, _ = dtypes(c)

    def rnd(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    xs = [rnd(T, H, dtype=dt) for _ in range(world)]
    residual = rnd(T, H, dtype=rdt) if c["res"] not in ("none", "first") else None
    if c["neg_zero"]:  # the sentinel bit pattern as real data: must be sent as +0.0, never wait forever
        for x in xs:
            x[:, ::5] = -0.0
        if residual is not None:
            residual[:, ::7] = -0.0
        if T > 1:  # a whole row of -0.0 everywhere (its sum is zero: a zero normed row)
            for x in xs:
                x[T // 2] = -0.0
            if residual is not None:
                residual[T // 2] = -0.0
    bias = rnd(H, dtype=dt, scale=0.5) if c["bias"] else None
    weight = rnd(H, dtype=dt) if c["weight"] else None
    if c["neg_zero"] and bias is not None:
        bias[::5] = 0.0
    return xs, residual, bias, weight


def poisoned_outputs(c, world, device):
    T, H = c["T"], c["H"]
    _, rdt, odt = dtypes(c)
    _, out_sh = flags(c)
    S = math.ceil(T / world)
    normed = torch.full((T, H), float("nan"), dtype=odt, device=device)
    res_out = torch.full((S, H) if out_sh else (T, H), float("nan"), dtype=rdt, device=device)
    return normed, res_out


def rank_args(c, world, rank, xs, residual):
    """This rank's x and residual as the fused op receives them."""
    in_sh, _ = flags(c)
    res_in = None if residual is None else (shard_rows(residual, world, rank) if in_sh else residual)
    return xs[rank], res_in


def launch_rank(ws, c, x, res_in, bias, weight, normed, res_out):
    in_sh, out_sh = flags(c)
    # an eps tensor's spec eps is 0.0: a kernel that read the float would miss the oracle
    eps_t = torch.tensor(eps_of(c), dtype=torch.float64, device=x.device) if c["eps_tensor"] else None
    spec = FusedSpec(residual_dtype=res_out.dtype, out_dtype=normed.dtype, eps=0.0 if c["eps_tensor"] else eps_of(c),
                     mid_dtype=DT[c["mid"]] if c["mid"] else None, weight_offset=c["woff"],
                     residual_in_sharded=in_sh, residual_out_sharded=out_sh, comm_ctas=c["ctas"])
    oneshot_kernel.launch(ws, Rows(x, res_in, bias, weight, eps_tensor=eps_t), spec, normed, res_out)


def expected(c, xs, residual, bias, weight):
    """The float64 oracle in the op's output dtypes (it rounds the residual where the contract does;
    a mid dtype is not modelled: the tolerances cover that one rounding)."""
    _, rdt, odt = dtypes(c)
    return allreduce_add_rmsnorm_ref(xs, residual, bias, weight, eps=eps_of(c), weight_offset=c["woff"],
                                     residual_dtype=rdt, out_dtype=odt)


def mismatches(c, world, rank, normed, res_out, ref_n, ref_r) -> list[str]:
    """What is wrong with one rank's outputs (empty: correct)."""
    T = c["T"]
    _, out_sh = flags(c)
    errs = []
    if out_sh:
        S = math.ceil(T / world)
        lo, hi = rank * S, min(T, (rank + 1) * S)
        n = max(0, hi - lo)
        pairs = [("normed", normed, ref_n), ("residual shard", res_out[:n], ref_r[lo:hi])]
        if n < S and not bool((res_out[n:] == 0).all()):
            errs.append("residual shard rows past T are not zero")
    else:
        pairs = [("normed", normed, ref_n), ("residual", res_out, ref_r)]
    for name, out, ref in pairs:
        if out.dtype != ref.dtype or out.shape != ref.shape:
            errs.append(f"{name}: {out.dtype}{tuple(out.shape)} != {ref.dtype}{tuple(ref.shape)}")
            continue
        atol, rtol = TOL[out.dtype]
        if name == "normed" and c["mid"]:  # the norm is rounded to mid_dtype first: its ulp rules
            atol, rtol = max(atol, TOL[DT[c["mid"]]][0]), max(rtol, TOL[DT[c["mid"]]][1])
        o, r = out.double().cpu(), ref.double().cpu()
        bad = ~((o - r).abs() <= atol + rtol * r.abs())  # NaN (an unwritten, poisoned element) is bad
        if bool(bad.any()):
            errs.append(f"{name}: {int(bad.sum())} elements off, max err {float((o - r).abs().nan_to_num(1e9).max()):.3g}")
    return errs


# ----------------------------------------------------------------------------- host-side units


def test_sentinel_is_negative_zero():
    for dt in DT.values():
        s = oneshot_ws.sentinel_tensor(dt)
        assert s.item() == 0.0 and torch.signbit(s).item(), dt


def test_layout_regions_aligned_and_disjoint():
    lay = oneshot_ws.layout(100, 3, 40, torch.bfloat16, torch.float32)
    assert lay.src_bytes >= 100 * 40 * 2 and lay.src_bytes % 256 == 0
    assert lay.res_off == 3 * lay.src_bytes
    assert lay.slot_bytes >= lay.res_off + 100 * 40 * 4 and lay.slot_bytes % 256 == 0
    assert lay.total == 3 * lay.slot_bytes


def test_poison_fills_every_region_with_sentinel():
    lay = oneshot_ws.layout(8, 2, 16, torch.bfloat16, torch.float32)
    buf = torch.zeros(lay.total, dtype=torch.uint8)
    oneshot_ws.poison_(buf, lay, 2, 16, torch.bfloat16, torch.float32)
    for s in range(3):
        xs = buf[s * lay.slot_bytes:s * lay.slot_bytes + 2 * lay.src_bytes].view(torch.int16)
        assert bool((xs == -(1 << 15)).all())
        rs = buf[s * lay.slot_bytes + lay.res_off:s * lay.slot_bytes + lay.res_off + 8 * 16 * 4].view(torch.int32)
        assert bool((rs == -(1 << 31)).all())


def test_choose_by_bytes_and_static_t(monkeypatch):
    from weave_compile.kernels import auto, oneshot
    from weave_compile.kernels.shared import probe

    H, dt = 4096, torch.bfloat16
    impl = dataclasses.replace(kernels.get("oneshot"), auto_ready=True)  # as once measured across GPUs
    site = kernels.Site(device=torch.device("cuda", 0), dtype=dt, residual_dtype=dt, out_dtype=dt, hidden=H,
                        group_name="g", world_size=2)
    limit_rows = oneshot.ONESHOT_MAX_BYTES // (H * 2)
    assert auto.verdict(impl, dataclasses.replace(site, num_tokens=limit_rows))[0]
    assert not auto.verdict(impl, dataclasses.replace(site, num_tokens=limit_rows + 1))[0]
    use, why = auto.verdict(impl, site)
    assert not use and "symbolic" in why
    monkeypatch.setattr(probe, "probe", lambda *a, **k: probe.SymmProbe(True, False, "mapped"))
    assert auto.choose("oneshot", dataclasses.replace(site, num_tokens=10**6)) == ("oneshot", "requested")


def test_traffic_model_two_ranks_equals_two_shot_nvlink_bytes():
    # At N = 2 one-shot moves T*H*b each way, like reduce-scatter + all-gather (T*H*b/2 + T*H*b/2).
    m = oneshot_kernel.traffic_model(256, 8192, torch.bfloat16, 2)
    assert m["nvlink_out"] == m["nvlink_in"] == 256 * 8192 * 2


# ----------------------------------------------------------------------------- interpreter simulation

#: Per workspace: (H, dtype, residual dtype, calls). Calls run back to back on one workspace, so
#: slots rotate (> 3 calls) and slots written with one T are re-poisoned before a different T.
SIM_GROUPS = [
    (64, "bf16", None, [case(7, 64, seed=1), case(1, 64, res="none", bias=False, seed=2),
                        case(13, 64, res="shard_both", neg_zero=True, ctas=2, seed=3),
                        case(7, 64, res="shard_in", mid="bf16", woff=1.0, seed=4, eps_tensor=True),
                        case(2, 64, res="shard_out", weight=False, neg_zero=True, seed=5),
                        case(16, 64, neg_zero=True, ctas=3, seed=6)]),
    (48, "fp32", "fp32", [case(5, 48, "fp32", odt="bf16", res="shard_in", neg_zero=True, seed=7),
                          case(11, 48, "fp32", odt="bf16", res="full", ctas=4, seed=8),
                          case(3, 48, "fp32", odt="bf16", res="shard_both", seed=9),
                          case(9, 48, "fp32", odt="bf16", res="shard_in", neg_zero=True, seed=10)]),
    (32, "fp16", "fp32", [case(37, 32, "fp16", rdt="fp32", res="shard_both", mid="bf16", ctas=4, seed=11),
                          case(4, 32, "fp16", rdt="fp32", res="full", neg_zero=True, seed=12),
                          case(20, 32, "fp16", rdt="fp32", res="shard_in", ctas=5, seed=13, eps_tensor=True),
                          case(1, 32, "fp16", rdt="fp32", res="shard_both", seed=14)]),
]


def _capacity(calls, world):
    return max(math.ceil(c["T"] / world) * world for c in calls)


def _sim_rank(rank, world, files, groups, seed):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    single_copy_volatile_loads()  # a peer's element is read whole, as on the GPU (interpreter_memory.py)
    import torch.distributed as dist

    torch.set_num_threads(1)
    failures = []
    for gi, (H, dts, rdts, calls) in enumerate(groups):
        dt, rdt = DT[dts], DT[rdts] if rdts else DT[dts]
        cap = _capacity(calls, world)
        lay = oneshot_ws.layout(cap, world, H, dt, rdt)
        bufs = [torch.from_file(files[gi][p], shared=True, size=lay.total, dtype=torch.uint8) for p in range(world)]
        ws = oneshot_ws.workspace_from_buffers(bufs, rank, hidden=H, in_dtype=dt, res_dtype=rdt, capacity=cap)
        dist.barrier()  # every rank's buffer is poisoned before anyone pushes
        for ci, c0 in enumerate(calls):
            c = dict(c0, seed=seed + 1000 * gi + c0["seed"])
            xs, residual, bias, weight = make_inputs(c, world, "cpu")
            normed, res_out = poisoned_outputs(c, world, "cpu")
            x, res_in = rank_args(c, world, rank, xs, residual)
            launch_rank(ws, c, x, res_in, bias, weight, normed, res_out)
            for e in mismatches(c, world, rank, normed, res_out, *expected(c, xs, residual, bias, weight)):
                failures.append(f"group {gi} call {ci} T={c['T']} {c['res']}: {e}")
        dist.barrier()
        if ws.timeouts():
            failures.append(f"group {gi}: {ws.timeouts()} spin-limit trips")
        if int(ws.state[0]) != len(calls) or int(ws.state[1]) != 0:
            failures.append(f"group {gi}: state {ws.state.tolist()} after {len(calls)} calls")
    return failures


@requires_triton
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_oneshot_in_cpu_interpreter(world, tmp_path, monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks inherit it before importing triton
    monkeypatch.setenv("WEAVE_SYMM_SPIN_LIMIT", str(1 << 16))  # a lost row fails instead of hanging
    files = []
    for gi, (H, dts, rdts, calls) in enumerate(SIM_GROUPS):
        dt, rdt = DT[dts], DT[rdts] if rdts else DT[dts]
        total = oneshot_ws.layout(_capacity(calls, world), world, H, dt, rdt).total
        paths = []
        for p in range(world):
            path = str(tmp_path / f"g{gi}_r{p}.bin")
            with open(path, "wb") as f:
                f.truncate(total)
            paths.append(path)
        files.append(paths)
    results = run_ranks(_sim_rank, world, args=(files, SIM_GROUPS, seed % 10**6), timeout=600)
    for rank, fails in enumerate(assert_ranks_ok(results)):
        assert not fails, f"rank {rank}: " + "; ".join(fails)


# ----------------------------------------------------------------------------- LayerNorm (interpreter)

#: Per workspace: (H, dtype, residual input dtype, LayerNorm calls, ``_layernorm_cases`` cases) back to
#: back on one workspace (slots rotate past 3), an RMSNorm with a norm bias (HAS_NORM_BIAS alone) among them.
LN_GROUPS = [
    (40, "bf16", "bf16", [lc.ln_case(7, 40, bias=True, ctas=3, seed=1),  # weight, norm bias, pre-norm bias
                          lc.ln_case(13, 40, res="shard_both", weight=False, seed=2),  # norm bias alone
                          lc.ln_case(5, 40, res="shard_in", norm_bias=False, mid="bf16", woff=1.0, eps_tensor=True,
                                     seed=3),  # weight alone (Gemma's 1 + w), a mid dtype, eps from a tensor
                          lc.ln_case(1, 40, res="shard_out", weight=False, norm_bias=False, seed=4),  # T < ranks
                          lc.ln_case(11, 40, res="first", norm="rmsnorm", offset=0.0, seed=5),
                          lc.ln_case(9, 40, res="none", ctas=1, seed=6)]),
    (40, "fp32", "fp32", [lc.ln_case(9, 40, "fp32", res="shard_both", seed=7),
                          lc.ln_case(6, 40, "fp32", out_dtype="bf16", weight=False, seed=8),
                          lc.ln_case(10, 40, "fp32", res="shard_out", norm_bias=False, eps_tensor=True, seed=9)]),
    (48, "bf16", "fp32", [lc.ln_case(9, 48, res_dtype="fp32", res="shard_both", ctas=2, seed=10),
                          lc.ln_case(4, 48, res_dtype="fp32", res="shard_in", bias=True, seed=11)]),
]


def _ln_sim_rank(rank, world, files, groups, seed):
    """This rank's outputs of every LayerNorm call of ``groups`` (their checks need every rank's)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    single_copy_volatile_loads()  # a peer's element is read whole, as on the GPU (interpreter_memory.py)
    import torch.distributed as dist

    torch.set_num_threads(1)
    results = []
    for gi, (H, dts, rdts, calls) in enumerate(groups):
        dt, rdt = DT[dts], DT[rdts]
        cap = _capacity(calls, world)
        lay = oneshot_ws.layout(cap, world, H, dt, rdt)
        bufs = [torch.from_file(files[gi][p], shared=True, size=lay.total, dtype=torch.uint8) for p in range(world)]
        ws = oneshot_ws.workspace_from_buffers(bufs, rank, hidden=H, in_dtype=dt, res_dtype=rdt, capacity=cap)
        dist.barrier()  # every rank's buffer is poisoned before anyone pushes
        outs = []
        for c0 in calls:
            c = dict(c0, seed=seed + 1000 * gi + c0["seed"])
            xs, residual, bias, weight, nb = lc.make_inputs(c, world, "cpu")
            normed, res_out = lc.poisoned_outputs(c, world, "cpu")[rank]
            res_in = lc.rank_residual(c, world, rank, residual)
            if res_in is not None and lc.sharding(c)[0]:  # a shard's rows past T must never be read
                res_in[max(0, min(res_in.shape[0], c["T"] - rank * res_in.shape[0])):] = float("nan")
            kw = lc.spec_kwargs(c, "cpu")
            eps_t = kw.pop("eps_tensor", None)
            _, c_rdt, c_odt = lc.dtypes(c)
            spec = FusedSpec(residual_dtype=c_rdt, out_dtype=c_odt, comm_ctas=c["ctas"], **kw)
            oneshot_kernel.launch(ws, Rows(xs[rank], res_in, bias, weight, eps_tensor=eps_t, norm_bias=nb), spec,
                                  normed, res_out)
            outs.append((normed, res_out))
        dist.barrier()
        results.append((outs, ws.timeouts(), ws.state.tolist()))
    return results


def _run_ln_groups(world, groups, seed, tmp_dir) -> list[str]:
    """Every call of ``groups`` on ``world`` interpreter ranks (one process each, buffers in shared files
    under ``tmp_dir``), checked by ``_layernorm_cases.check``: what is wrong (empty: correct)."""
    files = []
    for gi, (H, dts, rdts, calls) in enumerate(groups):
        total = oneshot_ws.layout(_capacity(calls, world), world, H, DT[dts], DT[rdts]).total
        paths = []
        for p in range(world):
            path = os.path.join(tmp_dir, f"ln{gi}_r{p}.bin")
            with open(path, "wb") as f:
                f.truncate(total)
            paths.append(path)
        files.append(paths)
    per_rank = assert_ranks_ok(run_ranks(_ln_sim_rank, world, args=(files, groups, seed), timeout=600))
    errs = []
    for gi, (_, _, _, calls) in enumerate(groups):
        for ci, c0 in enumerate(calls):
            c = dict(c0, seed=seed + 1000 * gi + c0["seed"])
            outs = [per_rank[r][gi][0][ci] for r in range(world)]
            errs += [f"group {gi} call {ci} {lc.case_name(c)}: {e}"
                     for e in lc.check(c, world, outs, lc.make_inputs(c, world, "cpu"))]
        for r in range(world):
            _, timeouts, state = per_rank[r][gi]
            if timeouts or state[0] != len(calls) or state[1] != 0:
                errs.append(f"group {gi} rank {r}: {timeouts} spin-limit trips, state {state} after {len(calls)} calls")
    return errs


@requires_triton
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_oneshot_layernorm_in_cpu_interpreter(world, tmp_path, monkeypatch, seed):
    """The LayerNorm variant (IS_LAYERNORM, HAS_NORM_BIAS) on fresh rows with a common offset on x, outputs
    NaN-poisoned, against the float64 oracle's LayerNorm of the kernel's own residual (which RMSNorm would
    fail); every rank's normed rows bit-identical."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("WEAVE_SYMM_SPIN_LIMIT", str(1 << 16))  # a lost row fails instead of hanging
    errs = _run_ln_groups(world, LN_GROUPS, seed % 10**6, str(tmp_path))
    assert not errs, "\n".join(errs)


@requires_triton
def test_oneshot_layernorm_property_in_cpu_interpreter(monkeypatch):
    """Drawn sequences of calls on one workspace: ranks (2, 3), H, dtypes, T (1..12, changing between calls,
    so slots of one size are re-poisoned before another), residual forms, weight, norm bias, bias, mid
    dtype, CTAs, eps from a tensor, RMSNorm or LayerNorm. Each example spawns its ranks: a few examples."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    import shutil
    import tempfile

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("WEAVE_SYMM_SPIN_LIMIT", str(1 << 16))
    call = st.fixed_dictionaries(dict(
        T=st.integers(1, 12), res=st.sampled_from(["full", "shard_both", "shard_in", "shard_out", "none", "first"]),
        weight=st.booleans(), norm_bias=st.booleans(), bias=st.booleans(), mid=st.sampled_from([None, "bf16"]),
        ctas=st.integers(1, 4), eps_tensor=st.booleans(), norm=st.sampled_from(["layernorm", "layernorm", "rmsnorm"])))

    @hypothesis.settings(max_examples=3, deadline=None, database=None)
    @hypothesis.given(world=st.integers(2, 3), H=st.sampled_from([8, 24, 40, 64]),
                      dts=st.sampled_from([("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")]),
                      calls=st.lists(call, min_size=2, max_size=5), seed=st.integers(0, 10**6))
    def prop(world, H, dts, calls, seed):
        cases = [lc.ln_case(k["T"], H, dts[0], res_dtype=dts[1], seed=i, **{n: v for n, v in k.items() if n != "T"})
                 for i, k in enumerate(calls)]
        tmp = tempfile.mkdtemp(prefix="oneshot_ln_")
        try:
            errs = _run_ln_groups(world, [(H, dts[0], dts[1], cases)], seed, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        assert not errs, "\n".join(errs)

    prop()


def test_oneshot_op_falls_back_to_reference_on_cpu_tensors():
    """kernel="oneshot" on CPU tensors runs the reference (checked on 2 gloo ranks)."""
    results = run_ranks(_op_rank, 2, timeout=120)
    assert_ranks_ok(results)


def _op_rank(rank, world):
    import torch.distributed as dist

    import weave_compile.ops as ar

    c = case(5, 16, "fp32", res="full", seed=3)
    xs, residual, bias, weight = make_inputs(c, world, "cpu")
    group = dist.group.WORLD.group_name
    normed, res_out, _ = ar.allreduce_add_rmsnorm(xs[rank], residual, bias, weight, 1e-6, group, torch.float32,
                                               torch.float32, None, 0.0, False, False, "oneshot", 8)
    errs = mismatches(c, world, rank, normed, res_out, *expected(c, xs, residual, bias, weight))
    assert not errs, errs


# ----------------------------------------------------------------------------- compiles for sm_90


def _compile_sm90(dtype, rdt, *, sharded: bool, eps_ptr: bool = False, hidden: int = 4096, norm: str = "rmsnorm",
                  norm_bias: bool = False, mid: bool = False, rows: int = 256):
    """The kernel's PTX for sm_90 at the launcher's shape for ``rows`` padded rows of ``hidden`` on 32 CTAs, 2
    ranks, with a bias, weight and residual (``sharded``: pushed by their owners); ``norm`` and
    ``norm_bias``: the LayerNorm variant's keywords as the launcher passes them (none for RMSNorm);
    ``mid``: a bf16 mid dtype."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton

    from weave_compile.kernels.shared.common import sig_dtype as _sig_dtype, tl_dtype as _tl_dtype
    from weave_compile.kernels.shared.shapes import layernorm_constexprs

    fn = oneshot_kernel._oneshot_allreduce_rmsnorm_kernel
    meta = oneshot_kernel.launch_meta(hidden, rows, 32)
    ptr = {"PTR_TABLE": "*i64", "STATE": "*i32", "X": _sig_dtype(dtype), "RESIDUAL": _sig_dtype(rdt),
           "BIAS": _sig_dtype(dtype), "WEIGHT": _sig_dtype(dtype), "NORMED": _sig_dtype(dtype),
           "RESIDUAL_OUT": _sig_dtype(rdt)}
    ints = ("num_tokens", "rows_per_rank", "rank", "stride_x_row", "stride_res_row", "stride_out_row",
            "stride_res_out_row")
    runtime = {**ptr, **{n: "i32" for n in ints}, "slot_bytes": "i64", "src_bytes": "i64", "res_off": "i64",
               "eps": "*fp64" if eps_ptr else "fp32", "weight_offset": "fp32"}
    consts = dict(WORLD_SIZE=2, HIDDEN=hidden, BLOCK_H=meta.block_h, BLOCK_ROWS=meta.block_rows,
                  IN_DTYPE=_tl_dtype(dtype), IN_BITS=oneshot_kernel._tl_int(dtype), IN_SENT=oneshot_ws.SENTINEL[dtype],
                  RIN_DTYPE=_tl_dtype(rdt), RIN_BITS=oneshot_kernel._tl_int(rdt), RIN_SENT=oneshot_ws.SENTINEL[rdt],
                  OUT_DTYPE=_tl_dtype(dtype), RES_DTYPE=_tl_dtype(rdt),
                  MID_DTYPE=_tl_dtype(torch.bfloat16 if mid else torch.float32),
                  HAS_BIAS=True, HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_MID=mid,
                  RESIDUAL_IN_SHARDED=sharded, RESIDUAL_OUT_SHARDED=sharded, PUSH_RES=sharded, SPIN_LIMIT=0,
                  EPS_PTR=eps_ptr)
    consts.update(layernorm_constexprs(norm, None))
    if norm_bias:
        consts["HAS_NORM_BIAS"] = True
        ptr["NORM_BIAS"] = _sig_dtype(dtype)
        runtime["NORM_BIAS"] = ptr["NORM_BIAS"]
    signature = {n: runtime.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ptr}
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": meta.num_warps, "num_stages": 1}).asm["ptx"]


@requires_triton
@pytest.mark.parametrize("dtype,rdt,sharded,eps_ptr", [(torch.bfloat16, torch.bfloat16, True, False),
                                                       (torch.float32, torch.float32, False, False),
                                                       (torch.float16, torch.float32, True, False),
                                                       (torch.bfloat16, torch.bfloat16, False, True)])
def test_compiles_for_sm90_with_volatile_waits_and_no_multimem(dtype, rdt, sharded, eps_ptr):
    """eps_ptr: eps read from a float64 device tensor (``EPS_PTR``), converted to fp32 once."""
    ptx = _compile_sm90(dtype, rdt, sharded=sharded, eps_ptr=eps_ptr)
    assert "ld.volatile" in ptx  # the waits read memory, not a cached line
    assert "multimem" not in ptx
    assert ("cvt.rn.f32.f64" in ptx) == eps_ptr


@requires_triton
@pytest.mark.parametrize("dtype,rdt,sharded,norm_bias", [(torch.bfloat16, torch.bfloat16, True, True),
                                                         (torch.bfloat16, torch.bfloat16, False, False),
                                                         (torch.float32, torch.float32, False, True)])
def test_layernorm_compiles_for_sm90_with_volatile_waits(dtype, rdt, sharded, norm_bias):
    """The LayerNorm variant compiles for sm_90 (Triton and its ptxas) at a decode shape (32 padded rows) as
    the RMSNorm kernel does, and its keywords reach the kernel: other code than RMSNorm's, the norm bias
    one more pointer parameter."""
    import re

    rms = _compile_sm90(dtype, rdt, sharded=sharded, rows=32)
    ln = _compile_sm90(dtype, rdt, sharded=sharded, rows=32, norm="layernorm", norm_bias=norm_bias)
    assert "ld.volatile" in ln and "multimem" not in ln
    params = [len(re.findall(r"^\s*\.param\b", p, re.M)) for p in (rms, ln)]
    assert params[1] == params[0] + norm_bias and ln != rms, params


@requires_triton
def test_the_launcher_passes_the_layernorm_keywords_only_for_a_layernorm_or_a_norm_bias(monkeypatch):
    """RMSNorm without a norm bias launches with none of the variant's keywords (its kernel and binary are
    the ones they were); ``norm="layernorm"`` sets IS_LAYERNORM, a norm bias NORM_BIAS and HAS_NORM_BIAS,
    also through ``oneshot_allreduce_rmsnorm``, which copies the rows first (``lc.check_layernorm_keywords``).
    The kernel is stubbed."""
    stub = lc.KernelStub()
    monkeypatch.setattr(oneshot_kernel, "_oneshot_allreduce_rmsnorm_kernel", stub)
    H, T, bf = 64, 6, torch.bfloat16
    lay = oneshot_ws.layout(8, 2, H, bf, bf)
    ws = oneshot_ws.workspace_from_buffers([torch.zeros(lay.total, dtype=torch.uint8) for _ in range(2)], 0,
                                           hidden=H, in_dtype=bf, res_dtype=bf, capacity=8)
    x = torch.randn(T, H).to(bf)

    def keywords(norm, nb, whole_op):
        spec = FusedSpec(residual_dtype=bf, out_dtype=bf, comm_ctas=2, norm=norm)
        if whole_op:
            oneshot_kernel.oneshot_allreduce_rmsnorm(Rows(torch.randn(T, 2 * H).to(bf)[:, ::2], norm_bias=nb), spec,
                                                     workspace=ws)
        else:
            oneshot_kernel.launch(ws, Rows(x, norm_bias=nb), spec, torch.empty(T, H, dtype=bf),
                                  torch.empty(T, H, dtype=bf))
        return stub.seen.pop()

    lc.check_layernorm_keywords(keywords, H, bf)


# ----------------------------------------------------------------------------- selection (explain's pick and reason)


# Nothing measured across GPUs on today's kernels (the committed table): auto leaves the site as
# written (kernels/auto.py), and the reason says why oneshot was not taken.
@pytest.mark.parametrize("requested,variant,tokens,want,reason", [
    ("auto", "p2p", 64, "as written", "auto waits for its measurement across GPUs"),  # fits, not yet measured
    ("auto", "p2p", 4096, "as written", "not oneshot: T*H*b = 33554432 B > "),
    ("auto", "p2p", None, "as written", "not oneshot: symbolic token count"),
    ("auto", "multimem", 64, "as written", "not multimem: "),  # multimem waits for its measurement too
    ("oneshot", "p2p", 4096, "oneshot", "requested"),
    ("p2p", "p2p", 64, "p2p", "requested"),
])
def test_select_kernel_picks_oneshot_below_crossover(monkeypatch, requested, variant, tokens, want, reason):
    from weave_compile.kernels import auto, auto_table
    from weave_compile.kernels.shared import probe

    for name in ("TABLE", "INTERFERENCE", "FLOOR"):
        monkeypatch.setattr(auto_table, name, {})
    monkeypatch.setattr(probe, "probe", lambda *a, **k: probe.SymmProbe(variant is not None, variant == "multimem",
                                                                        f"{variant} usable"))
    dt = torch.bfloat16
    site = kernels.Site(device=torch.device("cuda", 0), dtype=dt, residual_dtype=dt, out_dtype=dt, hidden=4096,
                        group_name="g", world_size=2, num_tokens=tokens)
    kernel, why = auto.choose(requested, site)
    assert kernel == want and reason in why, (kernel, why)


def test_a_grown_workspace_keeps_the_old_one_alive_and_grows_geometrically(monkeypatch):
    """Growth replaces the cached workspace; the replaced one must stay alive even with no CUDA
    graph captured (a launch on it may still run here or on a peer), and capacities grow by at
    least 1.5x so that few are kept.  Allocation, capture state and group size are stubbed."""
    made = stub_workspace_allocation(monkeypatch, oneshot_ws)
    dev = torch.device("cuda", 0)
    get = lambda T: oneshot_ws.get_workspace("g", torch.bfloat16, torch.bfloat16, 64, T, dev)  # noqa: E731
    first = get(12800)  # large against the 128-row rounding, so only the 1.5x growth gives 1.5x
    assert get(first.capacity) is first and not oneshot_ws._RETIRED  # fits: no new allocation
    second = get(first.capacity + 2)  # just past it
    assert second is not first and oneshot_ws._RETIRED == [first]
    assert second.capacity >= 1.5 * first.capacity
    assert len(made) == 2
