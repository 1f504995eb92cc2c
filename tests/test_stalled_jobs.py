"""A job whose ranks all died shows as stalled within the stated bound (lighthouse.jobs.stall):
on /api/jobs, in ``lighthouse jobs`` and in /metrics; real manager and worker processes."""

from __future__ import annotations

import signal
import time

import pytest

from lighthouse.jobs.stall import GONE_MIN_SECONDS, GONE_TTLS
from tests.helpers_lighthouse import run_cli
from tests.http_util import get_json, live, wait_healthy
from tests.procs import ProcessPool, metric, poll

TTL = 0.5
BOUND = max(GONE_TTLS * TTL, GONE_MIN_SECONDS)
SLACK = 5.0  # the refresh of a loaded machine


def _job(url: str) -> dict:
    answer: dict = get_json(url, "api/jobs/default")
    return answer


@pytest.mark.slow
def test_a_job_whose_ranks_all_died_shows_as_stalled(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    managers = [procs.manager(lh.address, f"g{i}", cache_ttl=TTL) for i in range(2)]
    workers = [
        procs.worker(m.address, group=f"g{i}", rank=0, steps=100_000, step_interval=0.01)
        for i, m in enumerate(managers)
    ]
    poll(lambda: live(lh.url)["current_step"] > 20, 30, what="the job steps")
    # Training: not stalled anywhere.
    job = _job(lh.url)
    assert job["stalled"] is False and job["stall_reason"] is None, job
    assert metric(lh.url, "lighthouse_job_stalled") == 0
    table = run_cli("jobs", "--url", lh.url)
    assert table.returncode == 0 and table.stdout.splitlines()[1].rstrip().endswith("ok"), table.stdout

    for proc in [*workers, *managers]:  # every rank and manager dies at once
        proc.signal(signal.SIGKILL)
    for proc in [*workers, *managers]:
        proc.wait(10)
    died = time.monotonic()
    job = poll(lambda: (j := _job(lh.url))["stalled"] and j, BOUND + SLACK, 0.2, "the job stalled")
    took = time.monotonic() - died
    assert BOUND - 1.0 <= took <= BOUND + SLACK, took  # not before the bound, soon after it
    assert "every manager is gone" in job["stall_reason"], job
    assert metric(lh.url, "lighthouse_job_stalled") == 1
    listed = get_json(lh.url, "api/jobs")["jobs"]
    assert [j["stalled"] for j in listed if j["job"] == "default"] == [True]
    table = run_cli("jobs", "--url", lh.url)
    assert table.returncode == 0 and "stalled: every manager is gone" in table.stdout, table.stdout

    # A manager back and stepping: no longer stalled.
    manager = procs.manager(lh.address, "g0", cache_ttl=TTL)
    first = live(lh.url)["current_step"] + 1
    procs.worker(manager.address, group="g0", rank=0, steps=100_000, step_interval=0.01, first_step=first)
    poll(lambda: not _job(lh.url)["stalled"], 30, 0.2, "the job no longer stalled")
    assert metric(lh.url, "lighthouse_job_stalled") == 0
