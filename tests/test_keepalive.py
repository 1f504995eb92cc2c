"""Keepalive: a black-holed peer is noticed in seconds, our servers permit our clients' pings (no
GOAWAY too_many_pings on an idle connection), and an etcd watch that goes silent moves to another
member."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.types import Event
from lighthouse.etcd.watch import WATCH_PROGRESS_INTERVAL, WATCH_SILENCE_TIMEOUT
from protos.etcd import rpc_pb2
from protos.rpc import (
    CHANNEL_OPTIONS,
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    SERVER_OPTIONS,
    format_address,
    grpc_target,
    make_channel,
    start_server,
)
from tests.etcd_cluster import EtcdCluster
from tests.procs import ProcessPool, poll

NOTICED_WITHIN = (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000  # 15 s
# The idle channel pings more often than our clients do, just above the interval our servers
# permit: a server that permits these permits our clients' (gRPC strikes only pings that come
# sooner than it allows), and five of them take 30 s, not 50.
PERMITTED_MS = dict(SERVER_OPTIONS)["grpc.http2.min_ping_interval_without_data_ms"]
QUIET_PING_MS = int(PERMITTED_MS) + 1_000


def pinging_channel(address: str, every_ms: int) -> grpc.Channel:
    """Our clients' channel, pinging every ``every_ms`` instead of every KEEPALIVE_TIME_MS."""
    options = [(k, v) for k, v in CHANNEL_OPTIONS if k != "grpc.keepalive_time_ms"]
    return grpc.insecure_channel(
        grpc_target(address), options=[*options, ("grpc.keepalive_time_ms", every_ms)]
    )


class Connectivity:
    """Every connectivity state a channel went through, with when."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.states: list[tuple[float, grpc.ChannelConnectivity]] = []
        self._lock = threading.Lock()
        channel.subscribe(self._add, try_to_connect=True)

    def _add(self, state: grpc.ChannelConnectivity) -> None:
        with self._lock:
            self.states.append((time.monotonic(), state))

    def since(self, t: float) -> list[grpc.ChannelConnectivity]:
        with self._lock:
            return [s for at, s in self.states if at >= t]

    def ready(self) -> bool:
        with self._lock:
            return bool(self.states) and self.states[-1][1] == grpc.ChannelConnectivity.READY

    def close(self) -> None:
        self.channel.unsubscribe(self._add)
        self.channel.close()


@pytest.mark.slow
def test_a_black_holed_server_is_noticed_and_a_quiet_connection_is_kept(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    manager = procs.manager(lh.address, "g0")
    assert KEEPALIVE_TIME_MS >= QUIET_PING_MS  # what the quiet channel shows holds for our clients
    quiet = Connectivity(pinging_channel(lh.address, QUIET_PING_MS))  # idle for the whole test: pings only
    frozen = Connectivity(make_channel(manager.address))
    try:
        poll(lambda: quiet.ready() and frozen.ready(), 20, what="both channels ready")
        quiet_since = time.monotonic()

        manager.signal(signal.SIGSTOP)  # the host froze: the connection looks open, nothing answers
        stopped = time.monotonic()
        poll(lambda: frozen.since(stopped), NOTICED_WITHIN + 10, interval=0.1, what="the frozen one noticed")
        noticed = frozen.since(stopped)[0]
        assert noticed != grpc.ChannelConnectivity.READY
        assert time.monotonic() - stopped < NOTICED_WITHIN + 10  # keepalive time + timeout, plus a margin
        manager.signal(signal.SIGCONT)

        # Four pings and more: a server that did not permit them would have sent GOAWAY (too_many_pings)
        # (at the fourth ping, here), and the idle channel would have left READY.
        deadline = quiet_since + 5 * QUIET_PING_MS / 1000
        while time.monotonic() < deadline:
            assert quiet.since(quiet_since) == [], quiet.states
            time.sleep(0.5)
    finally:
        quiet.close()
        frozen.close()


class SilentWatchMember:
    """etcd's Watch service on a real gRPC server that creates a watch and then says nothing: a
    member whose connection is alive (gRPC answers its pings) but whose watch went quiet."""

    def __init__(self) -> None:
        self.creates: list[rpc_pb2.WatchCreateRequest] = []
        self.progress_requests = 0
        handler = grpc.method_handlers_generic_handler(
            "etcdserverpb.Watch",
            {
                "Watch": grpc.stream_stream_rpc_method_handler(
                    self._watch,
                    request_deserializer=rpc_pb2.WatchRequest.FromString,
                    response_serializer=rpc_pb2.WatchResponse.SerializeToString,
                )
            },
        )
        self._server, port = start_server("127.0.0.1:0", [handler], max_workers=4)
        self.address = format_address("127.0.0.1", port)

    def _watch(
        self, requests: Iterator[rpc_pb2.WatchRequest], context: grpc.ServicerContext
    ) -> Iterator[rpc_pb2.WatchResponse]:
        self.creates.append(next(requests).create_request)
        yield rpc_pb2.WatchResponse(watch_id=1, created=True)
        for request in requests:  # read, and never answer, what the client sends
            if request.HasField("progress_request"):
                self.progress_requests += 1

    def close(self) -> None:
        self._server.stop(0).wait()


@pytest.fixture
def silent_member() -> Iterator[SilentWatchMember]:
    member = SilentWatchMember()
    try:
        yield member
    finally:
        member.close()


@pytest.mark.slow
def test_a_silent_watch_moves_to_another_member(etcd1: EtcdCluster, silent_member: SilentWatchMember) -> None:
    silent = silent_member
    prefix = f"/keepalive/{time.monotonic_ns()}/"
    events: list[Event] = []
    with EtcdClient(f"{silent.address},{etcd1.endpoints}") as watcher, EtcdClient(etcd1.endpoints) as writer:
        start = writer.get(prefix).revision + 1
        watch = watcher.watch(prefix, start_revision=start, on_events=events.extend, on_compacted=lambda: 0)
        try:
            poll(lambda: silent.creates, 10, what="the watch created on the silent member")
            assert silent.creates[0].progress_notify  # it asks etcd for progress notifications
            put_at = time.monotonic()
            writer.put(prefix + "a", "1")
            bound = WATCH_SILENCE_TIMEOUT + 2 * WATCH_PROGRESS_INTERVAL + 10  # plus a margin
            poll(lambda: events, bound, interval=0.05, what="the event, through the other member")
            assert time.monotonic() - put_at < bound
            assert [(e.type, e.kv.key) for e in events] == [("put", (prefix + "a").encode())]
            assert silent.progress_requests >= 2  # it asked the silent member before giving up on it
        finally:
            watch.stop()
