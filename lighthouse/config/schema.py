"""A job's JSON Schema (draft 2020-12): checking a schema, and a config against it.

Validation is the ``jsonschema`` library's (the reference implementation of the
standard); this module only turns its errors into violations that name the key
they are about, as a JSON pointer (``/lr``), so the editor and the CLI can point
at it. A missing required key and a key that ``additionalProperties: false``
refuses are named too, not reported against the whole object.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lighthouse.config.values import ConfigError

if TYPE_CHECKING:  # jsonschema is imported when a schema is first loaded: it costs every start 0.1 s
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
MAX_VIOLATIONS = 100  # a config of a thousand wrong keys answers with the first hundred


class SchemaInvalid(ConfigError):
    """The document is not a usable draft 2020-12 JSON Schema."""


class SchemaViolation(ConfigError):
    """A change would produce a config the schema refuses; nothing was changed."""

    def __init__(self, violations: Sequence[dict[str, str]], what: str = "the config") -> None:
        listed = "; ".join(f"{v['path'] or '/'}: {v['message']}" for v in violations[:10])
        more = f" (and {len(violations) - 10} more)" if len(violations) > 10 else ""
        super().__init__(f"{what} violates the schema: {listed}{more}")
        self.violations = list(violations)


def pointer(parts: Iterable[Any]) -> str:
    """RFC 6901 JSON pointer of a path (``["a/b", 0]`` -> ``/a~1b/0``)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


@dataclass(frozen=True)
class Schema:
    """A checked schema and its validator (built once, reused for every change)."""

    document: Any
    validator: Draft202012Validator

    def violations(self, config: dict[str, Any]) -> list[dict[str, str]]:
        """Every way ``config`` breaks the schema, as ``{"path", "message"}``, sorted by path."""
        found: dict[tuple[str, str], None] = {}
        for error in self.validator.iter_errors(config):
            for item in _named(error):
                found.setdefault(item, None)
                if len(found) >= MAX_VIOLATIONS:
                    break
        return [{"path": p, "message": m} for p, m in sorted(found)]


def load_schema(document: Any, what: str = "schema") -> Schema:
    """Check ``document`` as a draft 2020-12 schema; SchemaInvalid says where it is wrong."""
    from jsonschema import Draft202012Validator, SchemaError

    if not isinstance(document, dict | bool):
        raise SchemaInvalid(f"{what} must be a JSON object (or true/false)")
    declared = document.get("$schema") if isinstance(document, dict) else None
    if declared is not None and str(declared).rstrip("#") != DRAFT_2020_12:
        raise SchemaInvalid(f"{what}: only JSON Schema draft 2020-12 is supported, $schema is {declared!r}")
    try:
        Draft202012Validator.check_schema(document)
    except SchemaError as exc:
        raise SchemaInvalid(
            f"{what} is not a valid JSON Schema: {exc.message} at {pointer(exc.absolute_path) or '/'}"
        ) from None
    return Schema(document, Draft202012Validator(document))


def _named(error: ValidationError) -> list[tuple[str, str]]:
    """The violations one jsonschema error stands for, each at the key it concerns."""
    path = list(error.absolute_path)
    instance: Any = error.instance
    rule: Any = error.validator_value
    if error.validator == "required" and isinstance(instance, dict) and isinstance(rule, list):
        missing = [k for k in rule if isinstance(k, str) and k not in instance]
        return [(pointer([*path, k]), "required key is missing") for k in missing]
    if error.validator == "additionalProperties" and rule is False and isinstance(instance, dict):
        schema = error.schema if isinstance(error.schema, dict) else {}
        known = set(schema.get("properties", {}))
        patterns = [re.compile(p) for p in schema.get("patternProperties", {})]
        extra = [k for k in instance if k not in known and not any(p.search(k) for p in patterns)]
        return [(pointer([*path, k]), "key is not allowed by the schema") for k in extra]
    return [(pointer(path), error.message)]
