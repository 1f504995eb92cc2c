"""The README's first command: the demo runs every part, changes lr halfway, and leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.procs import ROOT
from tests.threads import CheckedThread

Process = tuple[int, str]  # pid and start time: a pid alone may be reused by an unrelated process


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def descendants(root: int) -> dict[Process, str]:
    """Every live descendant of ``root`` with its command line (a /proc walk: no psutil)."""
    children: dict[int, list[Process]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found: dict[Process, str] = {}
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                cmdline = ""
            found[(pid, start)] = cmdline
            todo.append(pid)
    return found


def still_running(process: Process) -> bool:
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


# The demo as started at a terminal: Python keeps SIGINT ignored when its parent ignores it (a
# script's background job does, and so does every test a suite started that way runs), and then
# the test's Ctrl-C would never reach it (a flake hunt started in the background failed so, twice).
AT_A_TERMINAL = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_path('examples/demo.py', run_name='__main__')"
)


def kill_demo(proc: subprocess.Popen[str]) -> None:
    """A demo still running (its test failed): SIGKILL it and every process it started (each in
    its own session, so not its process group), so that its lighthouse and managers do not
    outlive the test. A demo that exited is left alone: whether its children ended with it is
    for the test to check."""
    if proc.poll() is not None:
        return
    started = descendants(proc.pid)
    proc.kill()
    for process in started:
        if still_running(process):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process[0], signal.SIGKILL)


class Demo:
    """``examples/demo.py`` running: its stdout read line by line by a ``CheckedThread`` (each read
    with a deadline), its stderr, which its children share, to a file (no pipe left unread to fill
    and block a child)."""

    def __init__(self, args: list[str], stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with stderr_path.open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", AT_A_TERMINAL, *args],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        self.lines: queue.Queue[str | None] = queue.Queue()  # None: its stdout ended
        self.out: list[str] = []  # every line read so far
        self.reader = CheckedThread(self._pump, name="demo stdout")
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        try:
            with self.proc.stdout:
                for line in self.proc.stdout:
                    self.lines.put(line)
        finally:
            self.lines.put(None)  # a reader waiting for a line learns at once that none comes

    def err(self) -> str:
        """Its stderr and its children's, so far."""
        return self.stderr_path.read_text(errors="replace")

    def readline(self, deadline: float, what: str) -> str:
        """The next stdout line before ``deadline`` (monotonic); AssertionError if none comes."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {what} from the demo in time\n{self.err()[-3000:]}") from None
        if line is None:
            self.lines.put(None)
            self.reader.check(10)  # the reader's own error, if that is why the lines ended
            raise AssertionError(
                f"the demo's output ended before {what} (exit {self.proc.poll()})\n{self.err()[-3000:]}"
            )
        self.out.append(line)
        return line

    def wait(self, timeout: float, what: str) -> str:
        """Its exit within ``timeout`` s, then its whole stdout (the reader joined, its error raised)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            while not self.lines.empty() and (line := self.lines.get_nowait()) is not None:
                self.out.append(line)  # what it printed after the last line the test read
            out = "".join(self.out[-20:])
            raise AssertionError(
                f"the demo did not end within {timeout} s {what}\nits last lines:\n{out}\n"
                f"its and its children's stderr:\n{self.err()[-3000:]}"
            ) from None
        self.reader.check(30)  # its stdout ends with it: every line is queued
        while (line := self.lines.get_nowait()) is not None:
            self.out.append(line)
        self.lines.put(None)
        return "".join(self.out)


