"""``lighthouse config ...`` and ``lighthouse jobs``: read and change the live config through the admin API.

Every command prints a table for people (reads; see ``admin_tables``) or
``version N`` (changes), and with ``-o json`` the API's JSON answer for scripts.
A failure is one ``error: ...`` line on stderr and exit code 1 (2 for usage errors).
"""

from __future__ import annotations

import functools
import getpass
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from lighthouse.admin import tables as admin_tables
from lighthouse.admin.client import DEFAULT_URL, AdminClient, AdminError
from lighthouse.admin.guard_options import describe_guard, guard_options
from lighthouse.config.values import (
    ConfigError,
    config_changes,
    decode_cli_value,
    looks_numeric_text,
    parse_config,
    parse_json,
)
from protos.cli_options import client_tls_options, job_option
from protos.cli_output import JSON, echo_lines, fail, output_option, print_json, with_iso_times
from protos.job_ids import DEFAULT_JOB, InvalidJobId
from protos.tls import TLSConfig

F = TypeVar("F", bound=Callable[..., Any])


def connection_options(func: F) -> F:
    """``--url``/``--token``/``--timeout``/``--job``/``-o`` (and ``--cacert/--cert/--key``) on every
    subcommand; the client arrives as ``client``, the output format as ``output``."""

    @click.option(
        "--url",
        envvar="LIGHTHOUSE_URL",
        default=DEFAULT_URL,
        show_default=True,
        help="Lighthouse dashboard URL, or several as A,B (lighthouses on one store: the first that "
        "answers is used). Env LIGHTHOUSE_URL.",
    )
    @click.option(
        "--token",
        envvar="LIGHTHOUSE_ADMIN_TOKEN",
        default=None,
        help="The admin token, or the job's token, for commands that change a job where it needs one; "
        "reads need none (env LIGHTHOUSE_ADMIN_TOKEN).",
    )
    @click.option(
        "--author",
        envvar="LIGHTHOUSE_AUTHOR",
        default=None,
        help="Who makes the change, for the history (env LIGHTHOUSE_AUTHOR; default: your user name).",
    )
    @click.option(
        "--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True, help="Seconds."
    )
    @job_option("The training job whose config to read or change")
    @client_tls_options(peer="lighthouse")
    @output_option
    @functools.wraps(func)
    def wrapper(
        url: str,
        token: str | None,
        author: str | None,
        timeout: float,
        job: str,
        tls: TLSConfig | None,
        **kwargs: Any,
    ) -> Any:
        try:
            client = AdminClient(
                url, token=token or None, timeout=timeout, job=job, tls=tls, author=author or user_name()
            )
        except InvalidJobId as exc:
            raise click.BadParameter(str(exc), param_hint="--job") from None
        except ValueError as exc:
            fail(str(exc))
        try:
            return func(client=client, **kwargs)
        except AdminError as exc:
            fail(explain(exc))
        finally:
            if client.token_not_needed:
                click.echo(f"note: job {client.job} needs no token; --token was not needed", err=True)

    return wrapper  # type: ignore[return-value]


def user_name() -> str | None:
    """The operating-system user, the author of a change made from a terminal."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no passwd entry and no LOGNAME/USER (a bare container)
        return None


def explain(exc: AdminError) -> str:
    """The API's refusal in the CLI's words: a missing or wrong token names ``--token``."""
    if exc.status == 401:
        reason = exc.message.partition(": send ")[0]
        return f"{reason}: pass --token TOKEN (or set LIGHTHOUSE_ADMIN_TOKEN)"
    return exc.message


def require_job(client: AdminClient, create: bool) -> None:
    """A change to a job that does not exist makes it: only when asked (``--create``), so a mistyped
    ``--job`` is an error instead of a new job. The job ``default`` is always there to change."""
    if create or client.job == DEFAULT_JOB:
        return
    try:
        client.job_info()
    except AdminError as exc:
        if exc.status != 404:
            raise
        known = sorted(j["job"] for j in client.jobs()["jobs"])
        listed = ", ".join(known[:10]) + (", ..." if len(known) > 10 else "") if known else "none yet"
        fail(f"job {client.job!r} does not exist (jobs: {listed}): check --job, or pass --create to make it")


create_option = click.option(
    "--create", is_flag=True, help="Make the job if it does not exist yet (else a mistyped --job is refused)."
)


def emit(output: str, answer: Any, lines: Callable[[], list[str]]) -> None:
    """The API's ``answer`` as JSON (``-o json``), else the table ``lines()`` makes of it."""
    if output == JSON:
        print_json(answer)
    else:
        echo_lines(lines())


