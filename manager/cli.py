"""``manager`` command: ``serve`` a replica group's relay, ``get`` what a worker would receive."""

from __future__ import annotations

import json
import logging
import sys

import click

from protos.cli_options import client_tls_options, job_option, server_tls_options
from protos.daemon import Termination, announce, configure_logging
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
    "--step-window",
    type=click.IntRange(min=1),
    default=1024,
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
    "--parent-pid",
    type=int,
    default=None,
    help="Exit (as on SIGTERM) once this process is no longer our parent, e.g. when it was killed.",
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
    step_window: int,
    job: str,
    lighthouse_tls: TLSConfig | None,
    tls: ServerTLS | None,
    parent_pid: int | None,
    log_level: str,
) -> None:
    """Relay the config to this group's workers. Prints the bound address on line 1."""
    configure_logging(log_level)
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
            step_window=step_window,
            job=job,
            lighthouse_tls=lighthouse_tls,
            tls=tls,
        )
    except (OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    announce(server.address())
    name = termination.wait()
    logger.info("%s received, shutting down", name)
    server.shutdown()


@main.command()
@click.option("--addr", required=True, help="Manager address HOST:PORT.")
@click.option("--step", type=int, default=None, help="Ask for this step's pinned config.")
@click.option("--timeout", type=click.FloatRange(min=0.001), default=5.0, show_default=True, help="Seconds.")
@client_tls_options(peer="manager")
def get(addr: str, step: int | None, timeout: float, tls: TLSConfig | None) -> None:
    """Print the config a worker would get, as JSON (exit 1 when the manager is unreachable)."""
    from worker_client import ConfigUnavailable, ManagerClient

    try:
        with ManagerClient(addr, timeout=timeout, strict=True, tls=tls) as client:
            cfg = client.get_config(step=step, peek=True)  # look only: pins nothing
    except ConfigUnavailable as exc:
        if exc.answer is None:  # unreachable; an unconfirmed answer is shown as it is (its source says)
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        cfg = exc.answer
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    out = {
        "job": cfg.job,
        "version": cfg.version,
        "source": cfg.source,
        "pinned": cfg.pinned,
        "config": dict(cfg),
    }
    click.echo(json.dumps(out, indent=2, ensure_ascii=False))
