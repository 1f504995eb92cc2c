"""Helpers of the acknowledged-order tests: groups stepping through managers on two lighthouses,
and the check that every change holds from its effective step until a later one replaces it."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

from lighthouse.jobs.leases import LeasePolicy
from tests.http_util import call, history
from tests.procs import LighthouseProc, Proc, ProcessPool, last_record, poll, records_so_far

Record = dict[str, Any]
GROUPS = ("g0", "g1", "g2", "g3")
STEP_INTERVAL = 0.01  # seconds between two steps of a group
CACHE_TTL = 0.2  # each manager's: the seconds a lease covers
# The longest lease the lighthouses grant these groups (a step rate measured up to 1.5x too high).
LEASE_STEPS = LeasePolicy().length(rate=1.5 / STEP_INTERVAL, seconds=CACHE_TTL)


def stepping_groups(
    procs: ProcessPool, lighthouses: dict[str, str], steps: int = 100_000, first_step: int = 0
) -> dict[str, Proc]:
    """One worker per group stepping every 10 ms from ``first_step`` (a group joining a running job
    resumes at its step, as torchft heals it), its manager on ``lighthouses[group]`` ("A,B")."""
    workers = {}
    for group, addresses in lighthouses.items():
        manager = procs.manager(addresses, group, cache_ttl=CACHE_TTL)
        workers[group] = procs.worker(
            manager.address,
            group=group,
            rank=0,
            steps=steps,
            step_interval=STEP_INTERVAL,
            first_step=first_step,
            wait=False,
        )
    poll(lambda: all(len(records_so_far(w)) > 30 for w in workers.values()), 60, what="groups stepping")
    return workers


def spread(a: LighthouseProc, b: LighthouseProc, groups: tuple[str, ...] = GROUPS) -> dict[str, str]:
    """Managers on both lighthouses: every other group prefers ``a``."""
    return {
        g: f"{a.address},{b.address}" if i % 2 == 0 else f"{b.address},{a.address}"
        for i, g in enumerate(groups)
    }


def make_change(lh: LighthouseProc, n: int) -> dict[str, Any]:
    """PATCH ``n`` through ``lh``; its reply (version, effective_step)."""
    res = call(lh.url, "PATCH", "api/config", {"n": n})
    assert res.status == 200, res.body
    reply: dict[str, Any] = res.json
    return reply


def records_past(workers: dict[str, Proc], step: int, timeout: float = 60.0) -> dict[str, list[Record]]:
    """Each group's records once it stepped past ``step``."""
    poll(
        lambda: all(last_record(w)["step"] > step for w in workers.values()),
        timeout,
        what=f"every group past step {step}",
    )
    return {g: records_so_far(w) for g, w in workers.items()}


def check_acknowledged_order(
    url: str, replies: list[dict[str, Any]], records: dict[str, list[Record]]
) -> None:
    """The history's made-now changes take effect in version order (some within one lease of the
    one before: it was still pending), every reply's change holds from its effective step until
    the next one, and no two groups trained different configs at a step."""
    versions = {r["version"] for r in replies}
    rows = sorted((h for h in history(url) if h["version"] in versions), key=lambda h: h["version"])
    assert [h["version"] for h in rows] == sorted(versions)
    assert versions and sorted(versions) == [r["version"] for r in replies], "versions increase"
    steps = [h["effective_step"] for h in rows]
    assert all(isinstance(s, int) for s in steps), steps
    undone = [
        (x["version"], y["version"])
        for x, y in itertools.pairwise(rows)
        if y["effective_step"] < x["effective_step"]
    ]
    assert not undone, f"changes taking effect below one acknowledged before them: {undone}"
    for reply, row in zip(replies, rows, strict=True):
        assert reply["effective_step"] == row["effective_step"], (reply, row)
    close = [
        (x["version"], y["version"])
        for x, y in itertools.pairwise(rows)
        if y["effective_step"] - x["effective_step"] <= LEASE_STEPS
    ]
    assert close, f"no two changes within one lease ({LEASE_STEPS} steps) of each other: {steps}"
    by_step: dict[int, dict[str, str]] = {}
    for group, recs in records.items():
        fell_back = [
            (r["step"], r["source"], r["stable_through_step"], r["elapsed"])
            for r in recs
            if r["source"] not in ("lighthouse", "cache")
        ]
        assert not fell_back, f"{group} fell back at {len(fell_back)} steps: {fell_back[:5]}"
        for rec in recs:
            held = [h for h in rows if h["effective_step"] <= rec["step"]]
            if not held:
                continue
            want = json.dumps(held[-1]["change"]["n"])
            assert rec["config"]["n"] == want, (
                f"{group} at step {rec['step']}: n={rec['config']['n']}, version {held[-1]['version']} "
                f"(effective at {held[-1]['effective_step']}) holds n={want}"
            )
            by_step.setdefault(rec["step"], {})[group] = rec["config"]["n"]
    split = {step: seen for step, seen in by_step.items() if len(set(seen.values())) > 1}
    assert not split, f"groups trained different configs at one step: {sorted(split.items())[:3]}"


def pause(i: int) -> None:
    """Some changes within one lease of the one before, some a few leases apart."""
    time.sleep((0.0, 0.05, 0.3)[i % 3])