def change_lines(answer: dict[str, Any]) -> list[str]:
    """A change's lines (``admin_tables.change_lines``), and what guards it when it is guarded."""
    guard = answer.get("guard")
    return [*admin_tables.change_lines(answer), *([describe_guard(guard)] if guard else [])]


def parse_assignments(assignments: tuple[str, ...]) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="KEY=VALUE")
        try:
            changes[key] = decode_cli_value(value, key)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="KEY=VALUE") from None
        if isinstance(changes[key], str) and looks_numeric_text(value):
            click.echo(
                f"warning: {key}={value} is not a JSON number: stored as the string {value!r} "
                f"(quote it, {key}='\"{value}\"', if a string is meant)",
                err=True,
            )
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
if_match_option = click.option(
    "--if-match",
    type=int,
    default=None,
    help="Refuse the change unless VERSION is still the latest (`config show -o json`'s version) and the "
    "change keeps every pending change where VERSION's config has it.",
)
allow_type_change_option = click.option(
    "--allow-type-change",
    is_flag=True,
    help="Store a change that alters a key's JSON type (a number becoming a string); refused without.",
)


@click.group()
def config() -> None:
    """Read and change the live config of a running lighthouse (tables; -o json for scripts)."""


@config.command()
@connection_options
def show(client: AdminClient, output: str) -> None:
    """Print the live config, its version and the changes scheduled ahead."""
    view = client.show()
    emit(output, view, lambda: admin_tables.show(view))


@config.command("set")
@click.argument("assignments", nargs=-1, required=True, metavar="KEY=VALUE...")
@at_step_option
@comment_option
@if_match_option
@dry_run_option
@allow_type_change_option
@create_option
@guard_options
@connection_options
def set_(
    client: AdminClient,
    output: str,
    assignments: tuple[str, ...],
    at_step: int | None,
    comment: str | None,
    if_match: int | None,
    dry_run: bool,
    allow_type_change: bool,
    create: bool,
    guard: dict[str, Any],
) -> None:
    """Change keys, keeping the others.

    A VALUE that parses as JSON is stored as that JSON value (lr=0.01 stores the
    number 0.01, flag=true a boolean); anything else as a string (name=abc).
    KEY=null deletes the key. A change of a key's JSON type needs --allow-type-change.
    """
    changes = parse_assignments(assignments)
    require_job(client, create)
    answer = client.patch(
        changes,
        if_match=if_match,
        effective_step=at_step,
        comment=comment,
        dry_run=dry_run,
        allow_type_change=allow_type_change,
        **guard,
    )
    emit(output, answer, lambda: change_lines(answer))


@config.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@at_step_option
@comment_option
@if_match_option
@dry_run_option
@allow_type_change_option
@create_option
@guard_options
@connection_options
def load(
    client: AdminClient,
    output: str,
    file: Path,
    at_step: int | None,
    comment: str | None,
    if_match: int | None,
    dry_run: bool,
    allow_type_change: bool,
    create: bool,
    guard: dict[str, Any],
) -> None:
    """Replace the whole config with FILE's JSON object."""
    try:
        new = parse_config(file.read_bytes(), what=str(file))
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{file}: {exc.strerror or exc}")
    require_job(client, create)
    answer = client.put(
        new,
        if_match=if_match,
        effective_step=at_step,
        comment=comment or str(file),
        dry_run=dry_run,
        allow_type_change=allow_type_change,
        **guard,
    )
    emit(output, answer, lambda: change_lines(answer))


