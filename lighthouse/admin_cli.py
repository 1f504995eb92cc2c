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
from lighthouse.tls_options import client_tls_options
from lighthouse.values import ConfigError, decode_cli_value, parse_config
from protos.tls import TLSConfig

F = TypeVar("F", bound=Callable[..., Any])


def connection_options(func: F) -> F:
    """``--url``/``--token``/``--timeout`` (and ``--cacert/--cert/--key``) on every subcommand;
    the client arrives as ``client``."""

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
    @client_tls_options(peer="lighthouse")
    @functools.wraps(func)
    def wrapper(url: str, token: str | None, timeout: float, tls: TLSConfig | None, **kwargs: Any) -> Any:
        try:
            client = AdminClient(url, token=token or None, timeout=timeout, tls=tls)
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
    step = answer.get("effective_step")
    click.echo(
        f"version {answer['version']}" + (f" (takes effect at step {step})" if step is not None else "")
    )


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
@connection_options
def set_(
    client: AdminClient,
    assignments: tuple[str, ...],
    at_step: int | None,
    comment: str | None,
    if_match: int | None,
) -> None:
    """Change keys, keeping the others.

    A VALUE that parses as JSON is stored as that JSON value (lr=0.01 stores the
    number 0.01, flag=true a boolean); anything else as a string (name=abc).
    KEY=null deletes the key.
    """
    answer = client.patch(
        parse_assignments(assignments), if_match=if_match, effective_step=at_step, comment=comment
    )
    print_change(answer)


@config.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@at_step_option
@comment_option
@click.option("--if-match", type=int, default=None, help="Refuse the change unless VERSION is still live.")
@connection_options
def load(
    client: AdminClient, file: Path, at_step: int | None, comment: str | None, if_match: int | None
) -> None:
    """Replace the whole config with FILE's JSON object."""
    try:
        new = parse_config(file.read_bytes(), what=str(file))
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{file}: {exc.strerror or exc}")
    print_change(client.put(new, if_match=if_match, effective_step=at_step, comment=comment or str(file)))


@config.command()
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N versions.")
@connection_options
def history(client: AdminClient, limit: int) -> None:
    """Print the newest versions (with author, source and comment), as JSON."""
    print_json(client.history(limit))


@config.command()
@click.argument("version", type=click.IntRange(min=1))
@comment_option
@connection_options
def rollback(client: AdminClient, version: int, comment: str | None) -> None:
    """Make a new version with the content of VERSION."""
    print_change(client.rollback(version, comment=comment))


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
