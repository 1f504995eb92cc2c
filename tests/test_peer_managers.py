"""The managers table shared over etcd: every lighthouse on a prefix lists every manager of a job.

Two (or three) lighthouses' registries, each with its own in-memory store and a
real PeerManagers over one real etcd; managers report through
``LighthouseState.observe`` as the gRPC handlers do.
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.types import Event
from lighthouse.jobs.registry import JobRegistry
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import ConfigStore
from lighthouse.peers.managers import PeerManagers
from lighthouse.server import LighthouseServer
from lighthouse.store.backend import CeilingChanged, GuardsChanged, JobChanged, StepChanged
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb
from tests.etcd_cluster import EtcdCluster
from tests.http_util import call
from tests.procs import ProcessPool, poll
from tests.threads import CheckedThread

VISIBLE_WITHIN = 2.0  # the promise: a manager is listed by every lighthouse within 2 s
MARGIN = 4.0  # polls end as soon as the condition holds: the margin costs nothing unless cores are starved
_prefixes = itertools.count()


@pytest.fixture
def cluster(etcd1: EtcdCluster) -> EtcdCluster:
    """The session's 1-member etcd (tests/conftest.py); each test uses its own prefix."""
    return etcd1


@pytest.fixture
def client(cluster: EtcdCluster) -> Iterator[EtcdClient]:
    with EtcdClient(cluster.endpoints) as c:
        yield c


@pytest.fixture
def prefix() -> str:
    return f"/peers-test-{uuid.uuid4().hex[:8]}-{next(_prefixes)}"  # the etcd is shared by the session


class Lighthouse:
    """One lighthouse's registry and its PeerManagers (stopped by the fixture)."""

    def __init__(self, client: EtcdClient, prefix: str, name: str, **kw: Any) -> None:
        self.name = name
        self.registry = JobRegistry(SqliteBackend(None))
        self.peers = PeerManagers(client, prefix, f"id-{name}", name, self.registry, **kw)
        self.peers.start()

    def report(self, replica_id: str, job: str = "default", version: int = 1, requests: int = 0) -> None:
        status = pb.ManagerStatus(
            replica_id=replica_id, address=f"{replica_id}:1", version=version, requests=requests, job=job
        )
        self.registry.serve(job).observe(status, "peer")

    def managers(self, job: str = "default") -> dict[str, str]:
        """replica_id -> the lighthouse it talks to, as this lighthouse lists them."""
        state = self.registry.get(job)
        return {m["replica_id"]: m["lighthouse"] for m in state.managers()} if state else {}

    def close(self) -> None:
        self.peers.stop()
        self.registry.close()


@pytest.fixture
def lighthouses(client: EtcdClient, prefix: str) -> Iterator[list[Lighthouse]]:
    made: list[Lighthouse] = []
    try:
        for name in ("lh-a", "lh-b"):
            made.append(Lighthouse(client, prefix, name, ttl=3.0))
        yield made
    finally:
        for lh in made:
            lh.close()


def test_every_lighthouse_lists_every_manager_of_the_job(lighthouses: list[Lighthouse]) -> None:
    a, b = lighthouses
    a.report("g0")
    a.report("g1", job="llm")
    b.report("g2")
    expected = {"g0": "lh-a", "g2": "lh-b"}
    poll(lambda: a.managers() == expected, VISIBLE_WITHIN + MARGIN, what="lh-a lists lh-b's manager")
    poll(lambda: b.managers() == expected, VISIBLE_WITHIN + MARGIN, what="lh-b lists lh-a's manager")
    # A job whose managers all talk to the other lighthouse is held and counted here too.
    poll(lambda: b.managers("llm") == {"g1": "lh-a"}, VISIBLE_WITHIN + MARGIN, what="lh-b holds job llm")
    overview = {line["job"]: line for line in b.registry.overview()}
    assert overview["llm"]["managers"] == overview["llm"]["managers_live"] == 1
    assert overview["default"]["managers"] == 2
    row = next(m for m in b.registry.default.managers() if m["replica_id"] == "g0")
    assert row["address"] == "g0:1" and row["version"] == 1 and 0 <= row["last_seen_s"] < 5


