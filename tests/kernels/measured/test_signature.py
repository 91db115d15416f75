"""Signatures: what a fused op call's time depends on, and the token buckets a symbolic count is timed at."""

import json

import pytest

from weave_compile.kernels.measured.signature import MAX_BUCKET_TOKENS, Signature, bucket_of


def sig(**kw):
    base = dict(device="cuda", ranks=(0, 1), hidden=4096, dtype="bfloat16", residual_in="bfloat16",
                residual_dtype="bfloat16", out_dtype="bfloat16", weight="bfloat16")
    return Signature(**{**base, **kw})


def test_a_static_count_is_its_own_bucket():
    assert sig(tokens=37).buckets() == (37,)
    assert sig(tokens=0).buckets() == (1,)


@pytest.mark.parametrize("token_range, expected", [
    ((1, 8), (1, 2, 4, 8)),
    ((3, 20), (4, 8, 16, 32)),
    ((2, None), tuple(2 ** i for i in range(1, 15))),
    ((1, 1 << 20), tuple(2 ** i for i in range(0, 15))),
])
def test_a_symbolic_count_is_timed_at_powers_of_two_up_to_its_bound(token_range, expected):
    got = sig(tokens=None, token_range=token_range).buckets()
    assert got == expected
    assert got[-1] <= max(MAX_BUCKET_TOKENS, token_range[0] * 2)


def test_cpu_ranks_time_up_to_1k_tokens():
    from weave_compile.kernels.measured.signature import CPU_MAX_BUCKET_TOKENS

    assert sig(device="cpu", tokens=None, token_range=(1, None)).buckets() == tuple(2 ** i for i in range(11))
    assert sig(device="cpu", tokens=None, token_range=(1, None)).buckets()[-1] == CPU_MAX_BUCKET_TOKENS
    assert sig(device="cpu", tokens=None, token_range=(3000, None)).buckets() == (4096,)  # above: its lowest
    assert sig(device="cpu", tokens=5000).buckets() == (5000,)  # a static count is timed as it is


def test_sequence_parallel_buckets_hold_whole_shards():
    got = sig(tokens=None, token_range=(1, 64), ranks=(0, 1, 2), sequence_parallel=True).buckets()
    assert all(b % 3 == 0 for b in got) and got == tuple(sorted(set(got)))


def test_bucket_of_takes_the_smallest_that_holds_the_count():
    buckets = (1, 2, 4, 8)
    assert [bucket_of(buckets, t) for t in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 8, 8]


def test_key_covers_every_field_and_round_trips():
    a = sig(tokens=64)
    assert a.key() == sig(tokens=64).key()
    for change in (dict(tokens=65), dict(residual_out_sharded=True), dict(ranks=(0, 2)), dict(bias="bfloat16"),
                   dict(comm_ctas=8), dict(split=True), dict(hidden=4097),
                   dict(split=True, beside=((None, 4096, 3072),))):
        assert sig(**{"tokens": 64, **change}).key() != a.key(), change
    b = sig(tokens=None, token_range=(1, 128))
    assert Signature.from_json(b.to_json()) == b
    c = sig(tokens=None, token_range=(1, 128), split=True, beside=((None, 4096, 3072), (64, 1536, 4096)))
    assert Signature.from_json(json.loads(json.dumps(c.to_json()))) == c  # as the store and the cache hold it


def test_a_split_half_names_the_gemms_beside_it():
    assert sig(tokens=16, split=True).describe().endswith("split half")
    assert sig(tokens=16, split=True, beside=((None, 64, 32),)).describe().endswith("split half beside 1 GEMM")
    assert sig(tokens=16, split=True, beside=((None, 64, 32),) * 3).describe().endswith("beside 3 GEMMs")


def test_the_norm_is_in_the_key_and_an_rmsnorm_keeps_the_key_it_had():
    import dataclasses
    import hashlib
    import json

    a = sig(tokens=64)
    for change in (dict(norm="layernorm"), dict(norm="layernorm", norm_bias="bfloat16")):
        assert sig(tokens=64, **change).key() != a.key(), change
    # What key() hashed before the norm's fields existed: the cache entries of RMSNorm sites stay valid.
    old = {k: v for k, v in dataclasses.asdict(a).items() if k not in ("norm", "norm_bias", "quant")}
    assert a.key() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:20]
    ln = sig(tokens=None, token_range=(1, 128), norm="layernorm", norm_bias="float32")
    assert Signature.from_json(ln.to_json()) == ln
    assert ln.describe().startswith("LayerNorm H=4096") and "norm bias" in ln.describe()


def test_describe_names_layout_and_terms():
    text = sig(tokens=16, residual_in_sharded=True, residual_out_sharded=True, bias="bfloat16").describe()
    assert "H=4096" in text and "x2" in text and "res shard->shard" in text and "bias" in text, text
    assert "T=" not in text, text  # T is the measured table's own column, one row per bucket
