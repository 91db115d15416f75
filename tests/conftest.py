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
#: ranks), longest first. pytest-xdist's ``--dist loadfile`` hands files to whichever worker is
#: free in collection order: started first, they cannot be the one file a worker still runs while
#: the other has finished (measured: up to ~8 minutes of one idle worker at the end).
LONGEST_FIRST = (
    "tests/passes/test_fuse_sequence_parallel_models.py",
    "tests/test_agreement.py",
    "tests/models/test_hf_tp.py",
    "tests/passes/split_tokens/test_rewriter.py",
    "tests/passes/test_fuse_allreduce_rmsnorm.py",
    "tests/passes/split_tokens/test_merge_projections.py",
    "tests/test_examples.py",
    "tests/testing/test_emulated_ranks.py",
    "tests/passes/test_fuse_allreduce_rmsnorm_property.py",
    "tests/passes/split_tokens/test_attention.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def key(item):
        path = os.path.relpath(str(item.path), str(config.rootpath)).replace(os.sep, "/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the order within a file, and of the other files, is kept
