"""``LighthouseServer``: serves the config over gRPC (and the dashboard over HTTP) from one state."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import grpc

from lighthouse.config_file import FileWatcher
from lighthouse.state import LighthouseState
from lighthouse.store import ConfigStore
from protos import lighthouse_config_pb2 as pb
from protos.rpc import DEFAULT_LIGHTHOUSE_PORT, dialable_address, start_server
from protos.tls import ServerCertificates, ServerTLS

logger = logging.getLogger(__name__)

STORE_FILE = "lighthouse.db"


class LighthouseServer:
    """Starts serving on construction; ``address()`` is what clients dial.

    ``state_dir=None`` keeps the versions in memory only (lost on exit); the CLI
    always passes a directory. ``http_bind=None`` serves no dashboard.
    ``tls`` serves gRPC over TLS (mutual with ``client_ca``) and the dashboard
    over HTTPS with the same pair, unless ``http_tls=False``.
    """

    def __init__(
        self,
        bind: str = f"[::]:{DEFAULT_LIGHTHOUSE_PORT}",
        config_path: str | Path | None = None,
        *,
        state_dir: str | Path | None = None,
        http_bind: str | None = None,
        admin_token: str | None = None,
        allowed_hosts: Iterable[str] = (),
        strict: bool = False,
        history_limit: int | None = None,
        watch_interval: float = 1.0,
        max_workers: int = 16,
        tls: ServerTLS | None = None,
        http_tls: bool = True,
    ) -> None:
        path = Path(config_path) if config_path is not None else None
        store_path = Path(state_dir) / STORE_FILE if state_dir is not None else None
        self.store = ConfigStore(store_path, history_limit=history_limit)
        self._watcher: FileWatcher | None = None
        self._http = None
        self._server: grpc.Server | None = None
        try:
            certificates = ServerCertificates(tls) if tls is not None else None
            self.state = LighthouseState(self.store, path, strict=strict)
            handler = grpc.method_handlers_generic_handler(
                "lighthouse_config.LighthouseService",
                {
                    "GetConfig": grpc.unary_unary_rpc_method_handler(
                        self._get_config, request_deserializer=pb.LighthouseConfigRequest.FromString
                    ),
                    "Heartbeat": grpc.unary_unary_rpc_method_handler(
                        self._heartbeat,
                        request_deserializer=pb.LighthouseHeartbeatRequest.FromString,
                        response_serializer=pb.LighthouseHeartbeatResponse.SerializeToString,
                    ),
                },
            )
            credentials = certificates.grpc_credentials() if certificates is not None else None
            self._server, port = start_server(bind, [handler], max_workers, credentials)
            self._address = dialable_address(bind, port)
            if http_bind is not None:
                from lighthouse.http_api import DashboardServer

                self._http = DashboardServer(
                    self.state,
                    http_bind,
                    admin_token=admin_token,
                    allowed_hosts=allowed_hosts,
                    tls=certificates if http_tls else None,
                )
            if path is not None:
                self._watcher = FileWatcher(path, self.state.apply_file, interval=watch_interval)
                self._watcher.start()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "lighthouse serving version %d on %s%s",
            self.store.head,
            self._address,
            "" if tls is None else " (mutual TLS)" if tls.client_ca is not None else " (TLS)",
        )

    def address(self) -> str:
        """``host:port`` a client can dial."""
        return self._address

    def dashboard_url(self) -> str | None:
        return self._http.url if self._http is not None else None

    def _get_config(self, request: pb.LighthouseConfigRequest, context: grpc.ServicerContext) -> bytes:
        # Returns the reply already serialized: no per-call protobuf work on the hot path.
        return self.state.get_config_reply(request, context.peer())

    def _heartbeat(
        self, request: pb.LighthouseHeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.LighthouseHeartbeatResponse:
        self.state.count_heartbeat()
        self.state.observe(request.status, context.peer())
        return pb.LighthouseHeartbeatResponse(version=self.store.head, instance_id=self.state.instance_id)

    def shutdown(self, grace: float | None = 1.0) -> None:
        """Stop serving and close the store; safe to call twice."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        self.store.close()

    def __enter__(self) -> LighthouseServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
