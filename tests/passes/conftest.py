import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def group():
    """A fake 2-rank world in this process (graph tests trace collectives without spawning ranks):
    its group name."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
