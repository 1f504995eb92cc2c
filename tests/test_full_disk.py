"""A full disk stops no training (issue 26, item 6): the state directory on a small tmpfs, filled.

Edits get 507 and store nothing; stepping workers keep their config (the step-lease ceiling is
written in place, needing no space); ``/healthz`` and ``/metrics`` show the store full and
recover once space is back; a lighthouse started on the full disk serves reads or says why in one
line. The tmpfs needs root with CAP_SYS_ADMIN: the tests fail without it (never skip), saying so,
also where ``mount`` itself is refused (EPERM: a container without CAP_SYS_ADMIN).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.rpc import make_channel
from tests.etcd_cluster import EtcdCluster, require_etcd
from tests.http_util import call, change, get_json, history, live, wait_healthy
from tests.procs import LighthouseProc, Proc, ProcessPool, lighthouse_command, metric, poll, spawn

FULL_SPAN = float(os.environ.get("LIGHTHOUSE_FULL_DISK_SECONDS", "60"))  # seconds the disk stays full
STEP_INTERVAL = 0.05


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted for the test."""
    if os.geteuid() != 0:
        pytest.fail("test_full_disk mounts a tmpfs: run it as root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:  # never a skip: a machine that cannot run these tests fails them
        if "permission denied" in done.stderr.lower() or "not permitted" in done.stderr.lower():
            pytest.fail(
                "test_full_disk needs root with CAP_SYS_ADMIN to mount a 16 MiB tmpfs (a container:"
                f" --cap-add SYS_ADMIN or --privileged); mount was refused (EPERM): {done.stderr.strip()}"
            )
        pytest.fail(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Write a filler file until the filesystem has no block left."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 512):
            while True:
                try:
                    f.write(b"\0" * chunk)
                except OSError:
                    break
    stat = os.statvfs(disk)
    assert stat.f_bavail == 0, f"{stat.f_bavail} blocks still free"
    return filler


def stream(worker: Proc) -> Iterator[dict[str, Any]]:
    """A worker's per-step records as it prints them."""
    at = 0
    while True:
        poll(lambda at=at: len(worker.lines()) > at, 30, interval=0.01, what=f"{worker.name}'s next step")
        line = worker.seen[at]
        at += 1
        if line == "done":
            return
        if line.startswith("{"):
            yield json.loads(line)


def writable(url: str) -> float:
    """``lighthouse_store_writable`` from /metrics (a sample without labels)."""
    body = call(url, "GET", "metrics").body.decode()
    samples = [line.split()[1] for line in body.splitlines() if line.startswith("lighthouse_store_writable ")]
    assert len(samples) == 1, body[:2000]
    return float(samples[0])


def health(url: str) -> dict[str, object]:
    res = call(url, "GET", "healthz")
    assert res.status == 200, res.body
    body: dict[str, object] = res.json
    return body


@pytest.mark.slow
def test_full_disk_refuses_edits_and_keeps_training(procs: ProcessPool, small_disk: Path) -> None:
    state = small_disk / "state"
    # A short ceiling lead: every second or so of steps needs a ceiling write.
    flags = ["--lease-ceiling-ahead", "0.2"]
    lh = procs.lighthouse(state_dir=state, extra=flags)
    acked = [change(lh.url, "PUT", {"lr": 0.1}).json["version"]]
    assert health(lh.url).get("store", "ok") == "ok"
    assert writable(lh.url) == 1
    mgr = procs.manager(lh.address, "g0", cache_ttl=0.5, lighthouse_timeout=1.0, backoff=0.5)
    steps = int((FULL_SPAN + 40) / STEP_INTERVAL)
    worker = procs.worker(mgr.address, group="g0", rank=0, steps=steps, step_interval=STEP_INTERVAL)
    records = stream(worker)
    first = next(records)
    assert first["source"] != "fallback" and first["config"] == {"lr": "0.1"}, first

    filler = fill(small_disk)
    full_at = time.monotonic()
    poll(lambda: health(lh.url)["store"] == "full", 10, what="/healthz store full")
    body = health(lh.url)
    assert body["status"] == "degraded" and "full" in str(body["store_problem"]), body
    assert writable(lh.url) == 0
    writes_before = metric(lh.url, "lighthouse_lease_ceiling_writes_total")
    refused = 0
    seen: list[dict[str, object]] = []
    while time.monotonic() - full_at < FULL_SPAN:
        res = change(lh.url, "PATCH", {"lr": 0.5, "pad": "x" * 200_000})
        assert res.status == 507, (res.status, res.body[:300])
        assert "full" in res.error and "nothing was stored" in res.error, res.error
        refused += 1
        assert live(lh.url)["config"] == {"lr": 0.1}
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            record = next(records)
            seen.append(record)
            assert record["source"] != "fallback", record
            assert record["config"] == {"lr": "0.1"}, record
    assert refused >= 2 and len(seen) > 10, (refused, len(seen))
    # Each refused edit counted, for the StoreCannotWrite alert (deploy/prometheus).
    body = call(lh.url, "GET", "metrics").body.decode()
    assert f'lighthouse_store_write_failures_total{{job="default",reason="no_space"}} {refused}\n' in body
    # The leases went on past what was stored before: the ceiling was raised on the full disk.
    assert metric(lh.url, "lighthouse_lease_ceiling_writes_total") > writes_before
    assert health(lh.url)["store"] == "full"

    filler.unlink()
    poll(lambda: health(lh.url).get("store", "ok") == "ok", 10, what="/healthz store ok again")
    assert writable(lh.url) == 1
    res = change(lh.url, "PATCH", {"lr": 0.2})
    assert res.status == 200, res.body
    acked.append(res.json["version"])
    for record in records:
        assert record["source"] != "fallback", record
        if record["config"] == {"lr": "0.2"}:
            break
    else:
        raise AssertionError("the worker never got the edit made once space was back")

    lh.stop()
    again = procs.lighthouse(state_dir=state, extra=flags)
    stored = {v["version"] for v in history(again.url)}
    assert set(acked) <= stored, (acked, stored)
    assert live(again.url)["config"] == {"lr": 0.2}


@pytest.mark.slow
def test_start_on_full_disk_serves_reads_or_says_why(procs: ProcessPool, small_disk: Path) -> None:
    state = small_disk / "state"
    lh = procs.lighthouse(state_dir=state)
    assert change(lh.url, "PUT", {"lr": 0.1}).status == 200
    lh.stop()
    fill(small_disk)
    started = spawn(
        [*lighthouse_command(), "--state-dir", str(state)],
        "lighthouse-full",
        procs.tmp_path / "lighthouse-full.stderr",
        LighthouseProc,
    )
    procs.procs.append(started)
    try:
        started.address = started.readline()
    except AssertionError:  # it exited: one line saying why
        assert started.popen.wait(timeout=10) != 0
        err = started.stderr()
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if line.strip() and "WARNING" not in line]
        assert len(lines) == 1 and "full" in lines[0], err
        return
    started.url = started.readline()
    wait_healthy(started.url)
    assert health(started.url)["store"] == "full"
    assert get_json(started.url, "api/config")["config"] == {"lr": 0.1}
    res = change(started.url, "PATCH", {"lr": 0.3})
    assert res.status == 507, res.body
    assert "Traceback" not in started.stderr()


def grpc_health(address: str) -> str:
    """What ``grpc_health_probe -addr ADDRESS`` asks."""
    with make_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


@pytest.mark.slow
def test_not_serving_while_no_lease_can_be_promised(procs: ProcessPool, tmp_path: Path) -> None:
    """A store that cannot be written at all (its only etcd member killed): the ceiling cannot be
    raised, the stepping group runs past its promises, and gRPC health says NOT_SERVING until the
    store is back."""
    require_etcd()
    with EtcdCluster(tmp_path / "etcd", size=1) as cluster:
        store = f"etcd://{cluster.endpoints}/disk"
        lh = procs.lighthouse(store=store, extra=["--lease-ceiling-ahead", "0.2"])
        assert change(lh.url, "PUT", {"lr": 0.1}).status == 200
        mgr = procs.manager(lh.address, "g0", cache_ttl=0.5, lighthouse_timeout=1.0, backoff=0.5)
        worker = procs.worker(mgr.address, group="g0", rank=0, steps=4000, step_interval=STEP_INTERVAL)
        records = stream(worker)
        assert next(records)["source"] != "fallback"
        assert grpc_health(lh.address) == "SERVING"
        member = cluster.members[0]
        cluster.kill(member)
        poll(lambda: grpc_health(lh.address) == "NOT_SERVING", 30, interval=0.2, what="NOT_SERVING")
        for record in records:  # the group runs past its promises: the empty fallback
            if record["source"] == "fallback":
                assert record["config"] == {}, record
                break
        else:
            raise AssertionError("the worker ended before it ran past its promises")
        # The lighthouse, alive, hears the manager say so: the ManagersServedFallback alert's gauge.
        poll(lambda: metric(lh.url, "lighthouse_managers_fallback") == 1, 30, 0.1, "the fallback heard of")
        assert metric(lh.url, "lighthouse_managers") == 1
        cluster.start_member(member)
        poll(lambda: grpc_health(lh.address) == "SERVING", 30, interval=0.2, what="SERVING again")
        # The manager is SERVING once a lighthouse gave it a config again: from then on its
        # workers get that config, not the fallback.
        poll(lambda: grpc_health(mgr.address) == "SERVING", 30, interval=0.1, what="manager SERVING")
        poll(lambda: metric(lh.url, "lighthouse_managers_fallback") == 0, 30, 0.1, "the fallback over")
        back_at = time.time()
        for record in records:  # the first step the worker asked for once the store was back
            if record["t"] - record["elapsed"] > back_at:
                break
        else:
            raise AssertionError("the worker ended before it asked for a step once the store was back")
        assert record["source"] != "fallback" and record["config"] == {"lr": "0.1"}, (back_at, record)
