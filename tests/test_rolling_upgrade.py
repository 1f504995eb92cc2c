"""A rolling upgrade of an HA pair from the release before step leases (9e6485e), both ways:
while the old release is live on the prefix no step lease is granted and every change applies
on top of the ones before it; once it is gone leases resume and every change lands at one step
in every group (issue 29)."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests import old_release
from tests.etcd_cluster import EtcdCluster
from tests.http_util import call, get_json, history, live, wait_healthy
from tests.ordering import (
    CACHE_TTL,
    Record,
    check_acknowledged_order,
    make_change,
    pause,
    records_past,
    spread,
    stepping_groups,
)
from tests.procs import LighthouseProc, Proc, ProcessPool, last_record, poll, records_so_far


def old_lighthouse(procs: ProcessPool, tree: Path, store: str, bind: str = "127.0.0.1:0") -> LighthouseProc:
    """``lighthouse serve`` of the old release."""
    args = old_release.lighthouse_command(bind, "127.0.0.1:0", store)
    proc: LighthouseProc = procs.spawn(args, "old-lighthouse", LighthouseProc, env=old_release.env(tree))
    proc.address = proc.readline()
    proc.url = proc.readline()
    wait_healthy(proc.url)
    return proc


def leases_suspended_gauge(url: str) -> float:
    body = call(url, "GET", "/metrics").body.decode()
    samples = [
        line.split()[1] for line in body.splitlines() if line.startswith("lighthouse_step_leases_suspended ")
    ]
    assert len(samples) == 1, body
    return float(samples[0])


def suspended(url: str) -> bool:
    return bool(get_json(url, "healthz")["step_leases"] == "suspended")


def wait_suspended(new: LighthouseProc, old: LighthouseProc, times: int = 1) -> None:
    """The new release sees the old one, says so (its log for the ``times``-th time), and every
    promise it made has passed."""
    poll(lambda: suspended(new.url), 20, what="step leases suspended")
    assert get_json(new.url, "healthz")["step_leases_suspended_by"] == [old.address]
    assert leases_suspended_gauge(new.url) == 1
    assert live(new.url)["step_leases_suspended_by"] == [old.address]
    poll(lambda: new.stderr().count("step leases suspended") >= times, 10, what="the suspension logged")
    poll(lambda: live(new.url)["current_step"] > live(new.url)["lease_horizon"], 20, what="promises passed")


def wait_leases(lighthouses: list[LighthouseProc], workers: dict[str, Proc]) -> None:
    """Leases granted again, and every group holds one."""
    for lh in lighthouses:
        poll(lambda lh=lh: not suspended(lh.url), 20, what=f"step leases granted again by {lh.address}")
        assert leases_suspended_gauge(lh.url) == 0

    def leased() -> bool:
        last = [last_record(w) for w in workers.values()]
        return all((r["stable_through_step"] or -1) >= r["step"] for r in last)

    poll(leased, 30, what="every group holding a step lease")


def mixed_changes(
    lighthouses: list[LighthouseProc], first: int, count: int, workers: dict[str, Proc]
) -> list[dict[str, Any]]:
    """Changes alternating between an old and a new lighthouse: each applies on top of every one
    acknowledged before it, and the newest reaches every group."""
    replies = []
    for i in range(count):
        replies.append(make_change(lighthouses[i % 2], first + i))
        time.sleep(0.3)
    versions = [r["version"] for r in replies]
    assert versions == sorted(versions) and len(set(versions)) == count, versions
    rows = {h["version"]: h for h in history(lighthouses[1].url)}
    for i, reply in enumerate(replies):
        row = rows[reply["version"]]
        assert row["config"]["n"] == first + i, f"version {row['version']} undone by an older change: {row}"
    for lh in lighthouses:
        assert live(lh.url)["config"]["n"] == first + count - 1
    newest = str(first + count - 1)
    poll(
        lambda: all(last_record(w)["config"]["n"] == newest for w in workers.values()),
        20,
        what="the newest change in every group",
    )
    return replies


def upgrade_old(procs: ProcessPool, old: LighthouseProc, store: str) -> LighthouseProc:
    """Stop the old release and start this one on its ports."""
    assert old.stop() == 0, old.stderr()
    return procs.restart_lighthouse(old, store=store)


def ordered_phase(a: LighthouseProc, b: LighthouseProc, workers: dict[str, Proc], first: int) -> None:
    """Both lighthouses of this release: changes alternating between them land at one step in
    every group, in acknowledged order."""
    replies = []
    for i in range(12):
        replies.append(make_change((a, b)[i % 2], first + i))
        pause(i)
    records: dict[str, list[Record]] = records_past(workers, max(r["effective_step"] for r in replies) + 20)
    check_acknowledged_order(b.url, replies, records)


def roll(
    procs: ProcessPool,
    old: LighthouseProc,
    new: LighthouseProc,
    workers: dict[str, Proc],
    store: str,
    *,
    first: int = 0,
    times: int = 1,
) -> LighthouseProc:
    """The window of a rolling upgrade, whichever release came first: suspended while ``old``
    is live, changes through both applying in order, then ``old`` replaced by this release on its
    ports (returned), leases resumed, and every change landing at one step in every group."""
    wait_suspended(new, old, times)
    mixed_changes([old, new], first, 8, workers)
    old = upgrade_old(procs, old, store)
    wait_leases([old, new], workers)
    ordered_phase(old, new, workers, first + 100)
    return old


@pytest.mark.slow
def test_rolling_upgrade_from_the_release_before_step_leases_both_ways(
    procs: ProcessPool, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """Old A first, then this release's B; A upgraded. Then the reverse order, on the same prefix:
    this release leasing on both, a lighthouse C of the old release joins and managers talk to it
    (a host brought back with the old release), changes through C and B; C upgraded."""
    tree = old_release.install(tmp_path)
    store = f"etcd://{etcd1.endpoints}/test-upgrade/{uuid.uuid4().hex}"
    a = old_lighthouse(procs, tree, store)
    b = procs.lighthouse(store=store)
    wait_healthy(b.url)
    assert make_change(a, -1)["version"] == 1
    workers = stepping_groups(procs, spread(a, b))
    a = roll(procs, a, b, workers, store)
    c = old_lighthouse(procs, tree, store)
    # Groups joining the running job at its step, their managers on C (g4 and g5 start on the
    # first lighthouse of their list).
    joining = {g: f"{c.address},{b.address}" for g in ("g4", "g5")}
    workers |= stepping_groups(procs, joining, first_step=live(b.url)["current_step"])
    roll(procs, c, b, workers, store, first=200, times=2)


@pytest.mark.slow
def test_a_manager_never_serves_a_release_that_knows_no_runs_once_the_job_s_runs_began(
    procs: ProcessPool, etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """The chaos suite's old-release fault (seeds 1910554750, 7622960, 712775808): a job whose run
    1 ended and run 2 began, a group's manager moved onto a lighthouse of the release before runs
    (its other lighthouse gone). That release's answers carry no run era and, past a job's first
    run, are another config than the job's (it reads a packed step as a step); the manager took
    them for answers from before the job's current run, kept its snapshot and counted them as
    contact, so the group trained its last config as "cache" for as long as the old one lasted (up
    to 8.4 s), and serving them instead gave one version two configs at a step. Now the manager
    refuses them and moves on: with no other lighthouse its workers get the fallback (a fault
    they are told of), never a config the job does not have; once a lighthouse of this release is
    back, every change reaches the group."""
    tree = old_release.install(tmp_path)
    store = f"etcd://{etcd1.endpoints}/test-upgrade/{uuid.uuid4().hex}"
    a, b = procs.lighthouse(store=store), procs.lighthouse(store=store)
    old = old_lighthouse(procs, tree, store)  # its port, for the manager's list: it comes back later
    assert old.stop() == 0, old.stderr()
    for lh in (a, b):
        wait_healthy(lh.url)
    make_change(b, 0)
    manager = procs.manager(f"{a.address},{old.address}", "g0", cache_ttl=CACHE_TTL, extra=["--run-id", "r1"])
    worker = procs.worker(manager.address, group="g0", rank=0, steps=100_000, step_interval=0.01, wait=False)
    poll(lambda: (live(b.url).get("run") or {}).get("number") == 1, 20, what="run 1 begun")
    assert call(b.url, "POST", "api/config/runs/end").status == 200
    poll(lambda: (live(b.url).get("run") or {}).get("number") == 2, 20, what="run 2 begun")
    old = old_lighthouse(procs, tree, store, bind=old.address)  # a host rolled back to the old release
    a.signal(signal.SIGKILL)  # the manager's only other lighthouse: the old release
    a.wait(10)
    effective = make_change(b, 1).get("effective_step") or 0
    changed = time.time()
    time.sleep(CACHE_TTL + 4.5)
    # The steps promised before it keep the config before it (on etcd the stored ceilings run 2 s
    # of steps ahead): wait for the group to pass the change's step.
    poll(lambda: last_record(worker)["step"] > effective + 20, 20, what=f"the group past step {effective}")
    # From the change's step, and a TTL and two deadlines after it was made, on: the change, or the
    # fallback; never the config before it served as fresh.
    late = [
        r for r in records_so_far(worker) if r["t"] > changed + CACHE_TTL + 2.5 and r["step"] >= effective
    ]
    assert late, "the worker stopped stepping"
    assert all(r["source"] == "fallback" or r["config"].get("n") == "1" for r in late), [
        (r["step"], r["source"], r["config"]) for r in late if r["config"].get("n") != "1"
    ][:5]
    assert any(r["source"] == "fallback" for r in late)  # the old release was all it could reach
    assert "knows no runs" in manager.stderr(), manager.stderr()  # it answered, and was refused
    a = procs.restart_lighthouse(a, store=store)  # this release back on the first lighthouse's port
    for n in range(2, 5):
        make_change(b, n)
        poll(
            lambda n=n: last_record(worker)["config"].get("n") == str(n),
            10,
            interval=0.05,
            what=f"change {n} trained by the group",
        )
