"""Acknowledged order is effective order: changes made now through two lighthouses on one etcd
prefix never take effect below a change acknowledged before them (issue 29)."""

from __future__ import annotations

import uuid

import pytest

from tests.etcd_cluster import EtcdCluster
from tests.http_util import call, wait_healthy
from tests.ordering import check_acknowledged_order, make_change, pause, records_past, spread, stepping_groups
from tests.procs import ProcessPool


@pytest.mark.slow
def test_changes_alternating_between_two_lighthouses_take_effect_in_acknowledged_order(
    procs: ProcessPool, etcd1: EtcdCluster
) -> None:
    store = f"etcd://{etcd1.endpoints}/test-ord/{uuid.uuid4().hex}"
    a, b = (procs.lighthouse(store=store) for _ in range(2))
    for lh in (a, b):
        wait_healthy(lh.url)
    assert call(a.url, "PUT", "api/config", {"n": -1}).status == 200
    workers = stepping_groups(procs, spread(a, b))
    replies = []
    for i in range(40):
        replies.append(make_change((a, b)[i % 2], i))
        pause(i)
    last = max(r["effective_step"] for r in replies)
    records = records_past(workers, last + 20)
    check_acknowledged_order(a.url, replies, records)
