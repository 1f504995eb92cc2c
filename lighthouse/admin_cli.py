"""``lighthouse config ...``: read and change the live config through the admin API.

Every command prints JSON (reads) or ``version N`` (changes) on stdout; a failure
is one ``error: ...`` line on stderr and exit code 1 (2 for usage errors).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from lighthouse.admin_client import DEFAULT_URL, AdminClient, AdminError
from lighthouse.guard_options import describe_guard, guard_options
from lighthouse.values import ConfigError, decode_cli_value, parse_config, parse_json
from protos.cli_options import client_tls_options, job_option
from protos.jobs import InvalidJobId
from protos.tls import TLSConfig

F = TypeVar("F", bound=Callable[..., Any])


def connection_options(func: F) -> F:
    """``--url``/``--token``/``--timeout``/``--job`` (and ``--cacert/--cert/--key``) on every
    subcommand; the client arrives as ``client``."""

    @click.option(
        "--url",
        envvar="LIGHTHOUSE_URL",
        default=DEFAULT_URL,
        show_default=True,
        help="Lighthouse dashboard URL (env LIGHTHOUSE_URL).",
    )
    @click.option(
        "--token",
        envvar="LIGHTHOUSE_ADMIN_TOKEN",
        default=None,
        help="Admin token for changes (env LIGHTHOUSE_ADMIN_TOKEN).",
    )
    @click.option(
        "--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Seconds."
    )
    @job_option("The training job whose config to read or change")
    @client_tls_options(peer="lighthouse")
    @functools.wraps(func)
    def wrapper(
        url: str, token: str | None, timeout: float, job: str, tls: TLSConfig | None, **kwargs: Any
    ) -> Any:
        try:
            client = AdminClient(url, token=token or None, timeout=timeout, job=job, tls=tls)
        except InvalidJobId as exc:
            raise click.BadParameter(str(exc), param_hint="--job") from None
        except ValueError as exc:
            fail(str(exc))
        try:
            return func(client=client, **kwargs)
        except AdminError as exc:
            fail(exc.message)

    return wrapper  # type: ignore[return-value]


def fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False))


def print_change(answer: dict[str, Any]) -> None:
    """``version N`` for a change; for a dry run, the version it would make and its diff, key by key."""
    step = answer.get("effective_step")
    when = f" (takes effect at step {step})" if step is not None else ""
    guard = [describe_guard(answer["guard"])] if answer.get("guard") else []
    if not answer.get("dry_run"):
        click.echo(f"version {answer['version']}{when}")
        for line in guard:
            click.echo(line)
        return
    click.echo(f"dry run, nothing stored: would make version {answer['version']}{when}")
    for line in guard:
        click.echo(line)
    changes: dict[str, dict[str, Any]] = answer.get("changes") or {}
    if not changes:
        click.echo("  no key changes")
    show = functools.partial(json.dumps, ensure_ascii=False)
    for key, change in changes.items():
        if "before" not in change:
            click.echo(f"+ {key}: {show(change['after'])}")
        elif "after" not in change:
            click.echo(f"- {key}: {show(change['before'])}")
        else:
            click.echo(f"~ {key}: {show(change['before'])} -> {show(change['after'])}")


def parse_assignments(assignments: tuple[str, ...]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="KEY=VALUE")
        changes[key] = decode_cli_value(value)
    return changes


at_step_option = click.option(
    "--at-step",
    "at_step",
    type=click.IntRange(min=0),
    default=None,
    help="Take effect at this training step in every replica group instead of now.",
)
comment_option = click.option("--comment", default=None, help="Why; shown in the history.")
dry_run_option = click.option(
    "--dry-run", is_flag=True, help="Print what would change (or why it is refused) and store nothing."
)


@click.group()
def config() -> None:
    """Read and change the live config of a running lighthouse."""


@config.command()
@connection_options
def show(client: AdminClient) -> None:
    """Print the live config with its version, as JSON."""
    print_json(client.show())


@config.command("set")
@click.argument("assignments", nargs=-1, required=True, metavar="KEY=VALUE...")
@at_step_option
@comment_option
@click.option("--if-match", type=int, default=None, help="Refuse the change unless VERSION is still live.")
@dry_run_option
@guard_options
@connection_options
def set_(
    client: AdminClient,
    assignments: tuple[str, ...],
    at_step: int | None,
    comment: str | None,
    if_match: int | None,
    dry_run: bool,
    guard: dict[str, Any],
) -> None:
    """Change keys, keeping the others.

    A VALUE that parses as JSON is stored as that JSON value (lr=0.01 stores the
    number 0.01, flag=true a boolean); anything else as a string (name=abc).
    KEY=null deletes the key.
    """
    answer = client.patch(
        parse_assignments(assignments),
        if_match=if_match,
        effective_step=at_step,
        comment=comment,
        dry_run=dry_run,
        **guard,
    )
    print_change(answer)


@config.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@at_step_option
@comment_option
@click.option("--if-match", type=int, default=None, help="Refuse the change unless VERSION is still live.")
@dry_run_option
@guard_options
@connection_options
def load(
    client: AdminClient,
    file: Path,
    at_step: int | None,
    comment: str | None,
    if_match: int | None,
    dry_run: bool,
    guard: dict[str, Any],
) -> None:
    """Replace the whole config with FILE's JSON object."""
    try:
        new = parse_config(file.read_bytes(), what=str(file))
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{file}: {exc.strerror or exc}")
    answer = client.put(
        new, if_match=if_match, effective_step=at_step, comment=comment or str(file), dry_run=dry_run, **guard
    )
    print_change(answer)


