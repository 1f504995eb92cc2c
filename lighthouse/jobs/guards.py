"""Guarded changes: a change that rolls itself back when a reported metric regresses after it.

``lighthouse config set lr=0.02 --guard loss:1.5 --guard-steps 200``: once the
change takes effect at step E (its effective step, or the job's step when it was
committed), the lighthouse watches steps E to E+200 of the job's ``loss`` (the
mean over every value the groups reported for a step). It rolls the change back
when

* the loss, smoothed as a trailing mean over ``window`` reported steps (default
  10, all at or after E), exceeds 1.5 times its baseline: the mean of every value
  reported in the 200 steps before E; or
* any group reports a non-finite loss (NaN, inf) in that range.

Past step E+200 the guard has passed. A guard that could not be judged (no group reported
``loss`` through step E+200: a metric nobody reports, a typo) *lapses* once the job has been past
that step for ``lapse_after`` seconds (``--guard-lapse-seconds``): decided, the change stays, and
it no longer counts as active (kept active, such guards grew with a job's age).

The rollback is a new version made now, author ``guard``, a comment naming the metric, the
values and the step; it puts back the keys the guarded change set, to what they were before it
(a key changed again since is left as it is). It goes through ``LighthouseState.change`` like any
change made now, so every group switches at one step (issue 16's step leases).

Guards are stored in the job's store (SQLite, etcd), so they survive a restart.
On an etcd prefix every lighthouse evaluates them on the series it holds (the
whole job's, see ``peer_series``); the rollback is committed with ``If-Match`` on
the head the decision was made at, so exactly one lighthouse commits it, and a
rollback already in the history (found by its comment's tag) is never made twice.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from lighthouse.config.values import ConfigError
from lighthouse.jobs.series import JobSeries, Point
from lighthouse.jobs.versions import ConfigStore, NotCancellable, NotFound, Plan, VersionConflict
from lighthouse.store.backend import StoreUnavailable
from protos.limits import EVERY_RECORD, GUARD_STEPS, GUARD_WINDOW
from protos.metrics import is_metric_name

logger = logging.getLogger(__name__)

MAX_STEPS = 10_000_000
AUTHOR = "guard"
CHECK_INTERVAL = 0.5  # seconds between two evaluations of a lighthouse's active guards
LAPSE_AFTER = 300.0  # seconds past a guard's last step before one not judged lapses (--guard-lapse-seconds)
_SPEC = re.compile(r"\s*([^:\s]+)\s*:\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*")


@dataclass(frozen=True)
class GuardSpec:
    """What a change is guarded by: ``metric``'s smoothed mean over ``window`` steps must stay at
    most ``factor`` times its baseline during the ``steps`` steps after the change."""

    metric: str
    factor: float
    steps: int = GUARD_STEPS
    window: int = GUARD_WINDOW

    @classmethod
    def parse(cls, text: str, steps: int | None = None, window: int | None = None) -> GuardSpec:
        """``loss:1.5`` (with ``guard_steps``/``guard_window``); ConfigError says what is wrong."""
        match = _SPEC.fullmatch(text)
        if match is None:
            raise ConfigError(f"guard {text[:60]!r}: expected METRIC:FACTOR, e.g. loss:1.5")
        metric, factor = match.group(1), float(match.group(2))
        if not is_metric_name(metric):
            raise ConfigError(f"guard {text[:60]!r}: {metric[:64]!r} is not a metric name")
        if not 1.0 < factor < math.inf:
            raise ConfigError(f"guard factor must be above 1 (a regression is a rise), got {factor:g}")
        steps = GUARD_STEPS if steps is None else steps
        if not 1 <= steps <= MAX_STEPS:
            raise ConfigError(f"guard steps must be 1 to {MAX_STEPS}, got {steps}")
        window = min(GUARD_WINDOW, steps) if window is None else window
        if not 1 <= window <= steps:
            raise ConfigError(f"guard window must be 1 to the guard's steps ({steps}), got {window}")
        return cls(metric, factor, steps, window)

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "factor": self.factor, "steps": self.steps, "window": self.window}


@dataclass(frozen=True)
class Verdict:
    """What a look at the series found: nothing yet, a regression (``reason``), or the end."""

    regressed: str | None = None
    passed: bool = False
    baseline: tuple[float, int, int] | None = None  # (mean, from step, to step), when first known


def evaluate(guard: dict[str, Any], series: JobSeries) -> Verdict:
    """Judge ``guard`` on what ``series`` holds now (pure: no store, no clock)."""
    metric, effective = guard["metric"], guard["effective_step"]
    steps, window, factor = guard["steps"], guard["window"], guard["factor"]
    newest = series.settled(metric)
    if newest < effective:
        return Verdict()  # some reporting group has not reached the change's step yet
    baseline = None
    if guard.get("baseline") is None:
        first = max(0, effective - steps)
        mean = _mean(series.window(metric, first, effective - 1))
        if mean is not None:
            baseline = (mean, first, effective - 1)
    base = guard.get("baseline")
    if base is None and baseline is not None:
        base = baseline[0]
    last = effective + steps
    points = series.window(metric, effective, last)
    bad = next((p for p in points if p[3]), None)
    if bad is not None:
        groups = sorted({g for g, _ in series.nonfinite_groups(metric, bad[0], bad[1])})
        where = f" in group {', '.join(groups)}" if groups else ""
        return Verdict(f"{metric} was not finite (NaN or inf){where} at step {bad[0]}", baseline=baseline)
    if base is not None and base > 0:  # judged on steps every group has reported
        means = [(p[1], m) for p in points if p[1] <= newest and (m := _mean([p])) is not None]
        complete = newest >= last
        for i in range(len(means)):
            if i + 1 < window and not (complete and i == len(means) - 1):
                continue  # a full window, or what there is once the range is over
            run = means[max(0, i + 1 - window) : i + 1]
            smoothed = sum(m for _, m in run) / len(run)
            if smoothed > factor * base:
                return Verdict(
                    f"{metric} {smoothed:.6g} (mean of steps {run[0][0]}-{run[-1][0]}) > "
                    f"{factor:g} x {base:.6g} (mean before step {effective}) at step {run[-1][0]}",
                    baseline=baseline,
                )
    return Verdict(passed=newest > last, baseline=baseline)


def _mean(points: Iterable[Point]) -> float | None:
    """The mean of every finite value in ``points`` (None when there is none)."""
    total, finite = 0.0, 0
    for _, _, count, nonfinite, value_sum, _, _ in points:
        total += value_sum
        finite += count - nonfinite
    mean = total / finite if finite > 0 else None
    return mean if mean is not None and math.isfinite(mean) else None


def tag(version: int) -> str:
    """How a guard's rollback comment starts: finds a rollback already made."""
    return f"guard of v{version}:"


