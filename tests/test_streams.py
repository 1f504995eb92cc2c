"""protos.streams.StreamThread (the stop of the etcd watch and of the manager's push stream) against
a real gRPC server whose stream never answers: only a cancel ends a read."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from protos.rpc import format_address, make_channel, start_server
from protos.streams import StreamThread


class SilentStream:
    """A server-streaming method that sends nothing and ends only when the client cancels."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        handler = grpc.method_handlers_generic_handler(
            "test.Silent", {"Read": grpc.unary_stream_rpc_method_handler(self._read)}
        )
        self._server, port = start_server("127.0.0.1:0", [handler], max_workers=4)
        self.channel = make_channel(format_address("127.0.0.1", port))
        self.read = self.channel.unary_stream("/test.Silent/Read")

    def _read(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        ended = threading.Event()
        context.add_callback(ended.set)
        self.opened.set()
        ended.wait(60)
        yield from ()

    def close(self) -> None:
        self.channel.close()
        self._server.stop(0).wait()


@pytest.fixture
def silent() -> Iterator[SilentStream]:
    server = SilentStream()
    yield server
    server.close()


def read_one(stream: StreamThread, silent: SilentStream, codes: list[grpc.StatusCode]) -> None:
    call = silent.read(b"")
    stream.reading(call)
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        codes.append(exc.code())


def test_stop_cancels_the_stream_being_read(silent: SilentStream) -> None:
    codes: list[grpc.StatusCode] = []
    finished = threading.Event()

    def run() -> None:
        while not stream.stopped.is_set():
            read_one(stream, silent, codes)
        finished.set()

    stream = StreamThread(run, "test-stream")
    stream.start()
    assert silent.opened.wait(10)
    stream.stop()
    assert finished.is_set(), "stop() returned (its join timed out) with the thread still reading"
    assert codes == [grpc.StatusCode.CANCELLED]


def test_a_stream_opened_after_stop_looked_is_cancelled_at_once(silent: SilentStream) -> None:
    """stop() found no call to cancel (the thread had not opened it yet): ``reading`` cancels it."""
    codes: list[grpc.StatusCode] = []
    finished = threading.Event()

    def run() -> None:
        stream.stopped.wait(30)
        read_one(stream, silent, codes)
        finished.set()

    stream = StreamThread(run, "test-stream")
    stream.start()
    stream.stop()
    assert finished.wait(10), "the stream opened after stop() was never cancelled"
    assert codes == [grpc.StatusCode.CANCELLED]
