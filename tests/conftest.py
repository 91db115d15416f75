import os
import random

import pytest


def pytest_runtest_setup(item):
    # A test that times GPU work is only valid with the GPU to itself: pytest-xdist's workers run
    # other GPU tests at the same moment (one H200, 8 workers: a 180 us transfer measured 878 us).
    if item.get_closest_marker("timing") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.skip("times GPU work: other pytest-xdist workers share the GPU; run it without -n")


@pytest.fixture
def seed():
    """A fresh seed per test run (never a fixed one); printed so a failure can be replayed."""
    s = random.randrange(2**31)
    print(f"seed={s}")
    return s


#: The files that take longest on the 2-core CI machine (minutes each, mostly compiling on gloo
#: ranks), longest first (measured cold, 2026-12-03: each file's wall under ``-n 2``, or its CPU
#: time run alone). pytest-xdist's ``--dist loadfile`` hands files to whichever worker is free in
#: queue order: started first, they cannot be the one file a worker still runs while the other has
#: finished (measured: up to ~8 minutes of one idle worker at the end).
LONGEST_FIRST = (
    "tests/passes/test_fuse_sequence_parallel_models.py",
    "tests/test_agreement.py",
    "tests/models/test_hf_tp.py",
    "tests/passes/split_tokens/test_rewriter.py",
    "tests/testing/test_emulated_ranks.py",
    "tests/passes/split_tokens/test_merge_projections.py",
    "tests/passes/split_tokens/test_attention.py",
    "tests/test_examples.py",
    "tests/passes/test_fuse_allreduce_rmsnorm.py",
    "tests/passes/test_fuse_allreduce_rmsnorm_property.py",
    "tests/benchmarks/test_bench_floor.py",
    "tests/test_backend.py",
    "tests/passes/split_tokens/test_inductor_kernels.py",
    "tests/passes/split_tokens/test_plan.py",
)


def pytest_configure(config):
    # pytest-xdist queues the files of --dist loadfile by their number of tests, most first (its
    # --loadscope-reorder, on by default), not in collection order: LONGEST_FIRST was lost (in a
    # measured CI run test_hf_tp.py's 145 tests went first and the longest file started after 6
    # minutes). Collection order is kept unless the command line asks for the reorder itself.
    if getattr(config.option, "loadscopereorder", False) and "--loadscope-reorder" not in config.invocation_params.args:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item):
        path = os.path.relpath(str(item.path), str(config.rootpath)).replace(os.sep, "/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order within a file, and of the other files, is kept
