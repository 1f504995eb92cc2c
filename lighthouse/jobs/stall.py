"""When a job is stalled: every rank gone, or managers alive with no step progress.

The issue this answers: a job whose ranks all died on a bad value showed as healthy.
Stated bounds (the README quotes them):
- gone: every manager of the job unheard from for more than max(3 x its TTL, 10 s)
  (a manager on a push stream counts as heard from while the stream is open);
- no progress: the job's step has not moved for more than max(10 x its recent step
  time, 30 s) while a manager is live.
"""

from __future__ import annotations

import time
from typing import Any

GONE_TTLS = 3.0
GONE_MIN_SECONDS = 10.0
STALL_STEPS = 10.0
STALL_MIN_SECONDS = 30.0
SMOOTHING = 0.3  # each gap between step advances moves the recent step time this far towards it


def gone_after(manager: dict[str, Any]) -> float:
    return max(GONE_TTLS * float(manager.get("ttl_s") or 0.0), GONE_MIN_SECONDS)


class Progress:
    """The job's step progress: when its step last moved and its recent time per step."""

    def __init__(self) -> None:
        self.at: float | None = None  # monotonic time the job's step last moved
        self.step = -1
        self.step_seconds: float | None = None

    def moved(self, step: int) -> None:
        now = time.monotonic()
        if self.at is not None and step > self.step:
            sample = (now - self.at) / (step - self.step)
            known = self.step_seconds
            self.step_seconds = sample if known is None else known + SMOOTHING * (sample - known)
        if step > self.step:
            self.at, self.step = now, step

    def stall(self, managers: list[dict[str, Any]]) -> str | None:
        """Why the job is stalled, None while it is not (or never had managers)."""
        if not managers:
            return None
        if all(m["last_seen_s"] > gone_after(m) for m in managers):
            quiet = min(m["last_seen_s"] for m in managers)
            return f"every manager is gone (none heard from for {quiet:.0f} s)"
        if self.at is None or self.step_seconds is None:
            return None  # never stepped (stepless workers): nothing to stall
        bound = max(STALL_STEPS * self.step_seconds, STALL_MIN_SECONDS)
        idle = time.monotonic() - self.at
        if idle > bound:
            return f"no step progress for {idle:.0f} s (past step {self.step}; bound {bound:.0f} s)"
        return None
