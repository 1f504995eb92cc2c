"""The value contract: a flat JSON object served as ``dict[str, str]`` (DESIGN.md, "Config values")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lighthouse.config.values import (
    MAX_KEY_LENGTH,
    ConfigError,
    decode_cli_value,
    encode_config,
    encode_value,
    json_type,
    parse_config,
    parse_json,
    validate_object,
)


@pytest.mark.parametrize(
    ("value", "wire"),
    [
        ("plain", "plain"),
        ("", ""),
        ("0.001", "0.001"),  # a JSON string stays a string, even if it looks like a number
        ("true", "true"),
        ('{"a": 1}', '{"a": 1}'),  # string content is not re-encoded
        ("héllo ✓ 学习率", "héllo ✓ 学习率"),
        (0.001, "0.001"),
        (1e-05, "0.00001"),  # the seed's spelling (serde_json, ryu): see test_seed_values.py
        (3, "3"),
        (-7, "-7"),
        (10**20, "1e20"),  # past u64: the float serde_json reads it as
        (True, "true"),
        (False, "false"),
        (None, "null"),
        ([1, 2, 3], "[1,2,3]"),
        ([], "[]"),
        ({"a": 1}, '{"a":1}'),
        ({}, "{}"),
        ({"a": {"b": [1, {"c": None}]}, "d": "x y"}, '{"a":{"b":[1,{"c":null}]},"d":"x y"}'),
        ({"ключ": "значение"}, '{"ключ":"значение"}'),  # non-ASCII kept, not \\u-escaped
        (["ü", 1.5, False], '["ü",1.5,false]'),
    ],
)
def test_encode_value(value: Any, wire: str) -> None:
    assert encode_value(value) == wire


def test_encode_config_unicode_keys_and_nested_values() -> None:
    source = (
        '{"lr": 0.001, "name": "run-1", "学习率": 0.5, "émoji🚀": "ok", "flags": {"a": [1, 2], "b": true},'
        ' "warmup": 100, "use_amp": false, "schedule": [0.1, 0.01]}'
    )
    encoded = encode_config(parse_config(source))
    assert encoded == {
        "lr": "0.001",
        "name": "run-1",
        "学习率": "0.5",
        "émoji🚀": "ok",
        "flags": '{"a":[1,2],"b":true}',
        "warmup": "100",
        "use_amp": "false",
        "schedule": "[0.1,0.01]",
    }
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in encoded.items())
    # Non-string values round-trip through their JSON text.
    original = json.loads(source)
    for key, value in original.items():
        if not isinstance(value, str):
            assert json.loads(encoded[key]) == value


def test_encode_config_preserves_order_and_is_pure() -> None:
    config = {"z": 1, "a": {"x": 1}, "m": "s"}
    encoded = encode_config(config)
    assert list(encoded) == ["z", "a", "m"]
    assert config == {"z": 1, "a": {"x": 1}, "m": "s"}  # input untouched


def test_parse_json_accepts_bytes_and_str() -> None:
    assert parse_json(b'{"k": "\xc3\xa9"}') == {"k": "é"}
    assert parse_json('{"k": [1, 2]}') == {"k": [1, 2]}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_parse_json_rejects_non_standard_constants(constant: str) -> None:
    with pytest.raises(ConfigError, match=constant):
        parse_json(f'{{"x": {constant}}}')


def test_parse_json_rejects_duplicate_keys_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        parse_json('{"lr": 1, "lr": 2}')
    with pytest.raises(ConfigError, match="duplicate key 'b'"):
        parse_json('{"a": {"b": 1, "b": 2}}')


@pytest.mark.parametrize("text", ['{"x": NaN}', '{"x": 1, "x": 2}', '{"x": }'])
def test_parse_json_every_error_names_what(text: str) -> None:
    # The lighthouse's warning and --strict error must name the file for every kind of bad JSON.
    with pytest.raises(ConfigError, match=r"cfg\.json"):
        parse_json(text, what="cfg.json")


def test_parse_json_error_names_what_line_and_column() -> None:
    with pytest.raises(ConfigError) as err:
        parse_json('{\n  "a": 1,\n  "b": }', what="cfg.json")
    message = str(err.value)
    assert message.startswith("cfg.json is not valid JSON")
    assert "line 3" in message
    assert "column" in message


def test_parse_json_invalid_utf8() -> None:
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        parse_json(b'{"a": "\xff"}', what="body")


def test_parse_json_too_deep_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_json("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize(
    ("text", "kind"),
    [("[1, 2]", "an array"), ('"s"', "a string"), ("3", "a number"), ("true", "a boolean"), ("null", "null")],
)
def test_parse_config_requires_an_object(text: str, kind: str) -> None:
    with pytest.raises(ConfigError, match=f"must be a JSON object, got {kind}"):
        parse_config(text)


def test_validate_object_keys() -> None:
    with pytest.raises(ConfigError, match="empty key"):
        validate_object({"": 1})
    long_key = "k" * (MAX_KEY_LENGTH + 1)
    with pytest.raises(ConfigError, match=f"{MAX_KEY_LENGTH + 1} characters"):
        validate_object({long_key: 1})
    ok = {"k" * MAX_KEY_LENGTH: 1}
    assert validate_object(ok) is ok


def test_validate_object_null_is_a_value() -> None:
    # The seed's rule: null is a value (served as "null"); only the store's PATCH reads it as a delete.
    assert validate_object({"gone": None}) == {"gone": None}
    assert validate_object({"a": {"b": None}}) == {"a": {"b": None}}


def test_json_type_names() -> None:
    values: tuple[Any, ...] = (None, True, 1, 1.5, "s", [], {})
    assert [json_type(v) for v in values] == [
        "null",
        "a boolean",
        "a number",
        "a number",
        "a string",
        "an array",
        "an object",
    ]


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0.01", 0.01),
        ("3", 3),
        ("true", True),
        ("null", None),
        ('"quoted"', "quoted"),
        ("[1,2]", [1, 2]),
        ('{"a":1}', {"a": 1}),
        ("abc", "abc"),
        ("", ""),
        ("NaN", "NaN"),  # not JSON here: kept as the string
        ("héllo", "héllo"),
    ],
)
def test_decode_cli_value(text: str, value: Any) -> None:
    assert decode_cli_value(text) == value
    assert type(decode_cli_value(text)) is type(value)
