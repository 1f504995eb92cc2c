"""Defects an independent review found, each pinned down by a test that failed before its fix."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lighthouse import LighthouseClient, LighthouseServer
from lighthouse.config.values import MAX_CONFIG_BYTES, ConfigTooLarge
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.sqlite import SqliteBackend
from manager import ManagerServer
from manager.pinning import StepPins
from manager.snapshot import Snapshot
from protos import lighthouse_config_pb2 as pb
from tests.helpers_lighthouse import start_lighthouse
from tests.http_util import call
from tests.procs import ROOT, ProcessPool, poll, worker_records
from tests.threads import CheckedThread
from worker_client import ManagerClient


def test_concurrent_changes_never_leave_an_older_snapshot_served() -> None:
    # Two refreshes racing: the one that read the older head must not install its snapshot last.
    for _ in range(60):
        state = LighthouseState(ConfigStore(SqliteBackend()))
        change = functools.partial(state.change, source="t")
        threads = [CheckedThread(change, "patch", {f"k{i}": i}, name=f"change-{i}") for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.check()
        assert state.snapshot.version == state.store.head == 4


def test_one_stray_step_far_ahead_does_not_unpin_the_group() -> None:
    pins = StepPins(window=8)
    snap = Snapshot.from_reply(pb.LighthouseConfigResponse(version=1, config_data={"lr": "1"}))
    for step in range(100):
        assert pins.pin(step, snap, b"x") == b"x"
    assert pins.pin(10**9, snap, b"stray") is None  # answered unpinned, remembered as a possible leap
    assert pins.max_step == 99
    assert pins.pin(100, snap, b"y") == b"y" and not pins.outside_window(95)
    # A real leap (a restore at a later step): the group goes on from there, so it is taken.
    assert pins.pin(5000, snap, b"a") is None
    assert pins.pin(5001, snap, b"b") == b"b"
    assert pins.max_step == 5001


@pytest.mark.slow
def test_manager_get_looks_without_pinning_or_moving_the_step(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    manager = procs.manager(lh.address, "g", cache_ttl=0.05)
    first = worker_records(procs.worker(manager.address, group="g", rank=0, first_step=100, steps=1))
    assert first[0]["pinned"] and first[0]["config"] == {"lr": "0.1"}
    out = subprocess.run(
        [sys.executable, "-m", "manager", "get", "--addr", manager.address, "--step", "5000", "-o", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["pinned"] is False
    call(lh.url, "PATCH", "/api/config", {"lr": 0.5})
    poll(lambda: call(lh.url, "GET", "/api/managers").json["managers"][0]["version"] == 2, 10, what="v2")
    again = worker_records(procs.worker(manager.address, group="g", rank=1, first_step=100, steps=1))
    assert again[0]["pinned"] and again[0]["config"] == {"lr": "0.1"}, "step 100 lost its pin"
    assert call(lh.url, "GET", "/api/config").json["current_step"] < 5000


def test_prefetch_does_not_follow_an_irregular_jump() -> None:
    lh = LighthouseServer("127.0.0.1:0")
    manager = ManagerServer(lh.address(), "127.0.0.1:0", "g")
    try:
        with ManagerClient(manager.address(), prefetch=True) as client:
            for step in [0, 1, 2, 3, 5000]:
                client.get_config(step=step)
                if step < 5000:
                    poll(lambda s=step: manager._pins.max_step >= s, 5, what=f"step {step} pinned")
            other = ManagerClient(manager.address()).get_config(step=5001)
            assert other.pinned, "a step right after the jump must still be pinned"
            assert manager._pins.max_step < 9000
    finally:
        manager.shutdown()
        lh.shutdown()


def test_a_stray_reported_step_does_not_move_the_jobs_step() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    report = lambda step: state.observe(pb.ManagerStatus(replica_id="g", step=step), "peer")  # noqa: E731
    report(10)
    report(20)
    report(10**15)  # one wrong report
    assert state.store.current_step == 20
    report(30)
    assert state.store.current_step == 30


def test_rollback_keeps_that_versions_scheduled_change_scheduled() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    state.store.advance_step(100)
    state.change("put", {"lr": 0.1, "bs": 32}, source="t")
    scheduled = state.change("patch", {"lr": 0.01}, source="t", effective_step=5000).version
    state.change("patch", {"bs": 64}, source="t")
    state.rollback(scheduled)
    assert state.store.live() == {"lr": 0.1, "bs": 32}, "the scheduled lr must not apply before its step"
    assert state.store.resolve(state.store.head, 5000) == {"lr": 0.01, "bs": 32}


def test_patches_cannot_grow_the_config_past_the_limit() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    chunk = "x" * (MAX_CONFIG_BYTES // 3)
    state.change("patch", {"a": chunk}, source="t")
    state.change("patch", {"b": chunk}, source="t")
    with pytest.raises(ConfigTooLarge):
        state.change("patch", {"c": chunk + "more"}, source="t")
    assert state.store.head == 2


def test_patch_over_the_limit_is_413_and_changes_nothing(tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 0.1}) as lh:
        chunk = "x" * (MAX_CONFIG_BYTES // 2)
        assert call(lh.url, "PATCH", "/api/config", {"a": chunk}).status == 200
        answer = call(lh.url, "PATCH", "/api/config", {"b": chunk})
        assert answer.status == 413 and "max" in answer.json["error"]
        assert call(lh.url, "GET", "/api/config").json["version"] == 2


@pytest.mark.slow
def test_an_oversized_config_file_is_a_file_error_not_a_crash(procs: ProcessPool) -> None:
    big = {"blob": "x" * (MAX_CONFIG_BYTES + 10)}
    lh = procs.lighthouse(big)
    view = call(lh.url, "GET", "/api/config").json
    assert view["config"] == {} and "max" in view["file"]["error"]


@pytest.mark.slow
def test_changes_under_a_foreign_host_name_need_a_token(tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 0.1}, args=("--allowed-host", "lighthouse.internal")) as lh:
        rebound = call(lh.url, "PATCH", "/api/config", {"lr": 9}, headers={"Host": "evil.example:29511"})
        assert rebound.status == 403 and "--allowed-host" in rebound.json["error"]
        assert (
            call(lh.url, "GET", "/api/config", headers={"Host": "evil.example"}).status == 403
        )  # reads too (issue 26: tests/test_http_hardening.py)
        named = call(lh.url, "PATCH", "/api/config", {"lr": 2}, headers={"Host": "lighthouse.internal:1"})
        assert named.status == 200
        assert call(lh.url, "PATCH", "/api/config", {"lr": 3}).status == 200  # Host is an IP literal
        assert call(lh.url, "GET", "/api/config").json["config"] == {"lr": 3}
    with start_lighthouse(tmp_path, config={"lr": 0.1}, token="t") as lh:
        with_token = call(
            lh.url,
            "PATCH",
            "/api/config",
            {"lr": 4},
            headers={"Host": "evil.example", "Authorization": "Bearer t"},
        )
        assert with_token.status == 200  # a token is what a rebinding page cannot have


def test_metrics_print_counters_exactly(tmp_path: Path) -> None:
    big = 1_234_567  # past a million, where "%g" would print 1.23457e+06
    with start_lighthouse(tmp_path, config={"lr": 0.1}) as lh:
        with LighthouseClient(lh.grpc_addr) as client:
            for step in (big,):  # a job that never stepped takes its first reported step
                client.heartbeat(pb.ManagerStatus(replica_id="g", version=big, step=step), timeout=5)
        text = call(lh.url, "GET", "/metrics").body.decode()
    lines = text.splitlines()
    assert f'lighthouse_current_step{{job="default"}} {big}' in lines, text
    assert f'lighthouse_manager_version{{job="default",replica_id="g"}} {big}' in lines, text
    values = [line.split()[-1] for line in lines if line and not line.startswith("#")]
    assert values and all("e+" not in v for v in values)


@pytest.mark.slow
def test_a_second_lighthouse_on_the_same_state_dir_is_refused(procs: ProcessPool, tmp_path: Path) -> None:
    procs.lighthouse({"lr": 0.1}, state_dir=tmp_path / "shared")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lighthouse",
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--http-bind",
            "off",
            "--state-dir",
            str(tmp_path / "shared"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 1
    assert "in use by lighthouse pid" in out.stderr and "Traceback" not in out.stderr
