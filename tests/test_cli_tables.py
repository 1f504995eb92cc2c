"""The operator CLI's tables and ``-o json`` against a real lighthouse with a known history, and a
real manager in its managers table; colour only on a terminal.

History of the job ``default``:
  1 file    {"lr": 0.1, "name": "start"}
  2 api     set lr=0.05 (comment "tune")
  3 api     set warmup=100 name=null
  4 api     set lr=0.5 --at-step 100000 (comment "later")
plus a schema set through the API.
"""

from __future__ import annotations

import getpass
import json
import os
import pty
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest

from protos.cli_output import with_iso_times
from tests.helpers_lighthouse import LighthouseProc, run_cli, start_lighthouse
from tests.http_util import get_json
from tests.procs import ROOT, ManagerProc, ProcessPool, child_env, poll

ANSI = "\x1b["
USER = getpass.getuser()  # the CLI records the operating-system user as the author


@dataclass
class Job:
    lh: LighthouseProc
    manager: ManagerProc


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    home = tmp_path_factory.mktemp("tables")
    pool = ProcessPool(home)
    schema = home / "schema.json"
    schema.write_text('{"type": "object"}')
    try:
        with start_lighthouse(home, config={"lr": 0.1, "name": "start"}) as lh:
            for args in (
                ["set", "lr=0.05", "--comment", "tune"],
                ["set", "warmup=100", "name=null"],
                ["set", "lr=0.5", "--at-step", "100000", "--comment", "later"],
                ["schema", "set", str(schema), "--comment", "permissive"],
            ):
                done = run_cli("config", *args, "--url", lh.url)
                assert done.returncode == 0, done.stderr
            manager = pool.manager(lh.grpc_addr, "group0", cache_ttl=0.2)
            # Listed once it holds the head (its first report may come before its first fetch).
            poll(
                lambda: [m for m in get_json(lh.url, "api/managers")["managers"] if m["version"] == 4],
                20,
                what="the manager in the table, holding version 4",
            )
            yield Job(lh, manager)
            assert "Traceback" not in lh.log()
    finally:
        pool.stop_all()


def table_out(job: Job, *args: str) -> list[str]:
    """The command's stdout lines (a pipe: no colour); it must succeed with nothing on stderr."""
    done = run_cli(*args, "--url", job.lh.url)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert ANSI not in done.stdout  # stdout is a pipe here
    return done.stdout.splitlines()


def columns(line: str) -> list[str]:
    return re.split(r" {2,}", line.strip())


@pytest.mark.slow
def test_config_show(job: Job) -> None:
    lines = table_out(job, "config", "show")
    assert [columns(line) for line in lines[:3]] == [["KEY", "VALUE"], ["lr", "0.05"], ["warmup", "100"]]
    assert lines[3] == ""
    assert re.fullmatch(
        rf"version 4, (just now|\d+ (s|min) ago) by {re.escape(USER)} \(api\): later", lines[4]
    ), lines[4]
    # The table is the live config (version 3's); version 4's holds from its step.
    assert lines[5] == "live: version 3 (above); version 4: its config from step 100,000"
    assert lines[6:8] == [f"scheduled: version 4 at step 100,000 by {USER}: later", "    ~ lr: 0.05 -> 0.5"]
    assert lines[8:] == ["schema: set through the API"]


@pytest.mark.slow
def test_config_history_is_one_line_per_version_with_its_diff(job: Job) -> None:
    lines = table_out(job, "config", "history")
    rows = [columns(line) for line in lines if not line.startswith(" ")]
    assert [r[0] for r in rows] == ["4", "3", "2", "1"]
    assert [r[2:] for r in rows] == [
        [USER, "api", "at step 100,000", "later"],
        [USER, "api"],
        [USER, "api", "tune"],
        ["-", "file", str(job.lh.config_path)],
    ]
    assert all(re.fullmatch(r"just now|\d+ (s|min) ago", r[1]) for r in rows), rows
    # Each version's change against the config live just before it (v4 is still ahead: lr stays 0.05).
    assert lines == [
        lines[0],
        "    ~ lr: 0.05 -> 0.5",
        lines[2],
        '    - name: "start"',
        "    + warmup: 100",
        lines[5],
        "    ~ lr: 0.1 -> 0.05",
        lines[7],
        "    + lr: 0.1",
        '    + name: "start"',
    ]
    # --limit: the oldest shown is still diffed against the version before it.
    limited = table_out(job, "config", "history", "--limit", "2")
    assert [columns(line)[0] for line in limited if not line.startswith(" ")] == ["4", "3"]
    assert limited[-2:] == ['    - name: "start"', "    + warmup: 100"]


