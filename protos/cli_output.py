"""How the CLIs print: tables for people, ``-o json`` for scripts, colour only on a terminal.

Tables are plain columns two spaces apart under capitalised headers, as
``kubectl get`` prints them: nothing a pipe, ``grep`` or ``awk`` cannot read.
Times are relative in tables ("3 min ago"); ``-o json`` prints the API's answer
as it is, with an ISO 8601 twin next to every epoch field (``created_at`` ->
``created_at_iso``). Colour (ANSI) is used only when the stream is a terminal and
``NO_COLOR`` is unset (https://no-color.org): a pipe or a file never gets escapes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

TABLE, JSON = "table", "json"


def output_option(func: F) -> F:
    """``-o/--output table|json`` -> ``output``."""
    return click.option(
        "-o",
        "--output",
        type=click.Choice([TABLE, JSON]),
        default=TABLE,
        show_default=True,
        help="table for people; json for scripts (the API's JSON, with ISO 8601 times beside epoch ones).",
    )(func)


# ------------------------------------------------------------------ colour


def colour_on(err: bool = False) -> bool:
    """Whether escapes may go to stdout (stderr with ``err``): a terminal, and no NO_COLOR."""
    if os.environ.get("NO_COLOR"):
        return False
    stream = sys.stderr if err else sys.stdout
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


@dataclass(frozen=True)
class Styled:
    """Text to print in a colour (``fg``, a click colour name), or dimmed, when colour is on."""

    text: str
    fg: str | None = None
    dim: bool = False
    bold: bool = False


def paint(text: str | Styled, err: bool = False) -> str:
    if isinstance(text, str):
        return text
    if not colour_on(err):
        return text.text
    return click.style(text.text, fg=text.fg, dim=text.dim, bold=text.bold)


def fail(message: str) -> NoReturn:
    """The one-line error every CLI command ends with on failure (exit code 1)."""
    click.echo(f"{paint(Styled('error:', fg='red', bold=True), err=True)} {message}", err=True)
    sys.exit(1)


# ------------------------------------------------------------------ tables

Cell = str | Styled


def table(headers: Sequence[str] | None, rows: Sequence[Sequence[Cell]]) -> list[str]:
    """Rows of aligned columns (no trailing spaces); ``headers`` None prints none (``git log`` style)."""
    texts = [[c.text if isinstance(c, Styled) else c for c in row] for row in rows]
    if headers is not None:
        texts.insert(0, list(headers))
    if not texts:
        return []
    widths = [max(len(row[i]) for row in texts if i < len(row)) for i in range(max(map(len, texts)))]
    painted: list[Sequence[Cell]] = list(rows)
    if headers is not None:
        painted.insert(0, [Styled(h, bold=True) for h in headers])
    lines = []
    for cells, row in zip(painted, texts, strict=True):
        parts = [
            paint(cell) + " " * (widths[i] - len(text) if i < len(row) - 1 else 0)
            for i, (cell, text) in enumerate(zip(cells, row, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return lines


def echo_lines(lines: Sequence[str]) -> None:
    for line in lines:
        click.echo(line)


# ------------------------------------------------------------------ numbers and times


def steps(step: int | None) -> str:
    """A step with thousands separators (``12,345``); ``-`` for none (-1 or None)."""
    return "-" if step is None or step < 0 else f"{step:,}"


def duration(seconds: float, tenths: bool = True) -> str:
    """``0.4 s`` (whole seconds without ``tenths``), ``12 s``, ``3 min``, ``5 h``, ``2 d``."""
    s = abs(seconds)
    if s < 10 and tenths:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min"
    if s < 2 * 86400:
        return f"{s // 3600:.0f} h"
    return f"{s // 86400:.0f} d"


def ago(epoch: float | None, now: float | None = None) -> str:
    """``3 min ago`` (``in 5 s`` for a time ahead, ``just now`` within a second)."""
    if epoch is None:
        return "-"
    delta = (time.time() if now is None else now) - epoch
    if abs(delta) < 1:
        return "just now"
    text = duration(delta, tenths=False)
    return f"{text} ago" if delta > 0 else f"in {text}"


def iso(epoch: float) -> str:
    """``2026-11-30T09:15:02.123Z``: ISO 8601 in UTC."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def with_iso_times(value: Any) -> Any:
    """``value`` with ``KEY_iso`` after every epoch field ``*_at`` (a number), at any depth."""
    if isinstance(value, list):
        return [with_iso_times(v) for v in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, item in value.items():
        out[key] = with_iso_times(item)
        if key.endswith("_at") and isinstance(item, int | float) and not isinstance(item, bool):
            out[f"{key}_iso"] = iso(item)
    return out


def print_json(value: Any) -> None:
    click.echo(json.dumps(with_iso_times(value), indent=2, ensure_ascii=False))
