"""A lighthouse that hangs, for the failover and push tests: a real gRPC server on the
lighthouse's service whose handlers never answer, and the replica id that makes a manager start
on a given lighthouse of its list; ``get_config_server`` for stand-ins that answer GetConfig only."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from lighthouse.client import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from protos.rpc import LIGHTHOUSE_SERVICE, format_address, start_server


def get_config_server(
    get_config: Callable[[pb.LighthouseConfigRequest, grpc.ServicerContext], Any], workers: int = 4
) -> tuple[grpc.Server, str]:
    """A started gRPC server (in this process) on the lighthouse's service with GetConfig only,
    answered by ``get_config``; and its address."""
    handler = grpc.method_handlers_generic_handler(
        LIGHTHOUSE_SERVICE,
        {
            "GetConfig": grpc.unary_unary_rpc_method_handler(
                get_config,
                request_deserializer=pb.LighthouseConfigRequest.FromString,
                response_serializer=pb.LighthouseConfigResponse.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(workers), handlers=[handler])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, address


class _RecordingHandler(grpc.GenericRpcHandler):
    """Records each call as it arrives (before its request is read): a call the client cancels
    soon after, as a hedge does once the next lighthouse answered, is still counted as asked."""

    def __init__(self, inner: grpc.GenericRpcHandler, calls: list[str]) -> None:
        self._inner = inner
        self._calls = calls

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(details)
        if handler is not None:
            self._calls.append(details.method.rsplit("/", 1)[-1])
        return handler


class StuckLighthouse:
    """A real gRPC server on the lighthouse's service whose handlers never answer (until closed).

    Its connections complete the HTTP/2 handshake and answer pings (gRPC's core does both), so a
    client sees a healthy connection and calls that never end: a lighthouse that hangs.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._release = threading.Event()

        def stuck(name: str) -> grpc.RpcMethodHandler:
            def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
                self._release.wait()
                context.abort(grpc.StatusCode.UNAVAILABLE, "stuck lighthouse closed")
                raise AssertionError("abort raises")

            return grpc.unary_unary_rpc_method_handler(handler)

        service = grpc.method_handlers_generic_handler(
            "lighthouse_config.LighthouseService",
            {"GetConfig": stuck("GetConfig"), "Heartbeat": stuck("Heartbeat")},
        )
        self._server, port = start_server(
            "127.0.0.1:0", [_RecordingHandler(service, self.calls)], max_workers=16
        )
        self.address = format_address("127.0.0.1", port)

    def close(self) -> None:
        self._release.set()
        self._server.stop(0).wait()


def replica_starting_on(addresses: str, first: str) -> str:
    """A replica id whose manager starts on ``first`` (the id picks where a manager starts)."""
    for i in range(1000):
        with LighthouseClient(addresses, spread_key=f"group{i}") as client:
            if client.current == first:
                return f"group{i}"
    raise AssertionError(f"no replica id starts on {first}")
