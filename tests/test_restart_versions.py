"""Lighthouse restarts seen from a manager: never an older version, unless the state was reset.

The lighthouse restarts on the same gRPC port (the manager keeps dialing the
address it was given). A worker process steps through all of it; the versions
it gets from the lighthouse (sources other than "fallback") never go down
while the state is the same, and after the state dir is deleted the manager
says so in its log and serves the new state.
"""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import http_util
from tests.procs import ROOT, LighthouseProc, ProcessPool, child_env, poll, records_so_far

MANAGER_TIMEOUT = 0.5


def _manager_get(addr: str) -> dict[str, Any]:
    """What a worker would get now, through the ``manager get`` CLI."""
    out = subprocess.run(
        [sys.executable, "-m", "manager", "get", "--addr", addr, "--timeout", "5", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
        cwd=str(ROOT),
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _serving(addr: str, version: int, config: dict[str, str]) -> bool:
    got = _manager_get(addr)
    return got["version"] == version and got["config"] == config and got["source"] != "fallback"


@pytest.mark.slow
def test_manager_never_goes_back_unless_state_reset(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    state = tmp_path / "state"
    lh = procs.lighthouse({"lr": 0.1}, config_path=path, state_dir=state)
    port = lh.address.rpartition(":")[2]
    bind = f"127.0.0.1:{port}"

    def start_same_port() -> LighthouseProc:
        new = procs.lighthouse_when_free(config_path=path, state_dir=state, bind=bind)
        assert new.address.rpartition(":")[2] == port
        http_util.wait_healthy(new.url)
        return new

    http_util.wait_healthy(lh.url)
    for i in range(3):
        assert http_util.change(lh.url, "PATCH", {"step": i}).status == 200
    v4 = http_util.live(lh.url)["version"]
    cfg4 = {"lr": "0.1", "step": "2"}
    m = procs.manager(lh.address, "g0", cache_ttl=0.2, lighthouse_timeout=MANAGER_TIMEOUT, backoff=0.5)
    poll(lambda: _serving(m.address, v4, cfg4), 15, 0.1, f"manager serving version {v4}")
    worker = procs.worker(m.address, group="g0", rank=0, steps=100_000, step_interval=0.02, no_step=True)

    # 1. Crash and restart from the same state: the manager sees a new instance, same version.
    lh.signal(signal.SIGKILL)
    lh.wait(timeout=15)
    lh = start_same_port()
    poll(lambda: "lighthouse restarted" in m.stderr(), 15, 0.1, "manager noticing the restart")
    poll(lambda: _serving(m.address, v4, cfg4), 15, 0.1, f"manager serving version {v4} after restart")
    res = http_util.change(lh.url, "PATCH", {"step": 10})
    assert res.status == 200 and res.json["version"] == v4 + 1
    poll(lambda: _serving(m.address, v4 + 1, cfg4 | {"step": "10"}), 15, 0.1, "new version after restart")

    # 2. A stored state restored from an older copy (same state id, older head): the manager keeps
    #    what it served rather than going back.
    backup = tmp_path / "backup"
    lh.stop()
    shutil.copytree(state, backup)
    lh = start_same_port()
    assert http_util.change(lh.url, "PATCH", {"step": 20}).status == 200
    v6 = v4 + 2
    cfg6 = cfg4 | {"step": "20"}
    poll(lambda: _serving(m.address, v6, cfg6), 15, 0.1, f"manager serving version {v6}")
    lh.stop()
    shutil.rmtree(state)
    shutil.copytree(backup, state)
    lh = start_same_port()
    assert http_util.live(lh.url)["version"] == v4 + 1
    poll(lambda: m.stderr().count("lighthouse restarted") >= 3, 15, 0.1, "manager noticing the restart")
    poll(lambda: "older than the served" in m.stderr(), 15, 0.1, "manager refusing the older version")
    for _ in range(5):  # several cache TTLs: still the newer version
        got = _manager_get(m.address)
        assert got["version"] == v6 and got["config"] == cfg6, got
    assert "state was reset" not in m.stderr()

    # 3. State reset (state dir deleted): the manager says so and serves the new state's version 1.
    assert lh.stop() == 0
    shutil.rmtree(state)
    lh = start_same_port()
    assert http_util.live(lh.url)["version"] == 1
    poll(lambda: "state was reset" in m.stderr(), 15, 0.1, "manager logging the state reset")
    poll(lambda: _serving(m.address, 1, {"lr": "0.1"}), 15, 0.1, "manager serving the reset state")

    def worker_on_the_reset_state() -> bool:  # its own output lags the manager's switch
        records = records_so_far(worker)
        return bool(records) and records[-1]["version"] == 1 and records[-1]["source"] != "fallback"

    poll(worker_on_the_reset_state, 15, 0.05, "the worker served the reset state")
    reset_at_line = len(worker.lines())

    worker.signal(signal.SIGTERM)
    worker.wait(timeout=10)
    recs = [json.loads(line) for line in worker.lines()[:reset_at_line] if line.startswith("{")]
    served = [r["version"] for r in recs if r["source"] != "fallback"]
    assert len(served) > 50, len(served)
    went_back = [(a, b) for a, b in itertools.pairwise(served) if b < a]
    # Only the reset moved the manager back (from the newest version it served to the new state's 1).
    assert went_back == [(v6, 1)], went_back
    assert v6 in served and v4 + 1 in served
