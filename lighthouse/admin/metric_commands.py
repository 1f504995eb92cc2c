"""``lighthouse metrics``: what a job's ranks report, at a glance.

One line per metric: its newest step and value (mean across the groups' values,
with min and max), how many values were not finite in the range shown, and a
sparkline of the range (``!`` marks points with a non-finite value). ``-o json``
prints the API's answer for scripts.
"""

from __future__ import annotations

import math
from typing import Any

import click

from lighthouse.admin.client import AdminClient
from lighthouse.admin.config_commands import connection_options, emit
from protos.cli_output import fail, steps, table

SPARKS = "▁▂▃▄▅▆▇█"
NOT_FINITE = "!"


def sparkline(points: list[dict[str, Any]]) -> str:
    """One character a point, its mean scaled between the range's lowest and highest."""
    means = [p["mean"] for p in points if p["mean"] is not None]
    low, high = (min(means), max(means)) if means else (0.0, 0.0)
    out = []
    for point in points:
        mean = point["mean"]
        if point["nonfinite"] or mean is None:
            out.append(NOT_FINITE)
        elif high == low:
            out.append(SPARKS[len(SPARKS) // 2])
        else:
            out.append(SPARKS[round((mean - low) / (high - low) * (len(SPARKS) - 1))])
    return "".join(out)


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def lines(answer: dict[str, Any]) -> list[str]:
    """The ``lighthouse metrics`` table of one API answer."""
    if not answer["metrics"]:
        return ["no metric reported yet (workers call ManagerClient.report(step, loss=...))"]
    rows = []
    for name, points in answer["metrics"].items():
        last = answer.get("last", {}).get(name) or (points[-1] if points else None)
        if last is None:
            continue
        span = f"{steps(points[0]['step'])}-{steps(points[-1].get('to_step', points[-1]['step']))}"
        rows.append(
            [
                name,
                steps(last["step"]),
                _number(last["mean"]),
                _number(last["min"]),
                _number(last["max"]),
                str(last["count"]),
                str(sum(p["nonfinite"] for p in points)),
                span,
                sparkline(points),
            ]
        )
    headers = ["METRIC", "STEP", "MEAN", "MIN", "MAX", "VALUES", "NOT FINITE", "STEPS", ""]
    out = table(headers, rows)
    if answer.get("dropped"):
        out.append(
            f"{answer['dropped']} reported values were dropped on the way (full buffers, failed calls)"
        )
    return out


@click.command()
@click.option("--name", "names", multiple=True, help="Only this metric (repeatable). Default: every one.")
@click.option("--from-step", type=click.IntRange(min=0), default=None, help="First step shown.")
@click.option("--to-step", type=click.IntRange(min=0), default=None, help="Last step shown.")
@click.option(
    "--width", type=click.IntRange(min=1, max=1000), default=40, show_default=True, help="Sparkline points."
)
@connection_options
def metrics(
    client: AdminClient,
    names: tuple[str, ...],
    from_step: int | None,
    to_step: int | None,
    width: int,
    output: str,
) -> None:
    """Print each reported metric's newest value and a sparkline of its steps."""
    answer = client.metrics(*names, from_step=from_step, to_step=to_step, max_points=width)
    missing = [name for name in names if not answer["metrics"].get(name)]
    if missing:
        known = sorted(client.metrics(max_points=1)["metrics"])
        reported = (
            ", ".join(known) if known else "none yet: workers call ManagerClient.report(step, loss=...)"
        )
        fail(f"no metric named {', '.join(map(repr, missing))} in job {client.job} (reported: {reported})")
    emit(output, answer, lambda: lines(answer))
