"""End to end with real processes started through the CLIs: lighthouse -> 2 managers -> 4 workers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from protos.rpc import parse_address
from tests.http_util import call
from tests.procs import ROOT, ProcessPool, child_env, wait_ready, worker_records

# Written as UTF-8 text (not \u escapes): unicode keys, nested values, every JSON type.
CONFIG_TEXT = """{
  "lr": 0.001,
  "name": "run-1",
  "学习率": 0.5,
  "émoji🚀": {"nested": [1, null, {"ключ": "значение"}], "ok": true},
  "use_amp": true,
  "dropout": false,
  "warmup": 100,
  "schedule": [0.1, 0.01, 0.001],
  "empty": "",
  "tiny": 1e-05,
  "quoted": "0.5"
}
"""

# What every worker must receive: strings as they are, everything else as compact JSON text.
EXPECTED = {
    "lr": "0.001",
    "name": "run-1",
    "学习率": "0.5",
    "émoji🚀": '{"nested":[1,null,{"ключ":"значение"}],"ok":true}',
    "use_amp": "true",
    "dropout": "false",
    "warmup": "100",
    "schedule": "[0.1,0.01,0.001]",
    "empty": "",
    "tiny": "0.00001",  # the seed's spelling (serde_json), where Python writes 1e-05
    "quoted": "0.5",
}

STEPS = 60


def run_cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        cwd=str(ROOT),
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], result.stderr


@pytest.mark.slow
def test_relay_two_managers_four_workers(procs: ProcessPool) -> None:
    lh = procs.lighthouse(CONFIG_TEXT)
    _, port = parse_address(lh.address)
    assert port != 0  # port 0 was asked for; the printed line is the bound port
    assert lh.url.startswith("http://")

    managers = [procs.manager(lh.address, f"g{i}", cache_ttl=0.2) for i in range(2)]
    workers = [
        procs.worker(m.address, group=f"g{i}", rank=rank, steps=STEPS, step_interval=0.002, wait=False)
        for i, m in enumerate(managers)
        for rank in range(2)
    ]
    wait_ready(workers)
    records = [r for w in workers for r in worker_records(w)]

    assert len(records) == 4 * STEPS
    assert {(r["group"], r["rank"]) for r in records} == {("g0", 0), ("g0", 1), ("g1", 0), ("g1", 1)}
    for r in records:
        assert r["config"] == EXPECTED, r
        assert r["source"] in ("cache", "lighthouse"), r
        assert r["pinned"] is True
    versions = {r["version"] for r in records}
    assert len(versions) == 1 and versions.pop() >= 1

    # The lighthouse's own view agrees on the version, and keeps the original JSON types.
    answer = call(lh.url, "GET", "/api/config")
    assert answer.status == 200
    view = answer.json
    assert view["version"] == records[0]["version"]
    assert view["config"] == json.loads(CONFIG_TEXT)

    # `manager get` prints what a worker would get, as JSON.
    got = run_cli("-m", "manager", "get", "--addr", managers[1].address, "--step", "7", "-o", "json")
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["config"] == EXPECTED
    assert out["version"] == records[0]["version"]
    assert out["pinned"] is True and out["source"] in ("cache", "lighthouse")
    unpinned = json.loads(
        run_cli("-m", "manager", "get", "--addr", f"http://{managers[0].address}", "-o", "json").stdout
    )
    assert unpinned["config"] == EXPECTED and unpinned["pinned"] is False


def test_strict_invalid_json_exits_2_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken-config.json"
    bad.write_text('{"lr": 0.1,}')
    result = run_cli(
        "-m", "lighthouse", "serve", "--bind", "127.0.0.1:0", "--http-bind", "off",
        "--state-dir", str(tmp_path / "st"), "--config", str(bad), "--strict",
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""  # no address printed: it never served
    assert_one_line_error(result, str(bad), "not valid JSON")


def test_strict_missing_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    result = run_cli(
        "-m", "lighthouse", "serve", "--bind", "127.0.0.1:0", "--http-bind", "off",
        "--state-dir", str(tmp_path / "st"), "--lighthouse-config", str(missing), "--strict",
    )  # fmt: skip
    assert result.returncode == 2
    assert_one_line_error(result, str(missing))


@pytest.mark.parametrize(
    ("args", "code", "needles"),
    [
        (("-m", "lighthouse", "serve", "--bogus"), 2, ("--bogus",)),
        (("-m", "manager", "serve", "--replica-id", "g"), 2, ("--lighthouse",)),
        (("-m", "manager", "serve", "--lighthouse", "h:1", "--replica-id", "g", "--cache-ttl", "0"), 2, ()),
        (("-m", "manager", "serve", "--lighthouse", "nonsense", "--replica-id", "g"), 1, ("nonsense",)),
        (("-m", "lighthouse", "serve", "--bind", "nonsense", "--http-bind", "off"), 1, ("nonsense",)),
        (("-m", "manager", "get", "--addr", "nonsense"), 1, ("nonsense",)),
        (("-m", "manager", "get", "--addr", "127.0.0.1:1", "--timeout", "0.5"), 1, ("127.0.0.1:1",)),
        (("-m", "manager", "get", "--addr", "127.0.0.1:1", "--step", "x"), 2, ("--step",)),
    ],
)
def test_bad_invocations_give_a_short_error(
    tmp_path: Path, args: tuple[str, ...], code: int, needles: tuple[str, ...]
) -> None:
    full = [*args]
    if "lighthouse" in args and "serve" in args:
        full += ["--state-dir", str(tmp_path / "st")]
    result = run_cli(*full)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    error_lines = [line for line in result.stderr.splitlines() if line.lower().startswith("error")]
    assert len(error_lines) == 1, result.stderr
    for needle in needles:
        assert needle in error_lines[0], result.stderr
    if code == 1:
        assert_one_line_error(result)  # runtime errors: nothing but the one line


def test_port_in_use_is_an_error_not_a_traceback(procs: ProcessPool, tmp_path: Path) -> None:
    lh = procs.lighthouse({"a": 1}, http_bind="off")
    result = run_cli(
        "-m", "lighthouse", "serve", "--bind", lh.address, "--http-bind", "off",
        "--state-dir", str(tmp_path / "other"),
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot listen on")
    m = procs.manager(lh.address, "g0")
    result = run_cli(
        "-m", "manager", "serve", "--lighthouse", lh.address, "--replica-id", "x", "--bind", m.address
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot listen on")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_exits_0_on_signal(procs: ProcessPool, sig: signal.Signals) -> None:
    lh = procs.lighthouse({"a": 1})
    m = procs.manager(lh.address, "g0")
    w = procs.worker(m.address, group="g0", rank=0, steps=3)
    assert [r["config"] for r in worker_records(w)] == [{"a": "1"}] * 3  # both really served
    m.signal(sig)
    assert m.wait(timeout=15) == 0, m.stderr()
    lh.signal(sig)
    assert lh.wait(timeout=15) == 0, lh.stderr()
    assert "Traceback" not in lh.stderr() + m.stderr()
    assert sig.name in lh.stderr() and sig.name in m.stderr()  # logged on stderr, not stdout
    assert len(lh.lines()) == 2 and len(m.lines()) == 1  # stdout: only the bound addresses


def test_manager_reads_lighthouse_from_env(procs: ProcessPool) -> None:
    from tests.procs import ManagerProc

    lh = procs.lighthouse({"from": "env"}, http_bind="off")
    args = [sys.executable, "-m", "manager", "serve", "--bind", "127.0.0.1:0", "--replica-id", "g"]
    m: ManagerProc = procs.spawn(args, "manager-env", ManagerProc, env={"TORCHFT_LIGHTHOUSE": lh.address})
    m.address = m.readline()
    w = procs.worker(m.address, group="g", rank=0, steps=2)
    assert [r["config"] for r in worker_records(w)] == [{"from": "env"}] * 2


def test_manager_reads_a_lighthouse_list_and_the_job_from_env(procs: ProcessPool) -> None:
    """``TORCHFT_LIGHTHOUSE`` may list several lighthouses and ``LIGHTHOUSE_JOB`` names the job. The
    list holds one address with nothing listening, once first and once last: whichever the manager
    starts with, its workers get the live config of the job, never the fallback."""
    from tests.etcd_cluster import free_port
    from tests.procs import ManagerProc

    lh = procs.lighthouse({"lr": 0.1})
    assert call(lh.url, "PUT", "api/jobs/alpha/config", {"lr": 0.5}).status == 200
    nothing_there = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "manager", "serve", "--bind", "127.0.0.1:0", "--replica-id", "g"]
    for listed in (f"{nothing_there},{lh.address}", f"{lh.address},{nothing_there}"):
        env = {"TORCHFT_LIGHTHOUSE": listed, "LIGHTHOUSE_JOB": "alpha"}
        m: ManagerProc = procs.spawn(args, "manager-env", ManagerProc, env=env)
        m.address = m.readline()
        records = worker_records(procs.worker(m.address, group="g", rank=0, steps=3))
        assert [(r["config"], r["source"] != "fallback") for r in records] == [({"lr": "0.5"}, True)] * 3


def test_help_texts() -> None:
    top = run_cli("-m", "lighthouse", "--help")
    assert top.returncode == 0 and "serve" in top.stdout and "Usage:" in top.stdout
    serve = run_cli("-m", "lighthouse", "serve", "--help")
    assert serve.returncode == 0
    for flag in ("--bind", "--http-bind", "--config", "--lighthouse-config", "--state-dir", "--admin-token"):
        assert flag in serve.stdout, flag
    assert "29510" in serve.stdout  # the documented default port
    manager = run_cli("-m", "manager", "--help")
    assert manager.returncode == 0 and "serve" in manager.stdout and "get" in manager.stdout
    mserve = run_cli("-m", "manager", "serve", "-h")
    for flag in (
        "--lighthouse",
        "--bind",
        "--replica-id",
        "--cache-ttl",
        "--lighthouse-timeout",
        "--serve-stale",
    ):
        assert flag in mserve.stdout, flag
    assert "TORCHFT_LIGHTHOUSE" in mserve.stdout
    mget = run_cli("-m", "manager", "get", "--help")
    assert "--addr" in mget.stdout and "--step" in mget.stdout and "JSON" in mget.stdout
