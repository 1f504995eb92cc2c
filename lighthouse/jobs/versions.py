"""Versioned config store of one job: every change is a committed record in a backend (SQLite or etcd).

A version is an operation, not only a snapshot, because changes can be
scheduled at a training step. The config a group gets for step N from the state
at version H is a pure function ``resolve(H, N)`` of the stored rows:

* every change <= H is an operation: ``put`` (replace all), ``patch`` (merge,
  null deletes) or ``cancel`` (withdraw a scheduled change);
* a change made now applies to every step, a change scheduled at step S only
  to steps >= S;
* operations apply in order of ``(order_step, version)``: ``order_step`` is the
  step the job had reached when the change was made (the highest step any
  manager reported), or S for a scheduled change if S is later. So a scheduled
  change lands on top of whatever is live at S, an unrelated edit made before S
  does not undo it, and an edit made after S overrides it;
* once any group holds a step lease (see ``leases``), a change made now is
  stored like one scheduled at the step E the lighthouse chose above every
  promised step (``made_now``), and not below a pending change made now (so
  changes take effect in the order they were acknowledged, whichever lighthouse
  took them); nothing is scheduled or cancelled at or below a promised step.

Because ``resolve`` depends only on committed rows, every manager resolves the
same step to the same content, and the history can replay any (version, step).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lighthouse.config.values import (
    MAX_CONFIG_BYTES,
    ConfigError,
    ConfigTooLarge,
    apply_change,
    config_changes,
)
from lighthouse.jobs.leases import CommitWindow, LeaseBook, LeaseGate, LeasePolicy
from lighthouse.jobs.row_index import RowIndex
from lighthouse.jobs.runs import RUNS_META, Run, Runs, pack, same_run, unpack
from lighthouse.store.backend import (
    Change,
    HeadMoved,
    JobRecords,
    LeaseView,
    SharedBackend,
    StoreBackend,
    StoreFull,
    StoreUnavailable,
    Switch,
)
from protos.job_ids import DEFAULT_JOB, JobId
from protos.limits import FOREVER

__all__ = [
    "FOREVER",
    "Change",
    "ConfigStore",
    "HistoryPage",
    "NotFound",
    "PendingConflict",
    "Segment",
    "VersionConflict",
]

SEGMENTS_CACHED = 4  # results of _segments kept: a commit's before and after, a reload's
LATER_ROWS_EXTENDED = 64  # _extended puts a change under at most this many rows sorting after it

logger = logging.getLogger(__name__)

LEASE_META = "lease_ceiling"  # meta keys of step-lease ceilings start with this
FOLD_META = "fold_step"  # meta key of the live run's fold step (``ConfigStore._fold_step``), packed
# Retention by default (``lighthouse serve``, ``LighthouseServer``): a month of a controller's
# changes costs an edit, a reply and the lighthouse's memory what the first hour did.
DEFAULT_HISTORY_LIMIT = 1_000  # versions kept per job (about 2 KB each for a config of 10 keys)
DEFAULT_KEEP_STEPS = 1_000  # steps behind the job's that resolve exactly (``ConfigStore._fold_step``)
PRUNE_SLACK = 0.1  # versions pruned in batches: past the limit by this share, down to the limit
# A group this many times keep_steps behind the job's step is folded anyway: a made-up replica
# reporting step 0 must not hold every segment of the job's life.
LAG_KEPT = 10
MAX_COMMIT_RETRIES = 20  # another lighthouse appending first, again and again


class VersionConflict(Exception):
    """``If-Match`` named a version that is no longer the head."""

    def __init__(self, expected: int, head: int) -> None:
        super().__init__(f"version conflict: you edited version {expected}, the live version is {head}")
        self.head = head


class PendingConflict(VersionConflict):
    """``If-Match`` named the head, but the change, made from a config of it (``Edit.read_step``),
    would not land as made: a pending change would take effect early with it, override it from
    its step, or be overridden by it without having been in the config it was made from.

    ``pending``: those changes (version, effective step); ``earliest``: the step from which the
    same change, scheduled there, lands after all of them (None: read the config again instead).
    """

    def __init__(self, message: str, head: int, pending: list[dict[str, int]], earliest: int | None) -> None:
        Exception.__init__(self, message)
        self.head = head
        self.pending = pending
        self.earliest = earliest


class NotFound(LookupError):
    pass


class NotCancellable(ConfigError):
    """What a cancel names is not pending: a change not scheduled, cancelled or in effect already
    (``head``: the job's version then), or a guard that was decided (``head`` None)."""

    def __init__(self, message: str, head: int | None = None) -> None:
        super().__init__(message)
        self.head = head


class StepPromised(ConfigError):
    """The change would take effect at (or cancel one at) a step groups were already promised."""

    def __init__(self, message: str, earliest: int) -> None:
        super().__init__(message)
        self.earliest = earliest


@dataclass(frozen=True)
class Edit:
    """One change asked for; a commit is a list of them, stored together or not at all."""

    op: str
    change: dict[str, Any]
    source: str
    author: str = "-"
    comment: str = ""
    effective_step: int | None = None
    # A cancel a rollback adds for a pending change: left out, instead of refusing the whole
    # commit, when that change's step was promised to the groups meanwhile.
    optional: bool = False
    # The step of the head's config this put/patch was made from (FOREVER: the config every
    # pending change applied, what GET /api/config shows with the head's version; None: no
    # claim, a blind write). Planned with ``if_match`` on that head, the change is refused
    # (PendingConflict) when a pending change would not be where the maker saw it.
    read_step: int | None = None


@dataclass(frozen=True)
class Plan:
    """What a commit makes (or, planned without writing, would make): the same for a dry run."""

    rows: tuple[Change, ...]
    step: int  # the job's step when planned
    live: dict[str, Any]  # the config at that step once the rows apply
    before: dict[str, Any]  # at the step the change is about (its effective step, else the job's)
    after: dict[str, Any]
    segments_before: tuple[Segment, ...]
    segments_after: tuple[Segment, ...]

    @property
    def row(self) -> Change:
        return self.rows[-1]

    @property
    def version(self) -> int:
        return self.row.version

    def changes(self) -> dict[str, dict[str, Any]]:
        """Per key ``{"before": .., "after": ..}``; a key added has no "before", one removed no "after"."""
        return config_changes(self.before, self.after)

    def served(self) -> Segment:
        """The segment groups get at the job's step (step 0's before any step) once it commits:
        its ``config`` is the live one, its ``version`` the version whose config that is there."""
        segments = self.segments_after
        return segments[first_segment(segments, max(self.step, 0))]

    @property
    def from_step(self) -> int | None:
        """The first step from which every group gets the config of the version it makes (the
        row's ``config``), None when they get it at the job's step already."""
        last = self.segments_after[-1]
        return last.from_step if last.from_step > max(self.step, 0) else None


@dataclass(frozen=True)
class HistoryPage:
    """One page of a job's history: ``more`` when versions lie past its last entry,
    ``truncated`` when the byte budget, not the limit, ended it."""

    versions: list[dict[str, Any]]
    more: bool
    truncated: bool


@dataclass(frozen=True)
class Segment:
    """``config`` holds for steps from ``from_step`` up to the next segment's.

    ``version``: the version whose config it is, the newest change with an effect on it (the
    state at that version gives this config for these steps), 0 when only pruned versions
    made it; ``author`` and ``comment``: the change that takes effect at ``from_step`` (a
    change scheduled there may be older than a change made now that took effect before it).
    """

    from_step: int
    config: dict[str, Any]
    version: int = 0
    author: str = ""
    comment: str = ""


def first_segment(segments: Sequence[Segment], step: int) -> int:
    """Index of the segment that holds ``step`` (the first from step 0)."""
    return max(0, bisect.bisect_right([s.from_step for s in segments], step) - 1)


def _applies(row: Change, step: int) -> bool:
    """Whether ``row`` (not cancelled) is part of the config at ``step``."""
    return row.effective_step is None or row.effective_step <= step


def _same_row(a: Change, b: Change) -> bool:
    """``b`` is ``a``, or the same change with another resolved ``config`` (``_draft`` resolves its
    candidate row, then returns that row with the config filled in): segments never read
    ``config``, so a memo made with one holds for the other. The same ``change`` object, which
    the memo keeps alive, tells a refused plan's row from a committed one of the same version."""
    return a is b or (
        a.change is b.change
        and (a.version, a.op, a.effective_step, a.order_step, a.made_now, a.author, a.comment)
        == (b.version, b.op, b.effective_step, b.order_step, b.made_now, b.author, b.comment)
    )


@dataclass(frozen=True)
class SegmentsMemo:
    """A remembered ``_segments`` result and what it holds for: the pruned base and the runs it
    was made with, the first and last row objects it was made of."""

    base: list[tuple[int, dict[str, Any]]]
    runs: Runs
    fold: int
    segments: list[Segment]
    top: tuple[int, int, int]  # the apply order key of the last row it applies
    first: Change
    last: Change
    taking: dict[int, Change]  # the newest change taking effect at each step above 0 (the causes)
    effects: Effects


@dataclass(frozen=True)
class Effects:
    """The changes with an effect per step, what names a segment (``_named``): ``newest``, the
    newest with one at or below ``floor`` (0, or the fold step: every step there resolves alike),
    and the later ones in ``above`` by (step, version). Kept with the segments so that a fold
    step that moves renames the first segment without a pass over the history (``_refold``)."""

    floor: int
    newest: Change | None
    above: list[tuple[int, int, Change]]

    def with_effects(self, effects: Iterable[tuple[int, Change]]) -> Effects:
        newest, above = self.newest, list(self.above)
        for step, row in effects:
            if step <= self.floor:
                newest = _newer(newest, row)
            else:
                bisect.insort(above, (step, row.version, row))
        return Effects(self.floor, newest, above)

    def folded_to(self, floor: int) -> Effects:
        """The same with every step up to ``floor`` taking effect alike."""
        cut = bisect.bisect_right(self.above, floor, key=lambda effect: effect[0])
        newest = self.newest
        for _, _, row in self.above[:cut]:
            newest = _newer(newest, row)
        return Effects(floor, newest, self.above[cut:])


def _newer(a: Change | None, b: Change) -> Change:
    return b if a is None or b.version > a.version else a


def _apply(config: dict[str, Any], row: Change) -> dict[str, Any]:
    return apply_change(config, row.op, row.change)


class ConfigStore:
    """One job's versions over ``backend``; thread-safe.

    The caller opens the backend (one for every job of a lighthouse) and closes it after the
    stores: ``close`` leaves it open.
    """

    def __init__(
        self,
        backend: StoreBackend,
        *,
        job: JobId = DEFAULT_JOB,
        history_limit: int | None = None,
        keep_steps: int | None = None,
        owner: str = "",
        lease_policy: LeasePolicy | None = None,
        request_ceiling: Callable[[LeaseBook[Any]], None] | None = None,
        lease_gate: LeaseGate | None = None,
    ) -> None:
        if history_limit is not None and history_limit < 1:
            raise ValueError("history_limit must be at least 1")
        if keep_steps is not None and keep_steps < 1:
            raise ValueError("keep_steps must be at least 1")
        self.job = job
        self.history_limit = history_limit
        # Steps this far behind the job's resolve as the step this far behind (``_fold_step``).
        self.keep_steps = keep_steps
        # The lowest step a group of the live run stands at (None: none heard of lately): the fold
        # step stays below it (set by the job's LighthouseState).
        self.lowest_group_step: Callable[[], int | None] = lambda: None
        self.backend = backend
        # Other lighthouses write this job too (etcd): their lease ceilings bound promises this one
        # does not know of, and what it holds (the schema) may be older than the store.
        self.shared = isinstance(backend, SharedBackend)
        self._lock = threading.RLock()
        # Held through a whole commit (which may wait for the store), never by readers: a store
        # without quorum makes edits wait, not the managers' calls.
        self._commit_lock = threading.Lock()
        self._closed = False
        # The head of a commit of ours being appended (0: none), and whether the store's event of it
        # came first and was let go (``skips_event``).
        self._writing = 0
        self._own_event_skipped = False
        # Commits the store refused (nothing stored), by reason: no_space (HTTP 507), unavailable (503).
        self.write_failures = {"no_space": 0, "unavailable": 0}
        self._current_step = -1  # the job's step never goes down within a run, also across reloads
        self._stored_step = -1  # the highest step of this run read from the store (``_order_now``)
        self.runs = Runs()  # the job's runs (see ``runs``); read from the store in ``_take``
        self._runs_pending: dict[str, str] = {}  # the runs record to store (``_queue_runs``)
        self._runs_writing = False  # ``flush_runs`` is writing it (taken off the queue, not stored yet)
        # The runs record as stored when this lighthouse last read or wrote it: every write of the
        # record compares it (another lighthouse's begin or end first: follow theirs, not ours).
        self._runs_stored: str | None = None
        self._runs_queue_lock = threading.Lock()
        self._runs_write_lock = threading.Lock()
        # This lighthouse life: its step-lease ceiling is its own meta key.
        self.owner = owner or uuid.uuid4().hex
        self._lease_key = self.backend.lease_ceiling_key(self.owner)
        self.leases: LeaseBook[Any] = LeaseBook(
            (lease_policy or LeasePolicy()).for_store(self.shared),
            floor_grantable=not self.shared,
            request_ceiling=request_ceiling or (lambda book: None),
            gate=lease_gate,
        )
        # _segments' last results by (head, rows' count, ids of the first and last row).
        self._segments_cache: dict[tuple[int, int, int, int], SegmentsMemo] = {}
        self._take(self.backend.load(self.job))

    def _take(self, records: JobRecords) -> None:
        """Hold ``records``: the job as read at open, or again because another writer changed it."""
        meta = records.meta
        self._meta = meta
        self._segments_cache.clear()  # a recreated job may reuse the same version numbers
        self._rows: list[Change] = records.rows
        if "state_id" not in meta:
            meta["state_id"] = uuid.uuid4().hex
            if self._rows:  # a stored job keeps its state id; a new one stores it with its first version
                self.backend.set_meta(self.job, {"state_id": meta["state_id"]})
        self.state_id: str = meta["state_id"]
        # What pruned versions folded into, per step range: [(from_step, config)], first from -inf.
        self._base: list[tuple[int, dict[str, Any]]] = [
            (int(f), c) for f, c in json.loads(meta.get("base", f"[[{-FOREVER}, {{}}]]"))
        ]
        self._next_version = (
            max(int(meta.get("last_version", "0")), self._rows[-1].version if self._rows else 0) + 1
        )
        stored_run, stored_step = unpack(int(meta.get("current_step", "-1")))
        runs = Runs.decode(meta.get(RUNS_META), stored_step if stored_run == 0 else -1)
        with self._runs_queue_lock:
            if (self._runs_pending or self._runs_writing) and runs.number <= self.runs.number:
                # Ours, not stored yet (queued, or being written): its write compares what it was
                # based on. Taken from the store while in flight, the run this lighthouse began
                # went back to the ended one here, its leases with it (new_run), and a change made
                # meanwhile applied at once under the promises just made (chaos seed 434906234).
                runs = self.runs
            else:
                self._runs_stored = meta.get(RUNS_META)
        if runs.number != self.runs.number:  # another lighthouse began a run: its step starts over
            self._current_step = -1
            self._stored_step = -1
        if runs.era != self.runs.era and runs.era > 0:
            # Another lighthouse began or ended a run: every promise this one made was to the run
            # before. Kept after an end elsewhere, they placed the changes made between runs above
            # the ended run's steps, and a job resuming below them trained without those changes.
            self.leases.new_run()
        self.runs = runs
        if same_run(stored_run, runs.number):
            self._current_step = max(stored_step, self._current_step)
            self._stored_step = max(stored_step, self._stored_step)
        live = runs.live
        if live is not None:
            self._current_step = max(self._current_step, live.start_step)
        # Only kept versions: a pruned cancel's change was older, pruned with it (a record from an
        # earlier release may still hold a "pruned_cancels" list of them: not read).
        self._cancelled = {int(r.change["version"]) for r in self._rows if r.op == "cancel"}
        self._fold = unpack(int(meta.get(FOLD_META, "-1")))
        self._fold_seen: tuple[Runs | None, tuple[int, int], int] = (None, self._fold, -1)
        self._step_saved_at = time.monotonic()
        # Every other life's ceiling bounds promises this one does not know of (on a store with one
        # writer, the single key holds what the earlier lives stored). Between runs none does: the
        # ended run's promises ended with it (its ceilings, still stored, made a restarted
        # lighthouse, or one re-reading an etcd prefix, place changes made now above them).
        floors = [
            unpack(int(value))[1]
            for key, value in meta.items()
            if key.startswith(LEASE_META)
            and (key != self._lease_key or not self.shared)
            and same_run(unpack(int(value))[0], runs.number)
            and not runs.between
        ]
        self.leases.raise_floor(max(floors, default=-1), records.revision)
        for i, row in enumerate(self._rows):
            if row.version in records.unresolved:
                self._rows[i] = dataclasses.replace(
                    row, config=self._resolve(self._rows, row.version, FOREVER)
                )
        self._index = RowIndex(self._rows, self.runs, self._current_step)

    def skips_event(self, head: int) -> bool:
        """Whether the store's event of a new head ``head`` needs no re-read: it is the head of a
        commit of ours still being appended, added here when the append returns (and read again
        if the append fails after all). Re-reading loaded every kept version, per commit."""
        with self._lock:
            if head > self.head and head == self._writing:
                self._own_event_skipped = True
                return True
            return False

    def reload(self) -> None:
        """Re-read the job's records: another lighthouse on the same store changed them.

        Read outside the lock (readers never wait for the store); records older than what is
        held (a commit of ours landed meanwhile) are ignored, unless the job was deleted or
        recreated. The job's current step never goes down.
        """
        records = self.backend.load(self.job)
        with self._lock:
            newest = records.rows[-1].version if records.rows else 0
            recreated = records.meta.get("state_id") not in (None, self.state_id)
            if self._closed or (records.rows and newest < self.head and not recreated):
                return
            self._take(records)

    # ------------------------------------------------------------------ reads
    @property
    def commit_lock(self) -> threading.Lock:
        """Held by every commit (and a schema change): changes are checked and stored one at a time."""
        return self._commit_lock

    @property
    def lock(self) -> threading.RLock:
        """Hold to read several things from one instant (no commit in between)."""
        return self._lock

    @property
    def head(self) -> int:
        """The latest version (0 when nothing was ever stored)."""
        with self._lock:
            return self._rows[-1].version if self._rows else 0

    @property
    def served_state_id(self) -> str:
        """The state id managers are served: the job's, with the run era once runs began. A new
        one when a run ends or begins makes every manager drop the leases it holds (they were
        promises to the run before) and take the snapshot it is sent, at the same version."""
        return self.served_run()[0]

    def served_run(self) -> tuple[str, int | None]:
        """``served_state_id`` and the live run's first step (None: no run is live), from one look
        at the runs: a manager that sees a run begin keeps its pins below that step."""
        runs = self.runs
        live = runs.live
        state_id = self.state_id if runs.era == 0 else f"{self.state_id}-r{runs.era}"
        return state_id, (live.start_step if live is not None else None)

    @property
    def fold_step(self) -> int:
        """Steps at or below this resolve as it does (-1: every step resolves as scheduled): see
        ``_fold_step``; moved by commits, ``keep_steps`` to twice that behind the job's step."""
        with self._lock:
            return self._fold_step()

    def retention(self) -> dict[str, Any]:
        """Where the history was cut (``GET /api/config/history``): versions up to
        ``pruned_through`` were pruned (0: none), steps up to ``fold_step`` resolve as it does."""
        with self._lock:
            oldest = self._rows[0].version if self._rows else self._next_version
            return {
                "history_limit": self.history_limit,
                "keep_steps": self.keep_steps,
                "pruned_through": oldest - 1 if "base" in self._meta else 0,
                "fold_step": self._fold_step(),
            }

    @property
    def current_step(self) -> int:
        """The highest step any manager reported (-1 before the job reported one)."""
        return self._current_step

    def latest(self) -> Change | None:
        with self._lock:
            return self._rows[-1] if self._rows else None

    def get(self, version: int) -> Change:
        with self._lock:
            for row in reversed(self._rows):
                if row.version == version:
                    return row
        raise NotFound(f"version {version} is not in the history (never existed or pruned)")

    def history(self, limit: int = 100) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._rows[::-1][:limit]
            return [r.to_json(cancelled=r.version in self._cancelled) for r in rows]

    def history_page(
        self, limit: int, max_bytes: int, *, before: int | None = None, after: int | None = None
    ) -> HistoryPage:
        """Newest first below ``before`` (none: from the head), or with ``after`` the versions
        after it oldest first (a feed to follow); at most ``limit`` entries and ``max_bytes`` of
        JSON (one entry at least, so every page moves on)."""
        with self._lock:
            if after is not None:
                start = bisect.bisect_right(self._rows, after, key=lambda r: r.version)
                rows = self._rows[start : start + limit + 1]
            else:
                end = (
                    len(self._rows)
                    if before is None
                    else bisect.bisect_left(self._rows, before, key=lambda r: r.version)
                )
                rows = self._rows[max(0, end - limit - 1) : end][::-1]
            cancelled = {r.version for r in rows if r.version in self._cancelled}
        entries: list[dict[str, Any]] = []
        used = 0
        for row in rows[:limit]:  # encoded outside the lock: a page may be megabytes
            entry = row.to_json(cancelled=row.version in cancelled)
            used += len(json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode()) + 1
            if entries and used > max_bytes:
                return HistoryPage(entries, more=True, truncated=True)
            entries.append(entry)
        return HistoryPage(entries, more=len(rows) > limit, truncated=False)

    def held_changes(self) -> list[Change]:
        """The changes that apply (no cancels, none cancelled) in apply order: each holds from its
        ``order_step`` until the next one's (the job's timeline)."""
        with self._lock:
            rows = [r for r in self._rows if r.op != "cancel" and r.version not in self._cancelled]
            return sorted(rows, key=self._order)

    def pending(self, row: Change) -> bool:
        """Whether ``row`` has yet to take effect at the job's step (in the current run)."""
        at = self._effective(row, self.head + 1)
        if at is None:
            return row.order_step > self._current_step and not self.runs.runs  # before runs: as it was
        return at > self._current_step

    def resolve(self, version: int, step: int) -> dict[str, Any]:
        """The config the state at ``version`` gives for ``step``."""
        with self._lock:
            if version != 0 and self._rows and version < self._rows[0].version:
                raise NotFound(f"version {version} was pruned from the history")
            return self._resolve(self._rows, version, step)

    def live(self) -> dict[str, Any]:
        """The config at the job's current step (step 0's before the job reported a step)."""
        with self._lock:
            return self._resolve(self._rows, self.head, max(self._current_step, 0))

    def made_now_base(self) -> tuple[int, dict[str, Any]]:
        """Where a change made now would take effect (the job's step when at once), and the head's
        config there: what to make a change now from so that it keeps every pending change made
        now before it (commit it with ``Edit.read_step`` that step and ``if_match`` the head)."""
        with self._lock:
            at = self._now_step(self._rows, self.leases.window(self._current_step))
            step = self._current_step if at is None else at
            return step, self._resolve(self._rows, self.head, max(step, 0))

    def from_step(self) -> int | None:
        """The first step from which every group gets the head's config (the history's ``config``
        of the head: every change up to it applied), None when they get it at the job's step."""
        with self._lock:
            segments = self._segments(self._rows, self.head)
            last = len(segments) - 1
            while last > 0 and segments[last - 1].config == segments[last].config:
                last -= 1  # a change that left the config as it was starts a segment, not the config
            start = segments[last].from_step
            return start if start > max(self._current_step, 0) else None

    def segments(self, version: int | None = None) -> list[Segment]:
        """The config per step range at ``version`` (default head); one segment when nothing is scheduled.

        Remembered (``_segments``): every view of the live version reads them."""
        with self._lock:
            return self._segments(self._rows, self.head if version is None else version)

    def scheduled(self) -> list[dict[str, Any]]:
        """Every change that takes effect at a step (scheduled, or made now under step leases) with
        its status: pending, in_effect or cancelled."""
        rows = self._rows
        # Read before taking the lock: the backend may be slow (etcd) and readers must not wait.
        switches = self.backend.switches(self.job) if any(r.effective_step is not None for r in rows) else []
        with self._lock:
            out = []
            for row in self._rows:
                if row.effective_step is None:
                    continue
                if row.version in self._cancelled:
                    status = "cancelled"
                elif row.made_now and self.runs.rebased(row.version):
                    status = "in_effect"  # promised to an earlier run: holds at every step now
                elif row.effective_step > self._current_step:
                    status = "pending"
                else:
                    status = "in_effect"
                item = row.to_json(cancelled=status == "cancelled")
                item["status"] = status
                item["late_groups"] = self._late_groups(row, switches) if status != "cancelled" else []
                out.append(item)
            return out

    # ----------------------------------------------------------------- writes
    def plan(
        self, edits: list[Edit], *, if_match: int | None = None, window: CommitWindow | None = None
    ) -> Plan:
        """What committing ``edits`` would store, without storing it; raises what the commit would.

        ``window`` (default: the step leases as they are now) says where a change made now takes
        effect and below which step nothing may change.
        """
        if not edits:
            raise ValueError("nothing to plan")
        with self._lock:
            if if_match is not None and if_match != self.head:
                raise VersionConflict(if_match, self.head)
            if window is None:
                window = self.leases.window(self._current_step)
            rows = list(self._rows)
            for edit in edits:
                row = self._draft(rows, self._next_version + len(rows) - len(self._rows), edit, window)
                if row is not None and edit.read_step is not None:
                    self._check_read(rows, row, edit.read_step)
                if row is not None:
                    rows.append(row)
            new = rows[len(self._rows) :]
            if not new:
                raise ConfigError("nothing left to commit")
            last = new[-1]
            step = self._current_step
            focus = step if last.effective_step is None else max(step, last.effective_step)
            return Plan(
                rows=tuple(new),
                step=step,
                live=self._resolve(rows, last.version, step),
                before=self._resolve(self._rows, self.head, focus),
                after=self._resolve(rows, last.version, focus),
                segments_before=tuple(self._segments(self._rows, self.head)),
                segments_after=tuple(self._segments(rows, last.version)),
            )

    def apply(
        self,
        edits: list[Edit],
        *,
        if_match: int | None = None,
        check: Callable[[Plan], None] | None = None,
        dry_run: bool = False,
        committed: Callable[[], None] | None = None,
    ) -> Plan:
        """Plan ``edits``, let ``check`` refuse the plan (by raising), then store it in one transaction.

        A dry run stops before writing, so it answers exactly what the commit would. Commits
        run one at a time (the commit lock) and wait for the backend outside the store's lock:
        readers and managers' calls never wait for the store (etcd without quorum).

        From planning until ``committed()`` returned (the caller serves the new version there),
        no step lease is granted past today's horizon: the change takes effect above it.
        """
        with self._commit_lock:
            if dry_run:
                return self._apply(edits, if_match, check, dry_run=True)
            try:
                plan = self._apply(edits, if_match, check, dry_run=False)
                if committed is not None:
                    committed()
                return plan
            finally:
                self.leases.thaw()

    def _apply(
        self, edits: list[Edit], if_match: int | None, check: Callable[[Plan], None] | None, dry_run: bool
    ) -> Plan:
        expected = self.head
        if not dry_run:
            self.flush_runs()  # a run begun here is stored first: the commit compares the stored record
        for _ in range(MAX_COMMIT_RETRIES):
            lowest = self.lowest_group_step()  # before the store's lock: it takes the job's
            with self._lock:
                step = self._current_step
                window = self.leases.window(step) if dry_run else self.leases.freeze(step)
                plan = self.plan(edits, if_match=if_match, window=window)
                if check is not None:
                    check(plan)
                if dry_run:
                    return plan
                meta = {
                    "current_step": str(pack(self.runs.number, self._current_step)),
                    "last_version": str(plan.version),
                    "state_id": self.state_id,
                }
                fold = self._next_fold(lowest)
                if fold is not None:
                    meta[FOLD_META] = str(pack(self.runs.number, fold))
                expected = self.head
                view = LeaseView(self._lease_key, window.view, self._runs_stored, runs_checked=True)
                self._writing, self._own_event_skipped = plan.version, False
            try:  # outside the lock: readers and managers' calls never wait for the store
                self.backend.append(self.job, list(plan.rows), meta, expected_head=expected, leases=view)
            except HeadMoved:
                self._writing = 0
                self.reload()  # another lighthouse committed first: plan again after it
                continue
            except StoreUnavailable as exc:
                with self._lock:
                    self.write_failures["no_space" if isinstance(exc, StoreFull) else "unavailable"] += 1
                    self._writing, skipped = 0, self._own_event_skipped
                if skipped:  # stored after all (its event came), though the answer was lost: read it
                    with contextlib.suppress(StoreUnavailable):
                        self.reload()
                raise
            except BaseException:
                self._writing = 0  # refused before it was stored (too large, say): no event comes
                raise
            with self._lock:
                self._writing = 0
                self._meta.update(meta)
                if FOLD_META in meta:
                    self._fold = unpack(int(meta[FOLD_META]))
                    self._refold(self._fold_step())
                head = self.head  # past plan.version when a reload (the watch) brought them in already
                self._rows.extend(r for r in plan.rows if r.version > head)
                self._next_version = max(self._next_version, plan.version + 1)
                self._cancelled.update(int(r.change["version"]) for r in plan.rows if r.op == "cancel")
                self._index.add(plan.rows, self._current_step)
                pruned = self._prune()
            if pruned is not None:
                self.backend.prune(self.job, *pruned)
            return plan
        raise VersionConflict(expected, self.head)

    def advance_step(self, step: int) -> bool:
        """Note that some group reached ``step``; True when that moved the job's current step.

        Saved at most every ``backend.step_save_interval`` (and with every commit), so a
        restarted lighthouse orders new changes after steps the job had already passed.
        """
        if step <= self._current_step:
            return False
        with self._lock:
            if step <= self._current_step or self._closed:
                return False
            self._current_step = step
            now = time.monotonic()
            if now - self._step_saved_at >= self.backend.step_save_interval:
                self._step_saved_at = now
                self.backend.set_meta(self.job, {"current_step": str(pack(self.runs.number, step))})
            return True

    def adopt_step(self, stored: int) -> bool:
        """Take a job step another lighthouse reached (it stored it); True when it moved ours.

        Nothing is written: the step is already in the store. A step of another run is not ours.
        """
        run, step = unpack(stored)
        with self._lock:
            if not same_run(run, self.runs.number) or self._closed:
                return False
            self._stored_step = max(self._stored_step, step)
            if step <= self._current_step:
                return False
            self._current_step = step
            return True

    # ------------------------------------------------------------------ runs
    def begin_run(self, step: int, run_id: str = "", ttl: float = 0.0) -> Run | None:
        """Begin a run at ``step`` unless one is live (then None): the job's step starts over there,
        every change acknowledged so far applies from it. Stored at once (with the step)."""
        with self._lock:
            if self.runs.live is not None or self._closed or self.leases.gate.runs_suspended_by:
                return None
            self.leases.new_run()  # first: a grant that sees the new run is never reset
            self._current_step = step
            self._stored_step = -1
            self.runs = self.runs.begin(step, self.head, run_id, ttl)
            self._step_saved_at = time.monotonic()
            run = self.runs.live
            items = {RUNS_META: self.runs.encode(), "current_step": str(pack(self.runs.number, step))}
        assert run is not None
        self._queue_runs(items)
        return run

    def end_run(self, reason: str, idle_only: bool = False) -> Run | None:
        """End the live run (None: none is live, or another lighthouse changed the record first and
        this one follows it now): its step leases end with it, a change made now applies at once
        until the next run begins. Stored before it takes effect here (compare-and-set on the
        record, and on the head it names): a lighthouse never acts on an end the others do not see.

        ``idle_only`` (no manager stepped here for the run's lease): not while the job's stored
        step shows its groups stepping through another lighthouse (this one may have been cut off
        from the store, and they moved on)."""
        try:
            self.flush_runs()  # a begin still queued goes first: the end compares it
            if idle_only and self._stepped_elsewhere():
                return None
            with self._runs_write_lock:
                with self._lock:
                    if self.runs.live is None or self._closed:
                        return None
                    ended = self.runs.end(self._current_step, self.head, reason)
                    expected, head = self._runs_stored, self.head
                record = {RUNS_META: ended.encode()}
                if not self.backend.replace_meta(self.job, RUNS_META, expected, record, head=head):
                    self._follow_stored_runs("end")
                    return None
                with self._lock:
                    self._runs_stored = ended.encode()
                    self.runs = ended
                    self.leases.new_run()
        except StoreUnavailable as exc:
            logger.warning("job %s: the run's end is not stored (the run goes on): %s", self.job, exc)
            return None
        return ended.last

    def promised_to(self, run: Run) -> bool:
        """Whether ``run`` (ended) was given a change made now that is not cancelled, pending or in
        effect: from the next run's first step it holds at every step, which only a version
        committed after the run's end says (the versions up to it replay as they were served)."""
        with self._lock:
            return any(
                row.made_now and row.effective_step is not None and row.version not in self._cancelled
                for row in self._rows
                if run.base_version < row.version <= run.end_version
            )

    def note_run_ttl(self, ttl: float) -> None:
        """A manager of the live run asks leases for ``ttl`` seconds: the run is gone only after
        every manager was away for longer. Kept in memory and stored with the record's next write
        (a run's end or begin): a ceiling waits for a queued record, and a TTL must never hold one
        up (on a full disk the record cannot be written while the ceiling still can)."""
        with self._lock:
            live = self.runs.live
            if live is None or ttl <= live.ttl or self._closed:
                return
            self.runs = self.runs.with_ttl(ttl)

    def _queue_runs(self, items: dict[str, str]) -> None:
        """Store the runs record off the caller's thread (a run begins on the gRPC path, which never
        waits for the store); the lease ceiling of the new run is stored only after it
        (``save_lease_ceiling``), so no promise of a run is made before its record is durable."""
        with self._runs_queue_lock:
            self._runs_pending.update(items)
        threading.Thread(target=self._flush_runs_quietly, name="runs-record", daemon=True).start()

    def flush_runs(self) -> None:
        """Write the queued runs record now (raises what the store raises; it stays queued)."""
        with self._runs_write_lock:
            with self._runs_queue_lock:
                items, self._runs_pending = self._runs_pending, {}
                self._runs_writing = bool(items)  # a re-read of the store keeps ours until stored
            if not items:
                return
            try:
                with self._lock:
                    if self._closed:
                        return
                    items[RUNS_META] = self.runs.encode()  # the newest, whichever call queued it
                    expected = self._runs_stored
                try:
                    stored = self.backend.replace_meta(self.job, RUNS_META, expected, items)
                except BaseException:
                    with self._runs_queue_lock:
                        self._runs_pending = {**items, **self._runs_pending}
                    raise
                if stored:
                    with self._lock:
                        self._runs_stored = items[RUNS_META]
            finally:
                with self._runs_queue_lock:
                    self._runs_writing = False
            if not stored:
                self._follow_stored_runs("begin")

    def _stepped_elsewhere(self) -> bool:
        """Whether the job's stored step of the live run is past the one this lighthouse holds
        (taken then: it is the job's step)."""
        stored = self.backend.stored_step(self.job)
        run, step = unpack(stored)
        with self._lock:
            if not same_run(run, self.runs.number) or step <= self._current_step:
                return False
        self.adopt_step(stored)
        logger.info(
            "job %s: its groups step on through another lighthouse (step %d): the run goes on", self.job, step
        )
        return True

    def _follow_stored_runs(self, what: str) -> None:
        """Another lighthouse changed the runs record first (began or ended a run): take theirs;
        ours, never stored, made no promise (a run's ceiling is stored after its record)."""
        with self._runs_queue_lock:
            self._runs_pending = {}
        records = self.backend.load(self.job)
        with self._lock:
            mine = self.runs.last
            if not self._closed:
                self._take(records)
            theirs = self.runs.last
        logger.info(
            "job %s: another lighthouse changed the runs record first; this one's %s is dropped "
            "(run %s here, run %s %s there)",
            self.job,
            what,
            mine.number if mine else "-",
            theirs.number if theirs else "-",
            "live" if theirs is not None and theirs.live else "ended",
        )

    def _flush_runs_quietly(self) -> None:
        try:
            self.flush_runs()
        except Exception as exc:  # the ceiling writer flushes it again before its next write
            logger.warning("job %s: the runs record is not stored yet: %s", self.job, exc)

    def record_switches(self, replica_id: str, switches: Iterable[tuple[int, int, int]]) -> None:
        """Remember that ``replica_id`` started serving ``version`` at ``step`` after serving up to
        ``previous_step`` (for replay and lateness)."""
        rows: list[Switch] = [(replica_id, v, s, p) for v, s, p in switches]
        if rows:
            self.backend.add_switches(self.job, rows)

    def late_switches(self, before: int, switches: list[tuple[int, int, int]]) -> int:
        """How many changes a group took up after their effective step with ``switches`` (its newly
        reported ones: version, step, previous step), having served ``before`` until them (0: not
        known, none counted); the rule ``scheduled()``'s late groups follow."""
        if before <= 0 or not switches:
            return 0
        top = max(version for version, _, _ in switches)
        records = [("", version, step, previous) for version, step, previous in switches]
        with self._lock:
            start = bisect.bisect_right(self._rows, before, key=lambda r: r.version)
            end = bisect.bisect_right(self._rows, top, key=lambda r: r.version)
            taken = [
                r
                for r in self._rows[start:end]
                if r.effective_step is not None and r.version not in self._cancelled
            ]
        return sum(bool(self._late_groups(row, records)) for row in taken)

    def served_at(self, step: int) -> dict[str, int]:
        """For each group, the version it served at ``step`` (from its reported switches)."""
        latest: dict[str, tuple[int, int]] = {}  # replica -> (step, version) of its last switch <= step
        for replica, version, at, _ in self.backend.switches(self.job):
            if at <= step and (replica not in latest or (at, version) >= latest[replica]):
                latest[replica] = (at, version)
        return {replica: version for replica, (_, version) in sorted(latest.items())}

    def save_lease_ceiling(self, ceiling: int, served_version: int) -> None:
        """Store this lighthouse's step-lease ceiling durably (the ceiling writer's thread).

        On a store with one writer the single key must keep what earlier lives promised too.
        """
        if not self.shared:
            ceiling = max(ceiling, self.leases.floor)
        self.flush_runs()  # the run this ceiling is for is stored first
        with self._lock:
            if self._closed:
                return
            run = self.runs.number
        self.backend.save_lease_ceiling(self.job, self.owner, pack(run, ceiling), served_version)

    def file_hash(self, path: str) -> str | None:
        return self._meta.get(f"file:{path}")

    def set_file_hash(self, path: str, digest: str) -> None:
        self.backend.set_meta(self.job, {f"file:{path}": digest})
        with self._lock:
            self._meta[f"file:{path}"] = digest

    def discard(self) -> None:
        """Stop using this store without writing anything more (its job is being deleted)."""
        with self._lock:
            self._closed = True

    def schema(self) -> dict[str, Any] | None:
        """The latest schema change (``schema`` None when the schema was removed), None if never set."""
        rows = self.schema_history(1)
        return rows[0] if rows else None

    def set_schema(self, schema: Any, *, source: str, author: str = "-", comment: str = "") -> dict[str, Any]:
        """Store a new schema (None: no schema) durably, kept in its own history."""
        record = {
            "schema": schema,
            "created_at": time.time(),
            "source": source,
            "author": author,
            "comment": comment,
        }
        self.backend.add_schema(self.job, record)  # not under the read lock: the store may be slow
        latest = self.schema()
        assert latest is not None
        return latest

    def schema_history(self, limit: int = 100) -> list[dict[str, Any]]:
        """Every schema change with who and when, newest first."""
        return self.backend.schemas(self.job, limit)

    def close(self) -> None:
        try:
            self.flush_runs()
        except Exception as exc:
            logger.warning("job %s: the runs record was not stored: %s", self.job, exc)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._current_step >= 0:
                step = pack(self.runs.number, self._current_step)
                self.backend.set_meta(self.job, {"current_step": str(step)})

    # -------------------------------------------------------------- internals
    def _segments(self, rows: list[Change], head: int) -> list[Segment]:
        """The config per step range at ``head``, remembered for the last few (a commit plans with
        the segments before and after it, and the served reply is built from the latter). Rows
        are never changed in place, so the very first and last row objects and the count name a
        list of them (a refused plan's draft rows are other objects than the rows committed under
        the same versions); the runs are immutable, so their object says they did not move. A
        commit on top of remembered segments recomputes only those from its lowest step on."""
        if not rows:
            return self._compute_segments(rows, head)[0]
        memo = self._memo(rows, head)
        if memo is None:
            memo = self._extended(rows, head)
            if memo is None:
                segments, top = self._compute_segments(rows, head)
                named, taking, effects = self._named(rows, head, segments)
                memo = SegmentsMemo(
                    self._base, self.runs, self._fold_step(), named, top, rows[0], rows[-1], taking, effects
                )
            self._remember(rows, head, memo)
        return list(memo.segments)

    def _memo(self, rows: list[Change], head: int) -> SegmentsMemo | None:
        memo = self._segments_cache.get((head, len(rows), id(rows[0]), id(rows[-1].change)))
        if not self._memo_holds(memo):
            return None
        assert memo is not None
        return memo if memo.first is rows[0] and _same_row(memo.last, rows[-1]) else None

    def _memo_holds(self, memo: SegmentsMemo | None) -> bool:
        """Whether ``memo`` was made with the pruned base, runs and fold step held now."""
        return (
            memo is not None
            and memo.base is self._base
            and memo.runs is self.runs
            and memo.fold == self._fold_step()
        )

    def _refold(self, fold: int) -> None:
        """Carry the remembered segments over to the fold step just stored: those above it stay as
        they are, the ones below become the first (from step 0), named by the newest change with
        an effect at or below it, as ``_named`` names it: O(segments), not a pass over the history."""
        if len(self._base) != 1:
            return  # a base that changes with the step: the segments are computed afresh
        for key, memo in list(self._segments_cache.items()):
            if memo.base is not self._base or memo.runs is not self.runs or memo.fold > fold:
                continue
            at = first_segment(memo.segments, fold)
            effects = memo.effects.folded_to(max(fold, 0))
            source = effects.newest
            config = memo.segments[at].config
            first = (
                Segment(0, config)
                if source is None
                else Segment(0, config, source.version, source.author, source.comment)
            )
            self._segments_cache[key] = dataclasses.replace(
                memo,
                fold=fold,
                segments=[first, *memo.segments[at + 1 :]],
                taking={step: row for step, row in memo.taking.items() if step > fold},
                effects=effects,
            )

    def _remember(self, rows: list[Change], head: int, memo: SegmentsMemo) -> None:
        self._segments_cache[(head, len(rows), id(rows[0]), id(rows[-1].change))] = memo
        while len(self._segments_cache) > SEGMENTS_CACHED:
            del self._segments_cache[next(iter(self._segments_cache))]

    def _extended(self, rows: list[Change], head: int) -> SegmentsMemo | None:
        """The segments of ``rows`` from remembered ones of a prefix of them, when every row added
        is a change (no cancel), and no run ended at or after the prefix's head (so every prefix
        row keeps its effective step; an added row, newer than every ended run, keeps its own):
        below the lowest added step nothing changed, and from there each step's config is the
        prefix's with the added rows up to it on top. An added row may sort before a few prefix
        patches (a change made now under changes scheduled ahead of the job): where those apply,
        the keys they name stay as they were, as applying in order leaves them."""
        if len(self._base) != 1 or not rows:
            return None
        # The longest remembered prefix: the fewest rows to add (each costs a pass over the segments).
        for (h, n, _, _), memo in sorted(self._segments_cache.items(), key=lambda item: -item[0][1]):
            if not self._memo_holds(memo):
                continue
            if not 0 < n < len(rows) or head < rows[-1].version or h != memo.last.version:
                continue
            if memo.first is not rows[0] or not _same_row(memo.last, rows[n - 1]):
                continue
            if any(not run.live and run.end_version >= h for run in self.runs.runs):
                continue
            added = sorted(rows[n:], key=self._order)
            if any(r.op == "cancel" for r in added):
                continue
            later = self._sorting_after(rows[:n], added[0], memo.top)
            if later is None:
                continue
            steps = {r.version: self._effective(r, head) or 0 for r in [*added, *later]}  # 0: every step
            segments = memo.segments
            lowest = min(steps.values())
            out = [seg for seg in segments if seg.from_step < lowest]  # named as before: no added row applies
            taking = dict(memo.taking)
            for row in added:
                at = steps[row.version]
                if at > 0 and (at not in taking or row.version > taking[at].version):
                    taking[at] = row
            starts = [seg.from_step for seg in segments]
            # Per added row, the prefix rows sorting after it (its order does not change per point).
            under = {row.version: [r for r in later if self._order(r) > self._order(row)] for row in added}
            points = sorted({p for p in starts if p >= lowest} | {s for s in steps.values() if s >= lowest})
            for point in points:
                config = segments[max(0, bisect.bisect_right(starts, point) - 1)].config
                for row in added:
                    if steps[row.version] <= point:
                        over = [r for r in under[row.version] if steps[r.version] <= point]
                        config = self._apply_under(config, row, over)
                if not out or config != out[-1].config or point > 0:  # every point above 0 is an effect's
                    # Named by the newest row with an effect here: an added one (from ``lowest`` on,
                    # one applies at every point, and each added version is above the prefix's).
                    source = max((r for r in added if steps[r.version] <= point), key=lambda r: r.version)
                    cause = taking.get(point, source) if point > 0 else source
                    out.append(Segment(point, config, source.version, cause.author, cause.comment))
            effects = memo.effects.with_effects((steps[r.version], r) for r in added)
            return SegmentsMemo(
                self._base,
                self.runs,
                memo.fold,
                out,
                max(memo.top, self._order(added[-1])),
                rows[0],
                rows[-1],
                taking,
                effects,
            )
        return None

    def _sorting_after(
        self, prefix: list[Change], first: Change, top: tuple[int, int, int]
    ) -> list[Change] | None:
        """The rows of ``prefix`` that apply after ``first`` (none when it sorts after ``top``, the
        last one's key), when ``_extended`` can put the added rows under them: a few patches
        (None: it cannot)."""
        key = self._order(first)
        if key > top:
            return []
        if first.order_step < self._current_step:
            # Made between runs (ordered at -1): rows sorting after it need not be pending. A row
            # ordered at or past the job's step has only rows scheduled past it above it (the job's
            # step only goes up within an epoch, and the added rows are of the newest one).
            return None
        cancelled = self._cancelled_at(prefix, prefix[-1].version)
        # A row sorting after one made now is one ordered past the job's step: it may be pending.
        later = [
            r
            for r in self._maybe_pending(prefix)
            if r.op != "cancel" and r.version not in cancelled and self._order(r) > key
        ]
        if len(later) > LATER_ROWS_EXTENDED or any(r.op != "patch" for r in later):
            return None
        return later

    @staticmethod
    def _apply_under(config: dict[str, Any], row: Change, later: list[Change]) -> dict[str, Any]:
        """``row`` applied to ``config``, the prefix's, as if before ``later`` (patches that sort
        after it and apply here, in ``config`` already): the keys they name keep their value."""
        out = _apply(config, row)
        for key in {key for r in later for key in r.change}:
            if key in config:
                out[key] = config[key]
            else:
                out.pop(key, None)
        return out

    def _compute_segments(self, rows: list[Change], head: int) -> tuple[list[Segment], tuple[int, int, int]]:
        """The config per step range at ``head``, and the apply order key of the last row in apply
        order. One full resolve for step 0, then at each effective step its rows applied on
        top of the previous segment together with every row applied so far that sorts after them
        (usually none: changes land in order). Exact because a patch sets or deletes top-level
        keys: a key's value is that of the last row in apply order that names it (a put names
        every key), so re-applying the rows from the first new one's place on changes only what
        they name. A commit costs one config copy per segment, not a resolve of the history per
        segment, also for a job whose ended runs moved changes' effective steps."""
        cancelled = self._cancelled_at(rows, head)
        at: dict[int, list[Change]] = {}
        applied: list[Change] = []  # in apply order
        # Where a change has an effect, a segment starts even when the config does not change
        # there: a segment is named by the newest effect at its first step, so every step of it
        # must have that newest effect (a no-op change merged into the segment before was named
        # 200 by one snapshot and 201 by the next: two groups switched versions one step apart,
        # benchmarks/month on etcd). A cancelled change's step too: its cancel has its effect there.
        effects: set[int] = set()
        for r in rows:
            if r.version > head or r.op == "cancel":
                continue
            step = self._effective(r, head)
            if step is not None and step > 0:
                effects.add(step)
            if r.version in cancelled:
                continue
            if step is not None and step > 0:
                at.setdefault(step, []).append(r)
            else:
                applied.append(r)
        applied.sort(key=self._order)
        keys = [self._order(r) for r in applied]
        segments = [Segment(0, self._resolve_rows(rows, head, 0))]
        one_base = len(self._base) == 1  # a pruned base that changes with the step needs a resolve
        for point, _ in self._base[1:]:  # and its steps start segments too
            if point > 0:
                at.setdefault(point, [])
        for point in effects:
            at.setdefault(point, [])
        for point in sorted(at):
            new = sorted(at[point], key=self._order)
            if new and one_base:
                first = bisect.bisect_left(keys, self._order(new[0]))
                config = segments[-1].config
                for row in sorted([*applied[first:], *new], key=self._order):
                    config = _apply(config, row)
            else:
                config = self._resolve_rows(rows, head, point)
            for row in new:
                key = self._order(row)
                where = bisect.bisect_right(keys, key)
                keys.insert(where, key)
                applied.insert(where, row)
            if config != segments[-1].config or point in effects:
                segments.append(Segment(point, config))
        return segments, keys[-1] if keys else (-1, -FOREVER, 0)

    def _named(
        self, rows: list[Change], head: int, segments: list[Segment]
    ) -> tuple[list[Segment], dict[int, Change], Effects]:
        """``segments`` each named by the newest change with an effect at its first step (a change
        that applies there, or a cancel of one that would: every later version gives that step the
        same config, so the state at this version names it exactly), with the author and comment
        of the change that takes effect there (an older one, when it was scheduled before a change
        made now that took effect earlier). One pass over the rows, not one per segment."""
        cancelled = self._cancelled_at(rows, head)
        by_version = {r.version: r for r in rows}
        effects: list[tuple[int, int]] = []  # (from which step, version): a change's effect
        made: list[tuple[int, Change]] = []  # the same with the row
        taking: dict[int, Change] = {}  # the newest change taking effect at each step above 0
        for row in rows:
            if row.version > head:
                continue
            if row.op == "cancel":
                target = by_version.get(int(row.change["version"]))
                if target is not None:
                    effects.append((self._effective(target, head) or 0, row.version))
                    made.append((effects[-1][0], row))
                continue
            if row.version in cancelled:
                continue
            step = self._effective(row, head)
            effects.append((step or 0, row.version))
            made.append((step or 0, row))
            if step is not None and step > 0 and (step not in taking or row.version > taking[step].version):
                taking[step] = row
        effects.sort()
        starts = [step for step, _ in effects]
        newest: list[int] = []  # newest[i]: the highest version of effects[: i + 1]
        for _, version in effects:
            newest.append(max(version, newest[-1]) if newest else version)
        named = []
        for seg in segments:
            at = bisect.bisect_right(starts, seg.from_step)
            source = by_version.get(newest[at - 1]) if at else None
            if source is None:
                named.append(Segment(seg.from_step, seg.config))
                continue
            cause = taking.get(seg.from_step, source) if seg.from_step > 0 else source
            named.append(Segment(seg.from_step, seg.config, source.version, cause.author, cause.comment))
        return named, taking, Effects(max(self._fold_step(), 0), None, []).with_effects(made)

    def _draft(self, rows: list[Change], version: int, edit: Edit, window: CommitWindow) -> Change | None:
        """The row ``edit`` makes on top of ``rows``, with its resolved config; raises when refused
        (None: an optional edit left out)."""
        op, effective_step = edit.op, edit.effective_step
        made_now = False
        if op not in ("put", "patch", "cancel"):
            raise ValueError(f"unknown op {op!r}")
        if effective_step is not None and effective_step < 0:
            raise ConfigError("effective_step must be a step >= 0")
        if op == "cancel":
            try:
                self._check_cancellable(int(edit.change["version"]), rows, window.horizon)
            except StepPromised:
                if edit.optional:
                    return None
                raise
        elif effective_step is None:
            effective_step = self._now_step(rows, window)
            made_now = effective_step is not None
        elif effective_step <= window.horizon:
            raise StepPromised(
                f"step {effective_step} is already promised to the replica groups (step leases through "
                f"step {window.horizon}); the earliest step a change can take effect at is "
                f"{window.horizon + 1}",
                window.horizon + 1,
            )
        # Ordered after the steps the live run reached; with no run live, on top of every earlier
        # run and before anything the next run does (its own step is not known yet).
        order_step = -1 if self.runs.between else self._order_now(rows, version)
        if effective_step is not None:
            order_step = max(order_step, effective_step)
        draft = Change(
            version,
            op,
            edit.change,
            {},
            effective_step,
            order_step,
            time.time(),
            edit.source,
            edit.author,
            edit.comment,
            made_now,
        )
        candidate = [*rows, draft]
        config = self._resolve(candidate, version, FOREVER)
        self._check_size(candidate, version, config, effective_step)
        return dataclasses.replace(draft, config=config)

    def _check_read(self, rows: list[Change], draft: Change, read_step: int) -> None:
        """Refuse ``draft`` (PendingConflict) when it would not land on the head's config at
        ``read_step``, the one it was made from, as its maker saw it.

        A pending change (not cancelled, taking effect after the job's step) at step ``e``, with
        ``draft`` taking effect at ``at``: in the config read when ``e <= read_step``, applied
        before the draft when ``e <= at``. Where the two differ, a put would apply it early (read,
        not applied yet) or override it unseen (applied, not read); a patch conflicts only on the
        keys both name (a put names every key), when the pending change sorts after it (read, not
        applied: it would override the patch from ``e``) or before it (applied, not read: the
        patch would override it unseen). A pending change neither read nor applied yet lands on
        top at its step as scheduled, unless it sorts before the draft (a change made between
        runs sorts after the ended run's): then the draft overrides it unseen.
        """
        current = self._current_step
        at = draft.effective_step if draft.effective_step is not None else current
        cancelled = self._cancelled_at(rows, draft.version)
        keys = set(draft.change)
        conflicts: list[Change] = []
        for row in self._maybe_pending(rows):
            if row.op == "cancel" or row.version in cancelled:
                continue
            step = self._effective(row)
            if step is None or step <= current:
                continue  # in effect: in every config of the head from the job's step on
            read, applied = step <= read_step, step <= at
            after = self._order(row) > self._order(draft)
            if read == applied and (read or after):
                continue  # read and applied under the draft, or neither and landing on top at its step
            if draft.op == "patch":
                names = row.op == "put" or bool(keys & set(row.change))
                if not names or (read and not after):
                    continue  # keys apart, or read and sorting before the patch: the patch's keys win
            conflicts.append(row)
        if not conflicts:
            return
        conflicts.sort(key=lambda r: (r.effective_step or 0, r.version))
        # Read and still ahead of the draft, every one: the draft scheduled at the last lands as made.
        ahead = [r.effective_step or 0 for r in conflicts if at < (r.effective_step or 0) <= read_step]
        earliest = max(ahead) if len(ahead) == len(conflicts) else None
        listed = ", ".join(f"version {r.version} at step {r.effective_step}" for r in conflicts[:3])
        listed += f" and {len(conflicts) - 3} more" if len(conflicts) > 3 else ""
        one = len(conflicts) == 1
        named = f"the pending change{'' if one else 's'} ({listed})"
        them = "it" if one else "them"
        where = "now" if draft.effective_step is None else f"at step {draft.effective_step}"
        if earliest is None:
            message = (
                f"version conflict: {named} take{'s' if one else ''} effect between the config your "
                f"{draft.op} was made from and the step it would take effect at ({where}): read the "
                "config again and redo it"
            )
        elif draft.op == "put":
            message = (
                f"version conflict: the config of version {self.head} (what GET /api/config shows with "
                f"it) holds from step {earliest}, where {named} take{'s' if one else ''} effect; your "
                f"put would take effect {where} and apply {them} before {'its' if one else 'their'} "
                f"step. Schedule the put at step {earliest} or later (?effective_step={earliest}), "
                f"send a patch of only the keys you change, or cancel {them} first"
            )
        else:
            both = sorted(keys & {k for r in conflicts for k in r.change})
            replaces = any(r.op == "put" for r in conflicts)
            sets = f"set{'s' if one else ''} " + ", ".join(both[:5]) + (", ..." if len(both) > 5 else "")
            what = " and ".join(
                ([f"{sets} too"] if both else [])
                + ([f"replace{'s' if one else ''} the whole config"] if replaces else [])
            )
            message = (
                f"version conflict: {named} {what}: from {'its' if one else 'their'} step on "
                f"{them} would override your patch, which would take effect {where}. Schedule the "
                f"patch at step {earliest} or later (?effective_step={earliest}), or cancel {them} first"
            )
        pending = [{"version": r.version, "effective_step": r.effective_step or 0} for r in conflicts]
        raise PendingConflict(message, self.head, pending, earliest)

    def _order_now(self, rows: list[Change], version: int) -> int:
        """Where a change made now sorts among the live run's changes: at the step the job reached,
        and never below a change made at once before it, whatever step the lighthouse that took
        that one had seen (acknowledged order is apply order).

        While a lighthouse of an earlier release is live on the prefix, the step is the one stored
        on the prefix rather than ours: that release orders its changes by the step it has seen,
        which is the stored one or its own groups', and lags ours when our groups lead."""
        step = self._stored_step if self.leases.gate.suspended else self._current_step
        epoch = self.runs.epoch(version)
        extra = self._beyond_held(rows)  # the held rows' top is kept (the row index): scan the rest
        scanned = rows if extra is None else extra
        at_once = [
            r.order_step for r in scanned if r.effective_step is None and self.runs.epoch(r.version) == epoch
        ]
        top = None if extra is None else self._held_index().at_once_top(epoch)
        return max(step, max(at_once, default=-1), -1 if top is None else top)

    def _now_step(self, rows: list[Change], window: CommitWindow) -> int | None:
        """The lowest step a change made now may take effect at (None: at once).

        Above every promised step (``window``), and never below a change made now that is
        pending (acknowledged before this one, through any lighthouse): acknowledged order
        is effective order. The commit compares the job's head, so a change committed
        meanwhile through another lighthouse makes this one plan again with it in ``rows``.
        """
        cancelled = self._cancelled_at(rows, FOREVER)
        pending = max(
            (
                r.effective_step
                for r in self._maybe_pending(rows)
                if r.made_now
                and r.effective_step is not None
                and r.effective_step > self._current_step
                and r.version not in cancelled
                and not self.runs.rebased(r.version)
            ),
            default=None,
        )
        if pending is None:
            return window.now_step
        return pending if window.now_step is None else max(window.now_step, pending)

    def _effective(self, row: Change, at: int | None = None) -> int | None:
        """The step ``row`` takes effect at in the job's state at version ``at`` (None, or the head:
        now): a change made now that was promised to an earlier run holds at every step of this one
        (None), a scheduled change keeps its step.

        The head's state is the one served now, in the current runs: every run that ended counts,
        also before the version its end commits is stored. Without this, a run another lighthouse
        began in between served the ended run's promises at the head (not rebased) until that
        version came, and a group that asked after it got them rebased: two configs at one step
        (the chaos suite, an operator's run end). An older version replays as it was served."""
        if at is not None and at >= self.head:
            at = None
        if row.made_now and self.runs.rebased(row.version, at):
            return None
        step = row.effective_step
        return None if step is not None and step <= self._fold_step() else step

    def _fold_step(self) -> int:
        """The live run's fold step (-1: none): a change taking effect at or below it holds at
        every step, so every step below it resolves as it does (one segment, not one per change
        of a month behind the job). Stored with a commit once the job is ``keep_steps`` past it
        (``_next_fold``), so every lighthouse on the store resolves every step alike; a run that
        begins starts without one, so a resume from a checkpoint gets the schedule of its steps.
        """
        runs, fold, step = self._fold_seen
        if runs is not self.runs or fold is not self._fold:  # read per row: worked out once
            run, at = self._fold
            step = at if same_run(run, self.runs.number) and not self.runs.between else -1
            self._fold_seen = (self.runs, self._fold, step)
        return step

    def _next_fold(self, lowest: int | None) -> int | None:
        """The fold step to store with a commit now (None: keep the stored one): ``keep_steps``
        behind the job's step once it is twice that behind, so it stays between one and two times
        ``keep_steps`` behind and moves once per ``keep_steps`` steps; and below ``lowest``, the
        step of the group furthest behind (what the live run's groups may still ask for is kept),
        unless that is ``LAG_KEPT`` times ``keep_steps`` behind. Not while a lighthouse of an
        earlier release serves the job too (it would resolve the folded steps as scheduled)."""
        if self.keep_steps is None or self.runs.between or self.leases.gate.suspended:
            return None
        target = self._current_step - self.keep_steps
        if lowest is not None:
            target = max(min(target, lowest - 1), self._current_step - LAG_KEPT * self.keep_steps)
        if target - self._fold_step() < self.keep_steps:
            return None
        return target

    def _order(self, row: Change) -> tuple[int, int, int]:
        """Apply order: a later run's changes on top of an earlier run's, then by ``order_step``."""
        return (self.runs.epoch(row.version), row.order_step, row.version)

    def _cancelled_at(self, rows: list[Change], version: int) -> set[int]:
        extra = self._beyond_held(rows)
        if extra is not None and version >= self.head:  # every held cancel counts: the set kept
            return self._cancelled | {
                int(r.change["version"]) for r in extra if r.op == "cancel" and r.version <= version
            }
        return {int(r.change["version"]) for r in rows if r.op == "cancel" and r.version <= version}

    def _beyond_held(self, rows: list[Change]) -> list[Change] | None:
        """The rows of ``rows`` after the held ones, when it is the held rows with drafts added
        (what a plan checks); None for any other list (read it all)."""
        held = self._rows
        if rows is held:
            return []
        n = len(held)
        if n == 0 or (len(rows) >= n and rows[0] is held[0] and rows[n - 1] is held[-1]):
            return rows[n:]
        return None

    def _held_index(self) -> RowIndex:
        """The index of the held rows, built again when the runs moved (epochs, the job's step)."""
        if self._index.runs is not self.runs:
            self._index = RowIndex(self._rows, self.runs, self._current_step)
        return self._index

    def _maybe_pending(self, rows: list[Change]) -> list[Change]:
        """A part of ``rows`` holding every change that may take effect above the job's step."""
        extra = self._beyond_held(rows)
        if extra is None:
            return rows
        return [*self._held_index().pending(self._current_step), *extra]

    def _resolve(self, rows: list[Change], version: int, step: int) -> dict[str, Any]:
        """The config ``rows`` give at ``version`` for ``step``: a copy of a remembered (or
        extended) segment's when ``version`` is their head, else resolved from the rows."""
        if step >= 0 and rows and version == rows[-1].version and len(self._base) == 1:
            # Computed once and remembered: a commit resolves its head several times (its draft,
            # the size check, the plan's configs), and a served reply once more.
            memo = self._memo(rows, version)
            segments = memo.segments if memo is not None else self._segments(rows, version)
            return dict(segments[first_segment(segments, step)].config)
        return self._resolve_rows(rows, version, step)

    def _resolve_rows(self, rows: list[Change], version: int, step: int) -> dict[str, Any]:
        cancelled = self._cancelled_at(rows, version)
        ops = [
            r
            for r in rows
            if r.version <= version
            and r.op != "cancel"
            and r.version not in cancelled
            and ((at := self._effective(r, version)) is None or at <= step)
        ]
        ops.sort(key=self._order)
        start = max((i for i, r in enumerate(ops) if r.op == "put"), default=None)
        config = self._base_at(step) if start is None else {}  # a fresh dict: merged in place
        for row in ops[start or 0 :]:
            if row.op == "put":
                config = dict(row.change)
                continue
            for key, value in row.change.items():  # one copy, not one per row of the history
                if value is None:
                    config.pop(key, None)
                else:
                    config[key] = value
        return config

    def _check_size(
        self, rows: list[Change], version: int, config: dict[str, Any], effective_step: int | None
    ) -> None:
        """Refuse a change whose resulting config (now, or once scheduled) is over the limit."""
        candidates = [config]
        if effective_step is None:
            candidates.append(self._resolve(rows, version, self._current_step))
        for candidate in candidates:
            size = len(json.dumps(candidate, ensure_ascii=False).encode())
            if size > MAX_CONFIG_BYTES:
                raise ConfigTooLarge(f"the config would be {size} bytes of JSON (max {MAX_CONFIG_BYTES})")

    def _base_at(self, step: int) -> dict[str, Any]:
        step = max(step, self._fold_step())
        config: dict[str, Any] = {}
        for from_step, segment in self._base:
            if from_step > step:
                break
            config = segment
        return dict(config)

    def _check_cancellable(self, target: int, rows: list[Change], horizon: int) -> None:
        row = self.get(target)
        if row.effective_step is None:
            raise NotCancellable(f"version {target} is not a scheduled change", self.head)
        if target in self._cancelled or any(r.op == "cancel" and r.change["version"] == target for r in rows):
            raise NotCancellable(f"version {target} is already cancelled", self.head)
        if row.made_now and self.runs.rebased(row.version):
            raise NotCancellable(
                f"version {target} was promised to a run that ended: it holds at every step of the "
                "runs after it; make a new change instead",
                self.head,
            )
        if row.effective_step <= horizon:
            raise StepPromised(
                f"version {target} takes effect at step {row.effective_step}, already promised to the "
                f"replica groups (step leases through step {horizon}); make a new change instead",
                horizon + 1,
            )
        if row.effective_step <= self._current_step:
            raise NotCancellable(
                f"version {target} took effect at step {row.effective_step} "
                f"(the job is at step {self._current_step}); make a new change instead",
                self.head,
            )

    @staticmethod
    def _late_groups(row: Change, records: list[tuple[str, int, int, int]]) -> list[dict[str, Any]]:
        """Groups that served steps >= S without this change, and the step they switched at.

        A group switched late when its first step with a version that has the
        change came after S while it had already served a step >= S before.
        """
        assert row.effective_step is not None
        first: dict[str, tuple[int, int]] = {}
        for replica, version, step, previous in records:
            if version >= row.version and replica not in first:
                first[replica] = (step, previous)
        return [
            {"replica_id": replica, "switched_at_step": step, "late_by_steps": step - row.effective_step}
            for replica, (step, previous) in sorted(first.items())
            if step > row.effective_step and previous >= row.effective_step
        ]

    def _prune(self) -> tuple[set[int], dict[str, str], int] | None:
        """Drop the oldest versions beyond history_limit, folding them into the per-step base;
        returns what the backend must prune (done outside the lock), or None.

        Only a prefix that is both the oldest versions and the first in apply
        order can go, so every remaining version still resolves exactly. The
        base is per step range, so scheduled changes fold in too; a pending
        scheduled change holds back pruning of later versions until its step.
        With ``keep_steps``, only changes that hold at every step (made at once, or
        at or below the fold step) go, and the base is one config below the fold
        step: it stays one entry, whatever the job's age.

        Pruned in batches (past the limit by ``PRUNE_SLACK`` of it, down to the
        limit): each prune sorts the history, so per commit it costs O(log n).
        """
        limit = self.history_limit
        if limit is None or len(self._rows) <= limit + int(limit * PRUNE_SLACK):
            return None
        folding = self.keep_steps is not None

        def applies(row: Change) -> bool:
            # A cancelled change applies nowhere at or after its cancel, and a cancel changes no
            # key: neither has a place in apply order to keep. (Counting a kept cancelled change
            # as first in that order stopped every prune below it: a controller that schedules
            # and withdraws changes grew the history without bound.)
            return row.op != "cancel" and row.version not in self._cancelled

        by_version = sorted(self._rows, key=lambda r: r.version)
        # after[k]: the apply position of the first change that applies among versions k and on.
        after: list[tuple[int, int]] = [(FOREVER, FOREVER)] * (len(by_version) + 1)
        for k in range(len(by_version) - 1, -1, -1):
            row = by_version[k]
            after[k] = min(after[k + 1], (row.order_step, row.version)) if applies(row) else after[k + 1]
        excess = len(self._rows) - limit
        count, last = 0, (-FOREVER, -1)
        for k, row in enumerate(by_version[:excess], start=1):
            live = row.version not in self._cancelled
            if row.version == self.head or (live and row.order_step > self._current_step):
                break  # later changes may still sort before a row ordered beyond the job's step
            if folding and applies(row) and self._effective(row) is not None:
                break  # its step is still told apart from the ones before it
            if applies(row):
                last = max(last, (row.order_step, row.version))
            if last < after[k]:
                count = k  # the k oldest versions apply before every later one
        if count == 0:
            return None
        prefix = sorted(by_version[:count], key=lambda r: (r.order_step, r.version))  # apply order
        steps = {r.version: self._effective(r) for r in prefix}
        points: list[int] = sorted({f for f, _ in self._base} | {s for s in steps.values() if s is not None})
        base: list[tuple[int, dict[str, Any]]] = []
        for point in points:
            config = self._base_at(point)
            for row in prefix:
                at = steps[row.version]
                if row.op != "cancel" and row.version not in self._cancelled and (at is None or at <= point):
                    config = _apply(config, row)
            if not base or base[-1][1] != config:
                base.append((point, config))
        fold = self._fold_step()
        below = [config for point, config in base if point <= fold]
        if below:  # every step below the fold step resolves as it does
            base = [(-FOREVER, below[-1]), *((p, c) for p, c in base if p > fold)]
        gone = {r.version for r in prefix}
        meta = {"base": json.dumps(base, ensure_ascii=False)}
        # Step switches to pruned versions go too, but for each group's latest one: it still
        # tells which (pruned) version the group served from that step on.
        oldest = min(r.version for r in self._rows if r.version not in gone)
        self._meta.update(meta)
        self._base = base
        self._cancelled -= gone  # what a kept version's cancel names is still read from its row
        self._rows = [r for r in self._rows if r.version not in gone]
        self._index = RowIndex(self._rows, self.runs, self._current_step)
        return gone, meta, oldest
