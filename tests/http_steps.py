"""The admin API calls of the step-consistency tests, on ``tests.http_util``: JSON in, JSON out,
and an exception for any refused request, so a test reads as the steps it takes."""

from __future__ import annotations

import json
from typing import Any

from tests.http_util import call as http_call
from tests.procs import poll


class HttpStatusError(AssertionError):
    def __init__(self, status: int, body: Any, what: str) -> None:
        super().__init__(f"{what} -> HTTP {status}: {body}")
        self.status = status
        self.body = body


def call(base: str, method: str, path: str, body: Any = None, timeout: float = 10.0) -> Any:
    """``method`` ``path`` on the dashboard at ``base``; the JSON answer, or HttpStatusError for >= 400."""
    result = http_call(base, method, path, body, timeout=timeout)
    if result.status >= 400:
        try:
            answer: Any = result.json
        except ValueError:
            answer = result.body[:200]
        raise HttpStatusError(result.status, answer, f"{method} {path}")
    return json.loads(result.body or b"null")


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


def wait_for_end(url: str, timeout: float = 20.0) -> tuple[list[dict[str, Any]], int]:
    """Wait until the job's latest run ended: the runs, and the job's step the lighthouse had
    reached while that run was live (-1: no answer showed it live), as its runs route said: a
    bound below the run's end step, which is the job's step when it ended.

    An answer reads ``current_step`` after its runs, so its step counts once a later answer still
    shows the run live: the step was read within the run (where it only grows, to its end step)."""
    heard, read = -1, -1

    def ended() -> list[dict[str, Any]] | None:
        nonlocal heard, read
        answer = call(url, "GET", "/api/config/runs")
        if answer["runs"][-1]["live"]:
            heard, read = max(heard, read), answer["current_step"]
            return None
        found: list[dict[str, Any]] = answer["runs"]
        return found

    return poll(ended, timeout, what="the run ended"), heard
