"""Real processes for the tests: lighthouse, managers and workers started through their CLIs.

Every process is started on port 0 and its address read from the first line it
prints; ``ProcessPool.stop_all`` (the ``procs`` fixture) always stops them.
Nothing here sleeps to wait: reads and polls have deadlines. The benchmarks start
their processes with the same ``spawn`` and ``Proc`` (``benchmarks/procs.py``),
as they use the tests' etcd cluster and certificates.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
WORKER_SCRIPT = Path(__file__).resolve().parent / "worker_proc.py"
START_TIMEOUT = 20.0

T = TypeVar("T")


def poll(check: Callable[[], T], timeout: float, interval: float = 0.02, what: str = "condition") -> T:
    """Call ``check`` until it returns something truthy; raise AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Proc:
    """A child process whose stdout lines are collected by a reader thread."""

    args: list[str]
    popen: subprocess.Popen[str]
    name: str
    stdout_lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)
    stderr_path: Path | None = None
    ended: bool = False  # its stdout closed and every line was read
    start_timeout: float = START_TIMEOUT  # readline's default wait

    def __post_init__(self) -> None:
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        with self.popen.stdout:
            for line in self.popen.stdout:
                self.stdout_lines.put(line.rstrip("\n"))
        self.stdout_lines.put(None)

    def readline(self, timeout: float | None = None) -> str:
        """The next stdout line; AssertionError (with stderr) if none comes in time or the process ends."""
        timeout = self.start_timeout if timeout is None else timeout
        try:
            line = self.stdout_lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no output within {timeout}s\n{self.stderr()}") from None
        if line is None:
            self.stdout_lines.put(None)
            self.ended = True
            raise AssertionError(f"{self.name} exited ({self.popen.poll()}) early\n{self.stderr()}")
        self.seen.append(line)
        return line

    def lines(self) -> list[str]:
        """Every stdout line so far (non-blocking)."""
        while True:
            try:
                line = self.stdout_lines.get_nowait()
            except queue.Empty:
                return self.seen
            if line is None:
                self.stdout_lines.put(None)
                self.ended = True
                return self.seen
            self.seen.append(line)

    def output_ended(self) -> bool:
        """Whether every writer of its stdout is gone and every line they printed has been read."""
        self.lines()
        return self.ended

    def send(self, line: str) -> None:
        """One line to its stdin (a process spawned with ``stdin=True``)."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def stderr(self) -> str:
        if self.stderr_path is None or not self.stderr_path.exists():
            return ""
        return self.stderr_path.read_text(errors="replace")[-4000:]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (after SIGCONT, in case a test paused it), then SIGKILL if it will not go."""
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        code = self.popen.wait(timeout=timeout)
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()
        return code


@dataclass
class LighthouseProc(Proc):
    address: str = ""
    url: str = ""


@dataclass
class ManagerProc(Proc):
    address: str = ""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: this repo importable, unbuffered output, and none of
    the variables that would point it at another lighthouse, job, token or proxy; then ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("TORCHFT_LIGHTHOUSE", "LIGHTHOUSE_JOB", "LIGHTHOUSE_ADMIN_TOKEN", "LIGHTHOUSE_URL"):
        env.pop(name, None)
    for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(proxy, None)
    return {**env, **(extra or {})}


P = TypeVar("P", bound=Proc)


def lighthouse_command(bind: str = "127.0.0.1:0", http_bind: str = "127.0.0.1:0", *flags: str) -> list[str]:
    """``lighthouse serve`` on ``bind`` (gRPC) and ``http_bind`` (the dashboard; "off": none)."""
    return [sys.executable, "-m", "lighthouse", "serve", "--bind", bind, "--http-bind", http_bind, *flags]


def manager_command(
    lighthouse_addr: str,
    replica_id: str,
    cache_ttl: float,
    lighthouse_timeout: float,
    backoff: float,
    bind: str = "127.0.0.1:0",
    extra: Sequence[str] = (),
) -> list[str]:
    """``manager serve`` of ``replica_id`` in front of ``lighthouse_addr``."""
    args = [sys.executable, "-m", "manager", "serve", "--lighthouse", lighthouse_addr, "--bind", bind]
    args += ["--replica-id", replica_id, "--cache-ttl", str(cache_ttl)]
    return [*args, "--lighthouse-timeout", str(lighthouse_timeout), "--backoff", str(backoff), *extra]


def spawn(
    args: Sequence[str],
    name: str,
    stderr_path: Path,
    cls: type[P],
    env: dict[str, str] | None = None,
    stdin: bool = False,
    **kw: Any,
) -> P:
    """Start ``args`` in the repo as a ``cls`` (stdout collected, stderr to ``stderr_path``, stdin a
    pipe for ``send`` when ``stdin``); ``env`` adds variables to ``child_env``'s."""
    with stderr_path.open("w") as stderr:
        popen = subprocess.Popen(
            list(args),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=child_env(env),
            cwd=str(ROOT),
        )
    return cls(list(args), popen, name, stderr_path=stderr_path, **kw)


