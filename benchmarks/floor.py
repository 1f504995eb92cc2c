"""The floor: a minimal Python grpcio server answering the same ``ManagerConfigResponse`` a manager does.

Nothing in this stack can be faster than a plain unary call to a Python grpcio
server, so every relay figure is reported as a ratio to it. It uses the
manager's own server settings (``protos.rpc.start_server``, 32 threads) and the
manager's method path, so a ``ManagerClient`` can call it too (the
"same client, minimal server" comparison).

Run as a child: ``python -m benchmarks.floor`` prints its address, serves until SIGTERM.
"""

from __future__ import annotations

import grpc

from protos import lighthouse_config_pb2 as pb
from protos.rpc import MANAGER_GET_CONFIG

FRESH_METHOD = "/bench.Floor/Fresh"
MANAGER_MAX_WORKERS = 32  # ManagerServer's default thread pool


def reply_message(config: dict[str, str]) -> pb.ManagerConfigResponse:
    return pb.ManagerConfigResponse(config_data=config, version=1, source="cache", pinned=False)


def _identity(data: bytes) -> bytes:
    return data


class FloorClient:
    """A plain grpcio stub: default channel, the generated message classes, nothing else."""

    def __init__(self, addr: str, method: str = MANAGER_GET_CONFIG) -> None:
        self._channel = grpc.insecure_channel(addr)
        self._call = self._channel.unary_unary(
            method,
            request_serializer=pb.ManagerConfigRequest.SerializeToString,
            response_deserializer=pb.ManagerConfigResponse.FromString,
        )
        self._request = pb.ManagerConfigRequest()

    def get(self) -> pb.ManagerConfigResponse:
        reply: pb.ManagerConfigResponse = self._call(self._request, timeout=5.0)
        return reply

    def close(self) -> None:
        self._channel.close()


def main() -> None:
    from benchmarks.stack import encoded_config
    from protos.daemon import Termination, announce
    from protos.rpc import start_server

    termination = Termination()
    config = encoded_config()
    serialized = reply_message(config).SerializeToString()

    def preserialized(request: pb.ManagerConfigRequest, context: grpc.ServicerContext) -> bytes:
        return serialized

    def fresh(request: pb.ManagerConfigRequest, context: grpc.ServicerContext) -> pb.ManagerConfigResponse:
        return reply_message(config)

    def handler(fn, serializer):  # type: ignore[no-untyped-def]
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=pb.ManagerConfigRequest.FromString, response_serializer=serializer
        )

    service, method = MANAGER_GET_CONFIG.rsplit("/", 1)
    fresh_service, fresh_name = FRESH_METHOD.rsplit("/", 1)
    handlers = [
        grpc.method_handlers_generic_handler(service.strip("/"), {method: handler(preserialized, _identity)}),
        grpc.method_handlers_generic_handler(
            fresh_service.strip("/"), {fresh_name: handler(fresh, pb.ManagerConfigResponse.SerializeToString)}
        ),
    ]
    server, port = start_server("127.0.0.1:0", handlers, max_workers=MANAGER_MAX_WORKERS)
    announce(f"127.0.0.1:{port}")
    termination.wait()
    server.stop(0.5).wait()


if __name__ == "__main__":
    main()
