import os
import time

import pytest
import torch
import torch.distributed as dist

from weave_compile.testing.multiprocess import assert_ranks_ok, run_ranks


def _sum_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return t.item()


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def _fail_on_rank_0(rank, world_size):
    if rank == 0:
        raise RuntimeError("deliberate failure on rank 0")
    t = torch.ones(1)
    dist.all_reduce(t)  # blocks: rank 0 never joins
    return rank


def _crash_on_rank_1(rank, world_size):
    if rank == 1:  # (run_ranks starts fn only once every rank is past the group's setup)
        os._exit(3)
    return rank


def test_values_from_every_rank():
    assert assert_ranks_ok(run_ranks(_sum_ranks, 2, args=(10,), timeout=60)) == [21.0, 21.0]


def test_hanging_rank_becomes_a_failed_result_within_timeout():
    start = time.monotonic()
    results = run_ranks(_hang_on_rank_1, 2, timeout=8)
    elapsed = time.monotonic() - start
    assert results[0].ok and results[0].value == 0
    assert results[1].timed_out and not results[1].ok
    assert elapsed < 8 + 15, f"harness took {elapsed:.0f} s to give up on a hanging rank"
    with pytest.raises(AssertionError, match="timed out"):
        assert_ranks_ok(results)


def test_exception_is_reported_and_blocked_peer_is_killed():
    start = time.monotonic()
    results = run_ranks(_fail_on_rank_0, 2, timeout=120)
    assert "deliberate failure on rank 0" in results[0].error
    assert not results[1].ok
    # The peer blocked in all_reduce is given a short grace, not the whole timeout.
    assert time.monotonic() - start < 60


def test_crashed_rank_is_reported():
    results = run_ranks(_crash_on_rank_1, 2, timeout=60)
    assert results[0].ok
    assert not results[1].ok and "exited with code 3" in results[1].error


def _what_the_rank_sees(rank, world_size):
    import sys

    preloaded = "torch._inductor.compile_fx" in sys.modules  # before this function imported anything
    import torch._inductor.config as inductor_config

    return preloaded, inductor_config.fx_graph_cache, os.environ.get("WEAVE_TEST_MARK")


def test_ranks_start_with_the_compile_stack_and_read_settings_from_their_own_environment():
    # Forked from the server: Inductor already imported, under the ranks' usual settings (cache off).
    assert assert_ranks_ok(run_ranks(_what_the_rank_sees, 2, timeout=120)) == [(True, False, None)] * 2
    # Another environment: a server of its own, started in it, so what Inductor read at import follows it.
    env = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "WEAVE_TEST_MARK": "x"}
    assert assert_ranks_ok(run_ranks(_what_the_rank_sees, 2, timeout=120, env=env)) == [(True, True, "x")] * 2
    # And back: the first server still serves the first environment.
    assert assert_ranks_ok(run_ranks(_what_the_rank_sees, 2, timeout=120)) == [(True, False, None)] * 2


def test_a_compile_in_the_calling_process_keeps_the_ranks_on_the_server():
    # Inductor writes its cache directory (and more) into the environment of a process that
    # compiles: the ranks started after it must still fork from the server.
    torch.compile(lambda t: t.relu() + 1)(torch.randn(3))
    assert [s[0] for s in assert_ranks_ok(run_ranks(_what_the_rank_sees, 2, timeout=120))] == [True, True]


def _how_the_rank_started(rank, world_size):
    import sys

    preloaded = "torch._inductor.compile_fx" in sys.modules  # the fork server's preload
    return os.getppid(), preloaded


def test_ranks_are_spawned_where_a_gpu_driver_is_present(tmp_path, monkeypatch):
    """A rank forked from a process that touched the GPU driver cannot initialize CUDA: where a
    driver's device file exists, ranks are spawned by this process, not forked from the server."""
    from weave_compile.testing import multiprocess

    driver = tmp_path / "nvidiactl"
    monkeypatch.setattr(multiprocess, "_GPU_DRIVER_FILES", (str(driver),))
    assert multiprocess.start_method() == "forkserver"
    forked = assert_ranks_ok(run_ranks(_how_the_rank_started, 2, timeout=120))
    assert all(ppid != os.getpid() and preloaded for ppid, preloaded in forked), forked  # the server's children

    driver.touch()
    assert multiprocess.start_method() == "spawn"
    spawned = assert_ranks_ok(run_ranks(_how_the_rank_started, 2, timeout=120))
    assert spawned == [(os.getpid(), False)] * 2, spawned  # ours, a fresh interpreter each


def _cuda_in_the_rank(rank, world_size):
    x = torch.arange(4.0, device="cuda") + rank
    if dist.get_backend() == "nccl":
        dist.all_reduce(x)
    return x.cpu().tolist(), torch.cuda.is_initialized()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_rank_initializes_cuda_after_the_caller_did():
    """What failed on a GPU machine when ranks forked from the warm server: "Cannot re-initialize
    CUDA in forked subprocess". The caller has CUDA initialized here too (the GPU tests' own state)."""
    from weave_compile.testing.multiprocess import start_method

    torch.zeros(1, device="cuda")
    assert start_method() == "spawn"
    # NCCL, one rank per GPU (one here), and two gloo ranks sharing the GPU (tests/passes/test_output_in_place.py).
    assert assert_ranks_ok(run_ranks(_cuda_in_the_rank, 1, backend="nccl", timeout=120)) == [([0.0, 1.0, 2.0, 3.0],
                                                                                              True)]
    assert assert_ranks_ok(run_ranks(_cuda_in_the_rank, 2, timeout=120)) == [([0.0, 1.0, 2.0, 3.0], True),
                                                                              ([1.0, 2.0, 3.0, 4.0], True)]
