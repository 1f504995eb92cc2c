"""Standard probes on our gRPC servers: ``grpc.health.v1.Health`` and server reflection.

The health service lets Kubernetes gRPC probes, ``grpc_health_probe`` and load
balancers ask whether a server can do its job; reflection lets ``grpcurl`` list
and call the services without our ``.proto`` files. Both come from grpc's own
packages (``grpcio-health-checking``, ``grpcio-reflection``). Every server wires
them here, in one place, so that a server moving to ``grpc.aio`` swaps in the
packages' aio servicers here alone.

Each server reports its status under ``""`` (the server as a whole, what
``grpc_health_probe`` asks by default) and under its service's full name.
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Probes:
    """The health status and reflection of one gRPC server serving ``services``.

    Starts NOT_SERVING: the server says when it can serve (``set_serving``).
    """

    def __init__(self, *services: str) -> None:
        self.services = services
        # Watch answers without holding a server thread: the servers' pools stay for real calls.
        self._health = health.HealthServicer(experimental_non_blocking=True)
        self._lock = threading.Lock()
        self._serving: bool | None = None
        self.set_serving(False)

    def register(self, server: grpc.Server) -> None:
        """Add both services to ``server`` (before it starts)."""
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)

    @property
    def serving(self) -> bool:
        return bool(self._serving)

    def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING; watchers hear of changes only (as the protocol says)."""
        with self._lock:
            if serving == self._serving:
                return
            self._serving = serving
            for name in ("", *self.services):
                self._health.set(name, SERVING if serving else NOT_SERVING)

    def shutdown(self) -> None:
        """NOT_SERVING for good, told at once to every watcher: the server is about to stop."""
        with self._lock:
            self._serving = False
            self._health.enter_graceful_shutdown()
