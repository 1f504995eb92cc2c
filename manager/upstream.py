"""When a manager asks the lighthouse, and what it answers when the lighthouse does not.

Pure policy with an injected clock and fetch function, so the rules can be
tested without time passing:

* a snapshot is served while it is younger than ``ttl`` (age counted from the
  start of the fetch that produced it);
* at most one fetch is in flight; callers that find the cache expired wait for
  that fetch (bounded) instead of starting their own;
* a failed fetch opens a backoff window: until a fetch succeeds again, callers
  get the fallback (empty, or the last good snapshot with ``serve_stale``) at
  once and never wait on the lighthouse, so a dead lighthouse costs a training
  loop one deadline, not one per step. Retries come from ``refresh()`` (the
  manager's background loop), at most one per backoff window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from manager.snapshot import Snapshot

logger = logging.getLogger(__name__)
MAX_REASONS_LOGGED = 8  # distinct reasons per outage (details can carry ports, times)
RENEW_TRIES = 4  # answers a step past the lease waits for (``UpstreamCache.renew``)


class FetchFailed(Exception):
    """The lighthouse did not answer in time, or refused."""


@dataclass(frozen=True)
class Answer:
    snapshot: Snapshot
    fetched: bool  # this call waited for a fresh upstream fetch


# A fetch takes the snapshot held now (or None) and returns the new one; raises FetchFailed.
Fetch = Callable[[Snapshot | None], Snapshot]


class UpstreamCache:
    def __init__(
        self,
        fetch: Fetch,
        *,
        ttl: float,
        backoff: float,
        wait_timeout: float,
        serve_stale: bool = False,
        clock: Callable[[], float] = time.monotonic,
        fallback: Snapshot | None = None,
    ) -> None:
        self._fetch = fetch
        self._empty = fallback or Snapshot.fallback()
        self.ttl = ttl
        self.backoff = backoff
        self.wait_timeout = wait_timeout
        self.serve_stale = serve_stale
        self._clock = clock
        self._good: Snapshot | None = None
        self._fresh_until = float("-inf")
        self._confirmed_at = float("-inf")  # when the lighthouse last gave or confirmed the snapshot
        self._failing = False
        self._retry_at = float("-inf")
        self._in_flight = False
        self._fetch_now = False  # the push stream ended: refresh at once, fresh or not
        self._cond = threading.Condition(threading.Lock())
        self.fetches = 0
        self.failures = 0
        self.last_error = ""  # why the failing fetch failed (empty while fetches succeed)
        # Each reason is logged once per outage: a first DEADLINE_EXCEEDED must not hide the TLS
        # refusal or the refused connection that later retries find, nor every retry repeat it.
        self._reasons_logged: set[str] = set()

    @property
    def good(self) -> Snapshot | None:
        """The last snapshot the lighthouse gave."""
        return self._good

    @property
    def failing(self) -> bool:
        return self._failing

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    def age(self) -> float | None:
        """Seconds since the lighthouse last confirmed the held snapshot (the start of the fetch that
        brought it, or the last push); None before the first."""
        if self._good is None:
            return None
        return self._clock() - self._confirmed_at

    def get(self) -> Answer:
        """The snapshot a worker call should be answered from (the hot path: one clock read when fresh)."""
        good = self._good
        if good is not None and self._clock() < self._fresh_until:
            return Answer(good, False)
        if self._failing:
            return Answer(self.fallback(), False)
        return self._fetch_once(wait=True)

    def renew(self, satisfied: Callable[[], bool]) -> Answer:
        """Fetch now, whatever the TTL, unless ``satisfied()`` (for a call the held snapshot cannot
        answer: a step beyond the manager's step lease). Joins a fetch in flight first, then
        fetches itself if that one did not satisfy; during a backoff window, the fallback at once.

        Up to ``RENEW_TRIES`` answers: a fetch joined, or begun, before this step was wanted (or
        before an answer beginning a new run cleared the steps wanted) asks for a lease that may
        stop short of it (workers of one group asking steps in parallel at a run's start), and the
        next one asks for it: ``satisfied`` records the step again before each try. A lighthouse
        that fails sets the backoff window, so an outage still costs one deadline.
        """
        answer = Answer(self._good or self.fallback(), False)
        for _ in range(RENEW_TRIES):
            if satisfied():
                return answer
            if self._failing:
                return Answer(self.fallback(), False)
            answer = self._fetch_once(wait=True, fresh=True)
        return answer

    def offer(self, snapshot: Snapshot) -> Snapshot:
        """A snapshot pushed by the lighthouse: held, and fresh until ``expire`` (while the push stream
        lives it is always the newest). Never replaces a newer one of the same state; returns the one held."""
        with self._cond:
            held = self._keep(snapshot)
            if self._failing:
                logger.info("lighthouse reachable again; serving version %d", held.version)
            self._good = held
            self._fresh_until = float("inf")
            self._confirmed_at = self._clock()
            self._failing = False
            self._cond.notify_all()
            return held

    def stream_ended(self) -> None:
        """The push stream ended: the held snapshot is served until one TTL after the lighthouse last
        confirmed it (never emptied), and the background loop fetches at once."""
        with self._cond:
            self._fresh_until = min(self._fresh_until, self._confirmed_at + self.ttl)
            self._fetch_now = True
            self._cond.notify_all()

    @property
    def fresh(self) -> bool:
        """The held snapshot is served without asking the lighthouse (failing or not)."""
        return self._good is not None and self._clock() < self._fresh_until

    def _keep(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot``, unless the one held is newer in the same lighthouse state (answers of two
        paths, a fetch and a push, may arrive out of order)."""
        good = self._good
        if good is not None and good.state_id == snapshot.state_id and good.version > snapshot.version:
            return good
        return snapshot

    def refresh(self) -> Answer:
        """Fetch now unless a fetch is in flight or the backoff window is open (background loop)."""
        if self._failing and self._clock() < self._retry_at:
            return Answer(self.fallback(), False)
        return self._fetch_once(wait=False)

    def next_refresh_in(self) -> float:
        """Seconds until the background loop should refresh: just before expiry, or at the retry time."""
        now = self._clock()
        if self._failing:
            return max(0.0, self._retry_at - now)
        if self._fetch_now:
            return 0.0
        lead = min(0.05 * self.ttl, 0.05)
        return max(0.0, self._fresh_until - lead - now)

    def fallback(self) -> Snapshot:
        """What a call gets when the lighthouse cannot confirm a config: empty, or with
        ``serve_stale`` the last good one marked stale."""
        if self.serve_stale and self._good is not None:
            return self._good.as_stale()
        return self._empty

    def _fetch_once(self, wait: bool, fresh: bool = False) -> Answer:
        """Fetch unless one is in flight (``wait``: then wait for it, bounded). ``fresh``: a
        finished fetch counts even if the snapshot is past its TTL (the caller checks it)."""
        with self._cond:
            if self._in_flight:
                if not wait:
                    return Answer(self._good or self.fallback(), False)
                deadline = self._clock() + self.wait_timeout
                while self._in_flight:
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                good = self._good
                if good is not None and not self._failing and (fresh or self._clock() < self._fresh_until):
                    return Answer(good, True)
                return Answer(self.fallback(), False)
            self._in_flight = True
            self._fetch_now = False
        started = self._clock()
        try:
            snapshot = self._fetch(self._good)
        except FetchFailed as exc:
            with self._cond:
                self.failures += 1
                if not self._failing:
                    self._reasons_logged = {str(exc)}
                    logger.warning(
                        "lighthouse unavailable (%s); serving %s, retrying every %.1fs",
                        exc,
                        "the last good config" if self.serve_stale and self._good else "an empty config",
                        self.backoff,
                    )
                elif str(exc) not in self._reasons_logged and len(self._reasons_logged) < MAX_REASONS_LOGGED:
                    self._reasons_logged.add(str(exc))
                    logger.warning("lighthouse still unavailable, now: %s", exc)
                self._failing = True
                self.last_error = str(exc)
                self._retry_at = self._clock() + self.backoff
                self._in_flight = False
                self._cond.notify_all()
            return Answer(self.fallback(), False)
        except BaseException:
            with self._cond:
                self._in_flight = False
                self._cond.notify_all()
            raise
        with self._cond:
            self.fetches += 1
            if self._failing:
                logger.info("lighthouse reachable again; serving version %d", snapshot.version)
            self._failing = False
            self.last_error = ""
            snapshot = self._good = self._keep(snapshot)
            self._fresh_until = max(self._fresh_until, started + self.ttl)
            self._confirmed_at = max(self._confirmed_at, started)
            self._in_flight = False
            self._cond.notify_all()
        return Answer(snapshot, True)
