"""The lighthouse's ``lighthouse.store`` gRPC health, asked with grpc's own health stub (what
``grpc_health_probe -service lighthouse.store`` does) of a real ``lighthouse serve``: on a real etcd
it turns NOT_SERVING while the lighthouse's link to etcd is cut (a silent partition) or etcd is
stopped, and SERVING again once healed, and likewise while etcd's NOSPACE alarm is raised (when an
edit gets 507), while the lighthouse as a whole stays SERVING and serves its config throughout; on
SQLite it is SERVING."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lighthouse.client import LighthouseClient
from lighthouse.etcd.client import EtcdClient
from protos.etcd import rpc_pb2, rpc_pb2_grpc
from protos.rpc import LIGHTHOUSE_SERVICE, LIGHTHOUSE_STORE_HEALTH, make_channel
from tests.chaos.proxy import Proxy
from tests.etcd_cluster import EtcdCluster
from tests.http_util import change, get_json, wait_healthy
from tests.procs import ProcessPool, poll
from tests.threads import CheckedThread

Status = health_pb2.HealthCheckResponse
CONFIG = {"lr": 0.25}
# The store is looked at each second, a look at etcd taking at most half a second: a change is told
# within about 1.5 s. The bound (what the polls assert) leaves a loaded machine a wide margin.
TOLD_WITHIN = 10.0


def check(address: str, service: str = "") -> str:
    with make_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return str(Status.ServingStatus.Name(reply.status))


def watch(address: str, service: str, seen: list[str], channel: grpc.Channel) -> None:
    """Every status the server sends under ``service`` into ``seen``, until ``channel`` closes."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))
    try:
        for reply in stream:
            seen.append(str(Status.ServingStatus.Name(reply.status)))
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:  # CANCELLED: the test closed the channel
            raise


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["link cut", "etcd stopped"])
def test_the_store_health_follows_etcd_while_the_lighthouse_keeps_serving(
    procs: ProcessPool, tmp_path: Path, fault: str
) -> None:
    """The lighthouse's link to etcd cut without a FIN, or its etcd (one member) killed and started
    again on its data: the same health either way."""
    etcd = EtcdCluster(tmp_path / "etcd", size=1).start()
    link = Proxy(etcd.endpoints.split(",")[0])
    member = etcd.members[0]
    begin, end = (
        (link.cut, link.heal)
        if fault == "link cut"
        else (
            lambda: etcd.kill(member),
            lambda: etcd.start_member(member),
        )
    )
    channels: list[grpc.Channel] = []
    threads: list[CheckedThread] = []
    try:
        lh = procs.lighthouse(CONFIG, store=f"etcd://{link.address}/test-lh/{uuid.uuid4().hex}")
        wait_healthy(lh.url)
        poll(
            lambda: check(lh.address, LIGHTHOUSE_STORE_HEALTH) == "SERVING", TOLD_WITHIN, what="store SERVING"
        )
        assert check(lh.address) == check(lh.address, LIGHTHOUSE_SERVICE) == "SERVING"
        # Every status the whole and the store send from now on.
        whole: list[str] = []
        store: list[str] = []
        for service, seen in (("", whole), (LIGHTHOUSE_STORE_HEALTH, store)):
            channels.append(make_channel(lh.address))
            threads.append(CheckedThread(watch, lh.address, service, seen, channels[-1]))
            threads[-1].start()
        poll(lambda: whole == ["SERVING"] and store == ["SERVING"], 10, what="both watches' first status")

        begin()
        poll(lambda: store[-1] == "NOT_SERVING", TOLD_WITHIN, what="the store NOT_SERVING")
        # The lighthouse itself: still SERVING, and still serving its config from memory.
        assert check(lh.address) == check(lh.address, LIGHTHOUSE_SERVICE) == "SERVING"
        client = LighthouseClient(lh.address)
        try:
            assert dict(client.get_config(timeout=timedelta(seconds=5))) == {"lr": "0.25"}
        finally:
            client.close()
        assert get_json(lh.url, "/api/config")["config"] == {"lr": 0.25}
        assert LIGHTHOUSE_STORE_HEALTH + " NOT_SERVING" in lh.stderr()  # said why, once

        end()
        poll(lambda: store[-1] == "SERVING", TOLD_WITHIN, what="the store SERVING again")
        assert check(lh.address, LIGHTHOUSE_STORE_HEALTH) == "SERVING"
        assert whole == ["SERVING"], whole  # never NOT_SERVING while the store was cut off
        assert store == ["SERVING", "NOT_SERVING", "SERVING"], store
    finally:
        for channel in channels:
            channel.close()
        link.close()
        etcd.stop()
    for thread in threads:
        thread.check(10)


def set_alarm(cluster: EtcdCluster, action: int) -> None:
    """Raise or clear etcd's NOSPACE alarm on its member, as etcd does itself past
    ``--quota-backend-bytes``: while it is raised etcd refuses every write."""
    with EtcdClient(cluster.endpoints, timeout=5) as client:
        member = int(client.status(0).header.member_id)
    with make_channel(cluster.endpoints.split(",")[0]) as channel:
        request = rpc_pb2.AlarmRequest(action=action, memberID=member, alarm=rpc_pb2.NOSPACE)
        rpc_pb2_grpc.MaintenanceStub(channel).Alarm(request, timeout=5)


@pytest.mark.slow
def test_the_store_health_follows_etcds_nospace_alarm(procs: ProcessPool, etcd1: EtcdCluster) -> None:
    lh = procs.lighthouse(store=f"etcd://{etcd1.endpoints}/test-lh/{uuid.uuid4().hex}")
    wait_healthy(lh.url)
    assert change(lh.url, "PUT", CONFIG).status == 200
    poll(lambda: check(lh.address, LIGHTHOUSE_STORE_HEALTH) == "SERVING", TOLD_WITHIN, what="store SERVING")
    set_alarm(etcd1, rpc_pb2.AlarmRequest.ACTIVATE)
    try:
        poll(
            lambda: check(lh.address, LIGHTHOUSE_STORE_HEALTH) == "NOT_SERVING",
            TOLD_WITHIN,
            what="the store NOT_SERVING",
        )
        assert change(lh.url, "PATCH", {"lr": 0.5}).status == 507  # it was right: etcd takes no write
        assert check(lh.address) == check(lh.address, LIGHTHOUSE_SERVICE) == "SERVING"
        assert get_json(lh.url, "/api/config")["config"] == {"lr": 0.25}
    finally:
        set_alarm(etcd1, rpc_pb2.AlarmRequest.DEACTIVATE)  # etcd1 serves the session's other tests
    poll(
        lambda: check(lh.address, LIGHTHOUSE_STORE_HEALTH) == "SERVING",
        TOLD_WITHIN,
        what="store SERVING again",
    )
    assert change(lh.url, "PATCH", {"lr": 0.5}).status == 200


def test_a_lighthouse_on_sqlite_reports_its_store_serving(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG)
    poll(lambda: check(lh.address, LIGHTHOUSE_STORE_HEALTH) == "SERVING", TOLD_WITHIN, what="store SERVING")
    assert check(lh.address) == "SERVING"
