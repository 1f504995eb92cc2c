"""Concurrent ``If-Match`` PUTs: exactly one wins per version, the rest get 409, nothing lost or doubled.

Every writer does read-modify-write of a counter: GET the live config, PUT it
back with ``counter + 1`` and ``If-Match: <version read>``, retry on 409. If
optimistic concurrency works, the history is a chain in which each version is
exactly one writer's update of the previous one.
"""

from __future__ import annotations

import collections
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import pytest

from tests import http_util
from tests.procs import ProcessPool

THREADS = 8
ROUNDS = 12
PROCESSES = 4
UPDATES_PER_PROCESS = 25


def _put_if_match(
    url: str, base: dict[str, Any], writer: str, seq: int
) -> tuple[int, int, dict[str, Any], str | None]:
    """PUT counter+1 with ``If-Match: <base version>``.

    Returns (status, new version or head, body sent, mismatch): ``mismatch`` describes a 200
    whose reply paired the new version number with some other content.
    """
    body = {
        "counter": base["config"]["counter"] + 1,
        "writer": writer,
        "seq": seq,
        "based_on": base["version"],
    }
    res = http_util.change(url, "PUT", body, if_match=base["version"])
    reply = res.json
    assert res.status in (200, 409), f"{writer}: {res.status} {reply}"
    if res.status == 409:
        assert "error" in reply and reply.get("version", base["version"] + 1) > base["version"], (
            f"{writer}: 409 for If-Match {base['version']}: {reply}"
        )
    mismatch = None
    if res.status == 200 and reply["config"] != body:
        mismatch = f"{writer}: 200 for If-Match {base['version']}, sent {body}, reply {reply}"
    return res.status, reply.get("version", -1), body, mismatch


def _writer_process(url: str, writer: str, updates: int) -> list[tuple[int, dict[str, Any], str | None]]:
    """Runs in a spawned process: ``updates`` successful read-modify-writes, retrying on 409."""
    won: list[tuple[int, dict[str, Any], str | None]] = []
    torn: list[str] = []
    seq = 0
    conflicts = 0
    while len(won) < updates:
        assert conflicts < 2000, f"{writer}: starved"
        seq += 1
        base = http_util.live(url)
        if base["version"] > 1 and base["config"]["based_on"] != base["version"] - 1:
            torn.append(f"GET /api/config answered version {base['version']} with {base['config']}")
        status, version, body, mismatch = _put_if_match(url, base, writer, seq)
        if status == 200:
            assert version == base["version"] + 1, (version, base["version"])
            won.append((version, body, mismatch))
        else:
            conflicts += 1
    won += [(-1, {}, t) for t in torn]
    return won


@pytest.mark.slow
def test_if_match_puts_one_winner_per_version(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"counter": 0, "writer": "file", "seq": 0, "based_on": 0})
    http_util.wait_healthy(lh.url)
    start = http_util.live(lh.url)
    assert start["config"]["counter"] == 0
    start_version = start["version"]

    # Phase 1: lock-step rounds. Every thread reads the same version, then all PUT at once.
    barrier = threading.Barrier(THREADS)
    wins: list[tuple[int, int, dict[str, Any]]] = []  # (if-match, new version, body)
    statuses: dict[int, list[int]] = collections.defaultdict(list)
    lock = threading.Lock()
    mismatches: list[str] = []

    def lockstep(tid: int) -> None:
        for rnd in range(ROUNDS):
            barrier.wait(timeout=30)
            base = http_util.live(lh.url)
            barrier.wait(timeout=30)  # everyone holds the same base now
            status, version, body, mismatch = _put_if_match(lh.url, base, f"t{tid}", rnd)
            with lock:
                mismatches.extend([mismatch] if mismatch else [])
                statuses[base["version"]].append(status)
                if status == 200:
                    wins.append((base["version"], version, body))

    with ThreadPoolExecutor(THREADS) as pool:
        for fut in [pool.submit(lockstep, t) for t in range(THREADS)]:
            fut.result(timeout=120)

    assert sorted(statuses) == list(range(start_version, start_version + ROUNDS)), statuses
    for base_version, results in statuses.items():
        assert len(results) == THREADS, (base_version, results)
        assert results.count(200) == 1, f"If-Match {base_version}: {results.count(200)} winners"
        assert results.count(409) == THREADS - 1
    assert sorted(v for _, v, _ in wins) == list(range(start_version + 1, start_version + ROUNDS + 1))
    assert all(v == b + 1 for b, v, _ in wins)

    # Phase 2: free-for-all from separate processes (truly parallel clients), retrying on 409.
    mid = http_util.live(lh.url)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
        futures = [
            pool.submit(_writer_process, lh.url, f"p{i}", UPDATES_PER_PROCESS) for i in range(PROCESSES)
        ]
        proc_wins = [w for fut in futures for w in fut.result(timeout=120)]
    wins += [(v - 1, v, body) for v, body, _ in proc_wins if v >= 0]
    mismatches += [m for _, _, m in proc_wins if m]

    total = ROUNDS + PROCESSES * UPDATES_PER_PROCESS
    final = http_util.live(lh.url)
    assert final["version"] == start_version + total
    assert final["config"]["counter"] == total, "an update was lost or applied twice"
    assert mid["version"] == start_version + ROUNDS

    # The history is one unbroken chain: each version is one winner's update of the one before.
    hist = {h["version"]: h for h in http_util.history(lh.url)}
    won_by_version = {v: body for _, v, body in wins}
    assert len(won_by_version) == len(wins) == total, "two writers were told they made the same version"
    for version in range(start_version + 1, start_version + total + 1):
        stored = hist[version]
        assert stored["config"] == won_by_version[version], f"version {version} differs from its winner"
        assert stored["config"]["counter"] == hist[version - 1]["config"]["counter"] + 1
        assert stored["config"]["based_on"] == version - 1
        assert stored["source"] == "api"
    assert max(hist) == start_version + total
    bodies = [(b["writer"], b["seq"]) for b in won_by_version.values()]
    assert len(set(bodies)) == len(bodies), "one update applied twice"

    # Each 200 answers the new version with that version's content (not a later writer's).
    assert not mismatches, f"{len(mismatches)} replies paired a version with other content: {mismatches[:3]}"
