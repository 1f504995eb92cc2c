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
from lighthouse.etcd.connection import EtcdAuth
from lighthouse.jobs.guards import LAPSE_AFTER
from lighthouse.jobs.leases import LeasePolicy
from lighthouse.jobs.state import ManagerLimits
from lighthouse.jobs.versions import DEFAULT_HISTORY_LIMIT, DEFAULT_KEEP_STEPS
from lighthouse.rpc.manager_access import load_job_identities
from lighthouse.rpc.torchft_forward import TorchftMissing
from lighthouse.serve.options import ConfigSources, HttpOptions
from lighthouse.server import LighthouseServer
from lighthouse.service import KEEPALIVE
from lighthouse.store.backend import StoreUnavailable
from lighthouse.store.etcd import open_etcd_store
from lighthouse.store.etcd_options import ETCD_CONNECTION_OPTIONS, store_auth
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
    history_limit: int | None = DEFAULT_HISTORY_LIMIT
    """Versions kept per job, the oldest pruned first, never the live one (``--history-limit``)."""
    keep_steps: int | None = DEFAULT_KEEP_STEPS
    """Steps behind the job's step that resolve exactly (``--history-keep-steps``)."""
    auth: EtcdAuth | None = None
    """etcd user and password (``--store-user``; ``--store-password-file`` or the environment)."""


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
    store_user: str | None,
    store_password_file: str | None,
    history_limit: int,
    history_keep_steps: int,
) -> StoreOptions:
    if store_url is not None and state_dir is not None:
        raise click.UsageError(
            "--state-dir is for the embedded store; with --store the versions live in etcd"
        )
    try:
        auth = store_auth(store_user, store_password_file)
    except (ValueError, OSError) as exc:
        _fail(exc, 1)
    if auth is not None and store_url is None:
        raise click.UsageError("--store-user logs in to etcd: it needs --store")
    return StoreOptions(
        state_dir,
        store_url,
        store_ca,
        store_cert,
        store_key,
        history_limit or None,  # 0: keep every version
        history_keep_steps or None,
        auth,
    )


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
        "--manager-tokens-file": ctx.params.get("manager_tokens_path"),
        "--manager-identities-file": ctx.params.get("manager_identities_path"),
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


