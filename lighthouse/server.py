"""``LighthouseServer``: serves every job's config over gRPC (and the dashboard over HTTP)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import grpc

from lighthouse.config.files import ConfigDirWatcher, FileContent, FileWatcher, read_schema_file
from lighthouse.jobs.guards import GuardWatch
from lighthouse.jobs.leases import LeasePolicy
from lighthouse.jobs.registry import JobRegistry
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import ConfigStore
from lighthouse.options import ConfigSources, HttpOptions
from lighthouse.peers.managers import PeerManagers
from lighthouse.peers.series import PeerSeries
from lighthouse.service import KEEPALIVE, LighthouseService, seed_handler
from lighthouse.store.backend import SharedBackend, StoreBackend
from lighthouse.store.sqlite import STORE_FILE, SqliteBackend
from protos import lighthouse_config_pb2 as pb
from protos.aio_server import AioServer
from protos.probes import Probes
from protos.rpc import DEFAULT_LIGHTHOUSE_PORT, LIGHTHOUSE_SERVICE, dialable_address
from protos.tls import ServerCertificates, ServerTLS

logger = logging.getLogger(__name__)


class LighthouseServer:
    """Starts serving on construction; ``address()`` is what clients dial.

    ``state_dir=None`` keeps the versions in memory only (lost on exit); the CLI
    always passes a directory; ``backend`` replaces it (etcd). ``http_bind=None``
    serves no dashboard. ``config_path`` is the file of the job ``default``.
    ``tls`` serves gRPC over TLS (mutual with ``client_ca``) and the dashboard
    over HTTPS with the same pair. The rest comes in groups: ``sources`` (schema,
    per-job files), ``http`` (tokens, hosts), ``lease_policy`` (the step leases
    granted to managers, see ``lighthouse.jobs.leases``).
    ``keepalive_interval``: seconds between keep-alives on a quiet push stream (a manager ends one
    silent for two of them); tests shorten it.

    torchft's seed signature works too: ``LighthouseServer(bind, min_replicas,
    join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms, failure_tick_ms,
    lighthouse_config=PATH)``: an int second argument is ``min_replicas``,
    ``lighthouse_config`` is ``config_path``; the quorum arguments are logged and
    ignored (this lighthouse runs no quorum of its own).
    """

    def __init__(
        self,
        bind: str = f"[::]:{DEFAULT_LIGHTHOUSE_PORT}",
        config_path: str | Path | int | None = None,
        join_timeout_ms: int | None = None,
        quorum_tick_ms: int | None = None,
        heartbeat_timeout_ms: int | None = None,
        failure_tick_ms: int | None = None,
        lighthouse_config: str | Path | None = None,
        *,
        min_replicas: int | None = None,
        state_dir: str | Path | None = None,
        http_bind: str | None = None,
        tls: ServerTLS | None = None,
        backend: StoreBackend | None = None,
        sources: ConfigSources | None = None,
        http: HttpOptions | None = None,
        lease_policy: LeasePolicy | None = None,
        history_limit: int | None = None,
        max_workers: int = 16,
        keepalive_interval: float = KEEPALIVE,
    ) -> None:
        if isinstance(config_path, int):  # the seed's positional min_replicas
            config_path, min_replicas = None, config_path
        if lighthouse_config is not None:
            if config_path is not None:
                raise TypeError("give config_path or lighthouse_config, not both")
            config_path = lighthouse_config
        _ignore_quorum_arguments(
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            failure_tick_ms=failure_tick_ms,
        )
        sources = sources or ConfigSources()
        http = http or HttpOptions()
        path = Path(config_path) if config_path is not None else None
        schema_file = Path(sources.schema_path) if sources.schema_path is not None else None
        store_path = Path(state_dir) / STORE_FILE if state_dir is not None else None
        self._watchers: list[FileWatcher | ConfigDirWatcher] = []
        self._http = None
        self._server: AioServer | None = None
        self._peers: PeerManagers | None = None
        self._peer_series: PeerSeries | None = None
        self._guards: GuardWatch | None = None
        # SERVING from the end of start-up (every job loaded, the dashboard up) until shutdown starts.
        self._probes = Probes(LIGHTHOUSE_SERVICE)
        self.jobs = JobRegistry(
            backend if backend is not None else SqliteBackend(store_path),
            history_limit=history_limit,
            default_config_path=path,
            default_schema_path=schema_file,
            strict=sources.strict,
            lease_policy=lease_policy,
        )
        # the gRPC handlers and the push streams
        self.service = LighthouseService(self.jobs, keepalive_interval)
        try:
            certificates = ServerCertificates(tls) if tls is not None else None
            if sources.config_dir is not None:
                folder = ConfigDirWatcher(
                    Path(sources.config_dir),
                    self.jobs.apply_file,
                    self.jobs.apply_schema_file,
                    interval=sources.watch_interval,
                )
                folder.scan(startup=True)
                self._watchers.append(folder)
            handler = grpc.method_handlers_generic_handler(
                LIGHTHOUSE_SERVICE,
                {
                    # Requests arrive as bytes: the service parses them (junk gets INVALID_ARGUMENT).
                    "GetConfig": grpc.unary_unary_rpc_method_handler(self.service.get_config),
                    "Heartbeat": grpc.unary_unary_rpc_method_handler(
                        self.service.heartbeat,
                        response_serializer=pb.LighthouseHeartbeatResponse.SerializeToString,
                    ),
                    "WatchConfig": grpc.stream_stream_rpc_method_handler(self.service.watch),
                },
            )
            credentials = certificates.grpc_credentials() if certificates is not None else None
            # An event loop, not a thread per stream: one push stream per replica group.
            self._server = AioServer(
                bind,
                [handler, seed_handler(self.service)],
                max_workers=max_workers,
                credentials=credentials,
                probes=self._probes,
            )
            self._address = dialable_address(bind, self._server.port)
            self._start_peers()
            if http_bind is not None:
                from lighthouse.web.server import DashboardServer

                self._http = DashboardServer(
                    self.jobs,
                    http_bind,
                    admin_token=http.admin_token,
                    allowed_hosts=http.allowed_hosts,
                    job_tokens=http.job_tokens,
                    tls=certificates if http.https else None,
                    request_seconds=http.request_seconds,
                    max_connections=http.max_connections,
                )
            if path is not None:
                self._watchers.append(
                    FileWatcher(path, self._apply_default_file, interval=sources.watch_interval)
                )
            if schema_file is not None:
                self._watchers.append(
                    FileWatcher(
                        schema_file,
                        self._apply_default_schema,
                        interval=sources.watch_interval,
                        read=read_schema_file,
                    )
                )
            for watcher in self._watchers:
                watcher.start()
            self._guards = GuardWatch(lambda: [state.guards for state in self.jobs.states()])
            self._guards.start()
        except BaseException:
            self.shutdown()
            raise
        self._probes.set_serving(True)
        logger.info(
            "lighthouse serving %d job(s) on %s%s",
            len(self.jobs.names()),
            self._address,
            "" if tls is None else " (mutual TLS)" if tls.client_ca is not None else " (TLS)",
        )

    def _start_peers(self) -> None:
        """On a store shared by several lighthouses (etcd), share the managers table and the reported
        metrics with the others."""
        backend = self.jobs.backend
        if isinstance(backend, SharedBackend):
            instance = uuid.uuid4().hex
            self._peers = PeerManagers(backend.client, backend.prefix, instance, self._address, self.jobs)
            self._peers.start()
            self._peer_series = PeerSeries(backend.client, backend.prefix, instance, self.jobs)
            self._peer_series.start()

    @property
    def state(self) -> LighthouseState:
        """The job ``default``'s state (single-job use)."""
        return self.jobs.default

    @property
    def store(self) -> ConfigStore:
        """The job ``default``'s store (single-job use)."""
        return self.jobs.default.store

    def _apply_default_file(self, content: FileContent) -> None:
        self.jobs.default.apply_file(content)

    def _apply_default_schema(self, content: FileContent) -> None:
        self.jobs.default.schema.apply_file(content)

    def address(self) -> str:
        """``host:port`` a client can dial."""
        return self._address

    def dashboard_url(self) -> str | None:
        return self._http.url if self._http is not None else None

    def shutdown(self, grace: float | None = 1.0) -> None:
        """Stop serving and close the store; safe to call twice."""
        self._probes.shutdown()  # health watchers hear NOT_SERVING before the port closes
        while self._watchers:
            self._watchers.pop().stop()
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        if self._server is not None:
            self._server.stop(grace)
            self._server = None
        if self._guards is not None:
            self._guards.stop()
            self._guards = None
        if self._peer_series is not None:
            self._peer_series.stop()
            self._peer_series = None
        if self._peers is not None:
            self._peers.stop()
            self._peers = None
        self.jobs.close()

    def __enter__(self) -> LighthouseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _ignore_quorum_arguments(**given: int | None) -> None:
    """torchft's quorum arguments (the seed's signature) mean nothing to a config-only lighthouse."""
    named = {name: value for name, value in given.items() if value is not None}
    if named:
        logger.info(
            "ignoring torchft's quorum arguments %s: this lighthouse serves the config only",
            ", ".join(f"{name}={value}" for name, value in named.items()),
        )
