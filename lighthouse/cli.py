"""``lighthouse`` command: ``serve`` the config, and ``config ...`` to read and change it."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from lighthouse.admin.config_commands import config, jobs
from lighthouse.admin.guard_commands import guards
from lighthouse.admin.metric_commands import metrics
from lighthouse.config.values import ConfigError
from lighthouse.jobs.leases import LeasePolicy
from lighthouse.store.migrate import migrate_command
from lighthouse.web.access import load_job_tokens
from protos.cli_options import server_tls_options
from protos.daemon import Termination, announce, configure_logging, tune_for_many_streams
from protos.rpc import DEFAULT_DASHBOARD_PORT, DEFAULT_LIGHTHOUSE_PORT
from protos.tls import ServerTLS

logger = logging.getLogger("lighthouse")


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/lighthouse-config`` (``~/.local/state/lighthouse-config``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "lighthouse-config"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Lighthouse: the central service holding a training job's live config.

    Workers never talk to it directly: each replica group's manager fetches the
    config from here and relays it to the group's ranks.
    """


@main.command()
@click.option(
    "--bind",
    default=f"[::]:{DEFAULT_LIGHTHOUSE_PORT}",
    show_default=True,
    help="gRPC address managers connect to (port 0 picks a free port).",
)
@click.option(
    "--http-bind",
    default=f"[::]:{DEFAULT_DASHBOARD_PORT}",
    show_default=True,
    help="Dashboard and admin API address; 'off' serves none.",
)
@click.option(
    "--config",
    "--lighthouse-config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON object file with the initial config of the job 'default'; watched for edits while running.",
)
@click.option(
    "--config-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Folder of DIR/<job>.json files, one per job; watched: a new file creates its job.",
)
@click.option(
    "--tokens",
    "tokens_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help='JSON file {"job": ["token", ...]}: editor tokens that change only their job.',
)
@click.option(
    "--schema",
    "schema_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON Schema (draft 2020-12) every config change must satisfy; watched for edits while running.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where every version is stored durably [default: $XDG_STATE_HOME/lighthouse-config].",
)
@click.option(
    "--store",
    "store_url",
    default=None,
    metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
    help="Keep the versions in etcd instead of --state-dir, so several lighthouses serve the same "
    "jobs (etcds:// = TLS; default prefix /lighthouse-config).",
)
@click.option("--store-ca", default=None, help="CA bundle that signed etcd's certificates (etcds://).")
@click.option("--store-cert", default=None, help="Client certificate for etcd (mutual TLS).")
@click.option("--store-key", default=None, help="Key of --store-cert.")
@click.option(
    "--admin-token",
    envvar="LIGHTHOUSE_ADMIN_TOKEN",
    default=None,
    help="Bearer token required for changes (env LIGHTHOUSE_ADMIN_TOKEN). Unset: anyone can edit.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    help="Without --admin-token, a DNS name (besides IPs, localhost and this host's names) under "
    "which the dashboard accepts changes. Repeatable.",
)
@click.option("--strict", is_flag=True, help="Exit with code 2 when the config file is missing or invalid.")
@click.option(
    "--history-limit",
    type=click.IntRange(min=1),
    default=None,
    help="Keep at most N versions (oldest pruned, never the live one). Default: keep all.",
)
@server_tls_options
@click.option(
    "--http-tls",
    type=click.Choice(["on", "off"]),
    default="on",
    show_default=True,
    help="'off' keeps the dashboard on plain HTTP under --tls-cert (for a port only a local proxy reaches).",
)
@click.option(
    "--lease-extra-steps",
    type=click.IntRange(min=0),
    default=LeasePolicy.extra_steps,
    show_default=True,
    help="Step leases: steps added to the rate x TTL a lease lasts (slack for the renewal).",
)
@click.option(
    "--lease-min-steps",
    type=click.IntRange(min=1),
    default=LeasePolicy.min_steps,
    show_default=True,
    help="Step leases: the shortest lease, in steps (before the job's step rate is known).",
)
@click.option(
    "--lease-ceiling-ahead",
    type=click.FloatRange(min=0.0),
    default=None,
    help="Step leases: seconds of steps the stored promise ceiling runs ahead (fewer store writes; a "
    "change made through another lighthouse, or after a restart, waits up to this long). "
    "Default: 10 with --state-dir, 1 with --store.",
)
@click.option(
    "--keepalive-interval",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="Seconds between keep-alives on a quiet push stream; a manager ends one silent for two. "
    "Default: 15.",
)
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning or error.")
def serve(
    bind: str,
    http_bind: str,
    config_path: Path | None,
    schema_path: Path | None,
    state_dir: Path | None,
    admin_token: str | None,
    allowed_hosts: tuple[str, ...],
    strict: bool,
    history_limit: int | None,
    tls: ServerTLS | None,
    http_tls: str,
    log_level: str,
    config_dir: Path | None,
    tokens_path: Path | None,
    store_url: str | None,
    store_ca: str | None,
    store_cert: str | None,
    store_key: str | None,
    lease_extra_steps: int,
    lease_min_steps: int,
    lease_ceiling_ahead: float | None,
    keepalive_interval: float | None,
) -> None:
    """Serve the config. Prints the gRPC address (line 1) and dashboard URL (line 2)."""
    configure_logging(log_level)
    tune_for_many_streams()
    termination = Termination()
    from lighthouse.server import LighthouseServer
    from lighthouse.service import KEEPALIVE
    from lighthouse.store.backend import StoreUnavailable
    from lighthouse.store.etcd import open_etcd_store

    if store_url is not None and state_dir is not None:
        raise click.UsageError(
            "--state-dir is for the embedded store; with --store the versions live in etcd"
        )
    state_dir = state_dir or default_state_dir()
    backend = None
    try:
        if store_url is not None:
            backend = open_etcd_store(store_url, ca=store_ca, cert=store_cert, key=store_key)
        job_tokens = load_job_tokens(tokens_path) if tokens_path is not None else None
        server = LighthouseServer(
            bind,
            config_path,
            state_dir=state_dir,
            http_bind=None if http_bind.lower() == "off" else http_bind,
            admin_token=admin_token,
            allowed_hosts=allowed_hosts,
            strict=strict,
            history_limit=history_limit,
            config_dir=config_dir,
            job_tokens=job_tokens,
            schema_path=schema_path,
            tls=tls,
            http_tls=http_tls == "on",
            backend=backend,
            lease_policy=LeasePolicy(
                min_steps=lease_min_steps, extra_steps=lease_extra_steps, ceiling_ahead=lease_ceiling_ahead
            ),
            keepalive_interval=KEEPALIVE if keepalive_interval is None else keepalive_interval,
        )
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except (OSError, ValueError, StoreUnavailable) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if admin_token is None and http_bind.lower() != "off":
        logger.warning(
            "no --admin-token set: anyone who can reach %s can change the config", server.dashboard_url()
        )
    url = server.dashboard_url()
    announce(server.address(), *([url] if url else []))
    logger.info("state in %s", store_url or state_dir)
    name = termination.wait()
    logger.info("%s received, shutting down", name)
    server.shutdown()


config.add_command(guards)
main.add_command(config)
main.add_command(jobs)
main.add_command(metrics)
main.add_command(migrate_command)
