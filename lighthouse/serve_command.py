"""``lighthouse serve``: its flags, grouped into the options objects ``LighthouseServer`` takes.

Loaded only when ``serve`` runs (``lighthouse.cli`` names it lazily): the admin commands do not
pay for the server side.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
from click.core import ParameterSource

from lighthouse.config.values import ConfigError
from lighthouse.jobs.leases import LeasePolicy
from lighthouse.options import ConfigSources, HttpOptions
from lighthouse.server import LighthouseServer
from lighthouse.service import KEEPALIVE
from lighthouse.store.backend import StoreUnavailable
from lighthouse.store.etcd import open_etcd_store
from lighthouse.web.access import load_job_tokens
from protos.cli_options import server_tls_options
from protos.daemon import Termination, announce, configure_logging, tune_for_many_streams
from protos.rpc import DEFAULT_DASHBOARD_PORT, DEFAULT_LIGHTHOUSE_PORT
from protos.tls import ServerTLS

logger = logging.getLogger("lighthouse")

F = TypeVar("F", bound=Callable[..., Any])


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/lighthouse-config`` (``~/.local/state/lighthouse-config``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "lighthouse-config"


@dataclass(frozen=True)
class StoreOptions:
    """Where ``serve`` keeps the versions: a directory of its own, or etcd."""

    state_dir: Path | None = None
    """The SQLite store's directory (``--state-dir``); None: ``default_state_dir()`` unless ``url``."""
    url: str | None = None
    """``etcd[s]://HOST:PORT[,...][/PREFIX]`` (``--store``): several lighthouses serve the same jobs."""
    ca: str | None = None
    """CA bundle that signed etcd's certificates (``--store-ca``)."""
    cert: str | None = None
    """Client certificate for etcd, mutual TLS (``--store-cert``)."""
    key: str | None = None
    """Key of ``cert`` (``--store-key``)."""
    history_limit: int | None = None
    """Versions kept per job, the oldest pruned first, never the live one (``--history-limit``)."""


def _fail(exc: Exception, code: int) -> NoReturn:
    click.echo(f"error: {exc}", err=True)
    sys.exit(code)


def _grouped(dest: str, build: Callable[..., object], *options: Callable[[Any], Any]) -> Callable[[F], F]:
    """Add ``options`` to a command and hand it, as ``dest``, what ``build`` makes of their values
    (``build``'s parameters are the options' names)."""
    names = list(inspect.signature(build).parameters)

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names}
            return func(**{dest: build(**values)}, **kwargs)

        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper  # type: ignore[return-value]

    return decorate


def _sources(config_dir: Path | None, schema_path: Path | None, strict: bool) -> ConfigSources:
    return ConfigSources(schema_path=schema_path, config_dir=config_dir, strict=strict)


def _store(
    state_dir: Path | None,
    store_url: str | None,
    store_ca: str | None,
    store_cert: str | None,
    store_key: str | None,
    history_limit: int | None,
) -> StoreOptions:
    if store_url is not None and state_dir is not None:
        raise click.UsageError(
            "--state-dir is for the embedded store; with --store the versions live in etcd"
        )
    return StoreOptions(state_dir, store_url, store_ca, store_cert, store_key, history_limit)


def _http(
    admin_token: str | None,
    admin_token_file: Path | None,
    tokens_path: Path | None,
    allowed_hosts: tuple[str, ...],
    http_tls: str,
    http_request_timeout: float,
    http_max_connections: int,
) -> HttpOptions:
    if admin_token_file is not None:
        if admin_token is not None:
            raise click.UsageError(
                "--admin-token-file and --admin-token (or LIGHTHOUSE_ADMIN_TOKEN) exclude each other"
            )
        try:
            admin_token = admin_token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            _fail(ValueError(f"--admin-token-file {admin_token_file}: {exc}"), 1)
        if not admin_token:
            _fail(ValueError(f"--admin-token-file {admin_token_file} is empty"), 1)
    try:
        job_tokens = load_job_tokens(tokens_path) if tokens_path is not None else None
    except ValueError as exc:
        _fail(exc, 1)
    return HttpOptions(
        admin_token,
        job_tokens,
        allowed_hosts,
        https=http_tls == "on",
        request_seconds=http_request_timeout,
        max_connections=http_max_connections,
    )


