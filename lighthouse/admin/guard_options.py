"""``--guard METRIC:FACTOR [--guard-steps N] [--guard-window W]`` on ``config set`` and ``config load``.

Apart from ``guards_cli`` (which lists guards) because the ``config`` commands
use these options and ``guards_cli`` uses their connection options.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

from protos.limits import GUARD_STEPS, GUARD_WINDOW

F = TypeVar("F", bound=Callable[..., Any])


def guard_options(func: F) -> F:
    """``--guard METRIC:FACTOR [--guard-steps N] [--guard-window W]`` -> ``guard: dict`` (the keyword
    arguments of ``AdminClient.put``/``patch``; empty without ``--guard``)."""

    @click.option(
        "--guard",
        metavar="METRIC:FACTOR",
        default=None,
        help="Roll the change back by itself if, after it takes effect, METRIC (smoothed) rises above "
        "FACTOR x its mean before, or is not finite. E.g. loss:1.5.",
    )
    @click.option(
        "--guard-steps",
        type=click.IntRange(min=1),
        default=None,
        help=f"Steps the guard watches after the change takes effect [default: {GUARD_STEPS}].",
    )
    @click.option(
        "--guard-window",
        type=click.IntRange(min=1),
        default=None,
        help=f"Steps the metric is smoothed over (a trailing mean) [default: {GUARD_WINDOW}].",
    )
    @functools.wraps(func)
    def wrapper(guard: str | None, guard_steps: int | None, guard_window: int | None, **kwargs: Any) -> Any:
        if guard is None and (guard_steps is not None or guard_window is not None):
            raise click.UsageError("--guard-steps and --guard-window go with --guard METRIC:FACTOR")
        options = {"guard": guard, "guard_steps": guard_steps, "guard_window": guard_window}
        return func(guard=options if guard is not None else {}, **kwargs)

    return wrapper  # type: ignore[return-value]


def describe_guard(guard: dict[str, Any]) -> str:
    """One line: what the guard watches, and what it does."""
    first, last = guard["effective_step"], guard["effective_step"] + guard["steps"]
    return (
        f"guarded: rolled back if {guard['metric']} (mean of {guard['window']} steps) rises above "
        f"{guard['factor']:g} x its mean before step {first}, or is not finite, in steps {first} to {last}"
    )
