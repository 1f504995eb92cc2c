"""Standard probes on real lighthouse and manager processes: what grpc_health_probe asks (Check and
Watch of grpc.health.v1.Health) in the serving and not-serving states of both, and what grpcurl does
through server reflection (list the services, describe one, call it with messages built from the
reflected descriptors alone)."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lighthouse import LighthouseServer
from manager.server import ManagerServer
from manager.status_client import manager_info
from manager.upstream import FetchFailed
from protos.rpc import LIGHTHOUSE_SERVICE, MANAGER_SERVICE, make_channel
from tests.procs import ProcessPool, poll, worker_records
from worker_client import ManagerClient

Status = health_pb2.HealthCheckResponse
CONFIG = {"lr": 0.25}


def check(address: str, service: str = "") -> str:
    """What ``grpc_health_probe -addr ADDRESS [-service SERVICE]`` asks: the status's name."""
    with make_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return str(Status.ServingStatus.Name(reply.status))


class Watcher:
    """A Health.Watch stream: the statuses the server sends, one by one."""

    def __init__(self, address: str, service: str = "") -> None:
        self._channel = make_channel(address)
        request = health_pb2.HealthCheckRequest(service=service)
        self._stream: Iterator[Status] = health_pb2_grpc.HealthStub(self._channel).Watch(request, timeout=60)

    def next(self) -> str:
        return str(Status.ServingStatus.Name(next(self._stream).status))

    def rest(self) -> list[str]:
        """Every status until the stream ends (the server stopped)."""
        out = []
        try:
            while True:
                out.append(self.next())
        except (StopIteration, grpc.RpcError):
            return out

    def close(self) -> None:
        self._channel.close()


def test_lighthouse_serves_until_it_shuts_down(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG)
    assert check(lh.address) == "SERVING"
    assert check(lh.address, LIGHTHOUSE_SERVICE) == "SERVING"
    with pytest.raises(grpc.RpcError) as unknown:
        check(lh.address, "no.such.Service")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    watcher = Watcher(lh.address, LIGHTHOUSE_SERVICE)
    try:
        assert watcher.next() == "SERVING"
        lh.signal(signal.SIGTERM)
        assert watcher.next() == "NOT_SERVING"  # told before the port closes: a balancer drains it
    finally:
        watcher.close()
    assert lh.wait(timeout=20) == 0


def test_manager_is_not_serving_while_its_workers_get_the_fallback(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG)
    m = procs.manager(lh.address, "g0", cache_ttl=0.2, backoff=0.5)
    poll(lambda: check(m.address) == "SERVING", 20, what="the manager serving")
    assert check(m.address, MANAGER_SERVICE) == "SERVING"
    watcher = Watcher(m.address)
    try:
        assert watcher.next() == "SERVING"
        lh.signal(signal.SIGKILL)  # no lighthouse, and no --serve-stale: workers get the empty config
        assert watcher.next() == "NOT_SERVING"
        record = worker_records(procs.worker(m.address, group="g", rank=0, steps=1))[0]
        assert record["source"] == "fallback"
        assert check(m.address, MANAGER_SERVICE) == "NOT_SERVING"
        m.signal(signal.SIGTERM)
        assert set(watcher.rest()) <= {"NOT_SERVING"}  # never SERVING again, until the stream ends
    finally:
        watcher.close()
    assert m.wait(timeout=20) == 0


def test_manager_without_any_lighthouse_is_not_serving(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG)
    gone = lh.address
    lh.signal(signal.SIGKILL)
    lh.wait(timeout=10)
    m = procs.manager(gone, "g0", backoff=0.5)
    poll(lambda: "lighthouse unavailable" in m.stderr(), 20, what="the manager's first failed fetch")
    assert check(m.address) == check(m.address, MANAGER_SERVICE) == "NOT_SERVING"


