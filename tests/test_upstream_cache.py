"""UpstreamCache policy: TTL, single flight, backoff and serve_stale, with a fake clock and fetch."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from manager.snapshot import CACHE, FALLBACK, STALE, Snapshot
from manager.upstream import Answer, FetchFailed, UpstreamCache
from tests.procs import poll
from tests.threads import CheckedThread


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def snap(version: int, config: dict[str, str] | None = None) -> Snapshot:
    cfg = config if config is not None else {"v": str(version)}
    return Snapshot(version, "state", "inst", CACHE, (0,), (cfg,), cfg)


class FakeLighthouse:
    """The fetch function: counts calls, records what it was given, fails on demand."""

    def __init__(self, clock: Clock | None = None, duration: float = 0.0) -> None:
        self.calls = 0
        self.held: list[Snapshot | None] = []
        self.version = 1
        self.down = False
        self.reason = "UNAVAILABLE"  # what a failing fetch says
        self.clock = clock
        self.duration = duration  # fake time a fetch takes

    def __call__(self, held: Snapshot | None) -> Snapshot:
        self.calls += 1
        self.held.append(held)
        if self.clock is not None:
            self.clock.advance(self.duration)
        if self.down:
            raise FetchFailed(self.reason)
        if held is not None and held.version == self.version:
            return held  # not modified
        return snap(self.version)


def make(
    fetch: Callable[[Snapshot | None], Snapshot],
    clock: Callable[[], float],
    *,
    ttl: float = 1.0,
    backoff: float = 2.0,
    wait_timeout: float = 5.0,
    serve_stale: bool = False,
) -> UpstreamCache:
    return UpstreamCache(
        fetch, ttl=ttl, backoff=backoff, wait_timeout=wait_timeout, serve_stale=serve_stale, clock=clock
    )


def test_first_get_fetches_then_served_from_cache_until_ttl() -> None:
    clock = Clock()
    lh = FakeLighthouse()
    cache = make(lh, clock, ttl=1.0)

    first = cache.get()
    assert first.fetched and first.snapshot.version == 1 and lh.calls == 1
    assert lh.held == [None]

    for _ in range(100):
        clock.advance(0.009)  # 0.9 s in total, still fresh
        answer = cache.get()
        assert not answer.fetched
        assert answer.snapshot is first.snapshot
    assert lh.calls == 1

    clock.advance(0.2)  # past the TTL
    answer = cache.get()
    assert answer.fetched and lh.calls == 2
    assert lh.held[-1] is first.snapshot  # conditional fetch: it is told what is held
    assert answer.snapshot is first.snapshot  # not modified keeps the held snapshot
    assert cache.fetches == 2 and cache.failures == 0


def test_ttl_counts_from_the_start_of_the_fetch() -> None:
    clock = Clock()
    lh = FakeLighthouse(clock, duration=0.4)
    cache = make(lh, clock, ttl=1.0)
    cache.get()  # started at 1000.0, ended at 1000.4: fresh until 1001.0
    clock.advance(0.55)
    assert not cache.get().fetched
    clock.advance(0.1)  # 1001.05
    assert cache.get().fetched
    assert lh.calls == 2


def test_new_version_is_served_after_expiry() -> None:
    clock = Clock()
    lh = FakeLighthouse()
    cache = make(lh, clock, ttl=0.5)
    assert cache.get().snapshot.version == 1
    lh.version = 2
    clock.advance(0.3)
    assert cache.get().snapshot.version == 1  # still fresh: the change waits for the TTL
    clock.advance(0.3)
    answer = cache.get()
    assert answer.snapshot.version == 2 and answer.snapshot.configs[0] == {"v": "2"}
    assert cache.good is answer.snapshot


def test_failure_serves_empty_fallback_without_retrying_per_call() -> None:
    clock = Clock()
    lh = FakeLighthouse()
    lh.down = True
    cache = make(lh, clock, ttl=1.0, backoff=2.0)

    answer = cache.get()
    assert not answer.fetched
    assert answer.snapshot.kind == FALLBACK
    assert answer.snapshot.version == 0 and answer.snapshot.configs[0] == {}
    assert cache.failing and cache.failures == 1 and lh.calls == 1

    for _ in range(50):
        clock.advance(0.1)  # 5 s of calls: well past TTL and backoff
        again = cache.get()
        assert again.snapshot.kind == FALLBACK
    assert lh.calls == 1  # worker calls never retry the lighthouse while failing


def test_refresh_retries_once_per_backoff_window_and_recovers() -> None:
    clock = Clock()
    lh = FakeLighthouse()
    lh.down = True
    cache = make(lh, clock, ttl=1.0, backoff=2.0)
    cache.get()
    assert lh.calls == 1
    assert cache.next_refresh_in() == pytest.approx(2.0)

    clock.advance(1.0)
    assert cache.refresh().snapshot.kind == FALLBACK
    assert lh.calls == 1  # inside the backoff window: no attempt
    assert cache.next_refresh_in() == pytest.approx(1.0)

    clock.advance(1.01)
    cache.refresh()
    assert lh.calls == 2 and cache.failures == 2  # one retry, failed again: new window
    assert cache.next_refresh_in() == pytest.approx(2.0)
    cache.refresh()
    assert lh.calls == 2

    lh.down = False
    clock.advance(2.01)
    answer = cache.refresh()
    assert answer.fetched and answer.snapshot.version == 1
    assert not cache.failing and lh.calls == 3
    assert cache.get().snapshot.kind == CACHE


def test_serve_stale_gives_the_last_good_config_marked_stale() -> None:
    clock = Clock()
    lh = FakeLighthouse()
    cache = make(lh, clock, ttl=1.0, serve_stale=True)
    good = cache.get().snapshot
    lh.down = True
    clock.advance(1.5)
    answer = cache.get()
    assert answer.snapshot.kind == STALE
    assert answer.snapshot.version == good.version
    assert answer.snapshot.configs[0] == good.configs[0]
    assert answer.snapshot.configs == good.configs
    assert cache.good is good  # the stale view does not replace the good snapshot
    assert cache.get().snapshot is answer.snapshot  # same object every call: nothing rebuilt


def test_serve_stale_without_any_good_config_is_the_empty_fallback() -> None:
    lh = FakeLighthouse()
    lh.down = True
    cache = make(lh, Clock(), serve_stale=True)
    assert cache.get().snapshot.kind == FALLBACK


def test_without_serve_stale_failure_hides_the_old_config() -> None:
    clock = Clock()
    lh = FakeLighthouse()
    cache = make(lh, clock, ttl=1.0)
    cache.get()
    lh.down = True
    clock.advance(1.5)
    answer = cache.get()
    assert answer.snapshot.kind == FALLBACK and answer.snapshot.configs[0] == {}
    assert cache.good is not None and cache.good.version == 1  # kept for recovery, not served


def test_next_refresh_in_leads_the_expiry() -> None:
    clock = Clock()
    cache = make(FakeLighthouse(), clock, ttl=1.0)
    assert cache.next_refresh_in() == 0.0  # nothing held yet
    cache.get()
    assert cache.next_refresh_in() == pytest.approx(0.95)
    clock.advance(0.5)
    assert cache.next_refresh_in() == pytest.approx(0.45)
    clock.advance(5)
    assert cache.next_refresh_in() == 0.0
    short = make(FakeLighthouse(), clock, ttl=0.2)
    short.get()
    assert short.next_refresh_in() == pytest.approx(0.19)


def test_outage_is_logged_once_and_recovery_logged(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    lh = FakeLighthouse()
    lh.down = True
    cache = make(lh, clock, backoff=1.0)
    with caplog.at_level(logging.INFO, logger="manager.upstream"):
        cache.get()
        for _ in range(3):
            clock.advance(1.1)
            cache.refresh()
        lh.down = False
        clock.advance(1.1)
        cache.refresh()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "UNAVAILABLE" in warnings[0].getMessage()
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    assert lh.calls == 5


def test_a_new_reason_within_an_outage_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A first DEADLINE_EXCEEDED must not hide what later retries find (a TLS refusal, say)."""
    clock = Clock()
    lh = FakeLighthouse()
    lh.down = True
    cache = make(lh, clock, backoff=1.0)
    reasons = [
        "DEADLINE_EXCEEDED",
        "UNAVAILABLE: TLS refused",
        "DEADLINE_EXCEEDED",
        "UNAVAILABLE: TLS refused",
    ]
    reasons += [f"UNAVAILABLE: port {port}" for port in range(20)]  # details that never repeat
    with caplog.at_level(logging.WARNING, logger="manager.upstream"):
        for reason in reasons:
            lh.reason = reason
            clock.advance(1.1)
            cache.refresh()
        lh.down = False
        clock.advance(1.1)
        cache.refresh()
        lh.down, lh.reason = True, "DEADLINE_EXCEEDED"  # a new outage: its first reason again
        clock.advance(1.1)
        cache.refresh()
    logged = [r.getMessage() for r in caplog.records]
    assert lh.calls == len(reasons) + 2
    assert "DEADLINE_EXCEEDED" in logged[0] and "lighthouse unavailable" in logged[0]
    assert logged[1] == "lighthouse still unavailable, now: UNAVAILABLE: TLS refused"
    assert logged[2:-1] == [f"lighthouse still unavailable, now: UNAVAILABLE: port {p}" for p in range(6)]
    assert "lighthouse unavailable (DEADLINE_EXCEEDED)" in logged[-1]
    assert cache.last_error == "DEADLINE_EXCEEDED"


