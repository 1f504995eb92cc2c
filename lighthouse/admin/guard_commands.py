"""``lighthouse config guards``: a job's guarded changes (active, passed, triggered, lapsed,
cancelled), and ``--cancel VERSION`` to stop one. The options that guard a change are in
``guard_options``."""

from __future__ import annotations

from typing import Any

import click

from lighthouse.admin.client import AdminClient
from lighthouse.admin.config_commands import connection_options, emit
from protos.cli_output import steps, table


def lines(answer: dict[str, Any]) -> list[str]:
    """The ``lighthouse config guards`` table of one API answer."""
    if not answer["guards"]:
        return ["no guarded change (config set KEY=VALUE --guard METRIC:FACTOR makes one)"]
    rows = []
    for guard in answer["guards"]:
        baseline, rollback, at = (
            guard.get("baseline"),
            guard.get("rollback_version"),
            guard.get("rollback_step"),
        )
        rows.append(
            [
                f"v{guard['version']}",
                guard["status"],
                f"{guard['metric']}:{guard['factor']:g}",
                f"{steps(guard['effective_step'])}-{steps(guard['effective_step'] + guard['steps'])}",
                "-" if baseline is None else f"{baseline:.6g}",
                "-" if rollback is None else f"v{rollback}" + (f" at {steps(at)}" if at is not None else ""),
                guard.get("reason") or "",
            ]
        )
    return table(["VERSION", "STATUS", "GUARD", "STEPS", "BASELINE", "ROLLBACK", "REASON"], rows)


@click.command()
@click.option(
    "--cancel",
    type=click.IntRange(min=1),
    default=None,
    metavar="VERSION",
    help="Stop guarding VERSION (its change stays).",
)
@connection_options
def guards(client: AdminClient, cancel: int | None, output: str) -> None:
    """List the guarded changes: active, passed, triggered (with their rollback), lapsed (not
    judged: its metric was not reported) or cancelled."""
    if cancel is not None:
        answer = client.cancel_guard(cancel)
        emit(output, answer, lambda: [f"the guard of v{cancel} is cancelled"])
        return
    listed = client.guards()
    emit(output, listed, lambda: lines(listed))