@pytest.mark.slow
def test_config_diff(job: Job) -> None:
    assert table_out(job, "config", "diff", "1") == [
        "version 1 -> version 3 (live)",
        "~ lr: 0.1 -> 0.05",
        '- name: "start"',
        "+ warmup: 100",
    ]
    assert table_out(job, "config", "diff", "2", "3") == [
        "version 2 -> version 3",
        '- name: "start"',
        "+ warmup: 100",
    ]
    answer = json.loads("\n".join(table_out(job, "config", "diff", "1", "2", "-o", "json")))
    assert answer == {"from": 1, "to": 2, "live": False, "changes": {"lr": {"before": 0.1, "after": 0.05}}}
    missing = run_cli("config", "diff", "99", "--url", job.lh.url)
    assert (
        missing.returncode == 1
        and missing.stderr == "error: version 99 is not in the history (never made, or pruned)\n"
    )


def test_jobs(job: Job) -> None:
    lines = table_out(job, "jobs")
    assert columns(lines[0]) == [
        "JOB",
        "VERSION",
        "CHANGED",
        "MANAGERS (live/behind/late)",
        "STEP",
        "RUN",
        "SCHEDULED",
        "FILE ERROR",
        "STATUS",
    ]
    row = columns(lines[1])  # no step reported yet: no run
    assert row[:2] == ["default", "4"] and row[3:] == ["1/0/0", "-", "-", "1", "-", "ok"], row
    assert len(lines) == 2


def test_config_scheduled(job: Job) -> None:
    lines = table_out(job, "config", "scheduled")
    header = ["VERSION", "AT STEP", "STATUS", "CHANGE", "AUTHOR", "CREATED", "LATE GROUPS"]
    assert columns(lines[0]) == header
    row = columns(lines[1])
    assert row[:5] == ["4", "100,000", "pending", "lr=0.5", USER] and row[6] == "-", row
    assert len(lines) == 2


def test_config_managers(job: Job) -> None:
    def reported() -> bool:  # the manager's status after its first snapshot: what it serves
        (m,) = get_json(job.lh.url, "api/managers")["managers"]
        return bool(m["live_version"] == 3 and m["pending_version"] == 4)

    poll(reported, 20, what="the manager's live and pending versions")
    lines = table_out(job, "config", "managers")
    header = ["REPLICA", "ADDRESS", "VERSION", "LAST SEEN", "STEP", "REQUESTS", "CACHE HITS", "MODE", "LEASE"]
    assert columns(lines[0]) == [*header, "PENDING", "STATE"]
    row = columns(lines[1])
    # A manager with no worker yet: no step, no step lease; pushed to (it holds a stream). It holds
    # version 4, scheduled for step 100,000: what it serves is version 3, the 4th named apart.
    assert row[:3] == ["group0", job.manager.address, "3"] and row[4:9] == ["-", "0", "-", "push", "-"], row
    assert re.fullmatch(r"\d+\.\d s ago", row[3]) and row[9] == "v4 at step 100,000", row
    assert row[10] in ("current", "late"), row
    assert lines[2:] == ["", "live version 3, v4 pending from step 100,000"]


def test_config_at_step(job: Job) -> None:
    lines = table_out(job, "config", "at-step", "100000")
    assert lines[0] == "step 100,000, version 4"
    assert [columns(line) for line in lines[2:]] == [["KEY", "VALUE"], ["lr", "0.5"], ["warmup", "100"]]


