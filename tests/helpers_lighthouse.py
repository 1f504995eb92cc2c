"""Start a real ``lighthouse serve`` process for a test, and talk HTTP to its dashboard.

Usage::

    with start_lighthouse(tmp_path, config={"lr": 0.1}, token="s3cret") as lh:
        answer = http(lh.url, "GET", "/api/config")
        assert answer.json["config"] == {"lr": 0.1}

The process is always stopped when the ``with`` block ends, whatever happened.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

STARTUP_TIMEOUT_S = 30.0
REPO = Path(__file__).resolve().parent.parent
_counter = itertools.count()
T = TypeVar("T")


@dataclass
class LighthouseProc:
    grpc_addr: str
    url: str  # "http://host:port/"
    proc: subprocess.Popen[str]
    state_dir: Path
    config_path: Path | None
    log_path: Path
    token: str | None = None
    _lines: queue.Queue[str] = field(default_factory=queue.Queue)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Answer:
        return http(self.url, method, path, body, **kwargs)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: this repo importable, unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("LIGHTHOUSE_ADMIN_TOKEN", None)
    env.pop("LIGHTHOUSE_URL", None)
    env.update(extra or {})
    return env


@contextmanager
def start_lighthouse(
    tmp_path: Path,
    config: dict[str, Any] | None = None,
    token: str | None = None,
    args: tuple[str, ...] = (),
    http_bind: str = "127.0.0.1:0",
) -> Iterator[LighthouseProc]:
    """A ``lighthouse serve`` process on free ports; stopped when the block ends."""
    home = tmp_path / f"lighthouse-{next(_counter)}"
    home.mkdir(parents=True)
    config_path: Path | None = None
    cmd = [sys.executable, "-m", "lighthouse", "serve", "--bind", "127.0.0.1:0", "--http-bind", http_bind]
    if config is not None:
        config_path = home / "config.json"
        config_path.write_text(json.dumps(config))
        cmd += ["--config", str(config_path)]
    cmd += ["--state-dir", str(home / "state"), *args]
    if token is not None:
        cmd += ["--admin-token", token]
    log_path = home / "lighthouse.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=python_env(), cwd=str(home)
        )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    lh: LighthouseProc | None = None
    try:
        grpc_addr = _next_line(lines, proc, log_path)
        url = _next_line(lines, proc, log_path)
        lh = LighthouseProc(grpc_addr, url, proc, home / "state", config_path, log_path, token, lines)
        yield lh
    finally:
        if lh is not None:
            lh.stop()
        elif proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line.rstrip("\n"))


def _next_line(lines: queue.Queue[str], proc: subprocess.Popen[str], log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return lines.get(timeout=0.1)
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                raise RuntimeError(
                    f"lighthouse exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}"
                ) from None
    raise TimeoutError(f"lighthouse printed no address within {STARTUP_TIMEOUT_S} s")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> str:
        return str(self.json["error"])


def http(
    url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    content_type: str | None = "application/json",
    timeout: float = 10.0,
) -> Answer:
    """One request on a fresh connection. ``body`` is sent as JSON, ``raw`` as is."""
    parts = urlsplit(url)
    conn = HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    sent = dict(headers or {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if data is not None and content_type is not None:
        sent.setdefault("Content-Type", content_type)
    try:
        # The server may refuse a body before reading it all; its answer is still there to read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """``python -m lighthouse ARGS...`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "lighthouse", *args],
        capture_output=True,
        text=True,
        env=python_env(env),
        timeout=timeout,
    )
