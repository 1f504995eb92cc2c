"""The config's value contract: a flat JSON object, served as ``dict[str, str]``.

A JSON string is passed as it is; any other JSON value as its compact JSON text
(``0.001`` -> ``"0.001"``, ``true`` -> ``"true"``, ``{"a": 1}`` -> ``'{"a":1}'``), spelled as
torchft's config-sharing seed spells it: serde_json 1.0.140 (ryu floats, keys sorted; see
``compact_json``).
``null`` is a value like any other (served as ``"null"``) in a config file and a
PUT; only the store's PATCH reads a ``null`` as "delete this key".
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

MAX_KEY_LENGTH = 256


MAX_CONFIG_BYTES = 1024 * 1024

# Containers nested in one JSON document, the config object itself counting 1. The dashboard
# and the editor read this very number from the page (``data-max-json-depth``), so whatever the
# lighthouse stores, they can show.
MAX_JSON_DEPTH = 100

_SURROGATE = re.compile("[\ud800-\udfff]")


class ConfigError(ValueError):
    """The input is not a valid config; the message says what and where."""


class ConfigTooLarge(ConfigError):
    """The resulting config would exceed MAX_CONFIG_BYTES."""


class UnstorableValue(ConfigError):
    """Valid JSON the config cannot hold as written: a number past a double's range, an integer
    past Python's digit limit, a lone surrogate, nesting past MAX_JSON_DEPTH (the message names the key)."""


class _BadNumber:
    """What the parse hooks return for a number the config cannot hold: refused, naming its key,
    once the whole document is parsed (a hook does not know where it is)."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _parse_float(text: str) -> float | _BadNumber:
    value = float(text)
    if math.isfinite(value):
        return value
    return _BadNumber(f"{text[:40]} is out of range for a number (a double ends near 1.8e308)")


def _parse_int(text: str) -> int | _BadNumber:
    digits = len(text) - text.startswith("-")
    limit = sys.get_int_max_str_digits()
    if limit and digits > limit:
        return _BadNumber(f"an integer of {digits} digits is too long (max {limit}; use a string)")
    return int(text)


def _reject_constant(name: str) -> Any:
    raise ConfigError(f"{name} is not valid JSON (use a string or null)")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ConfigError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def parse_json(text: str | bytes, what: str = "body") -> Any:
    """Parse strict JSON (no NaN/Infinity, no duplicate keys); errors name line and column."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        document = json.loads(
            text,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
            object_pairs_hook=_no_duplicate_keys,
        )
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ConfigError as exc:  # raised by the hooks: NaN/Infinity, duplicate keys
        raise ConfigError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{what} is nested too deeply") from None
    check_storable(document, what)
    return document


def check_storable(document: Any, what: str) -> None:
    """Raise UnstorableValue, naming the top-level key, for what no store or answer can hold."""
    stack: list[tuple[Any, int, str | None]] = [(document, 0, None)]  # value, containers above it, key
    while stack:
        value, depth, key = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise UnstorableValue(f"{_where(what, key)} is nested too deeply (max {MAX_JSON_DEPTH})")
            if isinstance(value, list):
                stack.extend((item, depth + 1, key) for item in value)
                continue
            for name, item in value.items():
                named = name if depth == 0 else key
                if _SURROGATE.search(name):
                    raise UnstorableValue(f"{_where(what, named)} has a lone surrogate (not Unicode)")
                stack.append((item, depth + 1, named))
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise UnstorableValue(f"{_where(what, key)} holds a lone surrogate (not Unicode)")
        elif isinstance(value, _BadNumber):
            raise UnstorableValue(f"{_where(what, key)}: {value.problem}")


def _where(what: str, key: str | None) -> str:
    return what if key is None else f"{what} key {key[:64]!r}"


def validate_object(obj: Any, *, what: str = "config") -> dict[str, Any]:
    """Check that ``obj`` is a config object with acceptable keys (any JSON values); return it."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{what} must be a JSON object, got {json_type(obj)}")
    for key in obj:
        if not key:
            raise ConfigError(f"{what} has an empty key")
        if len(key) > MAX_KEY_LENGTH:
            raise ConfigError(f"{what} key {key[:32]!r}... is {len(key)} characters (max {MAX_KEY_LENGTH})")
    return obj


def parse_config(text: str | bytes, what: str = "config") -> dict[str, Any]:
    """Parse and validate a config JSON document."""
    return validate_object(parse_json(text, what), what=what)


def value_type(value: Any) -> str:
    """A JSON value's type: integer and float are both "number", null is its own."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def json_type(value: Any) -> str:
    kind = value_type(value)
    return kind if kind == "null" else f"{'an' if kind[0] in 'ao' else 'a'} {kind}"


class TypeChanged(ConfigError):
    """A change would alter the JSON type of an existing key (``lr=0.0.1`` storing a string over a
    number bricks every worker that reads it as a float): it must be asked for explicitly."""

    def __init__(self, changes: list[dict[str, str]]) -> None:
        listed = ", ".join(f"{c['key']}: {c['before']} -> {c['after']}" for c in changes[:10])
        more = f" (and {len(changes) - 10} more)" if len(changes) > 10 else ""
        super().__init__(
            f"the change alters the type of {listed}{more}; "
            "allow it explicitly (--allow-type-change, ?allow_type_change=1) if it is meant"
        )
        self.type_changes = changes


