"""Step leases: what a lighthouse promised the managers of a job, and where a change made now applies.

Every answer to a manager that reports a step carries a horizon H, ``stable_through_step``:
a promise that the config it carries (with the scheduled changes in it) is the job's config
for every step up to H. A change made now is committed with an effective step E above every
horizon ever promised for the job, so every replica group switches at E, whichever lighthouse
it talks to and whenever its next renewal comes.

Promises outlive the process that made them. A lighthouse promises only up to a *ceiling*
that is already stored, raised in the background ahead of need (so the gRPC path does not
wait for a disk or etcd write in steady state). The stored ceilings of the other lighthouses
on the same store, and of earlier lives of this one, are its *floor*: a bound on every promise
it does not know of. Its own promises it knows exactly, so its changes take effect at

    E = max(highest horizon promised in this life, floor, job step) + 1

(and at once, as before leases, while the job was never promised a step), and never below a
pending change made now (``ConfigStore._now_step``): acknowledged order is effective order.

Lease length, per job: ``L = max(min_steps, ceil(rate * seconds)) + extra_steps``, where
``rate`` is the job's step rate (steps per second of its fastest group, measured from the steps
managers report) and ``seconds`` what the manager asks for: its cache TTL when it polls, a fraction
of a second on a live push stream (push-speed leases: ``min_steps`` is then 1, a renewal on the
stream arrives within a step), so that while every group pushes a change made now is live within
about that plus a few steps; one polling group's TTL lease brings the TTL's wait back. A manager renews in
the background once it is half-way through its lease, so an outage of half a TTL changes
nothing its workers see, and E lies at most about one TTL plus ``extra_steps + 1`` steps ahead
of the fastest group (``benchmarks.leases`` measures it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from protos.job_ids import JobId

logger = logging.getLogger(__name__)

T = TypeVar("T")

NO_LEASE = -1
OWN_CEILING_AHEAD = 10.0
# On a shared store the ceiling's lead is the outage a group rides out: an etcd leader election
# takes its election timeout (1 s by default) and more; with 1 s, a chaos run on loaded cores
# (seed 1897) saw every group reach the ceiling 1.0 s after a leader kill.
SHARED_CEILING_AHEAD = 2.0
DEFAULT_MIN_STEPS = 3  # ``--lease-min-steps``
RATE_HALF_LIFE = 10.0  # seconds for a job's measured step rate to halve once its groups slow down


@dataclass(frozen=True)
class LeasePolicy:
    """The lease-length rule and how far the stored ceiling runs ahead (``lighthouse serve`` flags)."""

    min_steps: int = (
        DEFAULT_MIN_STEPS  # a lease is never shorter: a renewal at half of it has a step or more to arrive
    )
    # Asked on a push stream: a renewal there is one message on an open stream, answered in
    # milliseconds, so half of a 1-step lease (one step) is time enough; push-speed leases need it
    # (at 100 ms steps, 3 + 1 steps would hold a change made now back 500 ms).
    stream_min_steps: int = 1
    extra_steps: int = 1  # on top of the steps the rate gives: the step the job may be ahead of its report
    default_seconds: float = 1.0  # for managers that do not say (releases without leases)
    # Seconds of steps the stored ceiling runs ahead of the promises: fewer store writes, but
    # after a restart, or when made through another lighthouse, a change waits up to this much
    # longer. None: 10 s on a store with one writer (only a restart pays), 2 s on a shared one.
    ceiling_ahead: float | None = None
    # Seconds without a step from any manager before a job's run ends, at least (``runs``): a
    # pause shorter than this (an evaluation, a checkpoint save) keeps the run and its leases.
    run_end_after: float = 5.0

    def for_store(self, shared: bool) -> LeasePolicy:
        """This policy with the ceiling's lead decided for a store (shared by lighthouses or not)."""
        if self.ceiling_ahead is not None:
            return self
        return dataclasses.replace(self, ceiling_ahead=SHARED_CEILING_AHEAD if shared else OWN_CEILING_AHEAD)

    def length(self, rate: float, seconds: float, streamed: bool = False) -> int:
        """Steps a lease lasts at ``rate`` steps/s for a manager renewing every ``seconds``
        (``streamed``: on its push stream). A ``min_steps`` raised above its default is the
        operator's for every lease (a change made now then stays pending that long), streamed too."""
        raised = self.min_steps > DEFAULT_MIN_STEPS
        least = self.stream_min_steps if streamed and not raised else self.min_steps
        return max(least, math.ceil(rate * (seconds or self.default_seconds))) + self.extra_steps