def test_manager_with_serve_stale_keeps_serving_the_last_good_config(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG)
    m = procs.manager(lh.address, "g0", cache_ttl=0.2, backoff=0.5, extra=["--serve-stale"])
    poll(lambda: check(m.address) == "SERVING", 20, what="the manager serving")
    lh.signal(signal.SIGKILL)
    # The manager noticed: its own status says it serves the last good config (a line "lighthouse
    # unavailable" may be older than the kill: a first fetch that timed out on a loaded machine).
    poll(lambda: manager_info(m.address, 5.0).source == "stale", 20, what="the manager noticing")
    assert "lighthouse unavailable" in m.stderr()
    assert check(m.address) == "SERVING"  # its workers still get a lighthouse's config
    record = worker_records(procs.worker(m.address, group="g", rank=0, steps=1))[0]
    assert (record["source"], record["config"]) == ("stale", {"lr": "0.25"})


def test_a_fetch_begun_before_the_push_brought_a_config_fails_serving(tmp_path: Path) -> None:
    """The race behind a NOT_SERVING read after the lighthouse's death: the manager's first fetch
    (begun holding nothing) failed after the push stream had brought a config, and judged by what
    it began with. Replayed here in order, in-process: that fetch fails after the lighthouse is gone."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(CONFIG))
    lh = LighthouseServer("127.0.0.1:0", path)
    manager = ManagerServer(lh.address(), "127.0.0.1:0", "g0", backoff=600, serve_stale=True)
    try:
        poll(lambda: check(manager.address()) == "SERVING", 20, what="the manager serving")
        lh.shutdown()
        poll(lambda: manager.info().upstream_failures >= 1, 20, what="the manager's first failed fetch")
        with pytest.raises(FetchFailed):
            manager._fetch_and_report(None)  # the fetch begun before any config was held
        assert check(manager.address()) == "SERVING"
        assert dict(ManagerClient(manager.address()).get_config()) == {"lr": "0.25"}
    finally:
        manager.shutdown()
        lh.shutdown()


@pytest.mark.slow
def test_manager_shutdown_is_told_to_watchers(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG)
    m = procs.manager(lh.address, "g0")
    poll(lambda: check(m.address) == "SERVING", 20, what="the manager serving")
    watcher = Watcher(m.address, MANAGER_SERVICE)
    try:
        assert watcher.next() == "SERVING"
        m.signal(signal.SIGTERM)
        assert watcher.next() == "NOT_SERVING"
    finally:
        watcher.close()
    assert m.wait(timeout=20) == 0


# ------------------------------------------------------------------ reflection (what grpcurl does)


def reflect(channel: grpc.Channel, request: reflection_pb2.ServerReflectionRequest) -> Iterator[object]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    assert not reply.HasField("error_response"), reply.error_response
    return reply  # type: ignore[no-any-return]


def list_services(channel: grpc.Channel) -> set[str]:
    """``grpcurl ADDRESS list``."""
    reply = reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    return {s.name for s in reply.list_services_response.service}  # type: ignore[attr-defined]


def call_get_config(channel: grpc.Channel, service: str) -> dict[str, str]:
    """``grpcurl ADDRESS SERVICE/GetConfig``: the method and its messages from reflection only."""
    reply = reflect(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol=service))
    pool = descriptor_pool.DescriptorPool()  # not the default pool: nothing of our generated code
    for raw in reply.file_descriptor_response.file_descriptor_proto:  # type: ignore[attr-defined]
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    method = pool.FindServiceByName(service).methods_by_name["GetConfig"]
    request_type = message_factory.GetMessageClass(method.input_type)
    reply_type = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_unary(
        f"/{service}/{method.name}",
        request_serializer=request_type.SerializeToString,
        response_deserializer=reply_type.FromString,
    )
    answer = call(request_type(), timeout=10)
    return dict(answer.config_data)


@pytest.mark.slow
def test_reflection_lists_describes_and_calls_both_services(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG)
    m = procs.manager(lh.address, "g0")
    standard = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
    with make_channel(lh.address) as channel:
        assert list_services(channel) == {LIGHTHOUSE_SERVICE, *standard}
        assert call_get_config(channel, LIGHTHOUSE_SERVICE) == {"lr": "0.25"}
    with make_channel(m.address) as channel:
        assert list_services(channel) == {MANAGER_SERVICE, *standard}
        assert call_get_config(channel, MANAGER_SERVICE) == {"lr": "0.25"}
