"""Options: every field checked when built, with an error that names the option.

The per-field checks are derived from the dataclass's own type hints (a new field is tested
without a new line here); the range limits, which the hints cannot carry, are listed.
"""

import dataclasses
import types
import typing

import pytest

import weave_compile
from weave_compile.config import Options, TokenWeaveConfig

HINTS = typing.get_type_hints(Options)
FIELDS = [f.name for f in dataclasses.fields(Options)]


def _kind(name):
    """The field's type as the checks see it: ``("literal", values)``, ``bool``, ``int``, ``float``..."""
    hint = HINTS[name]
    if typing.get_origin(hint) is typing.Literal:
        return "literal", typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        return kinds[0], None
    return hint, None


def _valid_values(name):
    kind, values = _kind(name)
    if Options.choices(name):  # a fixed set of names: a Literal's, or the kernel registry's
        return Options.choices(name)
    if kind == "literal":
        return list(values)
    if kind is bool:
        return [True, False]
    return [getattr(Options(), name)]


def _wrong_types(name):
    """Values of a wrong type for the field, each must raise TypeError."""
    kind, _ = _kind(name)
    if kind == "literal":
        return [1, None, b"auto"]
    if kind is bool:
        return [1, 0, "yes", None]
    if kind is int:
        return ["8", 8.0, True, None]
    if kind is float:
        return ["1.5", True, None]
    return [object()]


def test_public_name_and_alias():
    assert weave_compile.Options is Options and TokenWeaveConfig is Options
    assert Options.valid_keys() == FIELDS


@pytest.mark.parametrize("name", FIELDS)
def test_every_option_accepts_its_valid_values(name):
    for value in _valid_values(name):
        opts = Options(**{name: value})
        assert getattr(opts, name) == value
        assert Options.from_options({name: value}) == opts


@pytest.mark.parametrize("name", FIELDS)
def test_every_option_rejects_a_wrong_type_naming_it(name):
    for value in _wrong_types(name):
        with pytest.raises(TypeError) as e:
            Options(**{name: value})
        assert f"option {name!r} must be" in str(e.value) and repr(value) in str(e.value), str(e.value)
        with pytest.raises(TypeError, match=f"option '{name}' must be"):
            Options.from_options({name: value})


@pytest.mark.parametrize("name", [n for n in FIELDS if _kind(n)[0] == "literal"])
def test_every_choice_option_rejects_an_unknown_value_listing_the_choices(name):
    with pytest.raises(ValueError) as e:
        Options(**{name: "bogus"})
    msg = str(e.value)
    assert f"option {name!r} must be one of" in msg and "got 'bogus'" in msg, msg
    for value in _kind(name)[1]:
        assert repr(value) in msg


@pytest.mark.parametrize("key,value", [
    ("kernel", "nvls"), ("compiler", "eager"), ("mode", "fast"), ("split_cost", "guess"),
    ("comm_ctas", 0), ("comm_ctas", 33), ("comm_ctas", -1),
    ("split_threshold", 1), ("split_threshold", 0), ("split_at", -1), ("num_sms", -4),
    ("agreement_timeout_s", 0), ("agreement_timeout_s", -1.0), ("agreement_timeout_s", float("inf")),
    ("agreement_timeout_s", float("nan")),
])
def test_out_of_range_value(key, value):
    with pytest.raises(ValueError) as e:
        Options(**{key: value})
    assert repr(key) in str(e.value) and str(value) in str(e.value), str(e.value)


@pytest.mark.parametrize("key,value", [("comm_ctas", 1), ("comm_ctas", 32), ("split_threshold", 2),
                                       ("split_at", 0), ("split_at", 4096), ("num_sms", 0), ("num_sms", 132)])
def test_range_limits_are_inclusive(key, value):
    assert getattr(Options(**{key: value}), key) == value


def test_wrong_type_message_names_type_and_value():
    with pytest.raises(TypeError, match=r"option 'comm_ctas' must be int, got bool True"):
        Options(comm_ctas=True)
    with pytest.raises(TypeError, match=r"option 'split' must be bool, got str 'yes'"):
        Options(split="yes")


def test_defaults():
    cfg = Options.from_options(None)
    assert cfg == Options()
    assert (cfg.kernel, cfg.comm_ctas, cfg.fuse, cfg.shard_residual, cfg.compiler) == ("auto", 32, True, True,
                                                                                      "inductor")
    assert (cfg.split, cfg.split_threshold, cfg.split_at, cfg.num_sms, cfg.split_cost) == (False, 1024, 0, 0,
                                                                                          "measured")
    assert cfg.output_in_place is False  # until its GPU tests have run


def test_unknown_key_lists_valid_keys_and_suggests_the_close_one():
    with pytest.raises(TypeError) as e:
        Options.from_options({"kernal": "p2p"})
    assert "'kernal'" in str(e.value) and "did you mean 'kernel'?" in str(e.value)
    for key in Options.valid_keys():
        assert key in str(e.value)


def test_unknown_keyword_of_options_gets_the_same_help_as_the_dict_form():
    with pytest.raises(TypeError) as e:
        Options(kernal="p2p")
    with pytest.raises(TypeError) as from_dict:
        Options.from_options({"kernal": "p2p"})
    assert type(e.value) is type(from_dict.value) is TypeError  # one mistake, one exception type
    assert str(e.value) == str(from_dict.value)
    assert "did you mean 'kernel'?" in str(e.value) and "'comm_ctas'" in str(e.value)
    assert Options(kernel="p2p").kernel == "p2p"  # keywords and positions still work
    assert Options(True, False).shard_residual is False


def test_replace_checks_again():
    opts = Options(kernel="p2p")
    assert dataclasses.replace(opts, split=True).split is True
    with pytest.raises(ValueError, match="comm_ctas"):
        dataclasses.replace(opts, comm_ctas=0)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Options().kernel = "p2p"


def test_options_pass_through_and_cache_key_changes():
    given = Options(kernel="reference", comm_ctas=4)
    assert Options.from_options(given) is given
    a = Options.from_options({"kernel": "reference", "comm_ctas": 4})
    assert a == given and a.cache_key() == given.cache_key()
    assert a.cache_key() != Options().cache_key()


@pytest.mark.parametrize("given", [["kernel"], "kernel=p2p", 3])
def test_non_dict_options_rejected(given):
    with pytest.raises(TypeError, match="dict or weave_compile.Options"):
        Options.from_options(given)


def test_choices_are_the_literal_values():
    from weave_compile.config import valid_kernels

    assert Options.choices("kernel") == valid_kernels() and "p2p" in Options.choices("kernel")
    assert Options.choices("mode") == list(typing.get_args(HINTS["mode"]))
    assert Options.choices("comm_ctas") is None
    for name in FIELDS:
        if Options.choices(name):
            assert getattr(Options(), name) in Options.choices(name)