@config.command()
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N versions.")
@connection_options
def history(client: AdminClient, output: str, limit: int) -> None:
    """One line per version, newest first (like git log --oneline), each with its change as a diff."""
    if output == JSON:
        print_json(client.history(limit))
        return
    entries = client.history(limit + 1)["versions"]  # one more: the diff base of the oldest shown
    older = entries[limit] if len(entries) > limit else None
    job_step = client.show()["current_step"]  # which scheduled changes are in effect
    echo_lines(admin_tables.history(entries[:limit], older, job_step))


@config.command()
@click.argument("older", type=click.IntRange(min=1), metavar="V1")
@click.argument("newer", type=click.IntRange(min=1), required=False, metavar="[V2]")
@connection_options
def diff(client: AdminClient, output: str, older: int, newer: int | None) -> None:
    """What changed, key by key, from version V1 to V2 (default: the live config)."""
    before = client.version(older)
    if newer is None:
        view = client.show()  # the live version and its config at the job's step
        after = {
            "version": view.get("live_version") or view["version"],
            "config": view.get("live", view["config"]),
        }
    else:
        after = client.version(newer)
    if output == JSON:
        changes = config_changes(before["config"], after["config"])
        print_json(
            {"from": before["version"], "to": after["version"], "live": newer is None, "changes": changes}
        )
        return
    echo_lines(admin_tables.diff(before, after, live=newer is None))


@config.command()
@click.option(
    "--since",
    type=click.IntRange(min=0),
    default=None,
    help="Print the versions after VERSION first (resume a watch); default: from the live version on.",
)
@connection_options
def watch(client: AdminClient, output: str, since: int | None) -> None:
    """Print each new version as it lands (who, what changed, effective step), until interrupted.

    Exits 1 with a message when the lighthouse goes away (with several --url, when none answers).
    """
    view = client.show()
    if since is None or since == view["version"]:
        since, base = view["version"], admin_tables.in_use(view)
    else:
        base = client.version(since)["config"] if since > 0 else {}
    replay = admin_tables.Replay(base, view["current_step"])
    exit_on_interrupt()
    if output != JSON:
        click.echo(f"watching job {client.job} after version {since} at {client.url} (Ctrl-C to stop)")
    last = since
    try:
        for entry in client.follow(since):
            if output == JSON:
                click.echo(json.dumps(with_iso_times(entry), ensure_ascii=False))
            else:
                echo_lines(admin_tables.watched(entry, replay))
            last = entry["version"]
    except AdminError as exc:
        fail(f"the watch ended after version {last}: {exc.message}")


def exit_on_interrupt() -> None:
    """From now on Ctrl-C (SIGINT) ends the process at once with exit code 0.

    A KeyboardInterrupt cannot promise "at once": a SIGINT that lands between Python's last check
    and the poll() of the blocking query leaves the watch waiting out the query (30 s). So SIGINT is
    blocked in every thread and taken by ``sigwait`` in a thread of its own. An inherited SIGINT
    disposition of "ignore" (``nohup``, a background job of a script) is kept.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def wait() -> None:
        signal.sigwait({signal.SIGINT})
        sys.stdout.flush()  # every line was flushed as printed: nothing half-written is lost
        os._exit(0)

    threading.Thread(target=wait, name="sigint", daemon=True).start()


@config.command()
@click.argument("version", type=click.IntRange(min=1))
@comment_option
@dry_run_option
@connection_options
def rollback(client: AdminClient, output: str, version: int, comment: str | None, dry_run: bool) -> None:
    """Make a new version with the content of VERSION."""
    answer = client.rollback(version, comment=comment, dry_run=dry_run)
    emit(output, answer, lambda: admin_tables.change_lines(answer))


@config.command()
@connection_options
def scheduled(client: AdminClient, output: str) -> None:
    """The changes scheduled at a step (pending, in effect or cancelled) and the groups that switched late."""
    answer = client.scheduled()
    emit(output, answer, lambda: admin_tables.scheduled(answer))


@config.command()
@click.argument("version", type=click.IntRange(min=1))
@connection_options
def cancel(client: AdminClient, output: str, version: int) -> None:
    """Cancel the scheduled change VERSION before it takes effect."""
    answer = client.cancel(version)
    emit(output, answer, lambda: [f"cancelled {version}: version {answer['version']}"])


@config.command("at-step")
@click.argument("step", type=click.IntRange(min=0))
@connection_options
def at_step(client: AdminClient, output: str, step: int) -> None:
    """Which config was live at STEP, and what each replica group served there."""
    answer = client.at_step(step)
    emit(output, answer, lambda: admin_tables.at_step(answer))


@config.command()
@connection_options
def managers(client: AdminClient, output: str) -> None:
    """The managers the lighthouse hears from: version served, last seen, step; behind or late ones."""
    answer = client.managers()
    emit(output, answer, lambda: admin_tables.managers(answer))


@config.group()
def schema() -> None:
    """Read and change the job's JSON Schema (draft 2020-12), which every change must satisfy."""