def test_a_group_that_moved_is_listed_once_at_its_newest_lighthouse(lighthouses: list[Lighthouse]) -> None:
    a, b = lighthouses
    a.report("g0", version=1)
    poll(lambda: b.managers() == {"g0": "lh-a"}, VISIBLE_WITHIN + MARGIN, what="lh-b sees g0 on lh-a")
    b.report("g0", version=2)  # the group failed over to lh-b; lh-a still remembers it
    assert b.managers() == {"g0": "lh-b"}
    poll(lambda: a.managers() == {"g0": "lh-b"}, VISIBLE_WITHIN + MARGIN, what="lh-a sees g0 moved")
    assert [m["version"] for m in a.registry.default.managers()] == [2]


def test_a_stopped_lighthouse_withdraws_its_managers(lighthouses: list[Lighthouse]) -> None:
    a, b = lighthouses
    a.report("g0")
    poll(lambda: "g0" in b.managers(), VISIBLE_WITHIN + MARGIN, what="lh-b sees g0")
    a.peers.stop()  # revokes the lease: no waiting for the TTL
    poll(lambda: "g0" not in b.managers(), VISIBLE_WITHIN + MARGIN, what="g0 gone from lh-b")


def test_a_killed_lighthouse_s_managers_go_when_its_lease_expires(
    cluster: EtcdCluster, lighthouses: list[Lighthouse], prefix: str, tmp_path: Path
) -> None:
    _, b = lighthouses
    ttl = 2.0
    pool = ProcessPool(tmp_path)
    try:
        args = ["--endpoints", cluster.endpoints, "--prefix", prefix, "--replica-id", "g9", "--ttl", str(ttl)]
        dying = pool.spawn([sys.executable, "-m", "tests.peer_proc", *args], "peer")
        assert dying.readline() == "ready"
        poll(lambda: b.managers() == {"g9": "dying-lighthouse:1"}, VISIBLE_WITHIN + MARGIN, what="g9 seen")
        dying.popen.kill()
        dying.popen.wait(10)
        # etcd checks leases about twice a second; the keepalive may have just renewed a full TTL.
        poll(lambda: "g9" not in b.managers(), ttl + 1.0 + MARGIN, what="the dead lighthouse's manager gone")
    finally:
        pool.stop_all()


def test_a_lost_lease_is_replaced_and_the_managers_published_again(
    client: EtcdClient, lighthouses: list[Lighthouse]
) -> None:
    a, b = lighthouses
    a.report("g0")
    poll(lambda: "g0" in b.managers(), VISIBLE_WITHIN + MARGIN, what="lh-b sees g0")
    # What etcd does to a lighthouse cut off for longer than the TTL: its lease ends, its keys go.
    client.lease_revoke(a.peers._lease)
    poll(lambda: "g0" not in b.managers(), VISIBLE_WITHIN + MARGIN, what="g0 gone with the lease")
    poll(lambda: "g0" in b.managers(), a.peers.ttl + VISIBLE_WITHIN + MARGIN, what="lh-a publishes g0 again")


