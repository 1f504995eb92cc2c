"""Crash safety: nothing acknowledged is ever lost when the lighthouse is SIGKILLed at random moments.

A client thread makes PUT and PATCH changes as fast as it can while a killer
thread SIGKILLs the lighthouse process at random moments and restarts it with
the same command (same ``--state-dir``, same ``--config`` file, port 0). Every
change answered 200 is recorded with its version and content; afterwards every
acknowledged version is in the history with exactly that content, versions are
strictly increasing, and the live config is the last acknowledged one. A change
in flight when the process died may or may not be stored, but whatever is
stored is one of the changes the client really sent.
"""

from __future__ import annotations

import http.client
import itertools
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import http_util
from tests.procs import LighthouseProc, ProcessPool, poll

KILLS = 8
RUN_BUDGET = 40.0  # seconds; the loop stops earlier when KILLS kills were done


@dataclass
class Ack:
    attempt: int
    op: str
    body: dict[str, Any]
    version: int
    config: dict[str, Any]


@dataclass
class Shared:
    """What the client and the killer share: the current lighthouse, and when to stop."""

    lighthouse: LighthouseProc
    generation: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    kills: int = 0
    errors: list[str] = field(default_factory=list)


def _body(rng: random.Random, attempt: int, op: str) -> dict[str, Any]:
    if op == "put":
        body: dict[str, Any] = {
            "attempt": attempt,
            "lr": round(rng.random(), 6),
            "name": f"run-{attempt}-" + "x" * rng.randrange(0, 2000),
            "layers": [rng.randrange(100) for _ in range(rng.randrange(5))],
            "flag": rng.random() < 0.5,
        }
    else:
        body = {"attempt": attempt, f"k{attempt % 7}": attempt, "note": "é" * rng.randrange(0, 50)}
        if rng.random() < 0.3:
            body["flag"] = None  # delete a key
    return body


def _client(shared: Shared, acks: list[Ack], unacked: dict[int, dict[str, Any]], seed: int) -> None:
    rng = random.Random(seed)
    attempt = 0
    while not shared.stop.is_set():
        with shared.lock:
            lh, generation = shared.lighthouse, shared.generation
        attempt += 1
        op = "put" if rng.random() < 0.5 else "patch"
        body = _body(rng, attempt, op)
        try:
            res = http_util.change(lh.url, op.upper(), body, timeout=10.0)
        except (OSError, http.client.HTTPException):
            unacked[attempt] = body  # in flight when the lighthouse died: may or may not be stored
            # wait for the killer to bring up the next lighthouse
            deadline = time.monotonic() + 30
            while not shared.stop.is_set() and shared.generation == generation:
                if time.monotonic() > deadline:
                    shared.errors.append("no restarted lighthouse within 30s")
                    return
                time.sleep(0.01)
            continue
        if res.status != 200:
            shared.errors.append(f"attempt {attempt}: {op} answered {res.status}: {res.body[:300]!r}")
            return
        reply = res.json
        acks.append(Ack(attempt, op, body, reply["version"], reply["config"]))


def _killer(shared: Shared, procs: ProcessPool, restart: Any, seed: int) -> None:
    rng = random.Random(seed)
    try:
        while not shared.stop.is_set() and shared.kills < KILLS:
            time.sleep(rng.uniform(0.05, 0.6))  # part of the scenario: a random moment to kill at
            lh = shared.lighthouse
            lh.signal(signal.SIGKILL)
            lh.wait(timeout=10)
            shared.kills += 1
            new = restart()
            with shared.lock:
                shared.lighthouse = new
                shared.generation += 1
    except BaseException as exc:  # reported by the test
        shared.errors.append(f"killer: {exc!r}")
    finally:
        shared.stop.set()


