"""``lighthouse config ...`` run as real processes against a real lighthouse."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers_lighthouse import LighthouseProc, run_cli, start_lighthouse
from tests.http_util import call
from tests.procs import ProcessPool, poll


@pytest.fixture(scope="module")
def lh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LighthouseProc]:
    with start_lighthouse(tmp_path_factory.mktemp("cli"), config={"lr": 0.1, "name": "start"}) as proc:
        yield proc
        assert "Traceback" not in proc.log()


def cli(lh: LighthouseProc, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    extra = ["--token", token] if token else []
    return run_cli("config", *args, "--url", lh.url, *extra)


def ok(lh: LighthouseProc, *args: str, token: str | None = None) -> str:
    result = cli(lh, *args, token=token)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout


def failed(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one-line error of a failed command."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    if code == 1:
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def show(lh: LighthouseProc) -> dict[str, Any]:
    view: dict[str, Any] = json.loads(ok(lh, "show", "-o", "json"))
    return view


def test_show(lh: LighthouseProc) -> None:
    view = show(lh)
    assert view["config"]["name"] == "start"
    assert isinstance(view["version"], int)


def test_set_decodes_values_as_json_when_they_parse(lh: LighthouseProc) -> None:
    version = show(lh)["version"]
    out = ok(lh, "set", "lr=0.01", "name=abc", "flag=true", "layers=[1,2]", 'quoted="7"', "--comment", "tune")
    assert out == f"version {version + 1}\n"
    config = show(lh)["config"]
    assert config["lr"] == 0.01 and config["name"] == "abc" and config["flag"] is True
    assert config["layers"] == [1, 2] and config["quoted"] == "7"
    assert json.loads(ok(lh, "history", "--limit", "1", "-o", "json"))["versions"][0]["comment"] == "tune"


def test_set_null_deletes(lh: LighthouseProc) -> None:
    ok(lh, "set", "doomed=1")
    ok(lh, "set", "doomed=null")
    assert "doomed" not in show(lh)["config"]


def test_set_with_stale_if_match_fails(lh: LighthouseProc) -> None:
    version = show(lh)["version"]
    assert "version conflict" in failed(cli(lh, "set", "x=1", "--if-match", str(version - 1)))
    ok(lh, "set", "x=1", "--if-match", str(version))


def test_load(lh: LighthouseProc, tmp_path: Path) -> None:
    path = tmp_path / "new.json"
    path.write_text('{"lr": 1.0, "from": "file"}')
    version = show(lh)["version"]
    assert ok(lh, "load", str(path)) == f"version {version + 1}\n"
    assert show(lh)["config"] == {"lr": 1.0, "from": "file"}
    bad = tmp_path / "bad.json"
    bad.write_text('{"lr": ')
    assert "not valid JSON" in failed(cli(lh, "load", str(bad)))
    bad.write_text("[1]")
    assert "must be a JSON object" in failed(cli(lh, "load", str(bad)))
    assert show(lh)["version"] == version + 1
    failed(cli(lh, "load", str(tmp_path / "missing.json")), code=2)


def test_history(lh: LighthouseProc) -> None:
    ok(lh, "set", "h=1")
    ok(lh, "set", "h=2")
    versions = json.loads(ok(lh, "history", "--limit", "2", "-o", "json"))["versions"]
    assert [v["config"]["h"] for v in versions] == [2, 1]
    assert {"version", "created_at", "source", "author", "comment"} <= set(versions[0])


def test_rollback(lh: LighthouseProc) -> None:
    ok(lh, "set", "r=old")
    old = show(lh)["version"]
    ok(lh, "set", "r=new")
    assert ok(lh, "rollback", str(old)) == f"version {old + 2}\n"
    assert show(lh)["config"]["r"] == "old"
    assert "99999" in failed(cli(lh, "rollback", "99999"))


def test_scheduled_and_cancel(lh: LighthouseProc) -> None:
    out = ok(lh, "set", "lr=0.5", "--at-step", "100000")
    assert out.endswith("(takes effect at step 100,000 in every group)\n")
    target = int(out.split()[1])
    view = show(lh)
    assert view["live"]["lr"] != 0.5  # live: not before its step
    assert (view["version"], view["config"]["lr"], view["from_step"]) == (target, 0.5, 100000)
    pending = json.loads(ok(lh, "scheduled", "-o", "json"))["scheduled"]
    assert [s["status"] for s in pending if s["version"] == target] == ["pending"]
    assert ok(lh, "cancel", str(target)) == f"cancelled {target}: version {target + 1}\n"
    assert "already cancelled" in failed(cli(lh, "cancel", str(target)))


def test_load_at_step_and_at_step_replay(lh: LighthouseProc, tmp_path: Path) -> None:
    path = tmp_path / "later.json"
    path.write_text('{"phase": 2}')
    target = int(ok(lh, "load", str(path), "--at-step", "200000").split()[1])
    assert json.loads(ok(lh, "at-step", "200000", "-o", "json"))["config"] == {"phase": 2}
    assert json.loads(ok(lh, "at-step", "0", "-o", "json"))["config"] != {"phase": 2}
    ok(lh, "cancel", str(target))


def test_managers(lh: LighthouseProc) -> None:
    answer = json.loads(ok(lh, "managers", "-o", "json"))
    assert answer["managers"] == [] and answer["version"] == show(lh)["version"]


def test_usage_errors_exit_2(lh: LighthouseProc) -> None:
    assert "KEY=VALUE" in failed(cli(lh, "set", "no-equals-sign"), code=2)
    assert "KEY=VALUE" in failed(cli(lh, "set", "=1"), code=2)
    failed(cli(lh, "set"), code=2)
    failed(cli(lh, "rollback", "abc"), code=2)
    failed(cli(lh, "set", "a=1", "--at-step", "-1"), code=2)


def test_unreachable_lighthouse(tmp_path: Path) -> None:
    result = run_cli("config", "show", "--url", "http://127.0.0.1:9", "--timeout", "2")
    assert "cannot reach the lighthouse" in failed(result)


def test_url_from_env_and_token(tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 1}, token="t0k") as secured:
        env = {"LIGHTHOUSE_URL": secured.url}
        assert json.loads(run_cli("config", "show", "-o", "json", env=env).stdout)["config"] == {"lr": 1}
        assert "token required" in failed(run_cli("config", "set", "lr=2", env=env))
        assert "wrong admin token" in failed(run_cli("config", "set", "lr=2", "--token", "nope", env=env))
        result = run_cli("config", "set", "lr=2", env={**env, "LIGHTHOUSE_ADMIN_TOKEN": "t0k"})
        assert result.returncode == 0, result.stderr
        assert run_cli("config", "rollback", "1", "--token", "t0k", env=env).returncode == 0
        assert json.loads(run_cli("config", "show", "-o", "json", env=env).stdout)["config"] == {"lr": 1}


@pytest.mark.slow
def test_several_urls_use_the_first_that_answers(procs: ProcessPool) -> None:
    """--url A,B (and LIGHTHOUSE_URL=A,B): a dead A is skipped, reads and changes go to B."""
    dead = procs.lighthouse({"lr": 0.1}, state_dir=procs.tmp_path / "dead")
    dead.stop()  # its port is closed now: a lighthouse that went away
    live = procs.lighthouse({"lr": 0.1}, state_dir=procs.tmp_path / "live")
    urls = f"{dead.url},{live.url}"
    shown = run_cli("config", "show", "--url", urls, "-o", "json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["config"] == {"lr": 0.1}, shown.stderr
    changed = run_cli("config", "set", "lr=0.2", env={"LIGHTHOUSE_URL": urls})
    assert changed.stdout == "version 2\n", changed.stderr
    assert call(live.url, "GET", "api/config").json["config"] == {"lr": 0.2}
    both_dead = run_cli("config", "show", "--url", f"{dead.url},{dead.url}")
    assert "cannot reach any lighthouse: " in failed(both_dead) and "Connection refused" in both_dead.stderr


@pytest.mark.slow
def test_a_hung_lighthouse_is_skipped_for_reads_but_a_change_is_never_sent_twice(procs: ProcessPool) -> None:
    hung = procs.lighthouse({"lr": 0.1}, state_dir=procs.tmp_path / "hung")
    live = procs.lighthouse({"lr": 0.1}, state_dir=procs.tmp_path / "live")
    hung.signal(signal.SIGSTOP)  # accepts connections (the kernel does) but never answers
    try:
        urls = f"{hung.url},{live.url}"
        shown = run_cli("config", "show", "--url", urls, "--timeout", "1", "-o", "json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["version"] == 1, shown.stderr
        # A change sent to the hung one may still be applied: it is not resent to the next.
        refused = run_cli("config", "set", "lr=0.5", "--url", urls, "--timeout", "1")
        assert "the change may or may not have been applied" in failed(refused)
        assert call(live.url, "GET", "api/config").json["version"] == 1
    finally:
        hung.signal(signal.SIGCONT)
    # Once the hung lighthouse runs again it reads the request it had been sent, and applies it once.
    poll(lambda: call(hung.url, "GET", "api/config").json["config"] == {"lr": 0.5}, 30, what="the change")
    assert call(hung.url, "GET", "api/config").json["version"] == 2
