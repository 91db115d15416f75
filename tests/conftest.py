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