@pytest.mark.slow
def test_acknowledged_changes_survive_sigkill(procs: ProcessPool, tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    config_path = tmp_path / "config.json"
    config_path.write_text('{"attempt": 0, "lr": 0.1}')

    def start() -> LighthouseProc:
        lh = procs.lighthouse(state_dir=state_dir, config_path=config_path)
        http_util.wait_healthy(lh.url)
        return lh

    first = start()
    initial = http_util.live(first.url)
    assert initial["version"] == 1 and initial["config"] == {"attempt": 0, "lr": 0.1}

    shared = Shared(first)
    acks: list[Ack] = []
    unacked: dict[int, dict[str, Any]] = {}
    seed = random.randrange(2**32)
    client = threading.Thread(target=_client, args=(shared, acks, unacked, seed), daemon=True)
    killer = threading.Thread(target=_killer, args=(shared, procs, start, seed + 1), daemon=True)
    client.start()
    killer.start()
    killer.join(RUN_BUDGET)
    shared.stop.set()
    killer.join(30)
    client.join(30)
    assert not killer.is_alive() and not client.is_alive(), "client or killer thread hung"
    assert not shared.errors, f"seed {seed}: {shared.errors}"
    assert shared.kills == KILLS, f"seed {seed}: only {shared.kills} kills in {RUN_BUDGET}s"
    assert len(acks) >= 20, f"seed {seed}: only {len(acks)} acknowledged changes"

    # One more acknowledged change on the final process: no kill can race it.
    lh = shared.lighthouse
    last_body = {"attempt": -1, "final": True}
    res = http_util.change(lh.url, "PUT", last_body)
    assert res.status == 200, res.body
    acks.append(Ack(-1, "put", last_body, res.json["version"], res.json["config"]))

    versions = [a.version for a in acks]
    print(f"{len(acks)} acknowledged, {len(unacked)} in flight at a kill")
    assert all(b > a for a, b in itertools.pairwise(versions)), (
        f"seed {seed}: acknowledged versions not strictly increasing: {versions}"
    )
    assert versions[0] > 1

    for ack in acks:
        if ack.op == "put":
            assert ack.config == ack.body, f"seed {seed}: PUT v{ack.version} acknowledged other content"
        else:
            expected = {k: v for k, v in ack.body.items() if v is not None}
            assert expected.items() <= ack.config.items(), f"seed {seed}: PATCH v{ack.version}"
            assert not any(ack.config.get(k) is not None for k, v in ack.body.items() if v is None)

    hist = http_util.history(lh.url)
    hist_versions = [h["version"] for h in hist]
    assert hist_versions == sorted(set(hist_versions), reverse=True), "history not strictly ordered"
    by_version = {h["version"]: h for h in hist}
    for ack in acks:
        stored = by_version.get(ack.version)
        assert stored is not None, f"seed {seed}: acknowledged version {ack.version} lost after a SIGKILL"
        assert stored["config"] == ack.config, f"seed {seed}: version {ack.version} content changed"
        assert stored["source"] == "api"

    # Anything else stored is the initial file version or an unacknowledged change really sent.
    acked = {a.version for a in acks}
    for h in hist:
        if h["version"] in acked:
            continue
        if h["version"] == 1:
            assert h["source"] == "file" and h["config"] == {"attempt": 0, "lr": 0.1}
            continue
        attempt = h["config"].get("attempt")
        assert attempt in unacked, f"seed {seed}: version {h['version']} holds no change the client sent: {h}"
        body = unacked[attempt]
        if "lr" in body:  # a PUT: stored exactly
            assert h["config"] == body, f"seed {seed}: version {h['version']} corrupt: {h} vs {body}"
        else:
            expected = {k: v for k, v in body.items() if v is not None}
            assert expected.items() <= h["config"].items(), f"seed {seed}: version {h['version']} corrupt"
    # the file was never edited: no restart turned it into a new version
    assert [h["version"] for h in hist if h["source"] == "file"] == [1]

    now = http_util.live(lh.url)
    assert now["version"] == acks[-1].version and now["config"] == last_body
    assert now["file"]["error"] is None

    # And once more after a clean restart from the same state.
    lh.stop()
    again = start()
    after = http_util.live(again.url)
    assert after["version"] == acks[-1].version and after["config"] == last_body
    assert poll(lambda: http_util.history(again.url) == hist, 5, what="same history after restart")
