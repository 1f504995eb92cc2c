"""The etcd client against a real etcd cluster (Debian's etcd-server): reads, writes, the
compare-and-append transaction, watches, leases, and what happens when members die."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.errors import EtcdError, EtcdUnavailable
from lighthouse.etcd.types import Compare, Delete, Event, Get, KeyValue, Put, prefix_end
from protos.etcd import rpc_pb2, rpc_pb2_grpc
from protos.tls import TLSConfig
from tests.chaos.proxy import Proxy
from tests.etcd_cluster import PORT_TAKEN, EtcdCluster, Member, free_port, make_certs, require_etcd
from tests.procs import poll


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One 3-member cluster for the tests that kill nothing (each uses its own key prefix)."""
    require_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), size=3) as cluster:
        yield cluster


@pytest.fixture
def client(shared_cluster: EtcdCluster) -> Iterator[EtcdClient]:
    with EtcdClient(shared_cluster.endpoints, timeout=5.0) as c:
        yield c


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh 3-member cluster for a test that kills members."""
    require_etcd()
    with EtcdCluster(tmp_path, size=3) as c:
        yield c


class Collector:
    """Thread-safe sink for watch events."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[Event] = []
        self.reloads = 0

    def add(self, events: list[Event]) -> None:
        with self.lock:
            self.events.extend(events)

    def keys(self) -> list[tuple[str, bytes]]:
        with self.lock:
            return [(e.type, e.kv.key) for e in self.events]


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_put_get_range_delete(client: EtcdClient) -> None:
    first = client.put("/kv/a", "1")
    client.put("/kv/b", b"2")
    client.put("/kv/c/d", "3")
    client.put("/kw", "outside the prefix")
    second = client.put("/kv/a", "changed")
    assert second > first

    got = client.get("/kv/a")
    assert [(kv.key, kv.value, kv.version) for kv in got.kvs] == [(b"/kv/a", b"changed", 2)]
    assert got.revision >= second
    assert got.kvs[0].create_revision == first and got.kvs[0].mod_revision == second
    assert client.get("/kv/a", revision=first).kvs[0].value == b"1"  # an older revision
    assert client.get("/kv/missing").kvs == []

    keys = [kv.key for kv in client.get("/kv/", prefix=True).kvs]
    assert keys == [b"/kv/a", b"/kv/b", b"/kv/c/d"]  # sorted, "/kw" not included

    assert client.delete("/kv/b") == 1
    assert client.delete("/kv/b") == 0
    assert client.delete("/kv/", prefix=True) == 2
    assert client.get("/kv/", prefix=True).kvs == []
    assert client.get("/kw").kvs[0].value == b"outside the prefix"


def append(client: EtcdClient, head_rev: int, version: int, payload: str) -> tuple[bool, list[KeyValue]]:
    """The store's compare-and-append: if the head is unchanged, write the version and move the head."""
    result = client.txn(
        [Compare("/txn/head", "mod", "==", head_rev)],
        [Put(f"/txn/v/{version:08d}", payload), Put("/txn/head", str(version))],
        [Get("/txn/head")],
    )
    return result.succeeded, result.gets[0] if result.gets else []


def test_txn_compare_and_append_detects_the_conflict(shared_cluster: EtcdCluster) -> None:
    with (
        EtcdClient(shared_cluster.endpoints) as a,
        EtcdClient([m.endpoint for m in reversed(shared_cluster.members)]) as b,
    ):
        # Create-if-absent: a missing key has create revision 0.
        created = a.txn(
            [Compare("/txn/head", "create", "==", 0)], [Put("/txn/head", "0")], [Get("/txn/head")]
        )
        assert created.succeeded and created.gets == []
        again = b.txn([Compare("/txn/head", "create", "==", 0)], [Put("/txn/head", "0")], [Get("/txn/head")])
        assert not again.succeeded and again.gets[0][0].value == b"0"

        head_rev = a.get("/txn/head").kvs[0].mod_revision
        ok, _ = append(a, head_rev, 1, "from a")
        assert ok
        ok, head = append(b, head_rev, 1, "from b")  # b read the same head: it must lose
        assert not ok
        assert [kv.value for kv in head] == [b"1"]  # the head a won with
        assert [kv.value for kv in a.get("/txn/v/", prefix=True).kvs] == [b"from a"]

        new_head = a.get("/txn/head").kvs[0]
        ok, _ = append(b, new_head.mod_revision, 2, "from b")  # with the fresh head, b wins
        assert ok

        assert a.txn([Compare("/txn/head", "value", "==", "2")], [Delete("/txn/", prefix=True)]).succeeded
        assert not a.txn([Compare("/txn/head", "version", ">", 0)], [Put("/txn/x", "x")]).succeeded
        assert a.get("/txn/", prefix=True).kvs == []


