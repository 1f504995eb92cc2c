"""Versions name what is served: a worker's ``cfg.version`` is the version whose config it holds at
its step, and a change known but not in effect yet is named apart (``cfg.pending_version`` from
``cfg.pending_step``). Real lighthouse, manager and worker processes stepping across changes made
now (pending under step leases) and one scheduled ahead; every step's pair is checked against the
history."""

from __future__ import annotations

from typing import Any

import pytest

from lighthouse.config.values import encode_config
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.sqlite import SqliteBackend
from tests.http_steps import call
from tests.http_util import wait_healthy
from tests.procs import ProcessPool, poll, wait_ready, worker_records
from tests.store_edits import commit

STEPS = 800


def _job_step(base: str) -> int:
    step: int = call(base, "GET", "/api/config")["current_step"]
    return step


def _patch(base: str, body: dict[str, Any], query: str = "") -> dict[str, Any]:
    answer: dict[str, Any] = call(base, "PATCH", "/api/config" + query, body)
    return answer


@pytest.mark.slow
def test_each_step_holds_the_config_of_the_version_it_names_and_pending_changes_apart(
    procs: ProcessPool,
) -> None:
    # Leases of 30 steps at least (also those asked on a push stream: a minimum raised above the
    # default holds for every lease): a change made now is pending for several steps whatever the load.
    lh = procs.lighthouse({"lr": 0.1, "tick": 0}, extra=["--lease-min-steps", "30"])
    wait_healthy(lh.url)
    managers = {g: procs.manager(lh.address, g, cache_ttl=0.2) for g in ("g0", "g1")}
    # g0 prefetches (its steps are memory reads of replies fetched ahead), g1 asks each step.
    workers = [
        procs.worker(m.address, group=g, rank=0, steps=STEPS, step_interval=0.003, prefetch=ahead, wait=False)
        for (g, m), ahead in zip(managers.items(), (True, False), strict=True)
    ]
    wait_ready(workers)

    # Two changes made now while the groups step (each takes effect above the steps promised,
    # so it is pending for a while), then one scheduled ahead.
    poll(lambda: _job_step(lh.url) >= 30, 30, what="the job steps")
    made: dict[int, int] = {}  # version -> the step it takes effect at
    for body in ({"lr": 0.2}, {"lr": 0.3, "tick": 1}):
        answer = _patch(lh.url, body)
        assert answer["effective_step"] is not None and not answer["scheduled"], answer
        made[answer["version"]] = answer["effective_step"]
        poll(lambda at=answer["effective_step"]: _job_step(lh.url) > at + 10, 30, what="the change in effect")
    horizon = call(lh.url, "GET", "/api/config")["lease_horizon"]
    at = max(horizon, _job_step(lh.url)) + 60
    assert at < STEPS - 50, f"the job stepped too slowly to schedule a change ahead of it ({at})"
    scheduled = _patch(lh.url, {"lr": 0.4}, f"?effective_step={at}")
    assert scheduled["scheduled"] and scheduled["effective_step"] == at
    made[scheduled["version"]] = at

    records = [rec for w in workers for rec in worker_records(w)]
    history = {e["version"]: e for e in call(lh.url, "GET", "/api/config/history")["versions"]}
    assert sorted(history) == [1, *sorted(made)], sorted(history)
    assert len(records) == 2 * STEPS
    for rec in records:
        version, step = rec["version"], rec["step"]
        assert rec["source"] in ("cache", "lighthouse") and rec["pinned"], rec
        # Never a version with another version's config, nor a version before its step.
        assert rec["config"] == encode_config(history[version]["config"]), rec
        assert made.get(version, 0) <= step, rec
        if rec["pending_version"] is None:
            assert rec["pending_step"] is None, rec
        else:
            assert made[rec["pending_version"]] == rec["pending_step"] > step, rec
            assert rec["pending_version"] > version, rec

    for group in managers:
        mine = sorted((r for r in records if r["group"] == group), key=lambda r: r["step"])
        versions = [r["version"] for r in mine]
        assert versions == sorted(versions), f"{group}: a version went back"
        for version, effective in made.items():
            # Every group switches at the change's step exactly, and saw it coming.
            first = next(r["step"] for r in mine if r["version"] >= version)
            assert first == effective, f"{group}: v{version} from step {first}, not {effective}"
            announced = [r["step"] for r in mine if r["pending_version"] == version]
            assert announced, f"{group}: v{version} was never named pending"
        # Scheduled far ahead: named pending up to the step before its own.
        announced = [r["step"] for r in mine if r["pending_version"] == scheduled["version"]]
        assert max(announced) == at - 1 and len(announced) > 30, announced


def test_each_segment_is_named_by_the_version_whose_state_gives_it_and_the_change_taking_effect() -> None:
    """The segments a reply carries: the version whose state gives each one's config (also when a
    change scheduled earlier takes effect after one made later), and who made the change that
    takes effect at its first step; cancelling a change not in effect yet names its step by the
    cancel, config unchanged (every reply names that step alike, before and after the fold passes it)."""
    store = ConfigStore(SqliteBackend(None))
    commit(store, "put", {"lr": 0.1, "wd": 0}, source="t", author="ann", comment="start")
    commit(store, "patch", {"lr": 0.01}, source="t", author="bob", comment="decay", effective_step=100)
    commit(store, "patch", {"wd": 0.1}, source="t", author="cy", comment="now")  # no lease: from step 0
    segments = store.segments()
    named = [(s.from_step, s.config, s.version, s.author, s.comment) for s in segments]
    assert named == [
        (0, {"lr": 0.1, "wd": 0.1}, 3, "cy", "now"),
        (100, {"lr": 0.01, "wd": 0.1}, 3, "bob", "decay"),
    ]
    for seg in segments:  # the state at the named version gives the segment's config
        assert store.resolve(seg.version, seg.from_step) == seg.config
    commit(store, "patch", {"lr": 0.5}, source="t", effective_step=200)
    cancel = commit(store, "cancel", {"version": 4}, source="t", author="dee")
    assert [(s.from_step, s.version) for s in store.segments()] == [(0, 3), (100, 3), (200, 5)]
    assert store.segments()[1].config == store.segments()[2].config
    assert cancel.version == 5 and store.head == 5
