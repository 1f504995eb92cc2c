"""``Config``: a ``dict[str, str]`` with version/source and typed getters."""

from __future__ import annotations

from typing import Any

import pytest

from lighthouse.config.values import encode_config
from worker_client import Config

WIRE = encode_config(
    {
        "lr": 0.001,
        "warmup": 100,
        "big": 10**20,
        "as_float_int": 5.0,
        "use_amp": True,
        "off": False,
        "name": "run-1",
        "学习率": 0.5,
        "nested": {"a": [1, 2], "b": None},
        "list": [0.1, "x"],
        "nothing": None,
        "text_number": "42",
        "yes": "yes",
    }
)


def cfg() -> Config:
    return Config(WIRE, version=3, source="cache", step=7, pinned=True)


def test_is_a_plain_str_dict_with_metadata() -> None:
    c = cfg()
    assert isinstance(c, dict)
    assert c == WIRE
    assert dict(c) == WIRE
    assert (c.version, c.source, c.step, c.pinned) == (3, "cache", 7, True)
    assert not c.is_fallback
    assert c["lr"] == "0.001" and c["nested"] == '{"a":[1,2],"b":null}'
    assert "version=3" in repr(c) and "'cache'" in repr(c)


def test_default_is_an_empty_fallback() -> None:
    c = Config()
    assert c == {} and c.version == 0 and c.source == "fallback" and c.is_fallback
    assert c.step is None and not c.pinned
    assert c.get_float("lr", 1e-3) == 1e-3


def test_no_instance_dict() -> None:
    with pytest.raises(AttributeError):
        cfg().typo = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("key", "expected"),
    [("warmup", 100), ("big", 10**20), ("as_float_int", 5), ("text_number", 42)],
)
def test_get_int(key: str, expected: int) -> None:
    value = cfg().get_int(key)
    assert value == expected and type(value) is int


@pytest.mark.parametrize(("key", "expected"), [("lr", 0.001), ("warmup", 100.0), ("学习率", 0.5)])
def test_get_float(key: str, expected: float) -> None:
    value = cfg().get_float(key)
    assert value == expected and type(value) is float


@pytest.mark.parametrize(("key", "expected"), [("use_amp", True), ("off", False), ("yes", True)])
def test_get_bool(key: str, expected: bool) -> None:
    assert cfg().get_bool(key) is expected


@pytest.mark.parametrize("raw", ["TRUE", " on ", "1", "Yes"])
def test_get_bool_true_spellings(raw: str) -> None:
    assert Config({"k": raw}).get_bool("k") is True


@pytest.mark.parametrize("raw", ["False", "0", "no", "OFF"])
def test_get_bool_false_spellings(raw: str) -> None:
    assert Config({"k": raw}).get_bool("k") is False


def test_get_str() -> None:
    c = cfg()
    assert c.get_str("name") == "run-1"
    assert c.get_str("lr") == "0.001"  # the wire text
    assert c.get_str("missing") is None
    assert c.get_str("missing", "dflt") == "dflt"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("nested", {"a": [1, 2], "b": None}),
        ("list", [0.1, "x"]),
        ("lr", 0.001),
        ("use_amp", True),
        ("nothing", None),
        ("name", "run-1"),  # a plain string that is not JSON comes back as it is
        ("text_number", 42),  # JSON text inside a string value is parsed
    ],
)
def test_get_json(key: str, expected: Any) -> None:
    assert cfg().get_json(key) == expected


def test_get_json_default_only_when_missing() -> None:
    c = cfg()
    assert c.get_json("missing") is None
    assert c.get_json("missing", {"d": 1}) == {"d": 1}
    assert c.get_json("nothing", "dflt") is None  # present as JSON null: not the default


def test_defaults_when_missing() -> None:
    c = cfg()
    assert c.get_int("missing", 8) == 8
    assert c.get_float("missing", 0.5) == 0.5
    assert c.get_bool("missing", True) is True
    assert c.get_int("missing") is None
    assert c.get_float("missing") is None
    assert c.get_bool("missing") is None


@pytest.mark.parametrize(
    ("getter", "key", "kind"),
    [
        ("get_int", "lr", "an integer"),
        ("get_int", "name", "an integer"),
        ("get_int", "use_amp", "an integer"),
        ("get_float", "name", "a number"),
        ("get_float", "nested", "a number"),
        ("get_bool", "lr", "a boolean"),
        ("get_bool", "name", "a boolean"),
        ("get_int", "学习率", "an integer"),
    ],
)
def test_unparsable_value_raises_naming_key_and_value(getter: str, key: str, kind: str) -> None:
    c = cfg()
    with pytest.raises(ValueError) as err:
        getattr(c, getter)(key, 0)  # the default does not hide a bad value
    message = str(err.value)
    assert repr(key) in message
    assert kind in message
    assert repr(WIRE[key][:80]) in message


def test_error_message_truncates_long_values() -> None:
    c = Config({"blob": "x" * 1000})
    with pytest.raises(ValueError) as err:
        c.get_int("blob")
    assert len(str(err.value)) < 200
    assert "'blob'" in str(err.value)


def test_int_rejects_non_finite_and_fractional() -> None:
    for raw in ("1.5", "inf", "nan", ""):
        with pytest.raises(ValueError, match="'k'"):
            Config({"k": raw}).get_int("k")
