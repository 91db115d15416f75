"""Cases, inputs, the float64 reference and output checks shared by the kernel tests.

Not a test module: ``tests/kernels/p2p/test_launch.py`` (multi-process CPU simulation, 2-GPU
suites), ``tests/kernels/p2p/test_push.py`` (emulated ranks on one GPU) and the one-shot tests
import it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from weave_compile.kernels.reference import allreduce_add_rmsnorm_ref

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DT_NAME = {v: k for k, v in DTYPES.items()}

#: Residual layouts: "none" (no residual), "full", "shard_in", "shard_out", "shard_both", and "first":
#: no residual in, this rank's rows out (a sequence-parallel model's first site, the embedding's
#: reduce-scatter, and the first site of a residual stream the shard pass keeps sharded).
NO_RESIDUAL = ("none", "first")
SHARDED_IN = ("shard_in", "shard_both")
SHARDED_OUT = ("shard_out", "shard_both", "first")


def sharding(c) -> tuple[bool, bool]:
    """``(residual_in_sharded, residual_out_sharded)`` of a case."""
    return c["res"] in SHARDED_IN, c["res"] in SHARDED_OUT


#: eps where a case gives it as a 0-d tensor: large enough to move every output, so a kernel that
#: read the spec's float (0.0 in :func:`eps_args`) instead would fail the oracle.
EPS_TENSOR_VALUE = 0.5


def make_case(T, H, dtype="bf16", *, res="full", bias=True, weight=True, mid=None, woff=0.0,
              res_dtype=None, out_dtype=None, ctas=16, channel=0, seed=0, eps_tensor=False):
    """res: 'none' | 'full' | 'shard_in' | 'shard_out' | 'shard_both' | 'first' (see NO_RESIDUAL);
    eps_tensor: the launch gets eps as a 0-d float64 tensor (see :func:`eps_args`)."""
    return dict(T=T, H=H, dtype=dtype, res=res, bias=bias, weight=weight, mid=mid, woff=woff,
                res_dtype=res_dtype, out_dtype=out_dtype, ctas=ctas, channel=channel, seed=seed,
                eps_tensor=eps_tensor)


def eps_args(c, device) -> dict:
    """The launch's eps keywords: ``eps`` as a float, or (``c["eps_tensor"]``) ``eps=0.0`` and
    ``eps_tensor`` a 0-d float64 tensor on ``device`` holding :data:`EPS_TENSOR_VALUE`, as the
    pass hands it under ``torch.compile(dynamic=True)``."""
    if not c.get("eps_tensor"):
        return dict(eps=kernel_kwargs(c)["eps"])
    return dict(eps=0.0, eps_tensor=torch.tensor(EPS_TENSOR_VALUE, dtype=torch.float64, device=device))


def case_name(c) -> str:
    parts = [f"T={c['T']}", f"H={c['H']}", c["dtype"], f"res={c['res']}"]
    if not c["bias"]:
        parts.append("nobias")
    if not c["weight"]:
        parts.append("noweight")
    for k in ("mid", "res_dtype", "out_dtype"):
        if c[k]:
            parts.append(f"{k}={c[k]}")
    if c["woff"]:
        parts.append(f"woff={c['woff']}")
    parts.append(f"ctas={c['ctas']}")
    if c["channel"]:
        parts.append(f"ch={c['channel']}")
    if c.get("eps_tensor"):
        parts.append("eps=tensor")
    return " ".join(parts)


def make_inputs(c, world, device):
    """Identical on every rank (same seed): all ranks' x, full residual, bias, weight."""
    g = torch.Generator(device=device).manual_seed(int(c["seed"]))
    T, H = c["T"], c["H"]
    dt = DTYPES[c["dtype"]]
    rdt = DTYPES[c["res_dtype"]] if c["res_dtype"] else dt

    def rnd(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    xs = [rnd(T, H, dtype=dt) for _ in range(world)]
    residual = rnd(T, H, dtype=rdt) if c["res"] not in NO_RESIDUAL else None
    bias = rnd(H, dtype=dt, scale=0.5) if c["bias"] else None
    weight = rnd(H, dtype=dt) if c["weight"] else None
    return xs, residual, bias, weight


def shard_rows(t, world, rank):
    """This rank's [S, H] shard of a [T, H] tensor, rows beyond T zero."""
    T, H = t.shape
    S = math.ceil(T / world)
    out = torch.zeros(S, H, dtype=t.dtype, device=t.device)
    lo, hi = rank * S, min(T, (rank + 1) * S)
    if hi > lo:
        out[: hi - lo] = t[lo:hi]
    return out


def kernel_kwargs(c):
    """FusedSpec's keywords for a case; ``eps`` is the value the oracle uses (a launch that gives
    it as a tensor takes :func:`eps_args` on top)."""
    return dict(
        eps=EPS_TENSOR_VALUE if c.get("eps_tensor") else 1e-6,
        residual_dtype=DTYPES[c["res_dtype"]] if c["res_dtype"] else None,
        out_dtype=DTYPES[c["out_dtype"]] if c["out_dtype"] else None,
        mid_dtype=DTYPES[c["mid"]] if c["mid"] else None,
        weight_offset=c["woff"],
        residual_in_sharded=sharding(c)[0],
        residual_out_sharded=sharding(c)[1],
        comm_ctas=c["ctas"],
        channel=c["channel"],
    )


def rows_ref(xs, residual=None, bias=None, weight=None, *, eps=1e-6, residual_dtype=None,
             out_dtype=None, weight_offset=0.0):
    """The float64 oracle's ``(normed, residual_out)`` in the kernel's output dtypes (the oracle
    rounds the residual where the contract does, before normalising it)."""
    dt = xs[0].dtype
    residual_dtype = residual_dtype or (residual.dtype if residual is not None else dt)
    return allreduce_add_rmsnorm_ref(xs, residual, bias, weight, eps=eps, weight_offset=weight_offset,
                                     residual_dtype=residual_dtype, out_dtype=out_dtype or dt)


def reference(c, xs, residual, bias, weight):
    kw = kernel_kwargs(c)
    return rows_ref(xs, residual, bias, weight, eps=kw["eps"],
                    residual_dtype=kw["residual_dtype"], out_dtype=kw["out_dtype"],
                    weight_offset=kw["weight_offset"])


def _tol(dtype):
    return (1e-4, 1e-4) if dtype == torch.float32 else (1.5e-2, 1.5e-2)


def _excess(a, b):
    """max(|a-b| - rtol*|b| - atol) <= 0 means close; also returns max |a-b|."""
    rtol, atol = _tol(b.dtype)
    a64, b64 = a.double(), b.double()
    if a64.numel() == 0:
        return 0.0, -1.0
    diff = (a64 - b64).abs()
    excess = (diff - rtol * b64.abs() - atol).max().item()
    if not torch.isfinite(a64).all():
        excess = float("inf")
    return diff.max().item(), excess


def check_outputs(c, world, rank, normed, res_out, ref_n, ref_r):
    """Returns (ok, err_normed, err_residual, message)."""
    T, H = c["T"], c["H"]
    S = math.ceil(T / world)
    msgs = []
    if tuple(normed.shape) != (T, H) or normed.dtype != ref_n.dtype:
        msgs.append(f"normed shape/dtype {tuple(normed.shape)}/{normed.dtype}")
        return False, float("nan"), float("nan"), "; ".join(msgs)
    en, xn = _excess(normed, ref_n)
    if xn > 0:
        msgs.append(f"normed mismatch (max err {en:.3g})")
    if sharding(c)[1]:
        if tuple(res_out.shape) != (S, H):
            return False, en, float("nan"), f"residual shard shape {tuple(res_out.shape)}"
        lo, hi = rank * S, min(T, (rank + 1) * S)
        n = max(0, hi - lo)
        er, xr = _excess(res_out[:n], ref_r[lo:hi])
        if n < S and (not torch.equal(res_out[n:], torch.zeros_like(res_out[n:]))
                      or torch.signbit(res_out[n:]).any()):
            msgs.append("residual shard rows beyond T not +0")
    else:
        if tuple(res_out.shape) != (T, H):
            return False, en, float("nan"), f"residual shape {tuple(res_out.shape)}"
        er, xr = _excess(res_out, ref_r)
    if xr > 0:
        msgs.append(f"residual mismatch (max err {er:.3g})")
    if res_out.dtype != ref_r.dtype:
        msgs.append(f"residual dtype {res_out.dtype} != {ref_r.dtype}")
    return not msgs, en, er, "; ".join(msgs)


def spawn_ranks(fn, world, args, timeout):
    """torch.multiprocessing spawn with a deadline: kill our children when it passes."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=(world,) + tuple(args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + timeout
    while not ctx.join(timeout=2.0):
        if time.time() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"ranks did not finish within {timeout} s")


def run_script(path, args, timeout, env=None):
    """Run ``path`` as a script in its own session; kill the whole session on timeout."""
    proc = subprocess.Popen([sys.executable, path] + list(args), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


def assert_interpreted_run(path, args, marker: str, timeout: float = 900) -> None:
    """Run test file ``path`` as a script under ``TRITON_INTERPRET=1`` (its :func:`interpreted_main`)
    and require a zero exit and ``marker`` in what it printed."""
    rc, out = run_script(path, args, timeout=timeout, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert rc == 0, out[-8000:]
    assert marker in out, out[-8000:]


def interpreted_main(main, prop=None) -> None:
    """A test file's ``__main__`` under the interpreter: ``main(world, seed)`` from ``--world`` and
    ``--seed`` (default 2 and 0), or ``prop(examples)`` with ``--property N``; exits with its code."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1")
    from weave_compile.testing.emulated_ranks import interpreter_compat

    interpreter_compat()

    def arg(name, default):
        return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default

    if prop is not None and "--property" in sys.argv:
        sys.exit(prop(arg("--property", 0)))
    sys.exit(main(arg("--world", 2), arg("--seed", 0)))


def stub_workspace_allocation(monkeypatch, module) -> list:
    """Let ``module.get_workspace`` (oneshot.workspace, ce.workspace) run on CPU: its allocation records a
    stand-in with the capacity asked for (the list returned), no capture, a 2-rank group."""
    import types

    from weave_compile.kernels.shared import outside_pool

    made = []

    def fake_allocate(*args):
        made.append(types.SimpleNamespace(world_size=2, capacity=args[-1], failed=None))
        return made[-1]

    monkeypatch.setattr(module, "_allocate", fake_allocate)
    monkeypatch.setattr(module, "_WORKSPACES", {})
    monkeypatch.setattr(module, "_RETIRED", [])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(outside_pool, "run_outside_graph_pool", lambda fn, device: fn())
    monkeypatch.setattr(module, "group_size", lambda group: 2)
    return made
