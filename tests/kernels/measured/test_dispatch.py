"""The kernel argument as a table by token count."""

import pytest

from weave_compile.kernels.measured import dispatch


def test_one_design_everywhere_is_a_plain_name():
    assert dispatch.encode([(1, "p2p"), (64, "p2p"), (4096, "p2p")]) == "p2p"


def test_a_table_merges_neighbours_and_resolves_by_count():
    k = dispatch.encode([(4096, "ce"), (1, "nccl"), (64, "nccl"), (128, "p2p"), (2048, "p2p")])
    assert k == "by_tokens:nccl<=64,p2p<=2048,ce"
    assert dispatch.decode(k) == [(64, "nccl"), (2048, "p2p"), (None, "ce")]
    assert [dispatch.resolve(k, t) for t in (1, 64, 65, 2048, 2049, 10 ** 6)] == ["nccl", "nccl", "p2p", "p2p", "ce",
                                                                                  "ce"]
    assert dispatch.designs(k) == ["nccl", "p2p", "ce"]
    assert dispatch.describe(k) == "nccl to T=64, p2p to T=2048, ce above"
    assert dispatch.resolve("p2p", 7) == "p2p" and dispatch.decode("p2p") is None


@pytest.mark.parametrize("bad", ["by_tokens:", "by_tokens:a<=x,b", "by_tokens:a<=4,b<=2", "by_tokens:a,b",
                                 "by_tokens:a<=4,b<=8", "by_tokens:a<=8,b<=4,c"])
def test_a_malformed_table_is_refused(bad):
    with pytest.raises(ValueError, match="malformed kernel table"):
        dispatch.decode(bad)


def test_an_empty_table_cannot_be_encoded():
    with pytest.raises(ValueError):
        dispatch.encode([])
