"""``lighthouse config guards``: a job's guarded changes (active, passed, triggered, cancelled),
and ``--cancel VERSION`` to stop one. The options that guard a change are in ``guard_options``."""

from __future__ import annotations

from typing import Any

import click

from lighthouse.admin_cli import connection_options, print_json
from lighthouse.admin_client import AdminClient
from lighthouse.metrics_cli import aligned, output_option


def _row(guard: dict[str, Any]) -> tuple[str, ...]:
    baseline = guard.get("baseline")
    rollback = guard.get("rollback_version")
    return (
        f"v{guard['version']}",
        guard["status"],
        f"{guard['metric']}:{guard['factor']:g}",
        f"{guard['effective_step']}-{guard['effective_step'] + guard['steps']}",
        "-" if baseline is None else f"{baseline:.6g}",
        "-" if rollback is None else f"v{rollback}",
        guard.get("reason") or "",
    )


@click.command()
@click.option(
    "--cancel",
    type=click.IntRange(min=1),
    default=None,
    metavar="VERSION",
    help="Stop guarding VERSION (its change stays).",
)
@output_option
@connection_options
def guards(client: AdminClient, cancel: int | None, output: str) -> None:
    """List the guarded changes: active, passed, triggered (with their rollback) or cancelled."""
    if cancel is not None:
        guard = client.cancel_guard(cancel)["guard"]
        if output == "json":
            print_json(guard)
        else:
            click.echo(f"the guard of v{cancel} is cancelled")
        return
    answer = client.guards()
    if output == "json":
        print_json(answer)
        return
    if not answer["guards"]:
        click.echo("no guarded change (config set KEY=VALUE --guard METRIC:FACTOR makes one)")
        return
    header = ("VERSION", "STATUS", "GUARD", "STEPS", "BASELINE", "ROLLBACK", "REASON")
    for line in aligned([header, *map(_row, answer["guards"])]):
        click.echo(line)
