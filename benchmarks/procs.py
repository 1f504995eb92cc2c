"""Child processes of the benchmark: started fresh, addressed by their printed lines, always stopped.

Every server and load generator runs in its own process, started with
``subprocess`` (never ``fork``: grpcio is not fork-safe), so the client being
timed never shares a GIL with the server it calls. A ``Children`` group stops
whatever it started, SIGCONT first so a SIGSTOPped lighthouse can exit.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 60.0


class ChildFailed(RuntimeError):
    """A child exited early or did not print in time (message carries its stderr tail)."""


class Child:
    """A process whose stdout lines are read by a thread; commands go to its stdin."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            args,
            cwd=ROOT,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.pid = self.popen.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, name=f"pump-{name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def readline(self, timeout: float = START_TIMEOUT) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise ChildFailed(
                f"{self.name}: nothing printed within {timeout:.0f}s\n{self.stderr_tail()}"
            ) from None
        if line is None:
            self._lines.put(None)
            raise ChildFailed(f"{self.name} exited ({self.popen.poll()})\n{self.stderr_tail()}")
        return line

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def stderr_tail(self, lines: int = 15) -> str:
        self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGCONT (in case it was stopped), SIGTERM, then SIGKILL after ``timeout``."""
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for stream in (self.popen.stdin, self.popen.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        self._log.close()


class Children:
    """Starts children and stops every one of them on exit, whatever happened."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._started: list[Child] = []

    def python(self, name: str, *args: str, env: dict[str, str] | None = None) -> Child:
        """``python -m ...`` style child with the repo on its path."""
        child = Child(name, [sys.executable, *args], self.log_dir, env)
        self._started.append(child)
        return child

    def command(self, name: str, args: list[str]) -> Child:
        child = Child(name, args, self.log_dir)
        self._started.append(child)
        return child

    def stop(self, child: Child) -> None:
        child.stop()
        if child in self._started:
            self._started.remove(child)

    def stop_all(self) -> None:
        errors = []
        for child in reversed(self._started):
            try:
                child.stop()
            except Exception as exc:  # keep stopping the others
                errors.append(exc)
        self._started.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def free_port() -> int:
    """A loopback port free right now (for servers that cannot bind port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (Linux)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc/<pid>/status (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class CpuMeter:
    """CPU use of some processes from now on, as % of one core each (``percent()`` reads it)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.started = time.monotonic()
        self._cpu0 = [cpu_seconds(pid) for pid in pids]

    def seconds(self) -> list[float]:
        """CPU seconds each process used since the meter started."""
        return [cpu_seconds(pid) - c0 for pid, c0 in zip(self.pids, self._cpu0, strict=True)]

    def percent(self) -> list[float]:
        elapsed = time.monotonic() - self.started
        return [100 * used / elapsed for used in self.seconds()]


def wait_for(check, timeout: float, interval: float = 0.02, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll ``check`` until truthy; raise TimeoutError after ``timeout`` (never a blind sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