def test_refusals_are_not_unavailability(client: EtcdClient) -> None:
    with pytest.raises(EtcdError) as err:
        client.lease_revoke(0x7EADBEEF)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(EtcdError):
        client.put("", "an empty key is not allowed")
    with pytest.raises(TypeError):
        client.txn([Compare("/x", "mod", "==", b"not an int")], [])


def test_unreachable_endpoints_fail_within_the_deadline() -> None:
    with EtcdClient(f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", timeout=1.0) as client:
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="no quorum or cannot be reached"):
            client.put("/k", "v")
        assert time.monotonic() - started < 5.0
    with pytest.raises(ValueError, match="no etcd endpoint"):
        EtcdClient(" , ")


def test_watch_delivers_changes_made_by_another_client(shared_cluster: EtcdCluster) -> None:
    with (
        EtcdClient(shared_cluster.endpoints) as watcher,
        EtcdClient([m.endpoint for m in reversed(shared_cluster.members)]) as writer,
    ):
        start = writer.get("/w1/").revision + 1
        seen = Collector()
        watch = watcher.watch("/w1/", start_revision=start, on_events=seen.add, on_compacted=lambda: 0)
        try:
            assert watch.created.wait(10)
            writer.put("/w1/a", "1")
            writer.put("/elsewhere", "not watched")
            writer.delete("/w1/a")
            expected = [("put", b"/w1/a"), ("delete", b"/w1/a")]
            poll(lambda: seen.keys() == expected, 10, what=f"watch events {expected}, got {seen.keys()}")
            revisions = [e.revision for e in seen.events]
            assert revisions == sorted(revisions) and watch.next_revision == revisions[-1] + 1
        finally:
            watch.stop()


def test_watch_from_an_old_revision_replays_and_compaction_asks_for_a_reload(
    client: EtcdClient, shared_cluster: EtcdCluster
) -> None:
    first = client.put("/w2/a", "1")
    client.put("/w2/b", "2")
    seen = Collector()
    replay = client.watch("/w2/", start_revision=first, on_events=seen.add, on_compacted=lambda: 0)
    try:
        poll(lambda: seen.keys() == [("put", b"/w2/a"), ("put", b"/w2/b")], 10, what="replayed events")
    finally:
        replay.stop()

    compacted_at = client.put("/w2/c", "3")
    with grpc.insecure_channel(shared_cluster.members[0].endpoint) as channel:
        rpc_pb2_grpc.KVStub(channel).Compact(rpc_pb2.CompactionRequest(revision=compacted_at), timeout=10)

    reloaded = Collector()

    def reload() -> int:
        # Counted once the state is read: the put below then lands above the revision the watch
        # resumes from. (Counted before, the put could land below it while ``created`` was still
        # set by the compacted stream, and the new stream would rightly never show it.)
        revision = client.get("/w2/", prefix=True).revision
        with reloaded.lock:
            reloaded.reloads += 1
        return revision

    watch = client.watch("/w2/", start_revision=first, on_events=reloaded.add, on_compacted=reload)
    try:
        poll(lambda: reloaded.reloads == 1 and watch.created.is_set(), 10, what="a reload, then a new stream")
        client.put("/w2/d", "4")
        poll(
            lambda: reloaded.keys() == [("put", b"/w2/d")], 10, what=f"events after reload {reloaded.keys()}"
        )
    finally:
        watch.stop()