class ProcessPool:
    """Starts the system's processes and stops every one of them at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[Proc] = []
        self._count = 0

    def spawn(
        self,
        args: Sequence[str],
        name: str,
        cls: type[Proc] = Proc,
        env: dict[str, str] | None = None,
        **kw: Any,
    ) -> Any:
        """Start ``args`` (stdout collected, stderr to a file); ``env`` adds variables."""
        self._count += 1
        proc = spawn(args, name, self.tmp_path / f"{name}-{self._count}.stderr", cls, env, **kw)
        self.procs.append(proc)
        return proc

    def lighthouse(
        self,
        config: dict[str, Any] | str | None = None,
        *,
        state_dir: Path | None = None,
        config_path: Path | None = None,
        bind: str = "127.0.0.1:0",
        http_bind: str = "127.0.0.1:0",
        extra: Sequence[str] = (),
        store: str | None = None,
    ) -> LighthouseProc:
        """Start ``lighthouse serve``; ``config`` (dict or raw text) is written to a file first.

        ``store`` (``etcd://...``) keeps the versions in etcd instead of a state directory.
        """
        if config is not None:
            config_path = config_path or self.tmp_path / "config.json"
            config_path.write_text(config if isinstance(config, str) else json.dumps(config))
        args = lighthouse_command(bind, http_bind)
        if store is None:
            args += ["--state-dir", str(state_dir or self.tmp_path / "state")]
        else:
            args += ["--store", store]
        if config_path is not None:
            args += ["--config", str(config_path)]
        args += list(extra)
        proc: LighthouseProc = self.spawn(args, "lighthouse", LighthouseProc)
        proc.address = proc.readline()
        if http_bind != "off":
            proc.url = proc.readline()
        return proc

    def lighthouse_when_free(self, timeout: float = 20.0, **kw: Any) -> LighthouseProc:
        """``lighthouse(**kw)`` on ports a lighthouse killed a moment ago held: retried until it binds."""

        def start() -> LighthouseProc | None:
            try:
                return self.lighthouse(**kw)
            except AssertionError as exc:
                if "exited" in str(exc):  # the port is not free yet
                    return None
                raise

        proc: LighthouseProc = poll(start, timeout, interval=0.2, what=f"a lighthouse on {kw.get('bind')}")
        return proc

    def restart_lighthouse(self, old: LighthouseProc, **kw: Any) -> LighthouseProc:
        """A new lighthouse on the gRPC and dashboard ports of ``old`` (killed or stopped)."""
        http_bind = old.url.split("://", 1)[-1].rstrip("/")
        return self.lighthouse_when_free(bind=old.address, http_bind=http_bind, **kw)

    def manager(
        self,
        lighthouse_addr: str,
        replica_id: str,
        *,
        cache_ttl: float = 0.2,
        lighthouse_timeout: float = 1.0,
        backoff: float = 1.0,
        bind: str = "127.0.0.1:0",
        extra: Sequence[str] = (),
    ) -> ManagerProc:
        args = manager_command(
            lighthouse_addr, replica_id, cache_ttl, lighthouse_timeout, backoff, bind, extra
        )
        proc: ManagerProc = self.spawn(args, f"manager-{replica_id}", ManagerProc)
        proc.address = proc.readline()
        return proc

    def worker(
        self,
        manager_addr: str,
        *,
        group: str,
        rank: int,
        steps: int,
        step_interval: float = 0.0,
        timeout: float = 5.0,
        first_step: int = 0,
        prefetch: bool = False,
        no_step: bool = False,
        wait: bool = True,
        extra: Sequence[str] = (),
    ) -> Proc:
        """A worker process calling get_config once per step; prints one JSON line per step, then 'done'.

        ``wait=False`` returns at once: start many, then ``wait_ready`` them all.
        """
        args = [sys.executable, str(WORKER_SCRIPT), "--addr", manager_addr, "--group", group]
        args += ["--rank", str(rank), "--steps", str(steps), "--interval", str(step_interval)]
        args += ["--timeout", str(timeout), "--first-step", str(first_step)]
        args += ["--prefetch"] if prefetch else []
        args += ["--no-step"] if no_step else []
        args += list(extra)
        proc: Proc = self.spawn(args, f"worker-{group}-{rank}")
        if wait:
            wait_ready([proc])
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception:  # keep stopping the others
                proc.popen.kill()


def worker_records(proc: Proc, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Wait for a worker to finish and return its per-step records."""
    poll(lambda: proc.lines() and proc.seen[-1] == "done", timeout, interval=0.05, what=f"{proc.name} done")
    return [json.loads(line) for line in proc.seen if line.startswith("{")]


def iter_records(procs: Sequence[Proc], timeout: float = 60.0) -> Iterator[dict[str, Any]]:
    for proc in procs:
        yield from worker_records(proc, timeout)


def wait_ready(workers: Sequence[Proc]) -> None:
    for proc in workers:
        poll(lambda p=proc: p.lines() and p.seen[0] == "ready", START_TIMEOUT, what=f"{proc.name} ready")


# ------------------------------------------------------------------------ helpers added for the e2e suites


def records_so_far(proc: Proc) -> list[dict[str, Any]]:
    """The per-step records a (maybe still running) worker printed so far."""
    return [json.loads(line) for line in proc.lines() if line.startswith("{")]


def last_record(proc: Proc) -> dict[str, Any]:
    """The newest per-step record of a running worker, after waiting for its first: a worker can
    hold a step lease before its first answer reaches it (a lease is granted at the lighthouse),
    so a test that paused or just started it may find nothing printed yet."""

    def newest() -> str | None:  # only the last line is parsed: tests poll this while thousands pile up
        return next((line for line in reversed(proc.lines()) if line.startswith("{")), None)

    record: dict[str, Any] = json.loads(poll(newest, START_TIMEOUT, what=f"{proc.name}'s first step"))
    return record


def metric(base_url: str, name: str, job: str = "default") -> float:
    """The sample of ``job`` from the lighthouse's Prometheus ``/metrics``."""
    from tests.http_util import call

    answer = call(base_url, "GET", "/metrics")
    body = answer.body.decode()
    assert answer.status == 200, body
    for line in body.splitlines():
        if line.startswith(f'{name}{{job="{job}"}} '):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not in /metrics:\n{body}")


def manager_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``manager ARGS`` (the manager's CLI) run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "manager", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    )
