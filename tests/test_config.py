import pytest

from weave_compile.config import TokenWeaveConfig


def test_defaults_and_valid_keys():
    cfg = TokenWeaveConfig.from_options(None)
    assert cfg == TokenWeaveConfig()
    assert set(TokenWeaveConfig.valid_keys()) == {"fuse", "shard_residual", "kernel", "comm_ctas", "split",
                                                  "split_threshold", "split_at", "num_sms", "split_cost", "mode", "compiler",
                                                  "output_in_place", "agreement_timeout_s"}
    assert (cfg.split, cfg.split_threshold, cfg.split_at, cfg.num_sms, cfg.split_cost) == (False, 1024, 0, 0, "measured")
    assert cfg.output_in_place is False  # until its GPU tests have run
    assert cfg.agreement_timeout_s == 60.0
    with pytest.raises(ValueError, match="split_cost"):
        TokenWeaveConfig.from_options({"split_cost": "guess"})


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError) as e:
        TokenWeaveConfig.from_options({"kernal": "p2p"})
    assert "kernal" in str(e.value)
    for key in TokenWeaveConfig.valid_keys():
        assert key in str(e.value)


@pytest.mark.parametrize("key,value", [
    ("comm_ctas", "8"), ("comm_ctas", 8.0), ("comm_ctas", True), ("fuse", 1), ("shard_residual", "yes"),
    ("split", 1), ("split_threshold", 1024.0), ("split_at", None), ("agreement_timeout_s", "60"),
    ("agreement_timeout_s", True),
])
def test_wrong_type(key, value):
    with pytest.raises(TypeError) as e:
        TokenWeaveConfig.from_options({key: value})
    want = type(getattr(TokenWeaveConfig(), key)).__name__
    assert f"option {key!r} must be {want}, got {type(value).__name__} {value!r}" in str(e.value)


@pytest.mark.parametrize("key,value", [("kernel", "nvls"), ("compiler", "eager"), ("comm_ctas", 0), ("comm_ctas", 33),
                                       ("split_threshold", 1), ("split_at", -1), ("num_sms", -4),
                                       ("mode", "fast"), ("agreement_timeout_s", 0), ("agreement_timeout_s", -1.0),
                                       ("agreement_timeout_s", float("inf")), ("agreement_timeout_s", float("nan"))])
def test_bad_value(key, value):
    with pytest.raises(ValueError, match=key):
        TokenWeaveConfig.from_options({key: value})


def test_options_reach_config_and_cache_key_changes():
    a = TokenWeaveConfig.from_options({"kernel": "reference", "comm_ctas": 4})
    assert (a.kernel, a.comm_ctas) == ("reference", 4)
    assert a.cache_key() != TokenWeaveConfig().cache_key()
    assert a.cache_key() == TokenWeaveConfig(kernel="reference", comm_ctas=4).cache_key()


def test_non_dict_options_rejected():
    with pytest.raises(TypeError, match="dict"):
        TokenWeaveConfig.from_options(["kernel"])
