import random

import pytest


@pytest.fixture
def seed():
    """A fresh seed per test run (never a fixed one); printed so a failure can be replayed."""
    s = random.randrange(2**31)
    print(f"seed={s}")
    return s