def _warn_about_secrets(ctx: click.Context, tls: ServerTLS | None, store: StoreOptions) -> None:
    """A secret others can read is a secret no more: say so at start (still serving)."""
    if ctx.get_parameter_source("admin_token") == ParameterSource.COMMANDLINE:
        logger.warning(
            "--admin-token is visible to every user in ps: use --admin-token-file or LIGHTHOUSE_ADMIN_TOKEN"
        )
    secrets = {
        "--tls-key": tls.key if tls is not None else None,
        "--store-key": store.key,
        "--tokens": ctx.params.get("tokens_path"),
        "--admin-token-file": ctx.params.get("admin_token_file"),
    }
    for flag, path in secrets.items():
        if path is None:
            continue
        with contextlib.suppress(OSError):
            mode = os.stat(path).st_mode
            if mode & 0o077:
                logger.warning(
                    "%s %s can be read by other users (mode %o): chmod 600 it", flag, path, mode & 0o777
                )


def _leases(lease_min_steps: int, lease_extra_steps: int, lease_ceiling_ahead: float | None) -> LeasePolicy:
    return LeasePolicy(
        min_steps=lease_min_steps, extra_steps=lease_extra_steps, ceiling_ahead=lease_ceiling_ahead
    )


source_options = _grouped(
    "sources",
    _sources,
    click.option(
        "--config-dir",
        type=click.Path(file_okay=False, exists=True, path_type=Path),
        default=None,
        help="Folder of DIR/<job>.json files, one per job; watched: a new file creates its job.",
    ),
    click.option(
        "--schema",
        "schema_path",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="JSON Schema (draft 2020-12) every config change must satisfy; watched for edits while running.",
    ),
    click.option(
        "--strict", is_flag=True, help="Exit with code 2 when the config file is missing or invalid."
    ),
)

store_options = _grouped(
    "store",
    _store,
    click.option(
        "--state-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Where every version is stored durably [default: $XDG_STATE_HOME/lighthouse-config].",
    ),
    click.option(
        "--store",
        "store_url",
        default=None,
        metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
        help="Keep the versions in etcd instead of --state-dir, so several lighthouses serve the same "
        "jobs (etcds:// = TLS; default prefix /lighthouse-config).",
    ),
    click.option("--store-ca", default=None, help="CA bundle that signed etcd's certificates (etcds://)."),
    click.option("--store-cert", default=None, help="Client certificate for etcd (mutual TLS)."),
    click.option("--store-key", default=None, help="Key of --store-cert."),
    click.option(
        "--history-limit",
        type=click.IntRange(min=1),
        default=None,
        help="Keep at most N versions (oldest pruned, never the live one). Default: keep all.",
    ),
)

http_options = _grouped(
    "http",
    _http,
    click.option(
        "--admin-token",
        envvar="LIGHTHOUSE_ADMIN_TOKEN",
        default=None,
        help="Bearer token required for changes; prefer env LIGHTHOUSE_ADMIN_TOKEN or --admin-token-file "
        "(a flag is visible in ps). Unset: anyone can edit.",
    ),
    click.option(
        "--admin-token-file",
        type=click.Path(dir_okay=False, exists=True, path_type=Path),
        default=None,
        help="File holding the admin token (one line; chmod 600).",
    ),
    click.option(
        "--tokens",
        "tokens_path",
        type=click.Path(dir_okay=False, exists=True, path_type=Path),
        default=None,
        help='JSON file {"job": ["token", ...]}: editor tokens that change only their job.',
    ),
    click.option(
        "--allowed-host",
        "allowed_hosts",
        multiple=True,
        help="A DNS name (besides IPs, localhost, this host's names and --http-bind's) under which the "
        "dashboard answers, and takes changes without a token. Repeatable.",
    ),
    click.option(
        "--http-request-timeout",
        type=click.FloatRange(min=0.1),
        default=HttpOptions.request_seconds,
        show_default=True,
        help="Seconds a whole HTTP request (headers and body) may take to arrive; then it is cut off.",
    ),
    click.option(
        "--http-max-connections",
        type=click.IntRange(min=1),
        default=HttpOptions.max_connections,
        show_default=True,
        help="HTTP connections served at once (a thread each); more get 503.",
    ),
    click.option(
        "--http-tls",
        type=click.Choice(["on", "off"]),
        default="on",
        show_default=True,
        help="'off' keeps the dashboard on plain HTTP under --tls-cert (for a port only a local proxy "
        "reaches).",
    ),
)

