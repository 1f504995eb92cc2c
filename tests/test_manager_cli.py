"""``manager get`` and ``manager status`` against real managers, and pointed at the wrong thing."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest

from tests.procs import ProcessPool, manager_cli, poll, worker_records


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == "" and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr
    return done.stderr


def status_json(addr: str) -> dict[str, Any]:
    done = manager_cli("status", "--addr", addr, "-o", "json")
    assert done.returncode == 0, done.stderr
    info: dict[str, Any] = json.loads(done.stdout)
    return info


@pytest.mark.slow
def test_status_and_get_of_a_real_manager(procs: ProcessPool) -> None:
    gone = procs.lighthouse({"lr": 0.1}, state_dir=procs.tmp_path / "gone")
    gone.stop()
    lh = procs.lighthouse({"lr": 0.1, "name": "x"}, state_dir=procs.tmp_path / "live")
    manager = procs.manager(f"{gone.address},{lh.address}", "group0", cache_ttl=0.2)
    worker_records(procs.worker(manager.address, group="group0", rank=0, first_step=100, steps=5))

    info = poll(lambda: (i := status_json(manager.address))["pinned_steps"] == 5 and i, 20, what="pins")
    assert info["replica_id"] == "group0" and info["job"] == "default" and info["address"] == manager.address
    assert info["source"] == "cache" and info["version"] == 1 and info["last_error"] == ""
    assert info["lighthouse"] == lh.address and info["lighthouses"] == [gone.address, lh.address]
    assert (info["first_pinned_step"], info["last_pinned_step"]) == (100, 104)
    assert info["cache_age_s"] >= 0 and info["last_answer_age_s"] >= 0 and info["cache_ttl_s"] == 0.2
    lease = info["lease_through_step"]
    assert lease >= 104 and info["requests"] >= 5  # the steps served are promised, and beyond

    table = manager_cli("status", "--addr", manager.address)
    assert table.returncode == 0 and table.stderr == "", table.stderr
    rows = {line[:14].strip(): line[14:] for line in table.stdout.splitlines()}
    assert rows["replica"] == "group0 (job default)" and rows["source"] == "cache" and rows["version"] == "1"
    assert re.fullmatch(r"\d+\.\d s \(TTL 0\.2 s\)", rows["cache age"]), rows
    assert re.fullmatch(rf"{re.escape(lh.address)} \(2 of 2\), last answer \d+\.\d s ago", rows["lighthouse"])
    assert rows["pinned steps"] == "5 (steps 100 to 104)" and rows["lease"].startswith("through step ")

    got = manager_cli("get", "--addr", manager.address, "--step", "102")
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [
        "KEY   VALUE",
        "lr    0.1",
        "name  x",
        "",
        "version 1 of job default, source cache, pinned for step 102",
    ]

    # The lighthouse goes away, and the group steps past its lease: the manager says what it serves
    # now (the fallback: it cannot confirm a config for those steps), and why.
    lh.stop()
    past = status_json(manager.address)["lease_through_step"] + 1
    worker_records(procs.worker(manager.address, group="group0", rank=0, first_step=past, steps=2))
    info = poll(lambda: (i := status_json(manager.address))["source"] == "fallback" and i, 30, what="outage")
    assert info["version"] == 0 and "UNAVAILABLE" in info["last_error"]
    assert "last error" in manager_cli("status", "--addr", manager.address).stdout


@pytest.mark.slow
def test_pointed_at_a_lighthouse_or_at_nothing_they_say_so(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    for command in ("get", "status"):
        error = one_line_error(manager_cli(command, "--addr", lh.address))
        assert f"{lh.address} is a lighthouse's gRPC port (config version 1), not a manager" in error
        assert "`lighthouse config show --url" in error and "UNIMPLEMENTED" not in error
        dashboard = lh.url.removeprefix("http://").rstrip("/")
        assert "speaks HTTP/1.1, not gRPC" in one_line_error(manager_cli(command, "--addr", dashboard))
    stopped = procs.manager(lh.address, "g0")
    stopped.stop()
    for command in ("get", "status"):
        error = one_line_error(manager_cli(command, "--addr", stopped.address, "--timeout", "5"))
        expected = f"no manager at {stopped.address}: connection refused (is `manager serve` running there?)"
        assert error == f"error: {expected}\n"
