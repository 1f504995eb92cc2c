"""The etcd store backend on a real etcd: what the shared store suite (test_store.py) cannot show
with one store: two lighthouses' stores on one prefix, retried transactions, big rows, the shared
job step, the watch, and the ``--store`` URL."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from lighthouse.config.values import MAX_CONFIG_BYTES
from lighthouse.jobs.registry import JobRegistry
from lighthouse.jobs.versions import ConfigStore, VersionConflict
from lighthouse.store.backend import Change, HeadMoved, SharedBackend, StoreUnavailable
from lighthouse.store.etcd import DEFAULT_PREFIX, EtcdBackend, open_etcd_store, parse_store_url
from lighthouse.store.sqlite import SqliteBackend
from protos.etcd import rpc_pb2, rpc_pb2_grpc
from tests.etcd_cluster import EtcdCluster, free_port
from tests.procs import poll
from tests.threads import CheckedThread


@pytest.fixture
def prefix() -> str:
    return f"/test-etcd-store/{uuid.uuid4().hex}"


@pytest.fixture
def backends(etcd1: EtcdCluster, prefix: str) -> Iterator[list[EtcdBackend]]:
    """Two backends on one prefix: what two lighthouses on one etcd hold."""
    pair = [EtcdBackend(etcd1.endpoints, prefix=prefix) for _ in range(2)]
    try:
        yield pair
    finally:
        for b in pair:
            b.close()


def row(version: int, config: dict[str, object]) -> Change:
    return Change(version, "put", config, config, None, -1, time.time(), "test", "-", "")


def test_parse_store_url() -> None:
    url = parse_store_url("etcd://a:1,b:2/team/x/")
    assert (url.endpoints, url.prefix, url.tls) == (["a:1", "b:2"], "/team/x", False)
    assert parse_store_url("etcds://[::1]:2379").prefix == DEFAULT_PREFIX
    assert parse_store_url("etcds://[::1]:2379").tls
    assert parse_store_url("etcd://h:1/").prefix == DEFAULT_PREFIX
    for bad, says in [
        ("h:1", "expected etcd://"),
        ("http://h:1", "expected etcd://"),
        ("etcd:///p", "no etcd endpoint"),
        ("etcd://h/p", "not HOST:PORT"),
        ("etcd://h:x", "not HOST:PORT"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_store_url(bad)
    with pytest.raises(ValueError, match="etcds://"):
        open_etcd_store("etcd://h:1", ca="ca.pem")


def test_unreachable_etcd_is_store_unavailable_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no quorum"):
        EtcdBackend(f"127.0.0.1:{free_port()}", timeout=1.0)
    assert time.monotonic() - started < 5


def test_append_compares_the_head_and_recognises_its_own_retry(backends: list[EtcdBackend]) -> None:
    a, b = backends
    first = row(1, {"k": 1})
    a.append("j", [first], {"last_version": "1"}, expected_head=0)
    with pytest.raises(HeadMoved):
        b.append("j", [row(1, {"k": "other"})], {}, expected_head=0)
    # The same transaction again (what etcd_client does after a timeout that hid a success):
    # the head moved, but the row there is this one, so it counts as committed.
    a.append("j", [first], {"last_version": "1"}, expected_head=0)
    b.append("j", [row(2, {"k": 2})], {}, expected_head=1)
    with pytest.raises(HeadMoved):
        a.append("j", [row(2, {"k": "late"})], {}, expected_head=1)
    assert [r.config for r in b.load("j").rows] == [{"k": 1}, {"k": 2}]
    assert a.jobs() == b.jobs() == ["j"]
    a.delete_job("j")
    assert b.jobs() == [] and b.load("j").rows == []
    assert a.is_empty()


def test_only_the_etcd_backend_is_a_shared_backend(backends: list[EtcdBackend]) -> None:
    """The registry subscribes to a SharedBackend, the server shares managers over one: no other."""
    plain = SqliteBackend(None)
    try:
        assert [isinstance(b, SharedBackend) for b in (backends[0], plain)] == [True, False]
    finally:
        plain.close()


def test_is_empty(etcd1: EtcdCluster, prefix: str) -> None:
    backend = EtcdBackend(etcd1.endpoints, prefix=prefix)
    try:
        assert backend.is_empty()
        ConfigStore(job="j", backend=backend).commit("put", {"a": 1}, source="t")
        assert not backend.is_empty()
        assert EtcdBackend(etcd1.endpoints, prefix=prefix + "-other").is_empty()
    finally:
        backend.close()


def test_stores_on_two_lighthouses_never_reuse_a_version(backends: list[EtcdBackend]) -> None:
    stores = [ConfigStore(job="j", backend=b) for b in backends]
    versions: list[int] = []
    lock = threading.Lock()

    def edit(store: ConfigStore, n: int) -> None:
        for i in range(n):
            v = store.commit("patch", {f"k{id(store)}": i}, source="t").version
            with lock:
                versions.append(v)

    threads = [CheckedThread(edit, s, 15) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.check()
    assert sorted(versions) == list(range(1, 31))
    fresh = ConfigStore(job="j", backend=backends[0])
    assert [h["version"] for h in fresh.history()] == list(range(30, 0, -1))
    # Each commit resolved on top of the other lighthouse's latest: nothing was lost.
    assert fresh.live() == {f"k{id(s)}": 14 for s in stores}


def test_if_match_conflicts_across_lighthouses(backends: list[EtcdBackend]) -> None:
    a, b = (ConfigStore(job="j", backend=x) for x in backends)
    a.commit("put", {"v": 1}, source="t")
    b.reload()
    a.commit("put", {"v": 2}, source="t", if_match=1)
    with pytest.raises(VersionConflict) as err:  # b still believes 1 is the head
        b.commit("put", {"v": 3}, source="t", if_match=1)
    assert err.value.head == 2
    assert b.live() == {"v": 2}  # and it learnt the new head


def test_a_config_of_the_full_size_limit_fits(etcd1: EtcdCluster, prefix: str) -> None:
    """1 MiB of config plus a 1 MiB change is more than etcd takes in one request: the row is
    stored without its config, which the store recomputes on load."""
    backend = EtcdBackend(etcd1.endpoints, prefix=prefix)
    try:
        big = {"blob": "x" * (MAX_CONFIG_BYTES - 20)}
        assert len(json.dumps(big)) <= MAX_CONFIG_BYTES
        store = ConfigStore(job="j", backend=backend)
        store.commit("put", {"small": 1}, source="t")
        store.commit("put", big, source="t")
        store.commit("patch", {"blob": "y"}, source="t")
        records = backend.load("j")
        assert records.unresolved == {2}
        reopened = ConfigStore(job="j", backend=backend)
        assert reopened.get(2).config == big
        assert reopened.get(3).config == {"blob": "y"}
        assert reopened.live() == {"blob": "y"}
    finally:
        backend.close()


def test_the_job_step_is_the_highest_any_lighthouse_stored(backends: list[EtcdBackend]) -> None:
    a, b = backends
    a.set_meta("j", {"current_step": "100"})
    b.set_meta("j", {"current_step": "40"})
    a.close()  # flushes its queue
    b.close()
    fresh = EtcdBackend(a.client.endpoints, prefix=a.prefix)
    try:
        assert fresh.load("j").meta["current_step"] == "100"
    finally:
        fresh.close()


def test_a_registry_serves_what_another_lighthouse_committed(backends: list[EtcdBackend]) -> None:
    a, b = backends
    here, there = JobRegistry(a), JobRegistry(b)
    try:
        there.default.change("put", {"lr": 1}, source="api")
        poll(lambda: here.default.snapshot.version == 1, 5, what="the edit on the other lighthouse")
        assert here.default.snapshot.config == {"lr": "1"}
        there.serve("newjob").change("put", {"x": 1}, source="api")
        poll(lambda: here.get("newjob") is not None and here.get("newjob").store.head == 1, 5, what="new job")  # type: ignore[union-attr]
        for step in (10, 11):  # steps close together: the last one is shared too
            there.default.store.advance_step(step)  # a manager of the other lighthouse reported it
        poll(lambda: here.default.store.current_step == 11, 5, what="the shared job step")
        assert here.default.view()["current_step"] == 11
    finally:
        here.close()
        there.close()


def test_a_watch_that_missed_compacted_revisions_reloads_every_job(
    etcd1: EtcdCluster, backends: list[EtcdBackend]
) -> None:
    late, writer = backends  # ``late`` read the store before the writes below
    store = ConfigStore(job="j", backend=writer)
    for i in range(3):
        store.commit("put", {"i": i}, source="t")
    revision = writer.client.get("/").revision
    with grpc.insecure_channel(etcd1.endpoints.split(",")[0]) as channel:
        rpc_pb2_grpc.KVStub(channel).Compact(rpc_pb2.CompactionRequest(revision=revision, physical=True))
    changed: list[tuple[str, int]] = []
    late.subscribe(lambda job, head: changed.append((job, head)), lambda job, step: None, lambda *_: None)
    poll(lambda: ("j", -1) in changed, 10, what="a reload of every job after the compaction")
