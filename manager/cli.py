"""``manager`` command: ``serve`` a replica group's relay; ``get`` what a worker would receive and
``status`` what the manager serves and why (tables; ``-o json`` for scripts)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from protos import lighthouse_config_pb2 as pb
from protos.cli_options import client_tls_options, job_option, server_tls_options
from protos.cli_output import (
    JSON,
    Cell,
    Styled,
    duration,
    echo_lines,
    fail,
    output_option,
    paint,
    print_json,
    steps,
    table,
)
from protos.daemon import Termination, announce, configure_logging, limit_malloc_arenas
from protos.limits import PUSH_LEASE_SECONDS, STEP_WINDOW
from protos.rpc import LIGHTHOUSE_TOKEN_ENV, LIGHTHOUSE_TOKEN_FILE_ENV
from protos.tls import LIGHTHOUSE_TLS_ENVS, ServerTLS, TLSConfig

logger = logging.getLogger("manager")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Manager: the config relay of one replica group.

    Workers of the group call its GetConfig every step; it answers from a short
    cache, fetching from the lighthouse at most once per TTL, and answers an
    empty (or, with --serve-stale, the last good) config when the lighthouse
    does not answer in time.
    """


@main.command()
@click.option(
    "--lighthouse",
    "lighthouse_addr",
    envvar="TORCHFT_LIGHTHOUSE",
    required=True,
    help="Lighthouse address HOST:PORT, or several as A,B,C (lighthouses on one etcd store: the "
    "manager moves to the next when one fails or hangs). Env TORCHFT_LIGHTHOUSE; http://HOST:PORT "
    "accepted; https://HOST:PORT speaks TLS, trusting the system's roots unless --lighthouse-ca.",
)
@click.option(
    "--bind", default="[::]:0", show_default=True, help="Address workers connect to (0: free port)."
)
@click.option("--replica-id", required=True, help="Name of this replica group, shown on the dashboard.")
@click.option(
    "--cache-ttl",
    type=click.FloatRange(min=0.001),
    default=1.0,
    show_default=True,
    help="Seconds a fetched config is served before asking the lighthouse again.",
)
@click.option(
    "--lighthouse-timeout",
    type=click.FloatRange(min=0.001),
    default=1.0,
    show_default=True,
    help="Deadline in seconds of one call to the lighthouse.",
)
@click.option(
    "--backoff",
    type=click.FloatRange(min=0.001),
    default=1.0,
    show_default=True,
    help="After a failed call, seconds during which workers get the fallback at once before a retry.",
)
@click.option(
    "--serve-stale", is_flag=True, help="During an outage serve the last good config, not an empty one."
)
@click.option(
    "--push/--poll",
    default=True,
    show_default=True,
    help="Hold a push stream to the lighthouse (a change arrives in milliseconds; the TTL then only "
    "paces the polling that takes over while no stream is open), or only poll every TTL.",
)
@click.option(
    "--push-lease-seconds",
    type=click.FloatRange(min=0),
    default=PUSH_LEASE_SECONDS,
    show_default=True,
    help="On a live push stream, the seconds of steps a step lease covers (a change made now is live "
    "in every group within about this plus 3 steps, while every group pushes); renewed half-way, "
    "on the stream. 0: a cache TTL, as when polling (fewer renewals, changes wait up to a TTL).",
)
@click.option(
    "--step-window",
    type=click.IntRange(min=1),
    default=STEP_WINDOW,
    show_default=True,
    help="How many recent steps stay pinned (all ranks get the same config for a step).",
)
@job_option("The training job this group belongs to")
@client_tls_options(
    "--lighthouse-ca",
    "--lighthouse-cert",
    "--lighthouse-key",
    dest="lighthouse_tls",
    peer="lighthouse",
    envvars=LIGHTHOUSE_TLS_ENVS,
)
@server_tls_options
@click.option(
    "--lighthouse-token-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar=LIGHTHOUSE_TOKEN_FILE_ENV,
    default=None,
    help="File holding this job's manager token, sent on every call to the lighthouse (env "
    "LIGHTHOUSE_TOKEN_FILE; or the token itself in env LIGHTHOUSE_TOKEN).",
)
@click.option(
    "--parent-pid",
    type=int,
    default=None,
    help="Exit (as on SIGTERM) once this process is no longer our parent, e.g. when it was killed.",
)
@click.option(
    "--run-id",
    default="",
    help="The training script's run id (e.g. torchelastic's restart count): an id the job never had "
    "ends its live run and begins a new one (see the README's 'Runs, restarts and resumes').",
)
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning or error.")
def serve(
    lighthouse_addr: str,
    bind: str,
    replica_id: str,
    cache_ttl: float,
    lighthouse_timeout: float,
    backoff: float,
    serve_stale: bool,
    push: bool,
    push_lease_seconds: float,
    step_window: int,
    job: str,
    lighthouse_tls: TLSConfig | None,
    tls: ServerTLS | None,
    lighthouse_token_file: Path | None,
    parent_pid: int | None,
    run_id: str,
    log_level: str,
) -> None:
    """Relay the config to this group's workers. Prints the bound address on line 1."""
    configure_logging(log_level)
    limit_malloc_arenas()  # before gRPC's threads: it lives as long as its training job
    token = _lighthouse_token(lighthouse_token_file)
    termination = Termination()
    if parent_pid is not None:
        from manager.lifeline import exit_with_parent

        exit_with_parent(parent_pid)
    from manager.server import ManagerServer

    try:
        server = ManagerServer(
            lighthouse_addr,
            bind,
            replica_id,
            cache_ttl=cache_ttl,
            lighthouse_timeout=lighthouse_timeout,
            backoff=backoff,
            serve_stale=serve_stale,
            push=push,
            push_lease_seconds=push_lease_seconds,
            step_window=step_window,
            job=job,
            lighthouse_tls=lighthouse_tls,
            tls=tls,
            lighthouse_token=token,
            run_id=run_id,
        )
    except (OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    announce(server.address())
    name = termination.wait()
    logger.info("%s received, shutting down", name)
    server.shutdown()


addr_option = click.option(
    "--addr", required=True, help="Manager address HOST:PORT (what `manager serve` printed)."
)
timeout_option = click.option(
    "--timeout", type=click.FloatRange(min=0.001), default=5.0, show_default=True, help="Seconds."
)
SOURCE_COLOURS = {"cache": "green", "lighthouse": "green", "stale": "yellow", "fallback": "red"}


@main.command()
@addr_option
@click.option("--step", type=int, default=None, help="Ask for this step's pinned config.")
@timeout_option
@client_tls_options(peer="manager")
@output_option
def get(addr: str, step: int | None, timeout: float, tls: TLSConfig | None, output: str) -> None:
    """Print the config a worker would get (exit 1 when no manager answers at ADDR).

    Looks only: pins nothing, moves no step. ``version`` names the config printed (the one in
    effect at the step, without --step at the job's); a change taking effect later is named apart.
    -o json prints {job, version, source, pinned, config, pending_version, pending_step,
    effective_step, author, comment} (pending_*: null when nothing is pending).
    """
    from manager.status_client import NotAManager, peek_config

    try:
        reply = peek_config(addr, step, timeout, tls)
    except NotAManager as exc:
        fail(str(exc))
    if output == JSON:
        print_json(
            {
                "job": reply.job,
                "version": reply.version,
                "source": reply.source,
                "pinned": reply.pinned,
                "config": dict(reply.config_data),
                **{name: _optional(reply, name) for name in _OPTIONAL_REPLY_FIELDS},
                "author": reply.author or None,
                "comment": reply.comment or None,
            }
        )
        return
    config = dict(reply.config_data)
    lines = table(["KEY", "VALUE"], sorted(config.items())) if config else ["(empty config)"]
    source = paint(Styled(reply.source, fg=SOURCE_COLOURS.get(reply.source)))
    pinned = "" if step is None else (f", pinned for step {steps(step)}" if reply.pinned else ", not pinned")
    lines += ["", f"version {reply.version} of job {reply.job}, source {source}{pinned}"]
    if reply.HasField("pending_version") and reply.HasField("pending_step"):
        lines.append(f"pending: version {reply.pending_version} from step {steps(reply.pending_step)}")
    echo_lines(lines)


_OPTIONAL_REPLY_FIELDS = ("pending_version", "pending_step", "effective_step")


def _optional(message: Any, name: str) -> int | None:
    """An optional field's value, None when absent."""
    return getattr(message, name) if message.HasField(name) else None


@main.command()
@addr_option
@timeout_option
@client_tls_options(peer="manager")
@output_option
def status(addr: str, timeout: float, tls: TLSConfig | None, output: str) -> None:
    """What the manager serves and why: source, version, cache age, lighthouse in use, pinned steps."""
    from manager.status_client import NotAManager, manager_info

    try:
        info = manager_info(addr, timeout, tls)
    except NotAManager as exc:
        fail(str(exc))
    if output == JSON:
        print_json(info_json(info))
    else:
        echo_lines(status_lines(info))


def info_json(info: pb.ManagerInfo) -> dict[str, Any]:
    """Every field by its proto name (int64 as numbers, unlike protobuf's JSON mapping)."""
    out: dict[str, Any] = {}
    for field in info.DESCRIPTOR.fields:
        value = getattr(info, field.name)
        if field.has_presence and not info.HasField(field.name):
            value = None  # an optional field not set (pending_*: nothing pending)
        out[field.name] = value if value is None or isinstance(value, str | int | float) else list(value)
    return out


def status_lines(info: pb.ManagerInfo) -> list[str]:
    """``manager status`` as a two-column table."""
    age = "none held yet" if info.cache_age_s < 0 else duration(info.cache_age_s)
    listed = list(info.lighthouses)
    position = f" ({listed.index(info.lighthouse) + 1} of {len(listed)})" if len(listed) > 1 else ""
    answered = (
        "never answered"
        if info.last_answer_age_s < 0
        else f"last answer {duration(info.last_answer_age_s)} ago"
    )
    pinned = "none"
    if info.pinned_steps:
        pinned = (
            f"{info.pinned_steps:,} (steps {steps(info.first_pinned_step)} to {steps(info.last_pinned_step)})"
        )
    hits = f" ({info.cache_hits / info.requests:.0%} from the cache)" if info.requests else ""
    rows: list[list[Cell]] = [
        ["replica", f"{info.replica_id} (job {info.job})"],
        ["address", info.address],
        ["source", Styled(info.source, fg=SOURCE_COLOURS.get(info.source))],
        ["version", str(info.live_version or info.version)],  # what workers get at the group's step
        ["cache age", f"{age} (TTL {duration(info.cache_ttl_s)})"],
        ["lighthouse", f"{info.lighthouse}{position}, {answered}"],
    ]
    if info.HasField("pending_version") and info.HasField("pending_step"):
        rows.append(["pending", f"version {info.pending_version} from step {steps(info.pending_step)}"])
    if len(listed) > 1:
        rows.append(["listed", ", ".join(listed)])
    if info.last_error:
        rows.append(["last error", Styled(info.last_error, fg="red")])
    rows += [
        ["pinned steps", pinned],
        ["job step", f"{steps(info.last_pinned_step)} here, {steps(info.lighthouse_step)} at the lighthouse"],
        [
            "lease",
            "none" if info.lease_through_step < 0 else f"through step {steps(info.lease_through_step)}",
        ],
        ["requests", f"{info.requests:,}{hits}"],
        ["fetches", f"{info.upstream_fetches:,} ({info.upstream_failures:,} failed)"],
    ]
    return table(None, rows)


def _lighthouse_token(path: Path | None) -> str | None:
    """The manager token: from ``--lighthouse-token-file`` (or LIGHTHOUSE_TOKEN_FILE), else the
    LIGHTHOUSE_TOKEN variable (never a flag of its own: ps shows flags)."""
    if path is None:
        return os.environ.get(LIGHTHOUSE_TOKEN_ENV, "").strip() or None
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"--lighthouse-token-file {path}: {exc}") from None
    if not token:
        raise click.UsageError(f"--lighthouse-token-file {path} is empty")
    return token