@schema.command("show")
@connection_options
def schema_show(client: AdminClient, output: str) -> None:
    """Print the schema with who set it and when."""
    answer = client.schema()
    emit(output, answer, lambda: admin_tables.schema(answer))


@schema.command("set")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Set it even though the live or a scheduled config violates it.")
@comment_option
@dry_run_option
@connection_options
def schema_set(
    client: AdminClient, output: str, file: Path, force: bool, comment: str | None, dry_run: bool
) -> None:
    """Replace the schema with FILE's; refused while the config violates it (the violations are listed)."""
    try:
        document = parse_json(file.read_bytes(), what=str(file))
    except ConfigError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{file}: {exc.strerror or exc}")
    answer = client.put_schema(document, force=force, dry_run=dry_run, comment=comment or str(file))

    def lines() -> list[str]:
        forced = [
            f"violated (forced): {v['path'] or '/'}: {v['message']}" for v in answer.get("violations") or []
        ]
        done = "dry run, nothing stored: the schema would be accepted" if dry_run else "schema set"
        return [*forced, done]

    emit(output, answer, lines)


@schema.command("history")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Newest N changes.")
@connection_options
def schema_history(client: AdminClient, output: str, limit: int) -> None:
    """The schema changes, newest first."""
    answer = client.schema_history(limit)
    emit(output, answer, lambda: admin_tables.schema_history(answer))


@click.group(invoke_without_command=True)
@connection_options
@click.pass_context
def jobs(ctx: click.Context, client: AdminClient, output: str) -> None:
    """The jobs of the lighthouse: version, last change, managers, job step, scheduled changes.

    `lighthouse jobs delete JOB` removes one (admin token).
    """
    if ctx.invoked_subcommand is None:
        answer = client.jobs()
        emit(output, answer, lambda: admin_tables.jobs(answer))


@click.group(invoke_without_command=True)
@connection_options
@click.pass_context
def runs(ctx: click.Context, client: AdminClient, output: str) -> None:
    """The job's runs: where each began (step, after which version) and how it ended.

    `lighthouse runs end` ends the live one: its step leases end, a change made now applies at
    once, and the next manager that steps begins the next run at its step.
    """
    if ctx.invoked_subcommand is None:
        answer = client.runs()
        emit(output, answer, lambda: admin_tables.runs(answer))


@runs.command("end")
@click.option("--comment", default=None, help="Why (kept in the run's record).")
@connection_options
def runs_end(client: AdminClient, output: str, comment: str | None) -> None:
    """End the job's live run (a change token for the job)."""
    answer = client.end_run(comment)
    ended = answer["ended"]
    emit(output, answer, lambda: [f"run {ended['number']} ended at step {ended['end_step']:,}"])


@jobs.command("delete")
@click.argument("name", metavar="JOB")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@connection_options
def jobs_delete(client: AdminClient, output: str, name: str, yes: bool) -> None:
    """Delete JOB and its whole history (admin token; refused while its managers report)."""
    try:
        target = client.for_job(name)
    except InvalidJobId as exc:
        raise click.BadParameter(str(exc), param_hint="JOB") from None
    info = target.job_info()
    if not yes:
        click.confirm(
            f"delete job {name!r} ({info.get('version', 0)} version(s)) and its whole history?",
            abort=True,
            err=True,
        )
    answer = target.delete_job()
    emit(output, answer, lambda: [f"deleted job {name}"])
