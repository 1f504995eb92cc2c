"""A job's runs: its training as a sequence of runs, each beginning at a step of its own.

A run ends when every manager of the job has been gone (or has not stepped) for longer than its
lease, when an operator ends it (``POST /api/config/runs/end``, ``lighthouse runs end``), or when
a manager reports a run id the job never had (``connect(run_id=...)``). The next run begins at
the first step a manager reports (or asks a lease for) after that, whatever the step: a resume
from a checkpoint at an earlier step, or at 0.

Step leases are promises to the live run and end with it. From a run's first step on, every
change acknowledged before it began applies (a change made now that an earlier run was promised
at a later step is *rebased*: it holds at every step of the new run); a change scheduled at a
step keeps its step.

This module is the one place that writes and reads the runs record (the job's ``runs`` meta key,
JSON) and the run number packed into the stored job step and lease ceilings (``pack``): those
values keep the backends' max semantics (a new run's values are above every earlier run's) while
a new run's step may be lower than the last one's.
"""

from __future__ import annotations

import bisect
import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

RUNS_META = "runs"  # the job's meta key holding the runs record
STEP_BITS = 44  # a stored step or ceiling is run << STEP_BITS | step (runs 0 and 1: the plain step)
MAX_RUNS_KEPT = 1000  # the record keeps the latest runs; older ones are dropped (their ids too)


def pack(run: int, step: int) -> int:
    """The stored form of a job step or lease ceiling of run ``run`` (-1 stays -1). A job's first
    run stores plain steps, as releases before runs do (they may share its etcd prefix then)."""
    if step < 0 or run <= 1:
        return step
    return (run << STEP_BITS) | min(step, (1 << STEP_BITS) - 1)


def unpack(value: int) -> tuple[int, int]:
    """(run, step) of a stored job step or lease ceiling; run 0 for a plain one (the first run, or
    the implicit run of a job stored before runs: see ``same_run``)."""
    if value < 0:
        return 0, value
    return value >> STEP_BITS, value & ((1 << STEP_BITS) - 1)


def same_run(stored: int, number: int) -> bool:
    """Whether a stored value of run ``stored`` (``unpack``) belongs to run ``number``."""
    return stored == number or (stored == 0 and number <= 1)


@dataclass(frozen=True)
class Run:
    """One run of a job."""

    number: int  # 1, 2, ...: 0 is the implicit run of a job stored before runs existed
    start_step: int  # its first step
    started_at: float  # wall clock
    base_version: int  # the job's head when it began: every version up to it applies from start_step
    run_id: str = ""  # the training script's id (connect(run_id=...)), "" when none was given
    ttl: float = 0.0  # the longest cache TTL its managers asked leases for (how long "gone" is)
    ended_at: float | None = None
    end_step: int = -1  # the job's step when it ended
    end_version: int = 0  # the job's head when it ended
    end_reason: str = ""  # "managers gone", "operator", "run id", ...

    @property
    def live(self) -> bool:
        return self.ended_at is None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["live"] = self.live
        return out


class Runs:
    """The runs record of one job (immutable: ``begin`` and ``end`` return a new record)."""

    def __init__(self, runs: tuple[Run, ...] = ()) -> None:
        self.runs = runs
        self._ends = sorted(r.end_version for r in runs if not r.live)  # ``epoch`` per row: a bisect

    @classmethod
    def decode(cls, text: str | None, job_step: int = -1) -> Runs:
        """The record stored as ``text``; none stored: for a job that stepped before runs existed
        (``job_step`` >= 0), one implicit live run 0 from step 0, so its leases hold as before."""
        if not text:
            if job_step >= 0:
                return cls((Run(0, 0, time.time(), 0),))
            return cls()
        return cls(tuple(Run(**item) for item in json.loads(text)))

    def encode(self) -> str:
        return json.dumps([asdict(r) for r in self.runs], separators=(",", ":"))

    @property
    def last(self) -> Run | None:
        return self.runs[-1] if self.runs else None

    @property
    def live(self) -> Run | None:
        last = self.last
        return last if last is not None and last.live else None

    @property
    def number(self) -> int:
        """The number of the latest run (0: none yet, or only the implicit one)."""
        last = self.last
        return last.number if last is not None else 0

    @property
    def era(self) -> int:
        """Moves at every begin and end (0: no run yet, or only the implicit one): what a manager's
        lease is tied to, with the job's state id (``ConfigStore.served_state_id``)."""
        last = self.last
        if last is None or last.number == 0:
            return 0
        return 2 * last.number - (1 if last.live else 0)

    def known_id(self, run_id: str) -> bool:
        return any(r.run_id == run_id for r in self.runs)

    def begin(self, step: int, head: int, run_id: str = "", ttl: float = 0.0) -> Runs:
        # After the implicit run 0 of a job stored before runs, run 2: run 1 stores plain steps too.
        number = self.number + 1 if self.number > 0 or not self.runs else 2
        run = Run(number, step, time.time(), head, run_id, ttl)
        return Runs((*self.runs[-(MAX_RUNS_KEPT - 1) :], run))

    def end(self, step: int, head: int, reason: str) -> Runs:
        live = self.live
        assert live is not None
        ended = replace(live, ended_at=time.time(), end_step=step, end_version=head, end_reason=reason)
        return Runs((*self.runs[:-1], ended))

    def with_ttl(self, ttl: float) -> Runs:
        live = self.live
        assert live is not None
        return Runs((*self.runs[:-1], replace(live, ttl=ttl)))

    def epoch(self, version: int) -> int:
        """How many runs ended before ``version`` was acknowledged: changes of a later epoch apply
        on top of every change of an earlier one (the config as the operator left it)."""
        return bisect.bisect_left(self._ends, version)

    def rebased(self, version: int, at: int | None = None) -> bool:
        """Whether a change made now at ``version`` holds at every step in the job's state at version
        ``at`` (None: the latest): it was acknowledged before a run that ended before ``at``, so its
        effective step was a promise to that run. A version served within that run replays as it
        was served (the run's end commits a version when it changes what is served)."""
        return any(
            not r.live and version <= r.end_version and (at is None or r.end_version < at) for r in self.runs
        )

    @property
    def between(self) -> bool:
        """A run ended and the next has not begun."""
        last = self.last
        return last is not None and not last.live

    def to_json(self) -> list[dict[str, Any]]:
        return [r.to_json() for r in self.runs]
