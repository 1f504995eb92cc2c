"""``LighthouseServer``: serves the config over gRPC (and the dashboard over HTTP) from one state."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import grpc

from lighthouse.config_file import FileWatcher, read_schema_file
from lighthouse.state import LighthouseState
from lighthouse.store import ConfigStore
from protos import lighthouse_config_pb2 as pb
from protos.rpc import DEFAULT_LIGHTHOUSE_PORT, dialable_address, start_server

logger = logging.getLogger(__name__)

STORE_FILE = "lighthouse.db"


class LighthouseServer:
    """Starts serving on construction; ``address()`` is what clients dial.

    ``state_dir=None`` keeps the versions in memory only (lost on exit); the CLI
    always passes a directory. ``http_bind=None`` serves no dashboard.
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
        schema_path: str | Path | None = None,
    ) -> None:
        path = Path(config_path) if config_path is not None else None
        schema_file = Path(schema_path) if schema_path is not None else None
        store_path = Path(state_dir) / STORE_FILE if state_dir is not None else None
        self.store = ConfigStore(store_path, history_limit=history_limit)
        self._watchers: list[FileWatcher] = []
        self._http = None
        self._server: grpc.Server | None = None
        try:
            self.state = LighthouseState(self.store, path, strict=strict, schema_path=schema_file)
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
            self._server, port = start_server(bind, [handler], max_workers=max_workers)
            self._address = dialable_address(bind, port)
            if http_bind is not None:
                from lighthouse.http_api import DashboardServer

                self._http = DashboardServer(
                    self.state, http_bind, admin_token=admin_token, allowed_hosts=allowed_hosts
                )
            if path is not None:
                self._watchers.append(FileWatcher(path, self.state.apply_file, interval=watch_interval))
            if schema_file is not None:
                self._watchers.append(
                    FileWatcher(
                        schema_file,
                        self.state.schema.apply_file,
                        interval=watch_interval,
                        read=read_schema_file,
                    )
                )
            for watcher in self._watchers:
                watcher.start()
        except BaseException:
            self.shutdown()
            raise
        logger.info("lighthouse serving version %d on %s", self.store.head, self._address)

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
        while self._watchers:
            self._watchers.pop().stop()
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