lease_options = _grouped(
    "lease_policy",
    _leases,
    click.option(
        "--lease-min-steps",
        type=click.IntRange(min=1),
        default=LeasePolicy.min_steps,
        show_default=True,
        help="Step leases: the shortest lease, in steps (before the job's step rate is known).",
    ),
    click.option(
        "--lease-extra-steps",
        type=click.IntRange(min=0),
        default=LeasePolicy.extra_steps,
        show_default=True,
        help="Step leases: steps added to the rate x TTL a lease lasts (slack for the renewal).",
    ),
    click.option(
        "--lease-ceiling-ahead",
        type=click.FloatRange(min=0.0),
        default=None,
        help="Step leases: seconds of steps the stored promise ceiling runs ahead (fewer store writes; a "
        "change made through another lighthouse, or after a restart, waits up to this long). "
        "Default: 10 with --state-dir, 1 with --store.",
    ),
)


@click.command()
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
    "--lighthouse_config",  # the seed's spelling
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON object file with the initial config of the job 'default'; watched for edits while running.",
)
@source_options
@store_options
@http_options
@server_tls_options
@lease_options
@click.option(
    "--keepalive-interval",
    type=click.FloatRange(min=0.0, min_open=True),
    default=KEEPALIVE,
    show_default=True,
    help="Seconds between keep-alives on a quiet push stream; a manager ends one silent for two.",
)
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning or error.")
def serve(
    bind: str,
    http_bind: str,
    config_path: Path | None,
    sources: ConfigSources,
    store: StoreOptions,
    http: HttpOptions,
    tls: ServerTLS | None,
    lease_policy: LeasePolicy,
    keepalive_interval: float,
    log_level: str,
) -> None:
    """Serve the config. Prints the gRPC address (line 1) and dashboard URL (line 2)."""
    configure_logging(log_level)
    _warn_about_secrets(click.get_current_context(), tls, store)
    tune_for_many_streams()
    termination = Termination()
    state_dir = None if store.url is not None else store.state_dir or default_state_dir()
    try:
        backend = None
        if store.url is not None:
            backend = open_etcd_store(store.url, ca=store.ca, cert=store.cert, key=store.key)
        server = LighthouseServer(
            bind,
            config_path,
            state_dir=state_dir,
            http_bind=None if http_bind.lower() == "off" else http_bind,
            tls=tls,
            backend=backend,
            sources=sources,
            http=http,
            lease_policy=lease_policy,
            history_limit=store.history_limit,
            keepalive_interval=keepalive_interval,
        )
    except ConfigError as exc:
        _fail(exc, 2)
    except (OSError, ValueError, StoreUnavailable) as exc:
        _fail(exc, 1)
    if http.admin_token is None and http_bind.lower() != "off":
        logger.warning(
            "no --admin-token set: anyone who can reach %s can change the config", server.dashboard_url()
        )
    url = server.dashboard_url()
    announce(server.address(), *([url] if url else []))
    logger.info("state in %s", store.url or state_dir)
    name = termination.wait()
    logger.info("%s received, shutting down", name)
    server.shutdown()
