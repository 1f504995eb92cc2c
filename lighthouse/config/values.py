"""The config's value contract: a flat JSON object, served as ``dict[str, str]``.

A JSON string is passed as it is; any other JSON value as its compact JSON text
(``0.001`` -> ``"0.001"``, ``true`` -> ``"true"``, ``{"a": 1}`` -> ``'{"a":1}'``).
``null`` is a value like any other (served as ``"null"``) in a config file and a
PUT; only the store's PATCH reads a ``null`` as "delete this key".
"""

from __future__ import annotations

import json
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


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


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
