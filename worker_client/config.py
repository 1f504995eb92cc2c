"""``Config``: the ``dict[str, str]`` a worker gets, with where it came from and typed getters."""

from __future__ import annotations

import json
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class Config(dict[str, str]):
    """The config for one call: values as the lighthouse encoded them (JSON text for non-strings).

    ``version``: the lighthouse version (0 for the fallback); ``source``:
    "lighthouse", "cache", "stale" or "fallback"; ``pinned``: whether this is
    the group's snapshot for the step asked for; ``job``: the training job the
    manager serves ("" when the manager did not say: the fallback of an unreachable one);
    ``stable_through_step``: the step lease the group held for this answer (its config
    is the job's for every step up to it), None without one.

    ``version`` names the config held at the step asked for; a change already known but
    taking effect at a later step is named apart: ``pending_version`` from ``pending_step``
    on (None when nothing is pending). ``effective_step``: the first step this config holds
    for (None: not said, e.g. the fallback); ``author`` and ``comment``: who made the change
    that took effect there and why (None when not said).
    """

    __slots__ = (
        "author",
        "comment",
        "effective_step",
        "job",
        "pending_step",
        "pending_version",
        "pinned",
        "source",
        "stable_through_step",
        "step",
        "version",
    )

    def __init__(
        self,
        data: dict[str, str] | None = None,
        *,
        version: int = 0,
        source: str = "fallback",
        step: int | None = None,
        pinned: bool = False,
        job: str = "",
        stable_through_step: int | None = None,
        pending_version: int | None = None,
        pending_step: int | None = None,
        effective_step: int | None = None,
        author: str | None = None,
        comment: str | None = None,
    ) -> None:
        super().__init__(data or {})
        self.pending_version = pending_version
        self.pending_step = pending_step
        self.effective_step = effective_step
        self.author = author
        self.comment = comment
        self.job = job
        self.stable_through_step = stable_through_step
        self.version = version
        self.source = source
        self.step = step
        self.pinned = pinned

    @property
    def is_fallback(self) -> bool:
        return self.source == "fallback"

    def __repr__(self) -> str:
        return f"Config({dict.__repr__(self)}, version={self.version}, source={self.source!r})"

    def _parse(self, key: str, default: T, kind: str, parse: Any) -> Any:
        raw = self.get(key)
        if raw is None:
            return default
        try:
            return parse(raw)
        except (ValueError, TypeError):
            raise ValueError(f"config key {key!r}: {raw[:80]!r} is not {kind}") from None

    def get_str(self, key: str, default: T = None) -> str | T:  # type: ignore[assignment]
        return self.get(key, default)

    def get_int(self, key: str, default: T = None) -> int | T:  # type: ignore[assignment]
        result: int | T = self._parse(key, default, "an integer", _to_int)
        return result

    def get_float(self, key: str, default: T = None) -> float | T:  # type: ignore[assignment]
        result: float | T = self._parse(key, default, "a number", float)
        return result

    def get_bool(self, key: str, default: T = None) -> bool | T:  # type: ignore[assignment]
        result: bool | T = self._parse(key, default, "a boolean (true/false)", _to_bool)
        return result

    def get_json(self, key: str, default: Any = None) -> Any:
        """The value as a Python object; a plain string value (not JSON text) is returned as it is."""
        raw = self.get(key)
        if raw is None:
            return default
        try:
            return json.loads(raw)
        except ValueError:
            return raw


def _to_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        number = float(raw)
        if not number.is_integer():
            raise
        return int(number)


def _to_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(raw)