@config.command()
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N versions.")
@connection_options
def history(client: AdminClient, limit: int) -> None:
    """Print the newest versions (with author, source and comment), as JSON."""
    print_json(client.history(limit))


@config.command()
@click.argument("version", type=click.IntRange(min=1))
@comment_option
@dry_run_option
@connection_options
def rollback(client: AdminClient, version: int, comment: str | None, dry_run: bool) -> None:
    """Make a new version with the content of VERSION."""
    print_change(client.rollback(version, comment=comment, dry_run=dry_run))


@config.command()
@connection_options
def scheduled(client: AdminClient) -> None:
    """Print the changes scheduled at a step (pending, in effect or cancelled), as JSON."""
    print_json(client.scheduled())


@config.command()
@click.argument("version", type=click.IntRange(min=1))
@connection_options
def cancel(client: AdminClient, version: int) -> None:
    """Cancel the scheduled change VERSION before it takes effect."""
    answer = client.cancel(version)
    click.echo(f"cancelled {version}: version {answer['version']}")


@config.command("at-step")
@click.argument("step", type=click.IntRange(min=0))
@connection_options
def at_step(client: AdminClient, step: int) -> None:
    """Print which config was live at STEP (and what each replica group served), as JSON."""
    print_json(client.at_step(step))


@config.command()
@connection_options
def managers(client: AdminClient) -> None:
    """Print the managers the lighthouse hears from, as JSON."""
    print_json(client.managers())


@config.group()
def schema() -> None:
    """Read and change the job's JSON Schema (draft 2020-12), which every change must satisfy."""


@schema.command("show")
@connection_options
def schema_show(client: AdminClient) -> None:
    """Print the schema with who set it and when, as JSON."""
    print_json(client.schema())


@schema.command("set")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Set it even though the live or a scheduled config violates it.")
@comment_option
@dry_run_option
@connection_options
def schema_set(client: AdminClient, file: Path, force: bool, comment: str | None, dry_run: bool) -> None:
    """Replace the schema with FILE's; refused while the config violates it (the violations are listed)."""
    try:
        document = parse_json(file.read_bytes(), what=str(file))
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{file}: {exc.strerror or exc}")
    answer = client.put_schema(document, force=force, dry_run=dry_run, comment=comment or str(file))
    for violation in answer.get("violations") or []:
        click.echo(f"violated (forced): {violation['path'] or '/'}: {violation['message']}")
    click.echo("dry run, nothing stored: the schema would be accepted" if dry_run else "schema set")


@schema.command("history")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N changes.")
@connection_options
def schema_history(client: AdminClient, limit: int) -> None:
    """Print the schema changes, newest first, as JSON."""
    print_json(client.schema_history(limit))


@click.command()
@connection_options
def jobs(client: AdminClient) -> None:
    """List the jobs of the lighthouse: version, last change, managers, job step, scheduled changes."""
    print_json(client.jobs())
