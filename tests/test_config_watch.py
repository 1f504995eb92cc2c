"""``lighthouse config watch`` and the blocking history query it follows, against real lighthouses."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from tests.http_util import call
from tests.procs import ROOT, LighthouseProc, Proc, ProcessPool, child_env, poll

EDITS = """
import sys
from lighthouse.admin.client import AdminClient

client = AdminClient(sys.argv[1])
client.patch({"lr": 0.2}, comment="first")
client.patch({"lr": 0.3, "warmup": 100}, comment="second")
client.patch({"lr": None}, comment="third")
"""


def edit_three_times(url: str) -> None:
    """Three edits, back to back, from another process."""
    done = subprocess.run(
        [sys.executable, "-c", EDITS, url],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# Python keeps SIGINT ignored when its parent ignores it (a script's background job does, and so
# do the tests it runs): the watch gets Python's own handler back first, as started at a terminal.
AT_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('lighthouse', run_name='__main__')"
)


def watch(procs: ProcessPool, lh: LighthouseProc, *args: str) -> Proc:
    proc: Proc = procs.spawn(
        [sys.executable, "-c", AT_A_TERMINAL, "config", "watch", "--url", lh.url, *args], "watch"
    )
    return proc


def read_until(proc: Proc, count: int) -> list[str]:
    """The watch's next ``count`` lines."""
    return [proc.readline(timeout=30) for _ in range(count)]


def test_watch_prints_every_edit_in_order_and_fails_when_the_lighthouse_is_killed(
    procs: ProcessPool,
) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    table = watch(procs, lh)
    as_json = watch(procs, lh, "-o", "json", "--since", "1")  # prints no header: its start is given
    # The header says where the watch starts: every version after it is printed, also one that
    # lands before its first blocking query.
    assert table.readline().startswith("watching job default after version 1 at ")
    edit_three_times(lh.url)

    lines = read_until(table, 7)
    rows = [line.split() for line in lines if not line.startswith(" ")]
    assert [(r[0], r[-1]) for r in rows] == [("2", "first"), ("3", "second"), ("4", "third")], lines
    assert [line for line in lines if line.startswith(" ")] == [
        "    ~ lr: 0.1 -> 0.2",
        "    ~ lr: 0.2 -> 0.3",
        "    + warmup: 100",
        "    - lr: 0.3",
    ]
    entries = [json.loads(line) for line in read_until(as_json, 3)]
    assert [e["version"] for e in entries] == [2, 3, 4]
    assert entries[2]["config"] == {"warmup": 100} and entries[2]["created_at_iso"].endswith("Z")

    lh.signal(signal.SIGKILL)
    for proc in (table, as_json):
        code = proc.wait(timeout=30)  # bounded: the watch notices at once (its connection drops)
        assert code == 1, proc.stderr()
        error = proc.stderr()
        assert error.startswith("error: the watch ended after version 4: cannot reach the lighthouse at ")
        assert error.count("\n") == 1 and "Traceback" not in error


@pytest.mark.slow
def test_since_replays_the_versions_after_it(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    edit_three_times(lh.url)
    proc = watch(procs, lh, "--since", "2", "-o", "json")
    assert [json.loads(line)["version"] for line in read_until(proc, 2)] == [3, 4]
    proc.signal(signal.SIGINT)  # while it waits in its next blocking query (30 s)
    assert proc.wait(timeout=10) == 0 and "Traceback" not in proc.stderr()


def test_a_sigint_ignored_by_its_parent_stays_ignored(procs: ProcessPool) -> None:
    """A watch started where SIGINT is ignored (``nohup``, a script's background job) keeps on."""
    lh = procs.lighthouse({"lr": 0.1})
    command = f"trap '' INT; exec {shlex.quote(sys.executable)} -m lighthouse config watch --url {lh.url}"
    proc = procs.spawn(["sh", "-c", command], "watch")
    assert proc.readline().startswith("watching job default after version 1 at ")
    proc.signal(signal.SIGINT)
    call(lh.url, "PATCH", "api/config", {"lr": 0.2})
    assert read_until(proc, 2)[1] == "    ~ lr: 0.1 -> 0.2"
    assert proc.popen.poll() is None


def history_after(lh: LighthouseProc, after: int, wait: float | None = None) -> Any:
    query = f"api/config/history?after={after}" + (f"&wait={wait}" if wait is not None else "")
    return call(lh.url, "GET", query, timeout=90)


def test_the_history_feed_and_its_wait(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    call(lh.url, "PATCH", "api/config", {"lr": 0.2})
    # Nothing new: empty once the wait is over.
    started = time.monotonic()
    assert history_after(lh, 2, wait=0.5).json["versions"] == []
    assert time.monotonic() - started >= 0.5
    # The feed is oldest first and starts right after the version given.
    call(lh.url, "PATCH", "api/config", {"lr": 0.3})
    assert [v["version"] for v in history_after(lh, 0).json["versions"]] == [1, 2, 3]
    assert call(lh.url, "GET", "api/config/history?after=1&limit=1").json["versions"][0]["version"] == 2
    # A version after the one given exists already: no wait.
    started = time.monotonic()
    assert [v["version"] for v in history_after(lh, 2, wait=60).json["versions"]] == [3]
    assert time.monotonic() - started < 50
    # Mistakes are 400s.
    assert call(lh.url, "GET", "api/config/history?wait=5").status == 400
    assert call(lh.url, "GET", "api/config/history?after=1&wait=soon").status == 400
    assert call(lh.url, "GET", "api/config/history?after=-1").status == 400


def test_waiting_requests_are_woken_by_a_change_and_capped(procs: ProcessPool) -> None:
    """Each waiting request holds a thread: past the cap the lighthouse answers 503 at once. Once
    every slot is known taken, one edit answers all the waiters with it, long before their wait ends."""
    from lighthouse.web.routes import MAX_WAITING_REQUESTS

    lh = procs.lighthouse({"lr": 0.1})
    answers: list[Any] = []
    errors: list[BaseException] = []

    def wait_for_it() -> None:
        try:
            while (answer := history_after(lh, 1, wait=60)).status == 503:
                time.sleep(0.01)
            answers.append(answer)
        except BaseException as exc:
            errors.append(exc)

    waiters = [threading.Thread(target=wait_for_it) for _ in range(MAX_WAITING_REQUESTS)]
    for thread in waiters:
        thread.start()
    try:
        # A probe that would wait 1 ms is refused once every slot is taken. (While it holds a slot
        # for its 1 ms, a waiter arriving is refused in its place and comes back.)
        refused = poll(
            lambda: (r := history_after(lh, 1, wait=0.001)).status == 503 and r,
            60,
            interval=0.2,
            what="the cap reached",
        )
        assert "retry later" in refused.error and refused.headers["retry-after"] == "1"
    finally:
        edited = time.monotonic()
        call(lh.url, "PATCH", "api/config", {"lr": 0.2})  # releases every waiter
        for thread in waiters:
            thread.join(timeout=90)
    assert not errors
    assert time.monotonic() - edited < 50  # woken by the edit, not by their 60 s wait ending
    assert [[v["version"] for v in a.json["versions"]] for a in answers] == [[2]] * MAX_WAITING_REQUESTS
