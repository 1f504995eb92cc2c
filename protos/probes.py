"""Standard probes on our gRPC servers: ``grpc.health.v1.Health`` and server reflection.

The health service lets Kubernetes gRPC probes, ``grpc_health_probe`` and load
balancers ask whether a server can do its job; reflection lets ``grpcurl`` list
and call the services without our ``.proto`` files. Both come from grpc's own
packages (``grpcio-health-checking``, ``grpcio-reflection``). Every server wires
them here, in one place, so that a server moving to ``grpc.aio`` swaps in the
packages' aio servicers here alone.

Each server reports its status under ``""`` (the server as a whole, what
``grpc_health_probe`` asks by default) and under its service's full name. A server
may also report parts of itself under names of their own (``parts``), each set
apart from the whole: what alerts watch, not what decides whether it serves.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Probes:
    """The health status and reflection of one gRPC server serving ``services``.

    Starts NOT_SERVING: the server says when it can serve (``set_serving``), and how each of its
    ``parts`` is (``set_part_serving``; no service answers under a part's name, so reflection lists none).
    """

    def __init__(self, *services: str, parts: tuple[str, ...] = ()) -> None:
        self.services = services
        # Watch answers without holding a server thread: the servers' pools stay for real calls.
        self._health = health.HealthServicer(experimental_non_blocking=True)
        # On a grpc.aio server: the aio servicer and the loop it lives on (set by register).
        self._aio: tuple[health_aio.HealthServicer, asyncio.AbstractEventLoop] | None = None
        self._lock = threading.Lock()
        self._serving: bool | None = None
        self._parts: dict[str, bool] = dict.fromkeys(parts, False)
        self.set_serving(False)
        for name in parts:
            self._health.set(name, NOT_SERVING)

    def register(self, server: grpc.Server | grpc.aio.Server) -> None:
        """Add both services to ``server`` (before it starts; an aio server's from its loop)."""
        if isinstance(server, grpc.aio.Server):
            servicer = health_aio.HealthServicer()
            self._aio = (servicer, asyncio.get_running_loop())
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            self._set_all(SERVING if self._serving else NOT_SERVING)
            for name, serving in self._parts.items():
                self._set((name,), SERVING if serving else NOT_SERVING)
        else:
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)

    def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING; watchers hear of changes only (as the protocol says)."""
        with self._lock:
            if serving == self._serving:
                return
            self._serving = serving
            self._set_all(SERVING if serving else NOT_SERVING)

    def set_part_serving(self, part: str, serving: bool) -> None:
        """Report the part ``part`` (one of ``parts``) SERVING or NOT_SERVING; the whole is untouched."""
        with self._lock:
            if serving == self._parts[part]:
                return
            self._parts[part] = serving
            self._set((part,), SERVING if serving else NOT_SERVING)

    def _set_all(self, status: int) -> None:
        self._set(("", *self.services), status)

    def _set(self, names: tuple[str, ...], status: int) -> None:
        if self._aio is None:
            for name in names:
                self._health.set(name, status)
            return
        servicer, loop = self._aio

        async def set_names() -> None:
            for name in names:
                await servicer.set(name, status)

        self._on_loop(loop, set_names())

    def shutdown(self) -> None:
        """NOT_SERVING for good, told at once to every watcher: the server is about to stop."""
        with self._lock:
            self._serving = False
            if self._aio is None:
                self._health.enter_graceful_shutdown()
            else:
                servicer, loop = self._aio
                self._on_loop(loop, servicer.enter_graceful_shutdown())

    @staticmethod
    def _on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` on ``loop``: at once on the loop's own thread, else waiting (bounded) for it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(coro)
        elif not loop.is_closed():
            asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=5)
        else:
            coro.close()
