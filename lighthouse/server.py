"""``LighthouseServer``: serves every job's config over gRPC (and the dashboard over HTTP)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

import grpc

from lighthouse.config.files import ConfigDirWatcher, FileContent, FileWatcher, read_schema_file
from lighthouse.etcd.errors import EtcdError, EtcdUnavailable
from lighthouse.jobs.guards import LAPSE_AFTER, GuardWatch
from lighthouse.jobs.leases import LeasePolicy
from lighthouse.jobs.registry import JobRegistry
from lighthouse.jobs.state import LighthouseState, ManagerLimits
from lighthouse.jobs.versions import DEFAULT_HISTORY_LIMIT, DEFAULT_KEEP_STEPS, ConfigStore
from lighthouse.peers.features import FeatureRecords
from lighthouse.peers.managers import PeerManagers
from lighthouse.peers.series import PeerSeries
from lighthouse.rpc.manager_access import ManagerAccess
from lighthouse.rpc.torchft_forward import ForwardHandler, TorchftLighthouse, TorchftView
from lighthouse.serve.options import ConfigSources, HttpOptions
from lighthouse.service import KEEPALIVE, LighthouseService, seed_handler
from lighthouse.store.backend import SharedBackend, StoreBackend
from lighthouse.store.sqlite import STORE_FILE, SqliteBackend
from protos import lighthouse_config_pb2 as pb
from protos.aio_server import AioServer
from protos.job_ids import JobId
from protos.probes import Probes
from protos.rpc import DEFAULT_LIGHTHOUSE_PORT, LIGHTHOUSE_SERVICE, LIGHTHOUSE_STORE_HEALTH, dialable_address
from protos.tls import ServerCertificates, ServerTLS

logger = logging.getLogger(__name__)

HEALTH_CHECK = 1.0  # seconds between two looks at what the lighthouse can serve (gRPC health)


class LighthouseServer:
    """Starts serving on construction; ``address()`` is what clients dial.

    ``state_dir=None`` keeps the versions in memory only (lost on exit); the CLI
    always passes a directory; ``backend`` replaces it (etcd). ``http_bind=None``
    serves no dashboard. ``config_path`` is the file of the job ``default``.
    ``tls`` serves gRPC over TLS (mutual with ``client_ca``) and the dashboard
    over HTTPS with the same pair. The rest comes in groups: ``sources`` (schema,
    per-job files), ``http`` (tokens, hosts), ``lease_policy`` (the step leases
    granted to managers, see ``lighthouse.jobs.leases``).
    ``manager_tokens`` and ``manager_identities`` (``{"job": [...]}``; identities need mutual TLS)
    make managers authenticate per job (``lighthouse.rpc.manager_access``); without both gRPC is open.
    ``keepalive_interval``: seconds between keep-alives on a quiet push stream (a manager ends one
    silent for two of them); tests shorten it.

    torchft's seed signature works too: ``LighthouseServer(bind, min_replicas,
    join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms, failure_tick_ms,
    lighthouse_config=PATH)``: an int second argument is ``min_replicas``,
    ``lighthouse_config`` is ``config_path``. With ``torchft=True`` the quorum
    arguments start torchft's own lighthouse in this process, and its RPCs are
    served on ``address()`` too (``lighthouse.rpc.torchft_forward``); without, they are
    logged and ignored (this lighthouse runs no quorum of its own).
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
        torchft: bool = False,
        state_dir: str | Path | None = None,
        http_bind: str | None = None,
        tls: ServerTLS | None = None,
        backend: StoreBackend | None = None,
        sources: ConfigSources | None = None,
        http: HttpOptions | None = None,
        lease_policy: LeasePolicy | None = None,
        manager_limits: ManagerLimits | None = None,
        manager_tokens: dict[str, list[str]] | None = None,
        manager_identities: dict[str, list[str]] | None = None,
        history_limit: int | None = DEFAULT_HISTORY_LIMIT,
        history_keep_steps: int | None = DEFAULT_KEEP_STEPS,
        max_workers: int = 16,
        keepalive_interval: float = KEEPALIVE,
        guard_lapse_seconds: float = LAPSE_AFTER,
    ) -> None:
        if manager_identities is not None and (tls is None or tls.client_ca is None):
            raise ValueError(
                "manager identities (--manager-identities-file) need mutual TLS (--tls-client-ca): "
                "without it managers send no certificate"
            )
        if isinstance(config_path, int):  # the seed's positional min_replicas
            config_path, min_replicas = None, config_path
        if lighthouse_config is not None:
            if config_path is not None:
                raise TypeError("give config_path or lighthouse_config, not both")
            config_path = lighthouse_config
        self._torchft: TorchftLighthouse | None = None
        self._forward: ForwardHandler | None = None
        self._torchft_view: TorchftView | None = None
        if torchft:
            if min_replicas is None:
                raise TypeError("torchft=True needs min_replicas (torchft's lighthouse has no default)")
            _ignore_quorum_arguments(failure_tick_ms=failure_tick_ms)  # not in torchft 0.2.0
            torchft_options = (min_replicas, join_timeout_ms, quorum_tick_ms, heartbeat_timeout_ms)
        else:
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
        self._features: FeatureRecords | None = None
        self._peer_series: PeerSeries | None = None
        self._guards: GuardWatch | None = None
        self._health_stop = threading.Event()
        self._health_thread: threading.Thread | None = None
        self._store_thread: threading.Thread | None = None
        # SERVING from the end of start-up (every job loaded, the dashboard up) until shutdown starts;
        # the store's own name apart (``_watch_store``).
        self._probes = Probes(LIGHTHOUSE_SERVICE, parts=(LIGHTHOUSE_STORE_HEALTH,))
        self.jobs = JobRegistry(
            backend if backend is not None else SqliteBackend(store_path),
            history_limit=history_limit,
            keep_steps=history_keep_steps,
            default_config_path=path,
            default_schema_path=schema_file,
            strict=sources.strict,
            lease_policy=lease_policy,
            manager_limits=manager_limits,
        )
        # the gRPC handlers and the push streams
        access = ManagerAccess(manager_tokens, http.job_tokens, http.admin_token, manager_identities)
        self.service = LighthouseService(self.jobs, keepalive_interval, access)
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
            if torchft:
                self._torchft = TorchftLighthouse(*torchft_options)
                self._torchft_view = TorchftView(self._torchft.dashboard_url)
                self._forward = ForwardHandler(self._torchft.target, self._torchft_view)
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
                [handler, seed_handler(self.service), *([self._forward] if self._forward else [])],
                max_workers=max_workers,
                credentials=credentials,
                probes=self._probes,
            )
            self._address = dialable_address(bind, self._server.port)
            # Said once it is bound: a bad invocation gets its one error line and nothing else.
            if access.enforced:
                logger.info("gRPC: managers must present %s", access.describe)
            else:
                logger.warning(
                    "gRPC is open: anyone who can reach it reads and reports for every job "
                    "(managers authenticate with --manager-tokens-file or --manager-identities-file)"
                )
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
                    torchft=self._torchft_view.snapshot if self._torchft_view is not None else None,
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
            self._guards = GuardWatch(
                lambda: [state.guards for state in self.jobs.states()], lapse_after=guard_lapse_seconds
            )
            self._guards.start()
        except BaseException:
            self.shutdown()
            raise
        self._probes.set_serving(True)
        self._health_thread = threading.Thread(target=self._watch_health, name="health", daemon=True)
        self._health_thread.start()
        self._store_thread = threading.Thread(target=self._watch_store, name="store-health", daemon=True)
        self._store_thread.start()
        logger.info(
            "lighthouse serving %d job(s) on %s%s",
            len(self.jobs.names()),
            self._address,
            "" if tls is None else " (mutual TLS)" if tls.client_ca is not None else " (TLS)",
        )

    def _watch_health(self) -> None:
        """NOT_SERVING while a job's groups step past every promise the lighthouse can make (its
        step-lease ceiling cannot be stored): their workers get no config then."""
        stuck: dict[JobId, str] = {}
        while not self._health_stop.wait(HEALTH_CHECK):
            self.jobs.check_runs()
            now = self.jobs.unpromised()
            if now.keys() != stuck.keys():
                if now:
                    logger.error("NOT_SERVING: no step lease can be promised for %s", now)
                else:
                    logger.info("SERVING: step leases are promised again")
            stuck = now
            self._probes.set_serving(not stuck)

    def _watch_store(self) -> None:
        """``lighthouse.store``: NOT_SERVING while the store could not commit a write (the backend's
        ``write_problem``: etcd without quorum, unreachable or out of space, a full disk under
        SQLite). For alerts, not routing: a lighthouse without its store still serves every config
        it holds, so the whole stays SERVING unless ``_watch_health``'s rule says otherwise. A
        thread of its own: a look at a hung etcd (up to 0.5 s) never delays the runs' checks."""
        problem = self._look_at_store("")  # at once: the store's name starts NOT_SERVING
        pause = HEALTH_CHECK
        while not self._health_stop.wait(pause):
            began = time.monotonic()
            problem = self._look_at_store(problem)
            pause = max(0.0, HEALTH_CHECK - (time.monotonic() - began))

    def _look_at_store(self, before: str | None) -> str | None:
        """Whether the store can take a write now (the problem, None when it can), told to the
        ``lighthouse.store`` health and logged when it changed from ``before`` ("": none yet)."""
        try:
            problem = self.jobs.backend.write_problem()
        except Exception as exc:  # a look that went wrong says the store is not known writable
            logger.exception("the look at the store failed")
            problem = f"the look at the store failed: {exc}"
        if (problem is None) != (before is None):
            if problem is not None:
                logger.warning("%s NOT_SERVING: %s", LIGHTHOUSE_STORE_HEALTH, problem)
            elif before:
                logger.info("%s SERVING: the store takes writes again", LIGHTHOUSE_STORE_HEALTH)
        self._probes.set_part_serving(LIGHTHOUSE_STORE_HEALTH, problem is None)
        return problem

    def _start_peers(self) -> None:
        """On a store shared by several lighthouses (etcd), share the managers table and the reported
        metrics with the others."""
        backend = self.jobs.backend
        if isinstance(backend, SharedBackend):
            instance = uuid.uuid4().hex
            self._peers = PeerManagers(backend.client, backend.prefix, instance, self._address, self.jobs)
            self._features = FeatureRecords(
                backend.client,
                backend.prefix,
                instance,
                self._address,
                self.jobs.lease_gate,
                self._peers.instances,
            )
            self.jobs.peer_lighthouses = self._features.live_peers
            try:  # before the managers summary: the others must never take this one for an earlier release
                self._features.publish()
            except (EtcdError, EtcdUnavailable) as exc:
                logger.warning("feature record not written yet: %s", exc)
            self._peers.start()
            self._features.start()
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

    def torchft_dashboard_url(self) -> str | None:
        """torchft's own page, with ``torchft=True`` (on a localhost port)."""
        return self._torchft.dashboard_url if self._torchft is not None else None

    def shutdown(self, grace: float | None = 1.0) -> None:
        """Stop serving and close the store; safe to call twice."""
        self._health_stop.set()
        for thread in (self._health_thread, self._store_thread):
            if thread is not None:
                thread.join(timeout=5)
        self._health_thread = self._store_thread = None
        self._probes.shutdown()  # health watchers hear NOT_SERVING before the port closes
        while self._watchers:
            self._watchers.pop().stop()
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        if self._server is not None:
            self._server.stop(grace, then=self._forward.close if self._forward is not None else None)
            self._server = None
        if self._torchft is not None:
            self._torchft.shutdown()
            self._torchft = None
        if self._guards is not None:
            self._guards.stop()
            self._guards = None
        if self._peer_series is not None:
            self._peer_series.stop()
            self._peer_series = None
        if self._peers is not None:
            self._peers.stop()
            self._peers = None
        if self._features is not None:
            self._features.stop()
            self._features = None
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