class LeaseGate:
    """Whether this lighthouse may grant step leases, for all its jobs.

    Not while a lighthouse that does not honour them is live on the same store (an earlier
    release: ``peers.features`` decides): its changes apply at once, inside any promise.
    """

    def __init__(self) -> None:
        self.suspended_by: tuple[str, ...] = ()  # those lighthouses' addresses
        self.runs_suspended_by: tuple[str, ...] = ()  # live lighthouses that know no runs: none begins

    @property
    def suspended(self) -> bool:
        return bool(self.suspended_by)


@dataclass(frozen=True)
class CommitWindow:
    """What a commit may change: nothing at or below ``horizon`` (promised, or maybe promised
    by another lighthouse); ``now_step`` is where a change made now takes effect (None: at
    once, nothing was ever promised). ``view`` is the store revision the floor was read at."""

    horizon: int
    now_step: int | None
    view: int


class LeaseBook(Generic[T]):
    """The leases of one job in one lighthouse, and the snapshot they are granted with.

    The served snapshot is published here: a promise and the snapshot it is about are read
    under one lock, so no grant can pair an old snapshot with a horizon past a change being
    committed (a commit freezes the horizon until its snapshot is published).
    """

    def __init__(
        self,
        policy: LeasePolicy,
        *,
        floor: int = NO_LEASE,
        view: int = 0,
        floor_grantable: bool,
        request_ceiling: Callable[[LeaseBook[T]], None] = lambda book: None,
        gate: LeaseGate | None = None,
    ) -> None:
        self.policy = policy
        self.gate = gate or LeaseGate()
        self._cond = threading.Condition(threading.Lock())
        self._served: T | None = None
        self._served_version = 0
        self.granted = NO_LEASE  # highest horizon promised in this life
        self.floor = floor  # bound on the promises of others and of earlier lives
        self.view = view
        # On a store with one writer the floor is this lighthouse's own earlier lives: promising
        # up to it is safe. On a shared store it may be another lighthouse's: never promise past
        # our own stored ceiling, that lighthouse commits right above its own promises.
        self._floor_grantable = floor_grantable
        self.stored = NO_LEASE  # our own ceiling, durably stored
        self.wanted = NO_LEASE  # the ceiling asked of the writer
        self.generation = 0  # moves at every run's begin and end: a ceiling asked before is not ours
        self.wanted_since = 0.0  # when the writer was last asked for a ceiling while none was wanted
        self._frozen: int | None = None
        self._request_ceiling = request_ceiling
        self.rate = 0.0
        self._rate_at = time.monotonic()
        self._unrated_from: int | None = None  # the first step granted before the rate was known
        self.ceiling_writes = 0

    # ------------------------------------------------------------ serving
    def publish(self, served: T, version: int) -> None:
        """Serve ``served`` (the snapshot of ``version``) from now on."""
        with self._cond:
            self._served = served
            self._served_version = version
            self._cond.notify_all()

    @property
    def served_version(self) -> int:
        return self._served_version

    @property
    def promisable(self) -> int:
        """The highest step this lighthouse may promise without another ceiling write."""
        return max(self.stored, self.floor) if self._floor_grantable else self.stored

    def grant(
        self,
        step: int,
        seconds: float,
        wait: float = 0.0,
        generation: int | None = None,
        streamed: bool = False,
    ) -> tuple[T, int]:
        """The served snapshot and the horizon promised with it to a group at ``step``.

        NO_LEASE when no promise can cover ``step`` within ``wait`` seconds (the ceiling is not
        stored yet, or a commit is under way and the group is past every promise), and while
        the gate suspends leases. ``generation``: the one the caller saw a run live in; once a
        run ended or began since (a grant may wait for its ceiling across one), nothing is
        promised: a ceiling asked after it would be one of no run, and the horizon it gave
        would place changes made between runs above steps nobody may hold.
        """
        if self.gate.suspended:
            with self._cond:
                assert self._served is not None, "publish() before grant()"
                return self._served, NO_LEASE
        length = self.policy.length(self.rate, seconds, streamed)
        want = step + length
        # The stored ceiling covers a polled lease whatever was asked: on a shared store its lead is
        # the outage a group rides out (an etcd election: 1-2 s), and sized by a push-speed lease
        # (~80 ms) it shrank to 0.6-1.2 s (chaos seed 1897, an etcd leader kill).
        reach = step + (self.policy.length(self.rate, self.policy.default_seconds) if streamed else length)
        deadline = time.monotonic() + wait
        request = False
        while True:
            with self._cond:
                if generation is not None and generation != self.generation:
                    horizon, served = NO_LEASE, self._served  # the run it was asked in is over
                    request = False
                    break
                limit = self.promisable
                if self._frozen is not None:
                    limit = min(limit, self._frozen)
                headroom = reach - step + math.ceil(self.rate * (self.policy.ceiling_ahead or 0.0))
                if self.rate <= 0:
                    headroom = max(headroom, self._slow_start(step))
                if reach > self.wanted - headroom // 2:  # running low: raise ahead of need
                    self._want(reach + headroom)
                    request = True
                remaining = deadline - time.monotonic()
                if limit >= step or (remaining <= 0 and not request):
                    horizon = min(want, limit) if limit >= step else NO_LEASE
                    if horizon != NO_LEASE and not self._floor_grantable:
                        # A shared store: every change made now goes above the stored ceilings anyway
                        # (the floor holds ours), so promising up to ours delays none, and covers an
                        # outage of the store or of this lighthouse for the ceiling's whole lead, however
                        # short the lease asked (push-speed: ~80 ms; chaos seed 1897, an etcd leader kill).
                        horizon = limit
                    if horizon > self.granted:
                        self.granted = horizon
                    served = self._served
                    break
                if not request:  # wait for the writer, or for a commit to end
                    self._cond.wait(remaining)
                    continue
            self._request_ceiling(self)  # outside the lock: a writer may store it at once
            request = False
        if request:
            self._request_ceiling(self)
        assert served is not None, "publish() before grant()"
        return served, horizon

    def _slow_start(self, step: int) -> int:
        """Headroom while the job's rate is not known yet (its first quarter second of reports):
        twice the steps granted since, so the ceiling's writes come at every 1.5x of the steps
        rather than every few steps (a job at 2 ms steps outran each write, ~10 ms on SQLite, and
        its workers' prefetched steps waited for it). Bounded by the steps the job made meanwhile:
        after a restart, a change waits at most that long for a ceiling it did not need."""
        if self._unrated_from is None:
            self._unrated_from = max(step, 0)
        return 2 * max(0, step - self._unrated_from)

    def prepare(self, step: int, seconds: float, generation: int | None = None) -> None:
        """A manager without steps yet (it just started): store a ceiling covering its first lease
        now, so that its workers' first steps do not wait for a store write. ``generation``: as
        for ``grant`` (not once the run it was asked in is over)."""
        if self.gate.suspended:  # no promise to cover: grants wait for the gate to open
            return
        want = max(step, 0) + self.policy.length(self.rate, seconds)
        with self._cond:
            if generation is not None and generation != self.generation:
                return
            headroom = want - max(step, 0) + math.ceil(self.rate * (self.policy.ceiling_ahead or 0.0))
            if want <= self.wanted - headroom // 2:
                return
            self._want(want + headroom)
        self._request_ceiling(self)

    def _want(self, ceiling: int) -> None:
        """Ask the writer for ``ceiling`` (under the lock), noting since when one is wanted."""
        if self.wanted <= self.stored:
            self.wanted_since = time.monotonic()
        self.wanted = ceiling

    def overdue(self, seconds: float) -> bool:
        """Whether a ceiling has been wanted for longer than ``seconds`` and is still not stored (the
        store is slow to take it, or cannot: etcd out of reach)."""
        with self._cond:
            return self.wanted > self.stored and time.monotonic() - self.wanted_since > seconds

    def observe_rate(self, steps_per_second: float) -> None:
        """A group's measured step rate; the job's is its fastest group's, decaying when they slow."""
        now = time.monotonic()
        with self._cond:
            decayed = self.rate * 0.5 ** ((now - self._rate_at) / RATE_HALF_LIFE)
            self.rate = max(decayed, steps_per_second)
            self._rate_at = now

    # ------------------------------------------------------------ commits
    @property
    def horizon(self) -> int:
        """The highest step any group may have been promised (NO_LEASE: none ever)."""
        return max(self.granted, self.floor)

    def freeze(self, job_step: int) -> CommitWindow:
        """Start a commit: no grant goes past today's horizon until ``thaw``; where a change made
        now takes effect."""
        with self._cond:
            self._frozen = max(self.granted, self.floor)
            return self._window(job_step)

    def window(self, job_step: int) -> CommitWindow:
        """Like ``freeze`` without freezing (a dry run)."""
        with self._cond:
            return self._window(job_step)

    def _window(self, job_step: int) -> CommitWindow:
        """At once while nothing is promised: never promised, or leases suspended and every
        promise passed (as the lighthouses that suspend them commit)."""
        horizon = max(self.granted, self.floor)
        at_once = horizon == NO_LEASE or (self.gate.suspended and job_step > horizon)
        return CommitWindow(horizon, None if at_once else max(horizon, job_step) + 1, self.view)

    def thaw(self) -> None:
        """The commit is over (its snapshot published, or it failed): grants go on."""
        with self._cond:
            self._frozen = None
            self._cond.notify_all()

    # ------------------------------------------------------------ ceilings
    def new_run(self) -> None:
        """A run ended or began: every promise was to the run before (see ``runs``), none holds now."""
        with self._cond:
            self.granted = self.floor = self.stored = self.wanted = NO_LEASE
            self.generation += 1
            self._cond.notify_all()

    def ceiling_stored(self, ceiling: int, generation: int | None = None) -> None:
        """The writer stored ``ceiling``, asked in ``generation`` (None: this one): a ceiling of the
        run before (it ended, or the next began, while it was written) counts for nothing now."""
        with self._cond:
            if generation is not None and generation != self.generation:
                return
            self.ceiling_writes += 1
            self.wanted_since = time.monotonic()  # the store takes ceilings: none is overdue
            if ceiling > self.stored:
                self.stored = ceiling
            if not self._floor_grantable:
                # The shared floor key holds it now: every lighthouse on the store, this one too once
                # it reads the job again, counts it as promised. Counted at once, the horizon never
                # jumps later (after leases were suspended and their promises seemed passed).
                self.floor = max(self.floor, ceiling)
            self._cond.notify_all()

    def raise_floor(self, ceiling: int, view: int, generation: int | None = None) -> None:
        """Another lighthouse (or an earlier life) stored ``ceiling``, seen at store revision ``view``;
        ``generation``: as for ``grant`` (a ceiling of a run that is over bounds nothing)."""
        with self._cond:
            if generation is not None and generation != self.generation:
                return
            self.floor = max(self.floor, ceiling)
            self.view = max(self.view, view)
            self._cond.notify_all()