@pytest.mark.slow
def test_lease_keepalive_keeps_keys_and_expiry_removes_them(client: EtcdClient) -> None:
    # A 2 s TTL renewed every ~0.7 s: a keepalive thread starved for over a second on two busy cores
    # still keeps it (with a 1 s TTL, one such stall lost the lease).
    ttl = 2
    lease = client.lease_grant(ttl)
    client.put("/lease/a", "1", lease=lease)
    assert client.get("/lease/a").kvs[0].lease == lease
    lost = threading.Event()
    keeper = client.keep_alive(lease, ttl=ttl, on_lost=lost.set)
    try:
        deadline = time.monotonic() + 2 * ttl  # two TTLs: the key lives only because of the keepalive
        while time.monotonic() < deadline:
            assert client.get("/lease/a").kvs, "the kept-alive key expired"
            time.sleep(0.2)
    finally:
        keeper.stop()
    poll(lambda: not client.get("/lease/a").kvs, 10, what="the key of an expired lease to go")
    assert client.lease_keepalive_once(lease) <= 0
    assert not lost.is_set()  # the keeper was stopped before etcd dropped the lease

    short = client.lease_grant(5)
    client.put("/lease/b", "1", lease=short)
    revoked = threading.Event()
    keeper = client.keep_alive(short, ttl=0.6, on_lost=revoked.set)
    try:
        client.lease_revoke(short)
        assert client.get("/lease/b").kvs == []
        assert revoked.wait(10), "the keepalive did not notice that its lease is gone"
    finally:
        keeper.stop()


@pytest.mark.slow
def test_watch_resumes_after_its_member_is_killed(cluster: EtcdCluster) -> None:
    watched = cluster.members[0]
    others = ",".join(m.endpoint for m in cluster.members[1:])
    with EtcdClient(cluster.endpoints) as watcher, EtcdClient(others) as writer:
        start = writer.put("/w3/before", "0")
        seen = Collector()
        watch = watcher.watch("/w3/", start_revision=start, on_events=seen.add, on_compacted=lambda: 0)
        try:
            poll(lambda: seen.keys() == [("put", b"/w3/before")], 10, what="the first event")
            cluster.kill(watched)  # the watch's stream is on the first endpoint
            for i in range(5):
                writer.put(f"/w3/after{i}", str(i), timeout=10)
            expected = [("put", b"/w3/before")] + [("put", f"/w3/after{i}".encode()) for i in range(5)]
            poll(lambda: seen.keys() == expected, 20, what=f"resumed events, got {seen.keys()}")
        finally:
            watch.stop()


@pytest.mark.slow
def test_writes_survive_the_loss_of_the_leader(cluster: EtcdCluster) -> None:
    with EtcdClient(cluster.endpoints, timeout=10.0) as client:
        client.put("/ha/0", "0")
        leader = cluster.leader()
        dead_id = member_id(cluster, leader)
        cluster.kill(leader)
        for i in range(1, 6):
            client.put(f"/ha/{i}", str(i))  # acknowledged after the election
        assert [kv.value for kv in client.get("/ha/", prefix=True).kvs] == [str(i).encode() for i in range(6)]
        # The survivors themselves say who leads now: someone, and not the member that was killed.
        with EtcdClient(",".join(m.endpoint for m in cluster.members if m is not leader)) as survivors:
            leaders = {survivors.status(i).leader for i in range(len(survivors.endpoints))}
        assert len(leaders) == 1 and 0 not in leaders and dead_id not in leaders, (leaders, dead_id)


def member_id(cluster: EtcdCluster, member: Member) -> int:
    """etcd's id of ``member``, as it reports it."""
    with EtcdClient(member.endpoint, tls=cluster.client_tls) as client:
        return int(client.status(0).header.member_id)


