"""Tiny urllib helpers for the step-consistency tests: the lighthouse's admin API, no third-party client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from tests.procs import poll

# The tests talk to loopback only: never through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HttpStatusError(AssertionError):
    def __init__(self, status: int, body: Any, what: str) -> None:
        super().__init__(f"{what} -> HTTP {status}: {body}")
        self.status = status
        self.body = body


def call(base: str, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
    """``method`` ``path`` on the dashboard at ``base``; the JSON answer, or HttpStatusError for >= 400."""
    url = base.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            answer: Any = json.loads(raw)
        except ValueError:
            answer = raw[:200]
        raise HttpStatusError(exc.code, answer, f"{method} {path}") from None


def wait_healthy(base: str, timeout: float = 20.0) -> None:
    def up() -> bool:
        try:
            return call(base, "GET", "/healthz", timeout=2.0).get("status") == "ok"
        except (OSError, AssertionError):
            return False

    poll(up, timeout, interval=0.05, what=f"{base}healthz")


def change(base: str, method: str, body: dict[str, Any], effective_step: int | None = None) -> int:
    """PUT or PATCH the config (scheduled at ``effective_step`` if given); the new version."""
    query = "" if effective_step is None else f"?effective_step={effective_step}"
    return int(call(base, method, "/api/config" + query, body)["version"])


def scheduled(base: str) -> dict[int, dict[str, Any]]:
    """The scheduled changes by version."""
    return {item["version"]: item for item in call(base, "GET", "/api/config/scheduled")["scheduled"]}


def at_step(base: str, step: int) -> dict[str, Any]:
    result: dict[str, Any] = call(base, "GET", f"/api/config/at-step/{step}")
    return result


def manager_versions(base: str) -> dict[str, int]:
    """The version each manager last reported serving, by replica id."""
    return {m["replica_id"]: m["version"] for m in call(base, "GET", "/api/managers")["managers"]}


def wait_managers_serve(base: str, replicas: list[str], version: int, timeout: float = 20.0) -> None:
    """Until every manager in ``replicas`` reports serving ``version`` or later."""

    def ready() -> bool:
        versions = manager_versions(base)
        return all(versions.get(r, 0) >= version for r in replicas)

    poll(ready, timeout, interval=0.05, what=f"managers {replicas} serving version {version}")
