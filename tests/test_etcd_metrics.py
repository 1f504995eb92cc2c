"""Reported metrics and guards across two ``lighthouse serve --store etcd://...`` processes on one
real etcd prefix: each lighthouse's API shows the whole job (the groups of both), and a guarded
change whose loss triples is rolled back exactly once, though both lighthouses judge it.

Group g0's manager talks to lighthouse A, group g1's to B; each group has one worker process
(``tests/worker_proc.py --report``) whose loss triples while ``lr`` is above 0.015.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.types import Event, KeyValue
from lighthouse.jobs.registry import JobRegistry
from lighthouse.peers.series import PeerSeries
from lighthouse.store.sqlite import SqliteBackend
from tests.etcd_cluster import EtcdCluster
from tests.http_util import call, get_json, history
from tests.procs import LighthouseProc, ProcessPool, poll, wait_ready
from tests.worker_proc import known_loss


@pytest.mark.slow
def test_every_lighthouse_shows_the_whole_job_and_one_rolls_back(
    procs: ProcessPool, etcd1: EtcdCluster
) -> None:
    store = f"etcd://{etcd1.endpoints}/test-metrics/{uuid.uuid4().hex}"
    a, b = (procs.lighthouse(store=store) for _ in range(2))
    assert call(a.url, "PUT", "/api/config", {"lr": 0.01}).status == 200
    workers = []
    for group, lighthouse in enumerate((a, b)):
        manager = procs.manager(lighthouse.address, f"g{group}", cache_ttl=0.2)
        extra = ["--report", "--hot-lr", "0.015"]
        workers.append(
            procs.worker(
                manager.address,
                group=f"g{group}",
                rank=0,
                steps=1_000_000,
                step_interval=0.02,
                wait=False,
                extra=extra,
            )
        )
    wait_ready(workers)

    def both_groups(lighthouse: LighthouseProc) -> list[dict[str, Any]] | None:
        answer = get_json(lighthouse.url, "/api/metrics?name=loss&from_step=10&to_step=40&groups=1")
        points = answer["metrics"].get("loss", [])
        whole = len(points) == 31 and all(p["count"] == 2 for p in points)
        return points if whole and set(answer["groups"]["loss"]) == {"g0", "g1"} else None

    for lighthouse in (a, b):
        points = poll(lambda lh=lighthouse: both_groups(lh), 30, 0.2, f"both groups on {lighthouse.url}")
        assert [p["mean"] for p in points] == [
            (known_loss("g0", 0, s) + known_loss("g1", 0, s)) / 2 for s in range(10, 41)
        ]

    version = call(a.url, "PATCH", "/api/config?guard=loss:1.5&guard_steps=60", {"lr": 0.02}).json["version"]

    def decided(lighthouse: LighthouseProc) -> dict[str, Any] | None:
        guards = get_json(lighthouse.url, "/api/config/guards")["guards"]
        guard = next(g for g in guards if g["version"] == version)
        return guard if guard["status"] != "active" else None

    guard = poll(lambda: decided(a), 60, 0.2, "the guard decided")
    assert guard["status"] == "triggered", guard
    assert (
        poll(lambda: decided(b), 20, 0.2, "B sees it decided")["rollback_version"]
        == guard["rollback_version"]
    )
    for lighthouse in (a, b):
        rollbacks = [v for v in history(lighthouse.url) if v["author"] == "guard"]
        assert [v["version"] for v in rollbacks] == [guard["rollback_version"]], rollbacks
    poll(
        lambda: (
            len([v for v in history(a.url) if v["version"] > version]) == 1
            and get_json(b.url, "/api/config")["config"]["lr"] == 0.01
        ),
        10,
        0.2,
        "one rollback, served by both",
    )


def test_a_malformed_batch_key_is_ignored_not_retried_forever(etcd1: EtcdCluster) -> None:
    """A key under ``series/`` whose sequence is not ASCII digits ("²" passes ``str.isdigit`` but
    not ``int``) was a callback failure, and the watch resumes at the failed event: it stalled
    every later batch. It is skipped like any other malformed key."""
    prefix = f"/series-keys-{uuid.uuid4().hex[:8]}"
    registry = JobRegistry(SqliteBackend(None))
    with EtcdClient(etcd1.endpoints) as client:
        series = PeerSeries(client, prefix, "me", registry)
        root = f"{prefix}/series/".encode()
        junk = KeyValue(root + "default/other/²".encode(), b"", 1, 1, 1, 0)
        series._on_events([Event("put", junk)])  # raised ValueError before
        assert series._parse_key(junk.key) is None
        seq = f"{12:020d}".encode()  # as the publisher writes it
        assert series._parse_key(root + b"default/other/" + seq) == ("default", "other", 12)
        assert series._parse_key(root + b"default/me/" + seq) is None  # our own
    registry.close()
