"""Child processes of the benchmark: started fresh, addressed by their printed lines, always stopped.

Every server and load generator runs in its own process, started with
``subprocess`` (never ``fork``: grpcio is not fork-safe), so the client being
timed never shares a GIL with the server it calls. The process itself is the
tests' ``Proc`` (one copy of reading lines, signalling and stopping; the
benchmarks already use the tests' etcd cluster and certificates). A
``Children`` group stops whatever it started, SIGCONT first so a SIGSTOPped
lighthouse can exit.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from tests.procs import Proc, spawn

START_TIMEOUT = 60.0  # a child's first line may take this long (a load generator opening its fleet)
STOP_TIMEOUT = 5.0  # seconds from SIGTERM to SIGKILL


class Children:
    """Starts children (``tests.procs.Proc``, stdin a pipe for commands, stderr to ``log_dir/NAME.log``)
    and stops every one of them on exit, whatever happened."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._started: list[Proc] = []

    def python(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """``python -m ...`` style child with the repo on its path."""
        return self.command(name, [sys.executable, *args], env)

    def command(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        child = spawn(
            args, name, self.log_dir / f"{name}.log", Proc, env, stdin=True, start_timeout=START_TIMEOUT
        )
        self._started.append(child)
        return child

    def stop(self, child: Proc) -> None:
        child.stop(STOP_TIMEOUT)
        if child in self._started:
            self._started.remove(child)

    def stop_all(self) -> None:
        errors = []
        for child in reversed(self._started):
            try:
                child.stop(STOP_TIMEOUT)
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