class MakeChange(Protocol):
    """Commits a change made now as the job makes any (``LighthouseState.change``): checked against
    its schema, stored, served, at one step in every group."""

    def __call__(
        self,
        op: str,
        body: Any,
        *,
        source: str,
        author: str = ...,
        comment: str = ...,
        if_match: int | None = ...,
        read_step: int | None = ...,
    ) -> Plan: ...


class JobGuards:
    """One job's guards: created with a change, judged on the job's series, stored in its store,
    rolled back through ``change`` (the job's own way of making a change now)."""

    def __init__(self, store: ConfigStore, series: JobSeries, change: MakeChange) -> None:
        self.store = store
        self.job = store.job
        self.series = series
        self._change = change
        self._lock = threading.Lock()  # one evaluation or change of this job's guards at a time
        # Held across a read of the store and the copy it makes (reload), and across a write and
        # its copy (_save): a reload that read before one of our writes cannot put back what it read
        # over that write (the guard a PATCH just made vanished from this lighthouse's list until
        # the store's next event, as seen with three test processes).
        self._copy_lock = threading.Lock()
        self._guards: dict[int, dict[str, Any]] = {}
        self._forgot_at: tuple[int, int] = (0, 0)  # (pruned through, decisions) at the last forget
        self._decisions = 0  # guards decided here or read decided from the store
        self._past_end: dict[int, float] = {}  # active guard -> when the job was seen past its end
        self.rollbacks = 0  # guards this lighthouse found regressed and rolled back (or tried to)
        self.reload()

    def reload(self) -> None:
        """Take the guards the store holds (at start, and when another lighthouse changed one)."""
        store = self.store
        with self._copy_lock:
            self._guards = {int(g["version"]): g for g in store.backend.guards(store.job)}
            self._decisions += 1  # another lighthouse may have decided some

    # ------------------------------------------------------------ changes
    @staticmethod
    def draft(plan: Plan, spec: GuardSpec, author: str) -> dict[str, Any]:
        """The guard ``spec`` makes for the change ``plan`` commits (or would: a dry run)."""
        row = plan.row
        changes = plan.changes()
        if not changes:
            raise ConfigError("the change changes no key: there is nothing to guard")
        effective = row.effective_step if row.effective_step is not None else max(row.order_step, 0)
        return {
            "version": row.version,
            **spec.to_json(),
            "effective_step": effective,
            "changes": changes,
            "author": author,
            "created_at": time.time(),
            "status": "active",
            "baseline": None,
            "baseline_steps": None,
            "rollback_version": None,
            "rollback_step": None,
            "reason": None,
            "decided_at": None,
        }

    def add(self, guard: dict[str, Any]) -> dict[str, Any]:
        """Store a new guard (right after its change committed)."""
        self._save(guard)
        logger.info(
            "version %d guarded by %s:%g over steps %d to %d",
            guard["version"],
            guard["metric"],
            guard["factor"],
            guard["effective_step"],
            guard["effective_step"] + guard["steps"],
        )
        return guard

    def cancel(self, version: int, author: str) -> dict[str, Any]:
        """Stop watching; NotFound without such a guard, NotCancellable when it is no longer active."""
        with self._lock:
            guard = self._guards.get(version)
            if guard is None:
                raise NotFound(f"version {version} has no guard")
            if guard["status"] != "active":
                raise NotCancellable(f"the guard of version {version} is {guard['status']} already")
            done = {
                **guard,
                "status": "cancelled",
                "reason": f"cancelled by {author}",
                "decided_at": time.time(),
            }
            self._save(done)
        return done

    def _save(self, guard: dict[str, Any]) -> None:
        with self._copy_lock:
            self.store.backend.save_guard(self.job, guard)
            self._guards[int(guard["version"])] = guard
            self._decisions += guard["status"] != "active"

    def forget_pruned(self) -> None:
        """Drop the decided guards of versions the history no longer holds. Kept, every guarded
        change a job ever made stayed in memory, in the store and in the guards list, and every
        look for an active guard went through them all: a controller guarding its changes for
        weeks grew them without bound. An active guard stays until decided (its change's keys
        are in the guard). Cheap when neither the history was cut nor a guard decided since."""
        through = self.store.retention()["pruned_through"]
        if (through, self._decisions) == self._forgot_at:
            return
        with self._lock:  # no decision meanwhile
            decisions = self._decisions
            with self._copy_lock:
                gone = [v for v, g in self._guards.items() if v <= through and g["status"] != "active"]
            if gone:
                try:
                    self.store.backend.drop_guards(self.job, gone)
                except StoreUnavailable:
                    return  # kept for now (the store is down or full): dropped at a later look
                with self._copy_lock:
                    for version in gone:
                        self._guards.pop(version, None)
            self._forgot_at = (through, decisions)

    # ------------------------------------------------------------ reads
    def list(self) -> list[dict[str, Any]]:
        """Every guard, newest first, each with the steps it watches."""
        return [
            {**g, "until_step": g["effective_step"] + g["steps"]}
            for g in sorted(list(self._guards.values()), key=lambda g: -int(g["version"]))
        ]

    def active(self) -> bool:
        return any(g["status"] == "active" for g in list(self._guards.values()))  # a copy: HTTP adds

    # ------------------------------------------------------------ watching
    def check(self, lapse_after: float = LAPSE_AFTER) -> None:
        """Judge every active guard now: record a baseline, a pass, or roll back a regression; one
        the job has been past the end of for ``lapse_after`` seconds without its metric lapses."""
        with self._lock:
            active = [g for g in list(self._guards.values()) if g["status"] == "active"]
            for guard in active:
                verdict = evaluate(guard, self.series)
                if verdict.baseline is not None:
                    mean, first, last = verdict.baseline
                    guard = {**guard, "baseline": mean, "baseline_steps": [first, last]}
                    self._save(guard)
                if verdict.regressed is not None:
                    self._roll_back(guard, verdict.regressed)
                elif verdict.passed:
                    self._save({**guard, "status": "passed", "decided_at": time.time()})
                    logger.info("the guard of version %d passed", guard["version"])
                else:
                    self._lapse_if_overdue(guard, lapse_after)
            versions = {int(g["version"]) for g in active}
            self._past_end = {v: t for v, t in self._past_end.items() if v in versions}

    def _lapse_if_overdue(self, guard: dict[str, Any], lapse_after: float) -> None:
        """Decide a guard ``lapsed`` once the job has stood past its last step for ``lapse_after``
        seconds and its metric still was not reported through that step by every reporting group
        (the change stays). A job back below that step (a resume from an earlier checkpoint)
        starts the wait again."""
        version, last = int(guard["version"]), guard["effective_step"] + guard["steps"]
        if self.store.current_step <= last:
            self._past_end.pop(version, None)
            return
        now = time.monotonic()
        since = self._past_end.setdefault(version, now)
        if now - since < lapse_after:
            return
        metric = guard["metric"]
        reported = self.series.settled(metric)
        through = f"reported through step {reported}" if reported >= 0 else "never reported"
        reason = (
            f"not judged: {metric} {through}, not through step {last}, {lapse_after:g}s after the "
            f"job passed it (the change stays)"
        )
        self._save({**guard, "status": "lapsed", "reason": reason, "decided_at": time.time()})
        logger.warning("the guard of version %d lapsed: %s", version, reason)

    def _roll_back(self, guard: dict[str, Any], reason: str) -> None:
        """Put back the keys the guarded change set, as a change made now (once, whoever does it)."""
        version = int(guard["version"])
        comment = f"{tag(version)} {reason}"
        done = _rollback_in_history(self.store, version)
        if done is None:
            try:
                plan = self._revert(guard, comment)
            except VersionConflict:
                return  # the job changed under this decision (another lighthouse rolled back?): next look
            except ConfigError as exc:  # the schema refuses the old values now, say
                reason += f" (the rollback was refused: {exc})"
                plan = None
            else:
                if plan is None:
                    reason += " (nothing left to roll back: every key was changed again since)"
            done = None if plan is None else (plan.version, plan.row.effective_step)
            self.rollbacks += 1  # decided here (a lighthouse that finds it in the history does not count it)
        rollback_version, rollback_step = done if done is not None else (None, None)
        self._save(
            {
                **guard,
                "status": "triggered",
                "reason": reason,
                "rollback_version": rollback_version,
                "rollback_step": rollback_step,
                "decided_at": time.time(),
            }
        )
        logger.warning("the guard of version %d triggered: %s", version, reason)

    def _revert(self, guard: dict[str, Any], comment: str) -> Plan | None:
        """Commit the rollback (If-Match on the head it was decided at); None: nothing to revert.

        Made from the config at the step a change made now takes effect at, not the live one: a
        change made now that is still pending stays (a key it changed again too), and one
        scheduled further ahead still lands on top at its step."""
        store = self.store
        with store.lock:
            head = store.head
            at, base = store.made_now_base()
        config = dict(base)
        reverted = []
        for key, change in guard["changes"].items():
            if config.get(key, _ABSENT) != change.get("after", _ABSENT):
                continue  # changed again since: the newer edit stays
            reverted.append(key)
            if "before" in change:
                config[key] = change["before"]
            else:
                config.pop(key, None)
        if not reverted:
            return None
        return self._change(
            "put",
            config,
            source=AUTHOR,
            author=AUTHOR,
            comment=f"{comment}; rolled back {', '.join(reverted)}",
            if_match=head,
            read_step=at,
        )


_ABSENT = object()


def _rollback_in_history(store: ConfigStore, version: int) -> tuple[int, int | None] | None:
    """(version, effective step) of a rollback this guard already made, if the history holds one."""
    prefix = tag(version)
    for row in store.history(limit=EVERY_RECORD):
        if row["version"] <= version:
            return None
        if row["author"] == AUTHOR and str(row["comment"]).startswith(prefix):
            return int(row["version"]), row["effective_step"]
    return None


class GuardWatch:
    """Checks every job's active guards every CHECK_INTERVAL seconds, in a thread of its own."""

    def __init__(
        self,
        jobs: Callable[[], Iterable[JobGuards]],
        interval: float = CHECK_INTERVAL,
        lapse_after: float = LAPSE_AFTER,
    ) -> None:
        self._jobs = jobs
        self._interval = interval
        self._lapse_after = lapse_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="guards", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            for guards in self._jobs():
                try:
                    guards.forget_pruned()
                    if guards.active():
                        guards.check(self._lapse_after)
                except Exception:  # one job's trouble (a store outage) must not stop the others'
                    logger.exception("job %s: guards not checked", guards.job)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