@pytest.mark.slow
def test_demo_runs_all_parts_and_stops_cleanly(tmp_path: Path) -> None:
    args = ["--duration", "6", "--dashboard", "127.0.0.1:0", "--step-time", "0.2"]
    demo = Demo([*args, "--verbose"], tmp_path / "demo.err")  # every worker line: the per-rank checks
    proc = demo.proc
    spawned: dict[Process, str] = {}  # every process the demo started, seen while it ran
    deadline = time.monotonic() + 120  # 6 s of training after starting 7 processes, on a busy machine
    try:
        while True:
            for process, command in descendants(proc.pid).items():
                # The newest command line: a child seen between fork and exec still shows the demo's
                # own; an exited one shows none (keep what it showed before).
                spawned[process] = command or spawned.get(process, "")
            try:
                proc.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"the demo (--duration 6) still running after 120 s\n{demo.err()[-3000:]}"
                    ) from None
        out = demo.wait(10, "once it exited")  # it has: the reader is joined
    finally:
        kill_demo(proc)
    err = demo.err()
    assert proc.returncode == 0, err[-2000:]
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/", out, re.M), out[:500]
    lines = re.findall(r"^(group\d)/(\d) step +(\d+) version +(\d+) lr (\S+)", out, re.M)
    ranks = {(g, r) for g, r, *_ in lines}
    assert ranks == {("group0", "0"), ("group0", "1"), ("group1", "0"), ("group1", "1")}
    assert {lr for *_, lr in lines} == {"0.001", "0.0005"}, "the halfway lr change never reached the workers"
    # Every rank of a group saw the same lr at the same step.
    seen: dict[tuple[str, str], set[str]] = {}
    for group, _rank, step, _version, lr in lines:
        seen.setdefault((group, step), set()).add(lr)
    assert all(len(v) == 1 for v in seen.values())
    assert "all processes ended" in out
    # Only the demo's own processes (never another test's or user's): all of them are gone.
    commands = list(spawned.values())
    assert sum("demo_worker.py" in c for c in commands) >= 4, commands
    assert sum(" manager " in c for c in commands) >= 2, commands
    assert any(" lighthouse serve " in c for c in commands), commands
    leftovers = {p: c for p, c in spawned.items() if still_running(p)}
    assert leftovers == {}, f"demo processes still running: {leftovers}"


STATUS = re.compile(r"^group0 step \d+ v\d+ lr \S+ \| group1 step \d+ v\d+ lr \S+$")


@pytest.mark.slow
def test_demo_teaches_fills_the_charts_and_ends_cleanly_on_ctrl_c(page: Page, tmp_path: Path) -> None:
    """Started as the README says (no --duration): it says where things are, charts fill, Ctrl-C ends it."""
    demo = Demo(["--dashboard", "127.0.0.1:0", "--step-time", "0.2"], tmp_path / "demo.err")
    proc = demo.proc
    try:
        intro: list[str] = []
        started = time.monotonic() + 60  # its lighthouse, managers and workers start first
        while "Ctrl-C" not in (line := demo.readline(started, "intro ending with Ctrl-C")):
            intro.append(line)
        intro.append(line)
        text = "".join(intro)
        found = re.search(r"^dashboard: (http://127\.0\.0\.1:\d+/)", text, re.M)
        assert found, text
        api = found.group(1).rstrip("/")
        for command in ("config set lr=0.01", "config history", "metrics"):
            assert f"  lighthouse {command} --url {api}\n" in text, text
        assert "runs until Ctrl-C" in text, text
        status = demo.readline(time.monotonic() + 30, "status line")
        # Waiting, or the groups that reported so far (group1 may start a moment after group0).
        assert re.match(r"^(waiting|group0 step \d+ v\d+ lr \S+( \| group1 step|$))", status), status
        page.goto(found.group(1))
        expect(page.locator('svg.chart[data-metric="loss"] path.ch-mean')).to_have_count(1, timeout=10_000)
        stepping = time.monotonic() + 60
        while not STATUS.match(status):  # one status line a second: a stepping one comes soon
            status = demo.readline(stepping, "status line with both groups' steps")
        proc.send_signal(signal.SIGINT)
        out = demo.wait(60, "after Ctrl-C")
    finally:
        kill_demo(proc)
        proc.wait()
    err = demo.err()
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
    assert "KeyboardInterrupt" not in out + err, (out + err)[-3000:]
    assert "all processes ended" in out
    assert STATUS.match(status), status