@pytest.mark.slow
def test_schema_show_and_history(job: Job) -> None:
    lines = table_out(job, "config", "schema", "show")
    assert re.fullmatch(
        rf"set (just now|\d+ (s|min) ago) by {re.escape(USER)} \(api\): permissive", lines[0]
    ), lines[0]
    assert json.loads("\n".join(lines[1:])) == {"type": "object"}
    lines = table_out(job, "config", "schema", "history")
    assert columns(lines[0]) == ["ID", "CHANGED", "AUTHOR", "SOURCE", "SCHEMA", "COMMENT"]
    assert columns(lines[1])[2:] == [USER, "api", "set", "permissive"]


def strip_iso(value: Any) -> Any:
    if isinstance(value, list):
        return [strip_iso(v) for v in value]
    if isinstance(value, dict):
        return {k: strip_iso(v) for k, v in value.items() if not k.endswith("_at_iso")}
    return value


@pytest.mark.parametrize(
    ("args", "path", "timed"),
    [
        (("config", "show"), "api/config", True),
        (("config", "history"), "api/config/history?limit=20", True),
        (("config", "scheduled"), "api/config/scheduled", True),
        (("config", "at-step", "100000"), "api/config/at-step/100000", False),
        (("config", "managers"), "api/managers", False),
        (("config", "schema", "show"), "api/config/schema", True),
        (("config", "schema", "history"), "api/config/schema/history?limit=20", True),
        (("jobs",), "api/jobs", True),
    ],
)
def test_json_output_is_the_apis_answer_with_iso_times(
    job: Job, args: tuple[str, ...], path: str, timed: bool
) -> None:
    out = json.loads("\n".join(table_out(job, *args, "-o", "json")))
    api = get_json(job.lh.url, path)
    if path == "api/managers":  # the live manager's counters move between two reads
        for m in [*out["managers"], *api["managers"]]:
            for moving in ("last_seen_s", "fetches", "requests", "cache_hits"):
                m.pop(moving)
    assert strip_iso(out) == api
    assert out == with_iso_times(api)
    assert ("_at_iso" in json.dumps(out)) is timed
    for epoch, text in iso_pairs(out):
        assert text.endswith("Z") and abs(datetime.fromisoformat(text).timestamp() - epoch) < 0.001


def iso_pairs(value: Any) -> Iterator[tuple[float, str]]:
    """(epoch, ISO text) of every ``*_at`` field and its ``*_at_iso`` twin."""
    if isinstance(value, list):
        for item in value:
            yield from iso_pairs(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key.endswith("_at") and isinstance(item, float | int) and not isinstance(item, bool):
                yield item, value[f"{key}_iso"]
            else:
                yield from iso_pairs(item)


def on_a_terminal(args: list[str], env: dict[str, str] | None = None) -> str:
    """stdout of ``python -m ARGS`` written to a pseudo-terminal (as an operator's shell would)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args],
            stdout=slave,
            stderr=subprocess.PIPE,
            env=child_env(env),
            cwd=ROOT,
        )
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr
    finally:
        os.close(master)
    return b"".join(chunks).decode()


def test_colour_only_on_a_terminal_and_never_with_no_color(job: Job) -> None:
    args = ["lighthouse", "config", "history", "--url", job.lh.url]
    coloured = on_a_terminal(args)
    assert ANSI in coloured and "~ lr: 0.05 -> 0.5" in re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    assert ANSI not in on_a_terminal(args, env={"NO_COLOR": "1"})
    manager = ["manager", "get", "--addr", job.manager.address]
    assert ANSI in on_a_terminal(manager) and ANSI not in on_a_terminal(manager, env={"NO_COLOR": "1"})
    piped = subprocess.run(
        [sys.executable, "-m", *manager],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=30,
    )
    assert piped.returncode == 0 and ANSI not in piped.stdout and "source cache" in piped.stdout


def test_shell_completion_is_clicks() -> None:
    env = {"_LIGHTHOUSE_COMPLETE": "bash_complete", "COMP_WORDS": "lighthouse config w", "COMP_CWORD": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "lighthouse"], capture_output=True, text=True, env=child_env(env), cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout.split() == ["plain,watch"], done
    source = subprocess.run(
        [sys.executable, "-m", "lighthouse"],
        capture_output=True,
        text=True,
        env=child_env({"_LIGHTHOUSE_COMPLETE": "bash_source"}),
        cwd=ROOT,
    )
    assert "_lighthouse_completion" in source.stdout
