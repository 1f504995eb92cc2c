"""Values as torchft's config-sharing seed spells them (serde_json 1.0.140 with ryu 1.0.20).

Every expected text below was printed by the real serde_json 1.0.140, built offline from its
source (``serde_json::from_str::<Value>`` then, for a non-string, ``Value::to_string``: what the
seed's GetConfig does). serde_json 1.0.14x's later float writer (late 2025) spells ``1e21`` as
``1e+21``; this project keeps the seed's release.
"""

from __future__ import annotations

import json

import pytest

from lighthouse.config.values import encode_value, parse_json

# input JSON text -> the text a worker gets from the seed (a string value as it is)
SEED_CASES = [
    ("0.00001", "0.00001"),
    ("1e-7", "1e-7"),
    ("1e-05", "0.00001"),
    ("0.001", "0.001"),
    ("2.5e-5", "0.000025"),
    ("3e-4", "0.0003"),
    ("0.1", "0.1"),
    ("0.30000000000000004", "0.30000000000000004"),
    ("123456789.123456789", "123456789.12345679"),
    ("1.0", "1.0"),
    ("-0.0", "-0.0"),
    ("1E2", "100.0"),
    ("100", "100"),
    ("1e15", "1000000000000000.0"),
    ("1e16", "1e16"),
    ("1e20", "1e20"),
    ("1e21", "1e21"),
    ("1.5e300", "1.5e300"),
    ("1.7976931348623157e308", "1.7976931348623157e308"),
    ("5e-324", "5e-324"),
    ("18446744073709551615", "18446744073709551615"),
    ("18446744073709551616", "1.8446744073709552e19"),
    ("123456789012345678901234567890", "1.2345678901234568e29"),
    ("-9223372036854775808", "-9223372036854775808"),
    ("-9223372036854775809", "-9.223372036854776e18"),
    ("-123456789012345678901234567890", "-1.2345678901234568e29"),
    ("99999999999999999999999", "1e23"),
    ('{"b":1,"a":{"d":2,"c":[1e-7,"x"]}}', '{"a":{"c":[1e-7,"x"],"d":2},"b":1}'),
    (
        '{"z":{"y":1,"x":[{"b":0,"a":0}]},"\u00e9":1,"e":2}',
        '{"e":2,"z":{"x":[{"a":0,"b":0}],"y":1},"\u00e9":1}',
    ),
    ('[1,2.0,"\\u00e9\\u0001\\n/\\"\\\\\\u007f"]', '[1,2.0,"\u00e9\\u0001\\n/\\"\\\\\x7f"]'),
    ('{"k":"\\u2028"}', '{"k":"\u2028"}'),
    ("true", "true"),
    ("null", "null"),
    ('"plain"', "plain"),
]

# Where this lighthouse still differs from the seed: Python's json reads "-0" as the integer 0 and
# parses floats correctly rounded, where serde_json's default parser (no float_roundtrip) may be
# one unit off in the last place for 17 significant digits or exponents beyond 10^22.
KNOWN_DIFFERENCES = [
    ("-0", "0", "-0.0"),
    ("1.2345678901234567e-30", "1.2345678901234567e-30", "1.2345678901234568e-30"),
    # past a double's range the seed refuses the whole file ("number out of range"): served as written
    ("1" + "0" * 400, "1" + "0" * 400, "number out of range"),
]


@pytest.mark.parametrize(("text", "seed"), SEED_CASES)
def test_value_text_is_the_seeds(text: str, seed: str) -> None:
    assert encode_value(parse_json(text)) == seed


@pytest.mark.parametrize(("text", "ours", "seed"), KNOWN_DIFFERENCES)
def test_known_differences_stay_as_documented(text: str, ours: str, seed: str) -> None:
    assert encode_value(parse_json(text)) == ours != seed


def test_python_would_have_written_otherwise() -> None:
    """The cases that made this necessary: Python's json spells these differently."""
    for text, seed in [("1e-7", "1e-7"), ("0.00001", "0.00001"), ('{"b":1,"a":2}', '{"a":2,"b":1}')]:
        value = parse_json(text)
        assert json.dumps(value, separators=(",", ":")) != seed == encode_value(value)


def test_non_finite_floats_are_null_as_serde_json_writes_them() -> None:
    assert encode_value([float("inf"), float("-inf"), float("nan")]) == "[null,null,null]"
