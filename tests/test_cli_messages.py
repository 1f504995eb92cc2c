"""What the admin CLI says when an operator makes the usual mistakes: one line that names what to do.

Real processes: a real lighthouse, real managers and reporting workers, the CLI as ``python -m
lighthouse``. Each failure is asserted to be exactly one ``error: ...`` line with no traceback.
"""

from __future__ import annotations

import getpass
import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from tests.helpers_lighthouse import LighthouseProc, run_cli, start_lighthouse
from tests.http_util import call
from tests.procs import ProcessPool, child_env, poll, worker_records


@pytest.fixture(scope="module")
def lh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LighthouseProc]:
    with start_lighthouse(tmp_path_factory.mktemp("messages"), config={"lr": 0.1}) as proc:
        yield proc


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LighthouseProc]:
    with start_lighthouse(tmp_path_factory.mktemp("guarded"), config={"lr": 0.1}, token="s3cret") as proc:
        yield proc


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_the_grpc_port_is_named_as_such(lh: LighthouseProc) -> None:
    error = one_error_line(run_cli("config", "show", "--url", f"http://{lh.grpc_addr}"))
    assert "does not answer HTTP/1.1" in error and "gRPC port" in error, error
    assert "--url takes its dashboard port" in error, error


def test_a_refused_connection_drops_the_https_hint() -> None:
    error = one_error_line(run_cli("config", "show", "--url", f"http://127.0.0.1:{free_port()}"))
    assert "Connection refused" in error and "is the lighthouse running?" in error, error
    assert "https" not in error.lower(), error


@pytest.mark.slow
def test_a_missing_token_names_the_flag(guarded: LighthouseProc) -> None:
    error = one_error_line(run_cli("config", "set", "lr=0.2", "--url", guarded.url))
    assert "pass --token TOKEN (or set LIGHTHOUSE_ADMIN_TOKEN)" in error, error
    assert "Authorization" not in error, error
    wrong = one_error_line(run_cli("config", "set", "lr=0.2", "--url", guarded.url, "--token", "nope"))
    assert wrong.startswith("error: wrong admin token: pass --token"), wrong


def test_a_mistyped_job_is_refused_until_create_says_so(lh: LighthouseProc) -> None:
    error = one_error_line(run_cli("config", "set", "lr=0.001", "--job", "exp22", "--url", lh.url))
    assert "job 'exp22' does not exist" in error and "pass --create" in error, error
    assert "default" in error, "the known jobs are listed"
    assert call(lh.url, "GET", "/api/jobs/exp22").status == 404, "nothing was created"
    made = run_cli("config", "set", "lr=0.001", "--job", "exp22", "--create", "--url", lh.url)
    assert made.returncode == 0, made.stderr
    assert call(lh.url, "GET", "/api/jobs/exp22/config").json["config"] == {"lr": 0.001}
    again = run_cli("config", "set", "lr=0.002", "--job", "exp22", "--url", lh.url)
    assert again.returncode == 0, "an existing job needs no --create"


def test_the_default_job_needs_no_create(tmp_path_factory: pytest.TempPathFactory) -> None:
    with start_lighthouse(tmp_path_factory.mktemp("empty")) as empty:
        done = run_cli("config", "set", "lr=0.5", "--url", empty.url)
        assert done.returncode == 0, done.stderr
        assert call(empty.url, "GET", "/api/config").json["config"] == {"lr": 0.5}


def test_jobs_delete_asks_first(lh: LighthouseProc) -> None:
    made = run_cli("config", "set", "x=1", "--job", "scratch", "--create", "--url", lh.url)
    assert made.returncode == 0, made.stderr
    asked = subprocess.run(
        [sys.executable, "-m", "lighthouse", "jobs", "delete", "scratch", "--url", lh.url],
        input="n\n",
        capture_output=True,
        text=True,
        env=child_env(None),
        timeout=30,
    )
    assert asked.returncode == 1 and "delete job 'scratch'" in asked.stderr, asked.stderr
    assert call(lh.url, "GET", "/api/jobs/scratch").status == 200, "not deleted without a yes"
    gone = run_cli("jobs", "delete", "scratch", "--yes", "--url", lh.url)
    assert gone.returncode == 0 and "deleted job scratch" in gone.stdout, gone.stderr
    assert call(lh.url, "GET", "/api/jobs/scratch").status == 404
    listed = run_cli("jobs", "--url", lh.url, "-o", "json")
    assert listed.returncode == 0 and "scratch" not in [j["job"] for j in json.loads(listed.stdout)["jobs"]]


def test_the_author_is_the_user_unless_told(lh: LighthouseProc) -> None:
    assert run_cli("config", "set", "a=1", "--url", lh.url).returncode == 0
    assert run_cli("config", "set", "a=2", "--url", lh.url, "--author", "alice").returncode == 0
    versions = call(lh.url, "GET", "/api/config/history?limit=2").json["versions"]
    assert [v["author"] for v in versions] == ["alice", getpass.getuser()]


@pytest.mark.slow
def test_an_unknown_metric_lists_the_known_ones(tmp_path_factory: pytest.TempPathFactory) -> None:
    pool = ProcessPool(tmp_path_factory.mktemp("metrics"))
    try:
        lighthouse = pool.lighthouse({"lr": 0.1})
        manager = pool.manager(lighthouse.address, "g0")
        worker_records(pool.worker(manager.address, group="g0", rank=0, steps=5, extra=["--report"]))
        poll(
            lambda: call(lighthouse.url, "GET", "/api/metrics").json["metrics"].get("loss"),
            15,
            what="the reported loss",
        )
        error = one_error_line(run_cli("metrics", "--name", "nosuch", "--url", lighthouse.url))
        assert "no metric named 'nosuch'" in error and "reported: loss, tokens" in error, error
        shown = run_cli("metrics", "--name", "loss", "--url", lighthouse.url)
        assert shown.returncode == 0 and shown.stdout.startswith("METRIC"), shown.stderr
    finally:
        pool.stop_all()


@pytest.mark.slow
def test_a_token_where_none_is_needed_is_said(lh: LighthouseProc, guarded: LighthouseProc) -> None:
    """Against an open job, --token is said to be unneeded (one note line), not silently accepted."""
    result = run_cli("config", "set", "lr=0.3", "--url", lh.url, "--token", "s3cret")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["note: job default needs no token; --token was not needed"]
    # The header it rides on: only when a token came to a job that needs none.
    request = urllib.request.Request(
        lh.url.rstrip("/") + "/api/config",
        data=b'{"lr": 0.4}',
        method="PATCH",
        headers={"Content-Type": "application/json", "Authorization": "Bearer s3cret"},
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.headers.get("X-Lighthouse-Token") == "not-needed"
    quiet = run_cli("config", "set", "lr=0.5", "--url", lh.url)
    assert quiet.returncode == 0 and "note:" not in quiet.stderr, quiet.stderr
    needed = run_cli("config", "set", "lr=0.2", "--url", guarded.url, "--token", "s3cret")
    assert needed.returncode == 0 and "note:" not in needed.stderr, needed.stderr


@pytest.mark.slow
def test_jobs_help_does_not_offer_a_token_for_changes_on_its_listing() -> None:
    result = run_cli("jobs", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "where changes need one" not in text, text
    assert "reads need none" in text, text