@pytest.mark.slow
def test_quorum_loss_fails_within_the_deadline_and_the_same_client_recovers(cluster: EtcdCluster) -> None:
    with EtcdClient(cluster.endpoints, timeout=2.0) as client:
        client.put("/q/a", "1")
        dead = cluster.members[:2]
        for m in dead:
            cluster.kill(m)
        for call in (lambda: client.put("/q/b", "2"), lambda: client.get("/q/a")):
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable, match="no quorum"):
                call()
            assert time.monotonic() - started < 2.0 + 3.0  # the deadline, plus a margin: no hang
        # The survivor still answers from its local copy when asked for a possibly stale read.
        assert client.get("/q/a", serializable=True).kvs[0].value == b"1"
        for m in dead:
            cluster.start_member(m, wait=False)
        cluster.wait_healthy()
        client.put("/q/b", "2", timeout=10)
        assert [kv.value for kv in client.get("/q/", prefix=True).kvs] == [b"1", b"2"]


@pytest.mark.slow  # two refused calls wait out their 3 s deadlines
def test_mutual_tls_on_a_single_member(tmp_path: Path) -> None:
    require_etcd()
    certs = make_certs(tmp_path / "certs")
    with EtcdCluster(tmp_path / "etcd", size=1, tls=certs) as cluster:
        with EtcdClient(cluster.endpoints, tls=certs.client) as client:
            client.put("/tls/a", "1")
            assert client.get("/tls/a").kvs[0].value == b"1"
        # Refused for a reason that is not "unreachable", and the error says which. The call waits
        # out its deadline (gRPC retries the connection) and reports the last handshake's failure:
        # 3 s leave a loaded machine room for one (at 1 s it failed once beside a second suite).
        for refused, reason in (
            (None, "does it require TLS"),
            (TLSConfig(ca=str(certs.ca)), "requires a client certificate"),
        ):
            with (
                EtcdClient(cluster.endpoints, timeout=3.0, tls=refused) as client,
                pytest.raises(EtcdUnavailable, match=reason),
            ):
                client.get("/tls/a")


def test_a_port_taken_before_etcd_binds_it_starts_the_cluster_again_on_fresh_ports(tmp_path: Path) -> None:
    """Another process takes a member's port between the pick and etcd's bind (another xdist
    process, another checkout's suite): the whole cluster starts again, every member on fresh ports."""
    require_etcd()
    cluster = EtcdCluster(tmp_path, size=2)
    picked = {port for m in cluster.members for port in (m.client_port, m.peer_port)}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", cluster.members[1].peer_port))
        holder.listen()
        with cluster:
            assert cluster.start_attempts >= 2  # 2, unless another process took a fresh port too
            assert picked.isdisjoint(port for m in cluster.members for port in (m.client_port, m.peer_port))
            with EtcdClient(cluster.endpoints, timeout=5.0) as client:
                client.put("/moved/a", "1")
                assert client.get("/moved/a").kvs[0].value == b"1"
    assert PORT_TAKEN in cluster.members[1].log_path.read_text()


def test_urgent_calls_leave_a_member_that_hangs_sooner(shared_cluster: EtcdCluster) -> None:
    """A member that stops answering on an open connection (stopped, or cut off without a FIN) holds
    a call for the client's whole attempt timeout (2 s) before it moves on; a step-lease ceiling,
    stored about a second before the leases need it, moves on after ``attempts_within``'s limit
    (found by the chaos suite: a stopped member made every group fall back for steps)."""
    first = shared_cluster.members[0].endpoint
    links = [Proxy(first), Proxy(first)]
    try:
        took = []
        for link, limit in zip(links, (None, 0.3), strict=True):
            endpoints = f"{link.address},{shared_cluster.endpoints}"
            with EtcdClient(endpoints, timeout=5.0) as client:
                client.put("/urgent/k", "v")  # connected through the link, which then goes silent
                link.cut()
                started = time.monotonic()
                with client.attempts_within(limit) if limit else contextlib.nullcontext():
                    client.put("/urgent/k", "w")
                took.append(time.monotonic() - started)
                assert client.get("/urgent/k").kvs[0].value == b"w"
        slow, fast = took
        assert slow >= 1.9, took  # the default attempt: what the limit is measured against
        assert fast < 1.5, took  # 0.3 s on the silent member, then a live one
    finally:
        for link in links:
            link.close()