def test_writes_are_batched_however_many_manager_calls(
    client: EtcdClient, lighthouses: list[Lighthouse], prefix: str
) -> None:
    a, b = lighthouses
    revisions: set[int] = set()
    lock = threading.Lock()

    def count(events: list[Event]) -> None:
        with lock:
            revisions.update(e.revision for e in events if e.kv.key.endswith(b"/id-lh-a"))

    start = client.get("/").revision
    watch = client.watch(
        f"{prefix}/peers/", start_revision=start + 1, on_events=count, on_compacted=lambda: start
    )
    stop = threading.Event()
    calls = itertools.count()

    def managers_calling() -> None:  # 40 groups across 4 jobs, each reporting as fast as it can
        while not stop.is_set():
            n = next(calls)
            a.report(f"g{n % 40}", job=f"job{n % 4}", requests=n)

    worker = CheckedThread(managers_calling)
    began = time.monotonic()
    worker.start()
    try:
        stop.wait(4.0)
    finally:
        stop.set()
        worker.check()
    elapsed = time.monotonic() - began
    total_calls = next(calls)
    final = {f"job{j}": {f"g{g}" for g in range(40) if g % 4 == j} for j in range(4)}
    poll(
        lambda: all(set(b.managers(job)) == groups for job, groups in final.items()),
        VISIBLE_WITHIN + MARGIN,
        what="every group listed by lh-b",
    )

    def latest_report() -> int:
        return max(m["requests"] for job in final for m in b.registry.serve(job).managers())

    poll(lambda: latest_report() == total_calls - 1, VISIBLE_WITHIN + MARGIN, what="the last report")

    def counts_agree() -> bool:  # lh-a counts a write once its call returns; watches may see it sooner
        with lock:
            return a.peers.puts == len(revisions)

    poll(counts_agree, MARGIN, what="lh-a's writes counted by lh-a and by the test's watch alike")
    with lock:
        written = len(revisions)
    watch.stop()
    assert total_calls > 1000  # many manager calls...
    # ...but at most one transaction per interval (plus the one after the calls stopped).
    assert 1 <= written <= elapsed / a.peers.interval + 3, (written, elapsed)


def test_nothing_new_nothing_written(lighthouses: list[Lighthouse]) -> None:
    a, b = lighthouses
    a.report("g0")
    poll(lambda: "g0" in b.managers(), VISIBLE_WITHIN + MARGIN, what="lh-b sees g0")
    # lh-b's watch can deliver the write before lh-a's transaction call returns and counts it.
    poll(lambda: a.peers.puts == 1, MARGIN, what="lh-a counted its one write")
    before, rounds = a.peers.puts, a.peers.rounds
    poll(lambda: a.peers.rounds >= rounds + 3, 3 * a.peers.interval + MARGIN, what="three publishing rounds")
    assert a.peers.puts == before


def test_managers_merge_keeps_the_latest_report() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    state.observe(pb.ManagerStatus(replica_id="g0", version=3), "peer")
    assert "lighthouse" not in state.managers()[0]  # no peers: the table as before
    remote = [
        {"replica_id": "g0", "version": 2, "last_seen_s": 9.0, "lighthouse": "other:1"},
        {"replica_id": "g1", "version": 2, "last_seen_s": 0.5, "lighthouse": "other:1"},
    ]
    state.peers = lambda: [dict(m) for m in remote]
    state.lighthouse = "me:1"
    rows = state.managers()
    assert [(m["replica_id"], m["version"], m["lighthouse"]) for m in rows] == [
        ("g0", 3, "me:1"),
        ("g1", 2, "other:1"),
    ]
    state.store.close()


class SqliteWithEtcd(SqliteBackend):
    """An in-memory store of its own plus the etcd client and prefix a shared (etcd) store carries:
    the managers table is what is under test here, not the shared versions."""

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        super().__init__(None)
        self.client = client
        self.prefix = prefix

    def subscribe(
        self,
        on_job_changed: JobChanged,
        on_step: StepChanged,
        on_lease_ceiling: CeilingChanged,
        on_guards: GuardsChanged = lambda job: None,
    ) -> None:
        """No other lighthouse writes this store's versions: nothing to watch."""


