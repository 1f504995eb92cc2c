"""A real ``lighthouse serve`` process for the dashboard and admin API tests, as a context manager.

Usage::

    with start_lighthouse(tmp_path, config={"lr": 0.1}, token="s3cret") as lh:
        answer = lh.http("GET", "/api/config")
        assert answer.json["config"] == {"lr": 0.1}

The process is started by ``tests.procs.ProcessPool`` (port 0, addresses read
from its output) and always stopped when the ``with`` block ends.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.http_util import HttpResult, call
from tests.procs import ProcessPool, child_env

_counter = itertools.count()


@dataclass
class LighthouseProc:
    grpc_addr: str
    url: str  # "http://host:port/"
    proc: subprocess.Popen[str]
    state_dir: Path
    config_path: Path | None
    log_path: Path
    token: str | None = None

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

    def http(self, method: str, path: str, body: Any = None, **kwargs: Any) -> HttpResult:
        return call(self.url, method, path, body, **kwargs)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


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
    pool = ProcessPool(home)
    try:
        token_args = ("--admin-token", token) if token is not None else ()
        proc = pool.lighthouse(
            config, state_dir=home / "state", http_bind=http_bind, extra=(*args, *token_args)
        )
        assert proc.stderr_path is not None
        config_path = home / "config.json" if config is not None else None
        yield LighthouseProc(
            proc.address, proc.url, proc.popen, home / "state", config_path, proc.stderr_path, token
        )
    finally:
        pool.stop_all()


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """``python -m lighthouse ARGS...`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "lighthouse", *args],
        capture_output=True,
        text=True,
        env=child_env(env),
        timeout=timeout,
    )
