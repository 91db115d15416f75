"""Run a function on N ranks in fresh processes, with a hard timeout.

``run_ranks(fn, world_size=2)`` starts one process per rank (see :func:`start_method`: forked from
a server process that imported torch's compile stack once where no GPU driver is present, spawned
where one is), in the caller's current environment, initializes a
process group (gloo on CPU by default, NCCL with one GPU per rank when asked), calls
``fn(rank, world_size, *args)`` and returns one :class:`RankResult` per rank: the value, or the
exception's traceback. A rank that does not finish before the deadline is killed together with
every other rank and reported as timed out, so a hang fails a test instead of stalling CI.

``fn`` and its arguments travel by pickle, so ``fn`` must be a module-level function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

# Ranks share the machine: keep each to one intra-op thread so two ranks on two cores do not
# oversubscribe (and Inductor's C++ compile workers stay in-process).
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
              # A graph served from Inductor's caches skips the passes, so explain() has no site
              # list: ranks always compile, whatever an earlier run left in the cache directory.
              "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
# Once one rank has failed, its peers are likely blocked in a collective: give them this long.
_GRACE_AFTER_ERROR_S = 15.0


@dataclasses.dataclass
class RankResult:
    rank: int
    value: Any = None
    error: Optional[str] = None  # formatted traceback
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def _child(call, rank, world_size, backend, store_path, timeout_s, env, out_q):
    # A forked child starts with the fork server's environment: take the caller's, whole, before
    # ``call`` (fn and args, pickled) imports fn's module: what reads the environment at import
    # (TRITON_INTERPRET at a kernel's definition, say) must see the caller's.
    os.environ.clear()
    os.environ.update(env)
    try:
        fn, args = pickle.loads(call)
        import torch
        import torch.distributed as dist

        # Forked: torch was imported by the server, before this environment: apply what it read then.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.set_debug_level_from_env()

        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # No rank starts ``fn`` before every rank is past the group's setup: a rank whose ``fn``
        # returns at once would close its connections while a peer is still in gloo's connect,
        # and the peer would fail there, whatever the test checks.
        store = dist.distributed_c10d._get_default_store()
        if store.add("weave: ranks set up", 1) == world_size:
            store.set("weave: all set up", "1")
        store.wait(["weave: all set up"])
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        payload = pickle.dumps(("ok", value))
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        payload = pickle.dumps(("error", traceback.format_exc()))
    out_q.put((rank, payload))


#: Prefixes of the environment variables that the servers' imports read (torch and its compilers,
#: Triton, transformers, the thread pools, this package). Others (pytest's, the shell's) do not
#: matter to what a server imported.
_IMPORT_ENV_PREFIXES = ("TORCH", "PYTORCH", "_TORCH", "TRITON", "CUDA", "NCCL", "HF_", "TRANSFORMERS", "OMP_", "MKL_",
                        "WEAVE")
#: ... except these, read when used, not at import: Inductor's cache directory and the pointer its
#: C++ wrapper code finds there (Inductor writes both into the environment of a process that
#: compiled), and the process-group debug level (``_child`` applies it).
_READ_WHEN_USED = frozenset({"TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
                             "TORCH_DISTRIBUTED_DEBUG"})
_PRELOAD = "weave_compile.testing.rank_server"
#: One fork server per environment (as :func:`_import_env` sees it) that ranks were started with.
_servers: dict[tuple, Any] = {}


#: Device files of a GPU driver (NVIDIA, AMD ROCm, WSL): where one exists, a process may touch it.
_GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
FORK_SERVER, SPAWN = "forkserver", "spawn"


def gpu_driver_present() -> bool:
    """Whether this machine has a GPU driver a process could initialize (a device file exists)."""
    return any(os.path.exists(f) for f in _GPU_DRIVER_FILES)


def start_method() -> str:
    """How :func:`run_ranks` starts ranks here: ``spawn`` where a GPU driver is present, else
    ``forkserver`` (forked from the warm server of :mod:`weave_compile.testing.rank_server`).

    CUDA cannot be initialized in a process forked from one that has touched the driver ("Cannot
    re-initialize CUDA in forked subprocess"), and touching it takes no more than
    ``torch.cuda.is_available()`` or ``device_count()``, which the server's imports (transformers',
    Inductor's) may call: nothing proves a fork server clean. A spawned rank starts a fresh
    interpreter, so any rank may use CUDA; it pays torch's imports itself (seconds), which a
    machine with GPUs has the cores for. Without a driver no rank can reach CUDA, and forking
    from the server saves the suite those imports for its hundreds of ranks on two cores."""
    return SPAWN if gpu_driver_present() else FORK_SERVER


def _import_env(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_IMPORT_ENV_PREFIXES) and k not in _READ_WHEN_USED))


@contextlib.contextmanager
def _in_environment(child_env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``child_env`` inside: a process started now (or a server) inherits it."""
    saved_env = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(child_env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


@contextlib.contextmanager
def _forking_from_server(child_env: dict[str, str]) -> Iterator[None]:
    """Processes of the forkserver context started inside fork from the server of ``child_env``.

    Ranks fork from a server process that has imported torch and its compile stack once
    (:mod:`weave_compile.testing.rank_server`; importing them costs every rank several seconds of
    CPU, and the suite starts hundreds of ranks). Those imports read some settings from the
    environment (Inductor's caches, Triton's interpreter), so each environment gets a server of its
    own, started in that environment. multiprocessing has one fork server per process; its
    module-level entry point is pointed at this environment's server while the ranks start."""
    from multiprocessing import forkserver

    key = _import_env(child_env)
    server = _servers.get(key)
    if server is None:
        server = _servers[key] = forkserver.ForkServer()
        server.set_forkserver_preload([_PRELOAD])
    saved_connect = forkserver.connect_to_new_process
    try:
        with _in_environment(child_env):
            forkserver.connect_to_new_process = server.connect_to_new_process
            yield
    finally:
        forkserver.connect_to_new_process = saved_connect


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    timeout: float = 300.0,
    backend: str = "gloo",
    env: Optional[dict[str, str]] = None,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` rank processes; kill all after ``timeout`` s."""
    child_env = {**os.environ, **_CHILD_ENV, **(env or {})}
    method = start_method()
    ctx = mp.get_context(method)
    call = pickle.dumps((fn, args))
    out_q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="weave_ranks_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_child, args=(call, r, world_size, backend, store, timeout, child_env, out_q),
                        daemon=True)
            for r in range(world_size)
        ]
        with _forking_from_server(child_env) if method == FORK_SERVER else _in_environment(child_env):
            for p in procs:
                p.start()
        results = {r: RankResult(rank=r) for r in range(world_size)}
        pending = set(range(world_size))
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, payload = out_q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) will never report.
                for r in list(pending):
                    if not procs[r].is_alive() and procs[r].exitcode not in (None, 0):
                        results[r].error = f"rank {r} exited with code {procs[r].exitcode} without a result"
                        pending.discard(r)
                continue
            status, value = pickle.loads(payload)
            if status == "ok":
                results[rank].value = value
            else:
                results[rank].error = value
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR_S)
            pending.discard(rank)
        for r in pending:
            results[r].timed_out = True
            results[r].error = (f"rank {r} did not finish before the deadline ({timeout:.0f} s, or a "
                                f"{_GRACE_AFTER_ERROR_S:.0f} s grace after another rank failed)")
        for p in procs:
            p.join(timeout=5 if not pending else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


def assert_ranks_ok(results: list[RankResult]) -> list[Any]:
    """Every rank's value; an AssertionError with every failing rank's traceback otherwise."""
    failed = [r for r in results if not r.ok]
    if failed:
        msg = "\n".join(f"--- rank {r.rank}{' (timed out)' if r.timed_out else ''}:\n{r.error}" for r in failed)
        raise AssertionError(f"{len(failed)} of {len(results)} ranks failed:\n{msg}")
    return [r.value for r in results]
