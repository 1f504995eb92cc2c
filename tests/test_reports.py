"""What the ranks report reaches the lighthouse exactly, and a job's series stays bounded.

Real processes: ``lighthouse serve``, ``manager serve`` per replica group, and
worker processes (``tests/worker_proc.py --report``) that report a loss known in advance.
"""

from __future__ import annotations

import json
import math
from array import array
from pathlib import Path
from typing import Any

import pytest

from lighthouse.client import LighthouseClient
from lighthouse.jobs.series import COARSE_BUCKETS, RECENT_STEPS
from protos import lighthouse_config_pb2 as pb
from protos.metrics import pack
from tests.helpers_lighthouse import run_cli
from tests.http_util import call, get_json
from tests.procs import ProcessPool, poll, wait_ready, worker_records
from tests.worker_proc import known_loss

GROUPS, RANKS, STEPS = 2, 2, 60
NAN_STEP, NAN_GROUP, NAN_RANK = 17, 1, 1


def expected(step: int, groups: range = range(GROUPS)) -> dict[str, Any]:
    """What the series must hold for ``step``: the values every rank of ``groups`` sent."""
    values = [
        math.nan if (g, r, step) == (NAN_GROUP, NAN_RANK, NAN_STEP) else known_loss(f"g{g}", r, step)
        for g in groups
        for r in range(RANKS)
    ]
    finite = [v for v in values if math.isfinite(v)]
    return {
        "step": step,
        "mean": pytest.approx(sum(finite) / len(finite), rel=1e-12),
        "min": min(finite),
        "max": max(finite),
        "count": len(values),
        "nonfinite": len(values) - len(finite),
    }


@pytest.mark.slow
def test_the_series_holds_what_every_rank_sent(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.01})
    managers = [procs.manager(lh.address, f"g{g}", cache_ttl=0.2) for g in range(GROUPS)]
    workers = []
    for g in range(GROUPS):
        for r in range(RANKS):
            extra = ["--report", *(["--nan-at", str(NAN_STEP)] if (g, r) == (NAN_GROUP, NAN_RANK) else [])]
            worker = procs.worker(
                managers[g].address,
                group=f"g{g}",
                rank=r,
                steps=STEPS,
                step_interval=0.01,
                prefetch=g == 1,  # group 1's reports ride on prefetches
                wait=False,
                extra=extra,
            )
            workers.append(worker)
    wait_ready(workers)
    for worker in workers:
        assert len(worker_records(worker)) == STEPS

    def complete() -> dict[str, Any] | None:
        answer: dict[str, Any] = get_json(lh.url, "/api/metrics?name=loss&groups=1")
        points = answer["metrics"].get("loss", [])
        full = len(points) == STEPS and all(p["count"] == GROUPS * RANKS for p in points)
        return answer if full else None

    answer = poll(complete, 20, 0.1, "every rank's loss of every step")
    assert answer["metrics"]["loss"] == [expected(step) for step in range(STEPS)]
    for g in range(GROUPS):
        detail = answer["groups"]["loss"][f"g{g}"]
        assert detail == [expected(step, range(g, g + 1)) for step in range(STEPS)]
    assert answer["dropped"] == 0
    assert answer["last"]["loss"] == expected(STEPS - 1)
    tokens = get_json(lh.url, "/api/metrics?name=tokens&from_step=10&to_step=12")["metrics"]
    assert tokens == {"tokens": [{"step": s, "mean": 150.0, "min": 100.0, "max": 200.0, "count": 4,
                                  "nonfinite": 0} for s in (10, 11, 12)]}  # fmt: skip

    prometheus = call(lh.url, "GET", "/metrics").body.decode().splitlines()
    assert f'lighthouse_training_metric_step{{job="default",name="loss"}} {STEPS - 1}' in prometheus
    last = next(
        line
        for line in prometheus
        if line.startswith('lighthouse_training_metric{job="default",name="loss"}')
    )
    assert float(last.split()[1]) == pytest.approx(expected(STEPS - 1)["mean"])

    table = run_cli("metrics", "--url", lh.url, "--width", str(STEPS))
    assert table.returncode == 0, table.stderr
    loss_line = next(line for line in table.stdout.splitlines() if line.startswith("loss"))
    assert loss_line.split()[1:2] == [str(STEPS - 1)]
    sparkline = loss_line.split()[-1]
    assert len(sparkline) == STEPS and sparkline[NAN_STEP] == "!" and sparkline.count("!") == 1
    as_json = json.loads(run_cli("metrics", "--url", lh.url, "--name", "tokens", "-o", "json").stdout)
    assert list(as_json["metrics"]) == ["tokens"]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _status(replica: str, batch: int, first: int, count: int) -> pb.ManagerStatus:
    """A manager's status carrying ``count`` steps from ``first`` of two metrics (loss = step % 100)."""
    steps = array("q", range(first, first + count))
    loss = array("d", (s % 100 for s in steps))
    ones = pack(array("I", [1]) * count)
    metrics = [
        pb.MetricSummaries(name=name, steps=pack(steps), count=ones, nonfinite=pack(array("I", [0]) * count),
                           sum=pack(values), min=pack(values), max=pack(values))
        for name, values in (("loss", loss), ("grad_norm", array("d", [2.0]) * count))
    ]  # fmt: skip
    return pb.ManagerStatus(replica_id=replica, step=first + count - 1, metrics=metrics, metrics_batch=batch)


@pytest.mark.slow
def test_a_million_reported_steps_leave_a_jobs_memory_bounded(procs: ProcessPool) -> None:
    """The bound (lighthouse/jobs/series.py): per metric at most COARSE_BUCKETS buckets for the older
    steps and 2 * RECENT_STEPS exact ones per group; so the series answers the same number of
    points, the lighthouse's memory does not grow with the steps, and the sums stay exact."""
    lh = procs.lighthouse()
    total, chunk, groups = 1_000_000, 1_000, ("g0", "g1")
    rss: dict[int, int] = {}
    with LighthouseClient(lh.address) as client:
        for replica in groups:  # served a config, as managers are: then their metrics count
            client.fetch(
                pb.LighthouseConfigRequest(status=pb.ManagerStatus(replica_id=replica, step=-1)), timeout=10
            )
        for batch, first in enumerate(range(0, total, chunk), start=1):
            for replica in groups:
                client.heartbeat(_status(replica, batch, first, chunk), timeout=30)
            if first + chunk in (100_000, total):
                rss[first + chunk] = _rss_bytes(lh.pid)
    answer = get_json(lh.url, "/api/metrics")
    for name in ("loss", "grad_norm"):
        points = answer["metrics"][name]
        assert len(points) <= COARSE_BUCKETS + 2 * RECENT_STEPS, len(points)
        assert sum(p["count"] for p in points) == total * len(groups)  # every value, once
        assert answer["resolution"][name]["bucket_steps"] == 1024  # 1,024 buckets of 1,024 steps
        assert answer["last"][name]["step"] == total - 1
    loss_sum = sum(p["mean"] * p["count"] for p in answer["metrics"]["loss"])
    assert loss_sum == pytest.approx(len(groups) * (total // 100) * sum(range(100)), rel=1e-9)
    grown = rss[total] - rss[100_000]
    assert grown < 24 * 2**20, (
        f"the lighthouse grew by {grown / 2**20:.1f} MiB from 100,000 to 1,000,000 steps"
    )
