"""The floor of any forward written in Python: a minimal grpcio server passing torchft's raw
request bytes to ``TARGET`` and its raw reply back, nothing else (no metadata, no view, no checks).

What ``lighthouse serve --torchft``'s forward is compared with in ``benchmarks.torchft_forward``:
the time a Python hop costs by itself. The synchronous grpcio stack on both sides (a thread pool
server, a blocking client call), which measured faster than ``grpc.aio`` for one unary hop here.

Run as a child: ``python -m benchmarks.passthrough TARGET`` prints its address, serves until SIGTERM.
"""

from __future__ import annotations

import sys

import grpc

from protos.torchft_seed import SEED_SERVICE


def main() -> None:
    from protos.daemon import Termination, announce
    from protos.rpc import start_server

    termination = Termination()
    channel = grpc.insecure_channel(sys.argv[1])
    calls = {name: channel.unary_unary(f"/{SEED_SERVICE}/{name}") for name in ("Heartbeat", "Quorum")}

    def forward(name: str) -> grpc.RpcMethodHandler:
        call = calls[name]
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: call(request, timeout=context.time_remaining())
        )

    handler = grpc.method_handlers_generic_handler(SEED_SERVICE, {name: forward(name) for name in calls})
    server, port = start_server("127.0.0.1:0", [handler], max_workers=8)
    announce(f"127.0.0.1:{port}")
    termination.wait()
    server.stop(0.5).wait()
    channel.close()


if __name__ == "__main__":
    main()