@pytest.mark.slow
def test_lighthouse_servers_share_their_managers_over_http(
    client: EtcdClient, prefix: str, procs: ProcessPool, page: Page
) -> None:
    servers = []
    try:
        for _ in range(2):
            servers.append(
                LighthouseServer(
                    "127.0.0.1:0", http_bind="127.0.0.1:0", backend=SqliteWithEtcd(client, prefix)
                )
            )
        for i, server in enumerate(servers):
            procs.manager(server.address(), f"group{i}")

        def listed(server: LighthouseServer) -> dict[str, str]:
            url = server.dashboard_url()
            assert url is not None
            rows = call(url, "GET", "/api/managers").json["managers"]
            return {m["replica_id"]: m["lighthouse"] for m in rows}

        expected = {"group0": servers[0].address(), "group1": servers[1].address()}
        for server in servers:
            poll(lambda s=server: listed(s) == expected, 10.0, what=f"{server.address()} lists both managers")
        url = servers[1].dashboard_url()
        assert url is not None
        page.goto(url + "jobs/default")  # the dashboard names the lighthouse each group talks to
        row = page.locator('#managers tr[data-replica="group0"] td.mono')
        expect(row).to_have_text(re.compile(f"via {re.escape(servers[0].address())}$"))
        servers[0].shutdown()  # revokes its lease: the other forgets its managers
        poll(lambda: "group0" not in listed(servers[1]), VISIBLE_WITHIN + MARGIN, what="group0 withdrawn")
    finally:
        for server in servers:
            server.shutdown()


def serve_on_etcd(procs: ProcessPool, store: str) -> tuple[str, str]:
    """A real ``lighthouse serve --store``; returns its gRPC address and dashboard URL."""
    args = [sys.executable, "-m", "lighthouse", "serve", "--store", store]
    lh = procs.spawn([*args, "--bind", "127.0.0.1:0", "--http-bind", "127.0.0.1:0"], "lighthouse")
    return lh.readline(), lh.readline()


@pytest.mark.slow
def test_lighthouses_on_one_etcd_prefix_list_every_manager(
    cluster: EtcdCluster, prefix: str, procs: ProcessPool
) -> None:
    store = f"etcd://{cluster.endpoints}{prefix}"
    (addr_a, url_a), (addr_b, url_b) = serve_on_etcd(procs, store), serve_on_etcd(procs, store)
    # Each sees the other by its feature record, before any manager (the LighthousePeerMissing alert's).
    for url in (url_a, url_b):
        poll(lambda u=url: "\nlighthouse_peers 1\n" in call(u, "GET", "/metrics").body.decode(), 15.0)
    procs.manager(addr_a, "g0")
    procs.manager(addr_b, "g1")
    # Jobs are made by an operator (an anonymous manager naming an unknown job creates nothing).
    assert call(url_b, "PUT", "/api/jobs/llm/config", {"lr": 0.1}).status == 200
    procs.manager(addr_b, "w0", extra=["--job", "llm"])

    def listed(url: str, job: str = "default") -> dict[str, str]:
        answer = call(url, "GET", f"/api/jobs/{job}/managers")
        if answer.status == 404:  # the job is not known here yet (its managers talk to the other)
            return {}
        return {m["replica_id"]: m["lighthouse"] for m in answer.json["managers"]}

    for url in (url_a, url_b):
        poll(lambda u=url: listed(u) == {"g0": addr_a, "g1": addr_b}, 15.0, what=f"{url} lists g0 and g1")
        poll(lambda u=url: listed(u, "llm") == {"w0": addr_b}, 15.0, what=f"{url} lists job llm's w0")
    jobs = {line["job"]: line for line in call(url_a, "GET", "/api/jobs").json["jobs"]}
    assert (jobs["default"]["managers"], jobs["llm"]["managers"]) == (2, 1)
    # /metrics counts only a lighthouse's own managers: scraping both counts each manager once.
    metrics_a = call(url_a, "GET", "/metrics").body.decode()
    assert 'replica_id="g0"' in metrics_a and 'replica_id="g1"' not in metrics_a
    assert 'lighthouse_managers{job="default"} 1' in metrics_a
    assert "\nlighthouse_peers 1\n" in metrics_a  # lh-b, once

    b = next(p for p in procs.procs if p.name == "lighthouse" and p.seen[0] == addr_b)
    b.popen.kill()  # SIGKILL: its lease expires; its managers leave lh-a's table with it
    poll(lambda: listed(url_a) == {"g0": addr_a}, 15.0, what="lh-b's managers gone from lh-a")
    alone = "\nlighthouse_peers 0\n"
    poll(lambda: alone in call(url_a, "GET", "/metrics").body.decode(), 15.0, what="lh-a sees no peer")