def _leases(
    lease_min_steps: int, lease_extra_steps: int, lease_ceiling_ahead: float | None, run_end_after: float
) -> LeasePolicy:
    return LeasePolicy(
        min_steps=lease_min_steps,
        extra_steps=lease_extra_steps,
        ceiling_ahead=lease_ceiling_ahead,
        run_end_after=run_end_after,
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
    *ETCD_CONNECTION_OPTIONS,
    click.option(
        "--history-limit",
        type=click.IntRange(min=0),
        default=DEFAULT_HISTORY_LIMIT,
        show_default=True,
        help="Keep about N versions per job: past N by a tenth, the oldest are pruned down to N "
        "(never the live one, nor one pending). 0 keeps every version.",
    ),
    click.option(
        "--history-keep-steps",
        type=click.IntRange(min=0),
        default=DEFAULT_KEEP_STEPS,
        show_default=True,
        help="Resolve every step down to N (at most 2N) steps behind the job's as scheduled; steps "
        "further behind get the config of that step (a resumed run starts afresh). 0: every step.",
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


def _credentials_file(flag: str, dest: str, help: str) -> Callable[[F], F]:
    """A file binding managers' credentials to jobs (``{"job": [...]}``)."""
    file = click.Path(dir_okay=False, exists=True, path_type=Path)
    return click.option(flag, dest, type=file, default=None, help=help)


def _manager_tokens(path: Path | None) -> dict[str, list[str]] | None:
    try:
        return load_job_tokens(path, "--manager-tokens-file") if path is not None else None
    except ValueError as exc:
        _fail(exc, 1)


def _manager_identities(path: Path | None, tls: ServerTLS | None) -> dict[str, list[str]] | None:
    if path is None:
        return None
    if tls is None or tls.client_ca is None:
        raise click.UsageError(
            "--manager-identities-file binds client certificates to jobs: it needs mutual TLS "
            "(--tls-cert, --tls-key, --tls-client-ca)"
        )
    try:
        return load_job_identities(path)
    except ValueError as exc:
        _fail(exc, 1)


def _manager_limits(max_managers: int, manager_record_ttl: float) -> ManagerLimits:
    return ManagerLimits(max_managers=max_managers, record_ttl=manager_record_ttl)


manager_options = _grouped(
    "manager_limits",
    _manager_limits,
    click.option(
        "--max-managers",
        type=click.IntRange(min=1),
        default=ManagerLimits.max_managers,
        show_default=True,
        help="Manager records kept per job; a new manager past it evicts the one unseen longest.",
    ),
    click.option(
        "--manager-record-ttl",
        type=click.FloatRange(min=0.0, min_open=True),
        default=ManagerLimits.record_ttl,
        show_default=True,
        help="Seconds a manager unseen (and without a push stream) stays in the managers table.",
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
        help="Step leases: the shortest lease, in steps (before the job's step rate is known). At the "
        "default, one asked on a push stream may be 1 step (push-speed leases); above it, every lease.",
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
        "Default: 10 with --state-dir, 2 with --store.",
    ),
    click.option(
        "--run-end-after",
        type=click.FloatRange(min=0.0),
        default=LeasePolicy.run_end_after,
        show_default=True,
        help="Runs: seconds without a step from any manager after which a job's run ends, at least "
        "(and at least 2 x its managers' TTL + 0.5 s): its leases end, changes apply at once.",
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
@manager_options
@_credentials_file(
    "--manager-tokens-file",
    "manager_tokens_path",
    'JSON file {"job": ["token", ...]}: managers must send a token of their job on gRPC '
    "(--tokens' editor tokens and the admin token count too). Without it (and the next) gRPC is open.",
)
@_credentials_file(
    "--manager-identities-file",
    "manager_identities_path",
    'Mutual TLS: JSON file {"job": ["CN=g0", "DNS:name", "URI:spiffe://...", "email:..."]}: a '
    "client certificate with one of these names reads and reports for those jobs only.",
)
@click.option(
    "--keepalive-interval",
    type=click.FloatRange(min=0.0, min_open=True),
    default=KEEPALIVE,
    show_default=True,
    help="Seconds between keep-alives on a quiet push stream; a manager ends one silent for two.",
)
@click.option(
    "--guard-lapse-seconds",
    type=click.FloatRange(min=0.0),
    default=LAPSE_AFTER,
    show_default=True,
    help="Seconds the job may stand past a guard's last step before a guard whose metric was not "
    "reported through it lapses (decided, not judged; the change stays).",
)
@click.option(
    "--torchft",
    is_flag=True,
    help="Also be torchft's lighthouse: start torchft's own (installed torchft) in this process and "
    "forward its RPCs (Quorum, Heartbeat) from --bind, so TORCHFT_LIGHTHOUSE names this one address.",
)
@click.option(
    "--min-replicas",
    type=click.IntRange(min=1),
    default=None,
    help="torchft: replica groups a quorum needs (required with --torchft, as by torchft_lighthouse).",
)
@click.option(
    "--join-timeout-ms",
    type=click.IntRange(min=0),
    default=None,
    help="torchft: ms to wait for heartbeating stragglers before a quorum [torchft's default: 60000].",
)
@click.option(
    "--quorum-tick-ms",
    type=click.IntRange(min=1),
    default=None,
    help="torchft: ms between quorum checks while waiting for stragglers [torchft's default: 100].",
)
@click.option(
    "--heartbeat-timeout-ms",
    type=click.IntRange(min=1),
    default=None,
    help="torchft: ms without a heartbeat before a replica group counts as dead [torchft's default: 5000].",
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
    manager_limits: ManagerLimits,
    manager_tokens_path: Path | None,
    manager_identities_path: Path | None,
    keepalive_interval: float,
    guard_lapse_seconds: float,
    torchft: bool,
    min_replicas: int | None,
    join_timeout_ms: int | None,
    quorum_tick_ms: int | None,
    heartbeat_timeout_ms: int | None,
    log_level: str,
) -> None:
    """Serve the config. Prints the gRPC address (line 1) and dashboard URL (line 2)."""
    configure_logging(log_level)
    if torchft and min_replicas is None:
        raise click.UsageError("--torchft needs --min-replicas N (torchft's lighthouse has no default)")
    quorum = (min_replicas, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms)
    if not torchft and any(value is not None for value in quorum):
        raise click.UsageError("--min-replicas and the other torchft options need --torchft")
    _warn_about_secrets(click.get_current_context(), tls, store)
    manager_identities = _manager_identities(manager_identities_path, tls)
    tune_for_many_streams()
    termination = Termination()
    state_dir = None if store.url is not None else store.state_dir or default_state_dir()
    try:
        backend = None
        if store.url is not None:
            backend = open_etcd_store(store.url, ca=store.ca, cert=store.cert, key=store.key, auth=store.auth)
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
            manager_limits=manager_limits,
            manager_tokens=_manager_tokens(manager_tokens_path),
            manager_identities=manager_identities,
            history_limit=store.history_limit,
            history_keep_steps=store.keep_steps,
            keepalive_interval=keepalive_interval,
            guard_lapse_seconds=guard_lapse_seconds,
            torchft=torchft,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except ConfigError as exc:
        _fail(exc, 2)
    except (OSError, ValueError, StoreUnavailable, TorchftMissing) as exc:
        _fail(exc, 1)
    if http.admin_token is None and http_bind.lower() != "off":
        logger.warning(
            "no --admin-token set: anyone who can reach %s can change the config", server.dashboard_url()
        )
    url = server.dashboard_url()
    announce(server.address(), *([url] if url else []))
    logger.info("state in %s", store.url or state_dir)
    if server.torchft_dashboard_url() is not None:
        logger.info(
            "torchft's lighthouse: quorum on %s (forwarded), its own page %s",
            server.address(),
            server.torchft_dashboard_url(),
        )
    name = termination.wait()
    logger.info("%s received, shutting down", name)
    server.shutdown()
