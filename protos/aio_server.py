"""A ``grpc.aio`` server on an event loop of its own thread, for a server that holds many streams.

A synchronous grpcio server gives every open stream a thread of its pool: a
lighthouse with a push stream per replica group would need 10,000 threads for
10,000 groups. Here a stream is a coroutine on one event loop. Synchronous
handlers may still be given: grpc.aio runs them on ``max_workers`` threads.
The rest of the program stays synchronous: ``call`` runs a coroutine on the
loop from any thread and waits for its result.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent import futures
from typing import Any, TypeVar

import grpc

from protos.probes import Probes
from protos.rpc import SERVER_OPTIONS, add_port, check_bindable

T = TypeVar("T")


class AioServer:
    """Binds and starts on construction (OSError when ``bind`` cannot be listened on)."""

    def __init__(
        self,
        bind: str,
        handlers: list[grpc.GenericRpcHandler],
        *,
        max_workers: int,
        credentials: grpc.ServerCredentials | None = None,
        probes: Probes | None = None,
    ) -> None:
        check_bindable(bind)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._thread.start()
        self._pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
        self.server: grpc.aio.Server | None = None
        try:
            self.port = self.call(self._start(bind, handlers, credentials, probes))
        except BaseException:
            self._close_loop()
            raise

    async def _start(
        self,
        bind: str,
        handlers: list[grpc.GenericRpcHandler],
        credentials: grpc.ServerCredentials | None,
        probes: Probes | None,
    ) -> int:
        server = grpc.aio.server(migration_thread_pool=self._pool, handlers=handlers, options=SERVER_OPTIONS)
        if probes is not None:
            probes.register(server)
        port = add_port(server, bind, credentials)
        await server.start()
        self.server = server
        return port

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the server's loop and return its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(
        self, grace: float | None = 1.0, then: Callable[[], Coroutine[Any, Any, None]] | None = None
    ) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), run ``then`` on the loop (closing what
        the handlers used), and end the loop; safe to call twice."""
        server, self.server = self.server, None
        if server is not None:
            self.call(server.stop(grace))
            if then is not None:
                self.call(then())
        self._close_loop()

    def _close_loop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
