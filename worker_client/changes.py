"""``ConfigChange``: what a worker's ``on_change`` callback gets when a new version takes effect.

``ManagerClient(..., on_change=callback)`` calls ``callback(change)`` on the training
thread, once per change, at the first step a ``get_config(step=...)`` call is
served its values (the first config too: its keys all new). A step costs a
comparison of the served version and the step its config holds from; only when
they differ from the last logged ones are the values compared. A callback
that raises is logged once and never breaks training. Fallback answers (version 0)
and calls without a step are no change.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from worker_client.config import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConfigChange:
    """A version that took effect at ``step``: ``changes`` maps each changed key to (old, new) as
    JSON text, None for a key added (old) or removed (new). ``author`` and ``comment``: who made
    the change that took effect and why, as the history shows them (cut to 64 and 500
    characters; None when the manager's reply does not say, e.g. a lighthouse of an earlier
    release)."""

    step: int
    version: int
    previous_version: int  # 0: the first config this worker got
    changes: dict[str, tuple[str | None, str | None]]
    config: dict[str, str] = field(repr=False)
    job: str = ""
    author: str | None = None
    comment: str | None = None

    def numbers(self) -> dict[str, float]:
        """The changed keys whose new value is a finite JSON number (booleans are not)."""
        out: dict[str, float] = {}
        for key, (_, new) in self.changes.items():
            value = number(new)
            if value is not None:
                out[key] = value
        return out

    def describe(self) -> str:
        """One line for a person: ``v7 at step 120 by alice: lr 0.01 -> 0.02 (comment)``."""
        who = f" by {self.author}" if self.author else ""
        parts = [f"{key} {_show(old)} -> {_show(new)}" for key, (old, new) in sorted(self.changes.items())]
        text = f"v{self.version} at step {self.step}{who}: " + (", ".join(parts) or "no key changed")
        return f"{text} ({self.comment})" if self.comment else text


def number(raw: str | None) -> float | None:
    """``raw`` as a float when it is a finite JSON number, else None."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    as_float = float(value)
    return as_float if math.isfinite(as_float) else None


def _show(raw: str | None) -> str:
    return "(none)" if raw is None else raw


class ChangeWatcher:
    """Remembers the last version served to this worker and calls the callback on a new one."""

    __slots__ = ("_callback", "_failed", "_last")

    def __init__(self, callback: Callable[[ConfigChange], object]) -> None:
        self._callback = callback
        self._last: Config | None = None
        self._failed = False

    def seen(self, config: Config) -> None:
        last = self._last
        if config.step is None or (
            last is not None
            and last.version == config.version
            and last.effective_step == config.effective_step
        ):
            # One version may name two configs (a change scheduled before one made now took
            # effect after it): the step they hold from tells them apart.
            return
        if config.version == 0:  # the fallback: no change, and the next real answer compares to `last`
            return
        before: dict[str, str] = {} if last is None else last
        changes = {
            key: (before.get(key), config.get(key))
            for key in before.keys() | config.keys()
            if before.get(key) != config.get(key)
        }
        if last is not None and not changes:
            # A version that changes no value, or one named before its step (a change pending
            # at a later step): nothing took effect yet; compared again at the next step.
            return
        self._last = config
        change = ConfigChange(
            step=config.step,
            version=config.version,
            previous_version=0 if last is None else last.version,
            changes=changes,
            config=dict(config),
            job=config.job,
            author=config.author,
            comment=config.comment,
        )
        try:
            self._callback(change)
        except Exception:
            if not self._failed:
                self._failed = True
                logger.exception("on_change callback failed (logged once; training goes on)")