class CeilingWriter:
    """Stores the lease ceilings of every job of a lighthouse, in the background, one thread.

    ``save(job, ceiling, served_version)`` writes durably; it raises ``retry`` exceptions when
    the write must wait (the job's head moved past the served version: the new version is
    served first) and other exceptions when the store cannot write now (backed off).
    """

    PAUSE = 0.02  # between two rounds: requests arriving meanwhile are written together
    BACKOFF_MAX = 2.0

    def __init__(
        self,
        save: Callable[[JobId, int, int], None],
        *,
        retry: tuple[type[BaseException], ...],
        unavailable: tuple[type[BaseException], ...],
    ) -> None:
        self._save = save
        self._retry = retry
        self._unavailable = unavailable
        self._lock = threading.Lock()
        self._queue: dict[JobId, LeaseBook[object]] = {}
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # Jobs whose last ceiling write failed, and why (until one is stored).
        self.failing: dict[JobId, str] = {}
        self._thread = threading.Thread(target=self._run, name="lease-ceilings", daemon=True)
        self._thread.start()

    def request(self, job: JobId, book: LeaseBook[object]) -> None:
        with self._lock:
            self._queue[job] = book
        self._wake.set()

    def _run(self) -> None:
        pause = self.PAUSE
        while not self._stopping.is_set():
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                batch, self._queue = self._queue, {}
            failed = False
            for job, book in batch.items():
                ceiling, generation = book.wanted, book.generation
                if ceiling <= book.stored:
                    continue
                try:
                    self._save(job, ceiling, book.served_version)
                except self._retry:  # the job changed elsewhere: serve that change, then raise
                    self.request(job, book)
                    continue
                except self._unavailable as exc:
                    logger.warning("job %s: step-lease ceiling not stored yet: %s", job, exc)
                    self.request(job, book)
                    self.failing[job] = str(exc)
                    failed = True
                    continue
                except Exception as exc:
                    logger.exception("job %s: storing the step-lease ceiling failed", job)
                    self.request(job, book)
                    self.failing[job] = str(exc)
                    failed = True
                    continue
                self.failing.pop(job, None)
                book.ceiling_stored(ceiling, generation)
            pause = min(pause * 2, self.BACKOFF_MAX) if failed else self.PAUSE
            self._stopping.wait(pause)

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=5)
