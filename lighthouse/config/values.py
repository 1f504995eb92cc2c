"""The config's value contract: a flat JSON object, served as ``dict[str, str]``.

A JSON string is passed as it is; any other JSON value as its compact JSON text
(``0.001`` -> ``"0.001"``, ``true`` -> ``"true"``, ``{"a": 1}`` -> ``'{"a":1}'``).
``null`` is a value like any other (served as ``"null"``) in a config file and a
PUT; only the store's PATCH reads a ``null`` as "delete this key".
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_KEY_LENGTH = 256


MAX_CONFIG_BYTES = 1024 * 1024


class ConfigError(ValueError):
    """The input is not a valid config; the message says what and where."""


class ConfigTooLarge(ConfigError):
    """The resulting config would exceed MAX_CONFIG_BYTES."""


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
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except ConfigError as exc:  # raised by the hooks: NaN/Infinity, duplicate keys
        raise ConfigError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{what} is nested too deeply") from None


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
        if key in before and value_type(before[key]) != value_type(value):
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
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def encode_config(config: dict[str, Any]) -> dict[str, str]:
    """The JSON object as the ``map<string,string>`` workers receive."""
    return {key: encode_value(value) for key, value in config.items()}


def decode_cli_value(text: str) -> Any:
    """``lr=0.01`` stores the number 0.01, ``name=abc`` the string "abc": JSON when it parses."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, ConfigError):
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
    sides = (("before", before), ("after", after))
    for key in [*before, *(k for k in after if k not in before)]:
        change = {side: config[key] for side, config in sides if key in config}
        if change.get("before", out) != change.get("after", out):
            out[key] = change
    return out