def test_unexpected_fetch_error_propagates_and_does_not_wedge_the_cache() -> None:
    clock = Clock()
    state = {"explode": True}

    def fetch(held: Snapshot | None) -> Snapshot:
        if state["explode"]:
            raise KeyError("bug")
        return snap(3)

    cache = make(fetch, clock)
    with pytest.raises(KeyError):
        cache.get()
    state["explode"] = False
    assert cache.get().snapshot.version == 3  # in-flight flag was released


# ---------------------------------------------------------------- concurrency (real clock, real threads)


class BlockingLighthouse:
    """A fetch that blocks until released, counting how many fetches ran."""

    def __init__(self) -> None:
        self.calls = 0
        self.started = threading.Event()
        self.release = threading.Event()
        self.thread: int | None = None  # the thread that fetches
        self._lock = threading.Lock()

    def __call__(self, held: Snapshot | None) -> Snapshot:
        with self._lock:
            self.calls += 1
            self.thread = threading.get_ident()
        self.started.set()
        self.release.wait(10)
        return snap(7)


def run_getters(cache: UpstreamCache, n: int) -> tuple[list[CheckedThread], list[Answer]]:
    results: list[Answer] = []
    lock = threading.Lock()

    def call() -> None:
        answer = cache.get()
        with lock:
            results.append(answer)

    threads = [CheckedThread(call, name=f"getter-{i}") for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


class ThreadClock:
    """``time.monotonic`` that counts its reads per thread.

    A caller that finds a fetch in flight reads the clock twice (its deadline, then the time
    left) while holding the cache's lock, and then waits, which releases that lock. The fetch
    cannot finish without the lock, so once a caller has read the clock twice it is certain to
    be waiting when the fetch ends: the test needs no sleep to know every caller piled up.
    """

    def __init__(self) -> None:
        self.reads: dict[int, int] = {}
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            ident = threading.get_ident()
            self.reads[ident] = self.reads.get(ident, 0) + 1
        return time.monotonic()

    def waiting(self, threads: list[threading.Thread], fetcher: int | None) -> int:
        with self._lock:
            return sum(self.reads.get(t.ident or 0, 0) >= 2 for t in threads if t.ident != fetcher)


def test_single_flight_many_threads_one_fetch() -> None:
    lh = BlockingLighthouse()
    clock = ThreadClock()
    cache = UpstreamCache(lh, ttl=5.0, backoff=1.0, wait_timeout=10.0, clock=clock)
    threads, results = run_getters(cache, 32)
    poll(lh.started.is_set, 10, what="fetch started")
    poll(lambda: clock.waiting(threads, lh.thread) == 31, 10, what="every other caller waiting")
    # The scenario: the fetch stays slow while more callers keep arriving; they wait on it too.
    more, more_results = run_getters(cache, 8)
    poll(lambda: clock.waiting(more, lh.thread) == 8, 10, what="the late callers waiting")
    assert lh.calls == 1
    lh.release.set()
    for t in threads + more:
        t.check(10)
    assert lh.calls == 1
    answers = results + more_results
    assert len(answers) == 40
    assert all(a.snapshot.version == 7 for a in answers)
    assert all(a.fetched for a in answers)
    assert cache.fetches == 1


def test_waiters_give_up_after_wait_timeout_with_the_fallback() -> None:
    lh = BlockingLighthouse()
    cache = UpstreamCache(lh, ttl=5.0, backoff=1.0, wait_timeout=0.3)
    fetcher, fetcher_result = run_getters(cache, 1)
    poll(lh.started.is_set, 10, what="fetch started")
    started = time.monotonic()
    waiters, waiter_results = run_getters(cache, 4)
    for t in waiters:
        t.check(10)
    elapsed = time.monotonic() - started
    assert 0.25 <= elapsed < 3.0  # bounded by wait_timeout (generous margin), not by the fetch
    assert len(waiter_results) == 4 and all(a.snapshot.kind == FALLBACK for a in waiter_results)
    assert lh.calls == 1
    lh.release.set()
    fetcher[0].check(10)
    assert fetcher_result[0].snapshot.version == 7
    assert cache.get().snapshot.version == 7


def test_refresh_does_not_wait_for_an_in_flight_fetch() -> None:
    lh = BlockingLighthouse()
    cache = UpstreamCache(lh, ttl=5.0, backoff=1.0, wait_timeout=10.0)
    threads, _ = run_getters(cache, 1)
    poll(lh.started.is_set, 10, what="fetch started")
    started = time.monotonic()
    answer = cache.refresh()
    assert time.monotonic() - started < 2.0
    assert not answer.fetched and answer.snapshot.kind == FALLBACK  # nothing good held yet
    assert lh.calls == 1
    lh.release.set()
    threads[0].check(10)
