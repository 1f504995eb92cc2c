"""Helper threads whose failure fails the test.

An exception raised in a plain ``threading.Thread`` ends that thread with a
warning and nothing else: the test goes on and may even pass. ``CheckedThread``
keeps the exception, and ``check()`` (join, then raise it) puts it in the test.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class CheckedThread(threading.Thread):
    """Runs ``target(*args)`` in a daemon thread; ``check()`` raises whatever it raised."""

    def __init__(self, target: Callable[..., Any], *args: Any, name: str | None = None) -> None:
        super().__init__(name=name or getattr(target, "__name__", None), daemon=True)
        self._work = target
        self._work_args = args
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work(*self._work_args)
        except BaseException as exc:
            self.error = exc

    def check(self, timeout: float = 60.0) -> None:
        """Join (AssertionError if it is still running after ``timeout``), then re-raise its error."""
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"thread {self.name} still running after {timeout}s")
        if self.error is not None:
            raise AssertionError(f"thread {self.name} failed: {self.error!r}") from self.error