def type_changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, str]]:
    """Keys in both configs whose JSON type differs; a key added or deleted is no type change."""
    out = []
    for key, value in after.items():
        old = before.get(key, value)
        if old is value or (type(old) is type(value) and old == value):
            continue  # unchanged (most keys of a big config): its type too
        if key in before and value_type(old) != value_type(value):
            out.append({"key": key, "before": value_type(before[key]), "after": value_type(value)})
    return out


def looks_numeric_text(text: str) -> bool:
    """``0.0.1``, ``1e-3.5``, ``.5``, ``-``: what a number typed wrong looks like (digits, dots,
    signs and exponents only, with a digit), for a value that did not parse as JSON."""
    return re.fullmatch(r"[+-]?[0-9.]*([eE][+-]?[0-9.]*)?", text) is not None and any(
        c.isdigit() for c in text
    )


def encode_value(value: Any) -> str:
    """One JSON value as it goes on the wire."""
    if isinstance(value, str):
        return value
    return compact_json(value)


_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def compact_json(value: Any) -> str:
    """``value`` as serde_json 1.0.140's ``Value::to_string`` writes it, so a worker reads what the
    seed's lighthouse serves: object keys sorted (no preserve_order), floats in ryu's shortest form
    (``1e-7``, ``0.00001``, ``1e21``: the releases before serde_json's late-2025 float writer),
    integers outside i64/u64 as the float serde_json parses them into (past a double's range, as
    they are), non-finite floats as null."""
    parts: list[str] = []
    _write(value, parts)
    return "".join(parts)


def _write(value: Any, out: list[str]) -> None:
    if value is None or value is True or value is False:
        out.append(json.dumps(value))
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, int):
        out.append(_integer(value))
    elif isinstance(value, float):
        out.append(ryu_float(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, key in enumerate(sorted(value, key=_utf8)):
            out.append(("," if i else "") + _string(key) + ":")
            _write(value[key], out)
        out.append("}")
    else:
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")


def _utf8(key: str) -> bytes:
    """serde_json's BTreeMap orders keys by their UTF-8 bytes (Python's str order is by code point,
    which differs only around surrogates)."""
    return key.encode("utf-8", "surrogatepass")


def _string(text: str) -> str:
    """serde_json's escapes: the same as Python's with ensure_ascii off (lower-case ``\\u00XX``)."""
    return '"' + "".join(_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ch < " " else ch) for ch in text) + '"'


def _integer(value: int) -> str:
    if _I64_MIN <= value <= _U64_MAX:
        return str(value)
    number = _serde_big_int(value)
    # past a double's range the seed refuses the whole file: the digits say more than null would
    return ryu_float(number) if math.isfinite(number) else str(value)


def _serde_big_int(value: int) -> float:
    """The f64 serde_json parses an integer literal beyond i64/u64 into: its leading digits that fit
    a u64, times the power of ten of the digits dropped (one rounding each, as serde_json does)."""
    digits = str(abs(value))
    significand = used = 0
    while used < len(digits) and significand <= (_U64_MAX - (ord(digits[used]) - 48)) // 10:
        significand = significand * 10 + ord(digits[used]) - 48
        used += 1
    dropped = len(digits) - used
    number = float(significand) * (float(f"1e{dropped}") if dropped <= 308 else math.inf)
    return number if value > 0 else -number


def ryu_float(number: float) -> str:
    """A float as ryu 1.0 formats it for serde_json: Python's shortest digits, ryu's layout."""
    if not math.isfinite(number):
        return "null"  # serde_json's serializer writes a non-finite f64 as null
    sign = "-" if math.copysign(1.0, number) < 0 else ""
    if number == 0:
        return sign + "0.0"
    mantissa, _, exp = repr(abs(number)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    joined = whole + fraction
    digits = joined.lstrip("0")
    point = len(whole) + int(exp or 0) - (len(joined) - len(digits))  # value = 0.DIGITS x 10^point
    digits = digits.rstrip("0")
    length = len(digits)
    if length <= point <= 16:
        text = digits + "0" * (point - length) + ".0"
    elif 0 < point <= 16:
        text = digits[:point] + "." + digits[point:]
    elif -5 < point <= 0:
        text = "0." + "0" * -point + digits
    elif length == 1:
        text = f"{digits}e{point - 1}"
    else:
        text = f"{digits[0]}.{digits[1:]}e{point - 1}"
    return sign + text


def encode_config(config: dict[str, Any]) -> dict[str, str]:
    """The JSON object as the ``map<string,string>`` workers receive."""
    return {key: encode_value(value) for key, value in config.items()}


def decode_cli_value(text: str, key: str | None = None) -> Any:
    """``lr=0.01`` stores the number 0.01, ``name=abc`` the string "abc": JSON when it parses.
    JSON the config cannot hold (``big=1e999``) is refused, not sent as a string."""
    try:
        return parse_json(text, "value" if key is None else f"key {key[:64]!r}")
    except UnstorableValue:
        raise
    except ConfigError:
        return text


def apply_change(config: dict[str, Any], op: str, change: dict[str, Any]) -> dict[str, Any]:
    """The config after one stored operation: ``put`` replaces it, ``patch`` merges (null deletes)."""
    if op == "put":
        return dict(change)
    merged = dict(config)
    for key, value in change.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per key ``{"before": .., "after": ..}``; a key added has no "before", one removed no "after"."""
    out: dict[str, dict[str, Any]] = {}
    for key, old in before.items():
        if key not in after:
            out[key] = {"before": old}
            continue
        new = after[key]
        if new is not old and new != old:  # most keys of a big config are the very same object
            out[key] = {"before": old, "after": new}
    for key, new in after.items():
        if key not in before:
            out[key] = {"after": new}
    return out
