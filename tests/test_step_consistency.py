"""Step consistency end to end: real lighthouse, managers and worker processes.

* every rank of a group gets the same config for a step while the config churns;
* a change scheduled at step S switches every group at S; a group that learns of
  it after passing S switches at once and is reported late; a cancelled change
  is never seen;
* the pinning window keeps memory bounded and answers older steps unpinned;
* ``GET /api/config/at-step/N`` replays what each group's workers saw.
"""

from __future__ import annotations

import json
import signal
import threading
import tracemalloc
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import pytest

from lighthouse.config.values import encode_config
from manager.pinning import StepPins
from manager.server import ManagerServer
from manager.snapshot import Snapshot
from protos import lighthouse_config_pb2 as pb
from tests.http_steps import (
    HttpStatusError,
    at_step,
    call,
    change,
    scheduled,
    wait_managers_serve,
)
from tests.http_util import call as call_status
from tests.http_util import wait_healthy
from tests.procs import LighthouseProc, ManagerProc, Proc, ProcessPool, poll, wait_ready, worker_records

Record = dict[str, Any]


# ----------------------------------------------------------------- helpers
def by_group_step(records: Iterable[Record]) -> dict[tuple[str, int], list[Record]]:
    out: dict[tuple[str, int], list[Record]] = defaultdict(list)
    for rec in records:
        out[(rec["group"], rec["step"])].append(rec)
    return out


def assert_ranks_agree(records: list[Record], ranks: int) -> None:
    """For every (group, step): all ``ranks`` ranks answered, with one version and one content."""
    assert records, "no records"
    for (group, step), recs in sorted(by_group_step(records).items()):
        assert sorted(r["rank"] for r in recs) == list(range(ranks)), (group, step)
        seen = {(r["version"], tuple(sorted(r["config"].items()))) for r in recs}
        assert len(seen) == 1, f"group {group} step {step}: ranks disagree: {seen}"


def assert_served_normally(records: list[Record]) -> None:
    bad = [r for r in records if r["source"] not in ("cache", "lighthouse") or not r["pinned"]]
    assert not bad, f"{len(bad)} records unpinned or not from the lighthouse, e.g. {bad[:2]}"


def per_step(records: list[Record], group: str) -> dict[int, Record]:
    """One record per step of ``group`` (rank 0's; ranks agree, checked separately)."""
    return {r["step"]: r for r in records if r["group"] == group and r["rank"] == 0}


def steps_seen(procs: list[Proc]) -> int:
    """The highest step any of these workers has printed so far."""
    steps = [json.loads(line)["step"] for p in procs for line in p.lines() if line.startswith("{")]
    return max(steps, default=-1)


def check_replay(base: str, records: list[Record], groups: list[str]) -> int:
    """``at-step`` answers, per group, the version and content its workers saw; returns steps checked."""
    last = {g: max(per_step(records, g)) for g in groups}
    final = {g: per_step(records, g)[last[g]]["version"] for g in groups}

    def switches_reported() -> bool:
        # Switches reach the lighthouse with the managers' next fetch or heartbeat.
        return all(at_step(base, last[g])["groups"].get(g, {}).get("version") == final[g] for g in groups)

    poll(switches_reported, 15, interval=0.1, what="the managers' switches reported to the lighthouse")
    checked = 0
    for group in groups:
        seen = per_step(records, group)
        for step in sorted(seen):
            answer = at_step(base, step)
            assert answer["step"] == step
            replay = answer["groups"].get(group)
            assert replay is not None, f"at-step {step} does not know group {group}: {answer}"
            rec = seen[step]
            assert replay["version"] == rec["version"], f"{group} step {step}: {replay} vs {rec}"
            assert replay["config"] is not None, f"{group} step {step}: version pruned"
            assert encode_config(replay["config"]) == rec["config"], f"{group} step {step}: {replay} vs {rec}"
            checked += 1
    return checked


class Churn:
    """A thread PATCHing the config every few milliseconds until stopped."""

    def __init__(self, base: str, interval: float = 0.004) -> None:
        self.base = base
        self.interval = interval
        self.versions: list[int] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(self.interval):
            tick += 1
            try:
                self.versions.append(change(self.base, "PATCH", {"tick": tick, "lr": 0.1 + tick / 1000}))
            except BaseException as exc:  # reported by stop()
                self.errors.append(exc)
                return

    def __enter__(self) -> Churn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def check(self) -> None:
        assert not self.errors, f"PATCH loop failed: {self.errors[0]!r}"


# ----------------------------------------------------------------- (1) churn
@pytest.mark.slow
def test_every_rank_of_a_group_gets_the_same_config_per_step_under_churn(procs: ProcessPool) -> None:
    groups, ranks, steps = ["g0", "g1"], 4, 200
    lh = procs.lighthouse({"lr": 0.1, "tick": 0})
    wait_healthy(lh.url)
    # A short TTL: the managers refetch many times while the ranks of a group are at the same step. A long
    # upstream deadline: a lighthouse busy with a write every few ms may answer late, not an empty config.
    managers = {g: procs.manager(lh.address, g, cache_ttl=0.02, lighthouse_timeout=5.0) for g in groups}
    with Churn(lh.url) as churn:
        poll(lambda: len(churn.versions) >= 3, 10, what="the PATCH loop to start")
        records = run_workers(procs, managers, ranks, steps)
    churn.check()

    assert len(records) == len(groups) * ranks * steps
    assert_served_normally(records)
    assert_ranks_agree(records, ranks)
    # The churn reached the workers: each group went through many versions during its run.
    for group in groups:
        versions = {r["version"] for r in records if r["group"] == group}
        assert len(versions) >= 10, f"{group} saw only versions {sorted(versions)}: no churn to survive"
    # The content is the version's content: tick and lr moved together.
    for rec in records:
        tick = int(rec["config"]["tick"])
        assert rec["config"]["lr"] == ("0.1" if tick == 0 else encode_config({"x": 0.1 + tick / 1000})["x"])


# ------------------------------------------------------- (2) scheduled changes
@pytest.mark.slow
def test_a_step_promised_to_a_group_cannot_be_scheduled_and_every_group_switches_at_its_step(
    procs: ProcessPool,
) -> None:
    ranks, steps = 4, 300
    # One run throughout: the workers stand still (SIGSTOP) while the operator schedules, and on a
    # loaded host that may take longer than the default 5 s after which a paused job's run ends (its
    # leases with it: the refusal below would not come). Run ends have their own tests (test_runs*).
    lh = procs.lighthouse({"lr": 0.1, "sync_every": 10}, extra=["--run-end-after", "120"])
    wait_healthy(lh.url)
    m_a = procs.manager(lh.address, "gA", cache_ttl=0.1)
    m_b = procs.manager(lh.address, "gB", cache_ttl=0.1)
    # gB's workers run far ahead of gA's (steps 10000+). Before step leases a change scheduled
    # ahead of gA was already behind gB, which switched late; now gB holds a lease past that
    # step, so such a change is refused, naming the earliest step every group can still switch at.
    # gB starts first: a group's report may move the job's step only so far past the steps already
    # accepted (plausible_step), so a group 10,000 steps ahead joins a job that has not stepped yet.
    b_workers = [
        procs.worker(
            m_b.address,
            group="gB",
            rank=r,
            steps=steps,
            step_interval=0.01,
            timeout=30,
            first_step=10_000,
            wait=False,
        )
        for r in range(ranks)
    ]
    wait_ready(b_workers)
    poll(lambda: steps_seen(b_workers) >= 10_001, 20, what="gB stepping")
    a_workers = [
        procs.worker(m_a.address, group="gA", rank=r, steps=steps, step_interval=0.01, timeout=30, wait=False)
        for r in range(ranks)
    ]
    everyone = a_workers + b_workers
    wait_ready(everyone)
    poll(lambda: steps_seen(a_workers) >= 20 and steps_seen(b_workers) >= 10_020, 20, what="workers running")

    # Pause the workers (not the managers) while scheduling, so that "ahead of gA" is a fact, not a race.
    for w in everyone:
        w.signal(signal.SIGSTOP)
    try:
        a_at, b_at = steps_seen(a_workers), steps_seen(b_workers)
        behind_b = a_at + 60  # ahead of gA by far more than a worker can have in flight, behind gB
        assert behind_b < steps - 40, f"gA's workers ran too far ({a_at}) before they were paused"
        refused = call_status(lh.url, "PATCH", f"/api/config?effective_step={behind_b}", {"lr": 0.01})
        assert refused.status == 409, refused.body
        earliest = json.loads(refused.body)["earliest_step"]
        assert earliest > b_at  # past every step gB was promised
        assert call(lh.url, "GET", "/api/config")["version"] == 1  # nothing stored
        drop_at = earliest + 5
        v_drop = change(lh.url, "PATCH", {"lr": 0.01}, effective_step=drop_at)
        # A change scheduled ahead of everyone, then cancelled before any group was promised its
        # step: no worker may ever see it.
        cancel_at = drop_at + 40
        v_cancelled = change(lh.url, "PATCH", {"lr": 999, "marker": "cancelled"}, effective_step=cancel_at)
        call(lh.url, "DELETE", f"/api/config/scheduled/{v_cancelled}")
        # An unrelated change made now, before drop_at: it takes effect above every promise (so
        # possibly after drop_at) and must not undo the scheduled lr.
        v_note = change(lh.url, "PATCH", {"note": "unrelated"})
        head = call(lh.url, "GET", "/api/config")["version"]
        assert head == v_note > v_cancelled + 1 > v_drop + 1  # the cancel is a version too
        note_at = scheduled(lh.url)[v_note]["effective_step"]
        assert note_at > b_at and not scheduled(lh.url)[v_note]["scheduled"]  # made now
        wait_managers_serve(lh.url, ["gA", "gB"], head)
    finally:
        for w in everyone:
            w.signal(signal.SIGCONT)
    records = [rec for w in everyone for rec in worker_records(w)]

    assert_served_normally(records)
    assert_ranks_agree(records, ranks)
    a, b = per_step(records, "gA"), per_step(records, "gB")
    # gB ran on past both changes (gA, far behind, did not reach them).
    assert max(b) >= max(drop_at, note_at)
    for group in (a, b):
        # Old value for steps < S, new one from S on; the unrelated edit from its own step on.
        assert {group[s]["config"]["lr"] for s in group if s < drop_at} == {"0.1"}
        assert {group[s]["config"]["lr"] for s in group if s >= drop_at} <= {"0.01"}
        assert all(group[s]["config"].get("note") == "unrelated" for s in group if s >= note_at)
        assert not any("note" in group[s]["config"] for s in group if s < note_at)
    assert {b[s]["config"]["lr"] for s in b if s >= drop_at} == {"0.01"}

    # The cancelled change was never served, though gB ran past its step.
    assert max(b) >= cancel_at
    assert not [r for r in records if r["config"].get("marker") or r["config"]["lr"] == "999"]

    # No group switched late: the promises kept every group on the same config at every step.
    listing = scheduled(lh.url)
    assert listing[v_drop]["status"] == "in_effect"
    assert listing[v_drop]["effective_step"] == drop_at
    assert listing[v_drop]["late_groups"] == [] and listing[v_note]["late_groups"] == []
    assert listing[v_cancelled]["status"] == "cancelled"
    # A cancelled change cannot be cancelled again.
    try:
        call(lh.url, "DELETE", f"/api/config/scheduled/{v_cancelled}")
    except HttpStatusError as exc:
        assert exc.status == 409, exc
    else:
        raise AssertionError("cancelling a cancelled change twice was accepted")

    # Replay: what each group saw at each step.
    assert check_replay(lh.url, records, ["gA", "gB"]) == 2 * steps


@pytest.mark.slow
def test_cancelled_change_pending_for_every_group_is_never_served(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    managers = {g: procs.manager(lh.address, g, cache_ttl=0.1) for g in ("g0", "g1")}
    keep = change(lh.url, "PATCH", {"lr": 0.05}, effective_step=40)
    dropped = change(lh.url, "PUT", {"lr": 7, "marker": "cancelled"}, effective_step=80)
    assert scheduled(lh.url)[dropped]["status"] == "pending"
    call(lh.url, "DELETE", f"/api/config/scheduled/{dropped}")
    workers = [
        procs.worker(m.address, group=g, rank=r, steps=120, step_interval=0.002, wait=False)
        for g, m in managers.items()
        for r in range(2)
    ]
    wait_ready(workers)
    records = [rec for w in workers for rec in worker_records(w)]
    assert_served_normally(records)
    assert_ranks_agree(records, 2)
    for rec in records:
        assert rec["config"] == {"lr": "0.1" if rec["step"] < 40 else "0.05"}, rec
    listing = scheduled(lh.url)
    assert listing[keep]["status"] == "in_effect" and listing[keep]["late_groups"] == []
    assert listing[dropped]["status"] == "cancelled"


# ------------------------------------------------------------ (3) the window
def _snapshot(version: int) -> Snapshot:
    reply = pb.LighthouseConfigResponse(
        config_data={"lr": str(version), "pad": "x" * 200}, version=version, instance_id="i", state_id="s"
    )
    return Snapshot.from_reply(reply)


@pytest.mark.slow
def test_step_pins_memory_stays_bounded_over_100k_steps() -> None:
    window = 64
    pins = StepPins(window)
    snapshots = [_snapshot(v) for v in range(1, 6)]
    total = 100_000
    tracemalloc.start()
    try:
        baseline = 0
        for step in range(total):
            snap = snapshots[(step // 500) % len(snapshots)]
            reply = snap.reply(0, True)
            # Four ranks ask for each step; the leader pins, the others get the same bytes.
            assert pins.pin(step, snap, reply) is reply
            other = snapshots[(step // 500 + 1) % len(snapshots)]
            for _rank in range(3):
                assert pins.pin(step, other, other.reply(0, True)) is reply
            # A lagging rank asks for an older step still in the window: the pinned answer.
            if step >= window:
                assert pins.get(step - window) is not None
            assert len(pins) <= 2 * window
            if step % 1000 == 999:  # the manager reports its switches about once per second
                pins.ack_switches(pins.take_switches())
            if step == 10_000:
                baseline = tracemalloc.get_traced_memory()[0]
        growth = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert growth < 64 * 1024, f"pinning state grew by {growth} bytes over {total - 10_000} steps"
    assert pins.max_step == total - 1
    assert pins.get(0) is None and pins.outside_window(total - 2 - window)
    assert all(pins.get(s) is not None for s in range(total - 1 - window, total))


def test_unacked_switches_stay_bounded_when_the_lighthouse_is_away() -> None:
    pins = StepPins(16)
    snapshots = [_snapshot(1), _snapshot(2)]
    for step in range(20_000):  # a new version at every step, never reported
        snap = snapshots[step % 2]
        pins.pin(step, snap, snap.reply(0, True))
    switches = pins.take_switches()
    assert 0 < len(switches) <= 1000
    assert switches[-1] == (2, 19_999, 19_998)  # the newest ones are kept
    assert len(pins) <= 32


@pytest.mark.slow
def test_step_older_than_the_window_is_answered_unpinned(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=0.05, extra=["--step-window", "64"])
    first = worker_records(procs.worker(m.address, group="g0", rank=0, steps=200))
    assert all(r["pinned"] and r["config"] == {"lr": "0.1"} for r in first)
    v_new = change(lh.url, "PATCH", {"lr": 0.2})
    wait_managers_serve(lh.url, ["g0"], v_new)

    # Step 180 is within 64 steps of the newest (199): the snapshot pinned for it, though the config changed.
    inside = worker_records(procs.worker(m.address, group="g0", rank=1, first_step=180, steps=1))
    assert [(r["pinned"], r["version"], r["config"]) for r in inside] == [
        (True, first[180]["version"], {"lr": "0.1"})
    ]
    # Step 10 is far older: its pin was dropped, and it is answered from the current snapshot, unpinned
    # (the change, made now while the group held a step lease, takes effect after step 199: at step
    # 10 the current snapshot still gives the old lr, named by its own version; the new one apart).
    outside = worker_records(procs.worker(m.address, group="g0", rank=1, first_step=10, steps=1))
    switch_at = scheduled(lh.url)[v_new]["effective_step"]
    assert switch_at > 199
    got = [(r["pinned"], r["version"], r["config"], r["pending_version"], r["pending_step"]) for r in outside]
    assert got == [(False, first[180]["version"], {"lr": "0.1"}, v_new, switch_at)]
    at_switch = worker_records(procs.worker(m.address, group="g0", rank=1, first_step=switch_at, steps=1))
    assert [(r["version"], r["config"]) for r in at_switch] == [(v_new, {"lr": "0.2"})]


# ------------------------------------------------------------ (4) replay
def run_workers(
    procs: ProcessPool, managers: dict[str, ManagerProc], ranks: int, steps: int
) -> list[dict[str, Any]]:
    """``ranks`` worker processes per group, started together; their records once all are done."""
    workers = [
        procs.worker(m.address, group=g, rank=r, steps=steps, step_interval=0.004, wait=False)
        for g, m in managers.items()
        for r in range(ranks)
    ]
    wait_ready(workers)
    return [rec for w in workers for rec in worker_records(w)]


@pytest.mark.slow
def test_at_step_replay_matches_what_workers_saw(procs: ProcessPool) -> None:
    groups, ranks, steps = ["g0", "g1"], 2, 150
    lh = procs.lighthouse({"lr": 0.1, "tick": 0})
    wait_healthy(lh.url)
    managers = {g: procs.manager(lh.address, g, cache_ttl=0.02, lighthouse_timeout=5.0) for g in groups}
    v_sched = change(lh.url, "PATCH", {"lr": 0.5, "phase": "two"}, effective_step=100)
    with Churn(lh.url, interval=0.01) as churn:
        records = run_workers(procs, managers, ranks, steps)
    churn.check()
    assert_served_normally(records)
    assert_ranks_agree(records, ranks)
    for group in groups:
        seen = per_step(records, group)
        assert len({r["version"] for r in seen.values()}) >= 5, f"{group}: too little churn to replay"
        assert all(("phase" in seen[s]["config"]) == (s >= 100) for s in seen), group
    assert check_replay(lh.url, records, groups) == len(groups) * steps
    # The top-level answer resolves the head version for the step (scheduled change included from 100).
    assert at_step(lh.url, 99)["config"].get("phase") is None
    assert at_step(lh.url, 100)["config"]["phase"] == "two"
    assert scheduled(lh.url)[v_sched]["late_groups"] == []


def lighthouse_answer(
    address: str, request: pb.LighthouseConfigRequest | None = None
) -> pb.LighthouseConfigResponse:
    """The lighthouse's raw answer to ``request`` (none: a caller that reports no step), for a test
    to hand to a manager as its push stream would."""
    from protos.rpc import LIGHTHOUSE_GET_CONFIG, make_channel

    asked = request if request is not None else pb.LighthouseConfigRequest()
    with make_channel(address) as channel:
        raw = channel.unary_unary(LIGHTHOUSE_GET_CONFIG)(asked.SerializeToString(), timeout=5)
    return pb.LighthouseConfigResponse.FromString(raw)


def polling_manager(lh: LighthouseProc) -> ManagerServer:
    """An in-process manager of group g0 without a push stream, whose TTL (60 s) never sends it to
    the lighthouse by itself: it hears only what its workers' steps and the test hand it."""
    return ManagerServer(lh.address, "127.0.0.1:0", "g0", cache_ttl=60.0, push=False)


def run_1_trained_then_ended(lh: LighthouseProc, manager: ManagerServer) -> dict[int, str]:
    """Rank 0 trains steps 0-39 through ``manager`` in run 1 (lr 0.1); then the operator ends run 1
    and changes lr to 0.2 at once. The lr rank 0 trained at each step."""
    from worker_client import ManagerClient

    with ManagerClient(manager.address(), timeout=5, group_rank=0) as ahead:
        trained = {step: ahead.get_config(step=step)["lr"] for step in range(40)}
    assert set(trained.values()) == {"0.1"}
    # The lease's renewals are over: the last one's answer covers the group's steps with room to
    # spare, and nothing else makes this manager ask the lighthouse (its TTL is 60 s), so it does
    # not hear of the run's end below. (A renewal answered after the end sets every pin aside, as a
    # run's end must: the flake hunt saw one land there, and the replay got the new config.)
    poll(lambda: manager._renew_at > 39, 10, what="the group's lease renewed past its last step")
    assert call(lh.url, "POST", "/api/config/runs/end")["ended"]["number"] == 1
    assert call(lh.url, "PATCH", "/api/config", {"lr": 0.2})["effective_step"] is None  # at once
    return trained


def test_a_reply_cropped_above_a_groups_promised_steps_does_not_replace_its_promise(
    procs: ProcessPool,
) -> None:
    """A push answered for the job's step (before the stream heard of this group's) carries the
    segments from the job's step on. A group behind the job, holding a lease on its next steps,
    keeps serving them the config promised: found by the replay test above, 1 run in 5-10, as
    a group at step 1 served a version taking effect at step 13, then went back at step 3."""
    from worker_client import ManagerClient

    lh = procs.lighthouse({"lr": 0.1}, extra=["--run-end-after", "60"])
    wait_healthy(lh.url)
    ahead = procs.manager(lh.address, "g0", cache_ttl=1.0)
    change(lh.url, "PATCH", {"lr": 0.2}, effective_step=10)
    change(lh.url, "PATCH", {"lr": 0.3}, effective_step=20)
    worker_records(procs.worker(ahead.address, group="g0", rank=0, steps=40))  # the job at step 39
    behind = ManagerServer(lh.address, "127.0.0.1:0", "g1", cache_ttl=5.0, push=False)
    try:
        with ManagerClient(behind.address(), timeout=5) as client:
            first = client.get_config(step=0)
            assert first["lr"] == "0.1" and first.stable_through_step >= 1, first
            cropped = lighthouse_answer(lh.address)  # what a push to a manager without a step holds
            held = Snapshot.from_reply(cropped)
            assert held.configs[held.segment(1)] == {"lr": "0.3"}  # it knows no step below the job's
            behind._pushed(cropped)  # as the push stream hands it over
            promised = client.get_config(step=1)
            assert (promised["lr"], promised.version) == ("0.1", first.version), promised
            past = client.get_config(step=first.stable_through_step + 1)  # renewed: from its step on
            assert past["lr"] == ("0.1" if past.step < 10 else "0.2"), past
    finally:
        behind.shutdown()


def test_a_rank_behind_its_group_replays_the_steps_before_a_new_run_as_its_group_trained_them(
    procs: ProcessPool,
) -> None:
    """Chaos seed 216499858: a rank restarted 200 steps behind its group after a run had begun, and
    its manager had dropped every pin at the begin: the rank got the new run's config for steps its
    group-mate had trained with another. A run begun at step R drops the pins from R on (its own
    steps: a resume asks for them again) and keeps those below; a run's end sets them all aside (a
    resume from a checkpoint may follow)."""
    from worker_client import ManagerClient

    lh = procs.lighthouse({"lr": 0.1}, extra=["--run-end-after", "60"])
    wait_healthy(lh.url)
    manager = polling_manager(lh)
    try:
        trained = run_1_trained_then_ended(lh, manager)
        # Another group resumes at step 45 and begins run 2 there; this manager, which never saw the
        # end (it polls), hears of it with the lighthouse's answer, handed over as a push stream does
        # (at its next step it would renew only past the lease it holds: a length that varies).
        other = pb.LighthouseConfigRequest(
            status=pb.ManagerStatus(replica_id="g1", step=45), lease_from_step=45
        )
        begun = lighthouse_answer(lh.address, other)
        assert begun.HasField("run_start_step") and begun.run_start_step == 45, begun
        manager._pushed(begun)
        with ManagerClient(manager.address(), timeout=5, group_rank=0) as ahead:
            assert ahead.get_config(step=45)["lr"] == "0.2"  # the new run, from its first step
        with ManagerClient(manager.address(), timeout=5, group_rank=1) as behind:
            replayed = {step: behind.get_config(step=step)["lr"] for step in range(10, 40)}
        assert replayed == {step: trained[step] for step in range(10, 40)}, replayed
        # A run's end (no run begun: no first step named) sets every pin aside: a resume may follow.
        assert call(lh.url, "POST", "/api/config/runs/end")["ended"]["number"] == 2
        ended = lighthouse_answer(lh.address)
        assert not ended.HasField("run_start_step")
        manager._pushed(ended)  # as the push stream hands it over
        with ManagerClient(manager.address(), timeout=5, group_rank=1) as resumed:
            assert resumed.get_config(step=20)["lr"] == "0.2"  # not the pin of run 1
    finally:
        manager.shutdown()


def test_a_rank_behind_its_group_replays_the_steps_of_a_run_an_operator_ended_as_its_group_trained_them(
    procs: ProcessPool,
) -> None:
    """Chaos seed 788386760: an operator ended the run while the job went on, the group's next step
    began another, and a rank restarted behind its group got the fallback for steps its group-mate
    had trained in the ended run (the end had dropped every pin). The end sets the pins aside; the
    begin brings back those below the new run's first step."""
    from worker_client import ManagerClient

    lh = procs.lighthouse({"lr": 0.1}, extra=["--run-end-after", "60"])
    wait_healthy(lh.url)
    manager = polling_manager(lh)
    try:
        trained = run_1_trained_then_ended(lh, manager)
        ended = lighthouse_answer(lh.address)  # the end, as the push stream hands it over
        assert not ended.HasField("run_start_step")
        manager._pushed(ended)
        with ManagerClient(manager.address(), timeout=5, group_rank=0) as ahead:
            going_on = ahead.get_config(step=40)  # the group's next step begins run 2 there
        assert going_on["lr"] == "0.2", going_on
        runs = call(lh.url, "GET", "/api/config/runs")
        assert [(r["number"], r["start_step"]) for r in runs["runs"]][-1] == (2, 40), runs
        with ManagerClient(manager.address(), timeout=5, group_rank=1) as behind:
            replayed = {step: behind.get_config(step=step)["lr"] for step in range(10, 40)}
        assert replayed == {step: trained[step] for step in range(10, 40)}, replayed
    finally:
        manager.shutdown()


# ------------------------------------------------- edge cases of scheduling
def test_change_scheduled_at_step_0_before_the_job_started_is_served_from_step_0(procs: ProcessPool) -> None:
    """A change scheduled at step 0 before any manager reported a step holds for every step."""
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    v = change(lh.url, "PATCH", {"lr": 0.5}, effective_step=0)
    m = procs.manager(lh.address, "g0", cache_ttl=0.05)
    records = worker_records(procs.worker(m.address, group="g0", rank=0, steps=20))
    assert call(lh.url, "GET", "/api/config")["config"] == {"lr": 0.5}
    assert at_step(lh.url, 5)["config"] == {"lr": 0.5}
    # What the workers got must be what the lighthouse says is live and what replay answers.
    assert [(r["version"], r["config"]) for r in records] == [(v, {"lr": "0.5"})] * 20


@pytest.mark.slow
def test_calls_without_a_step_follow_the_live_config_once_the_job_passes_a_scheduled_step(
    procs: ProcessPool,
) -> None:
    """After the job passes S, a call without a step gets the config live at the job's step (within TTLs)."""
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=0.05)
    change(lh.url, "PATCH", {"lr": 0.5}, effective_step=50)
    stepped = worker_records(procs.worker(m.address, group="g0", rank=0, steps=100))
    assert [r["config"]["lr"] for r in stepped] == ["0.1"] * 50 + ["0.5"] * 50
    poll(lambda: call(lh.url, "GET", "/api/config")["current_step"] >= 99, 10, what="the job's step reported")
    assert call(lh.url, "GET", "/api/config")["config"] == {"lr": 0.5}
    # 40 calls 50 ms apart: 40 cache TTLs for the manager to pick up the live config.
    plain = worker_records(
        procs.worker(m.address, group="g0", rank=1, steps=40, step_interval=0.05, no_step=True)
    )
    assert plain[-1]["config"] == {"lr": "0.5"}, plain[-1]


@pytest.mark.slow
def test_a_group_that_skips_past_the_step_without_serving_it_is_not_reported_late(
    procs: ProcessPool,
) -> None:
    """Late means "served steps >= S without the change"; a group that jumps over S (e.g. heals from a
    checkpoint of a later step) after learning of the change served none of them."""
    lh = procs.lighthouse({"lr": 0.1})
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "gJ", cache_ttl=0.05)
    before = worker_records(procs.worker(m.address, group="gJ", rank=0, steps=20))
    assert {r["config"]["lr"] for r in before} == {"0.1"}
    poll(lambda: call(lh.url, "GET", "/api/config")["current_step"] >= 19, 10, what="the job's step reported")
    v = change(lh.url, "PATCH", {"lr": 0.5}, effective_step=100)
    wait_managers_serve(lh.url, ["gJ"], v)
    after = worker_records(procs.worker(m.address, group="gJ", rank=0, first_step=150, steps=10))
    assert {r["config"]["lr"] for r in after} == {"0.5"}
    poll(
        lambda: at_step(lh.url, 159)["groups"].get("gJ", {}).get("version") == v,
        10,
        what="gJ's switch reported",
    )
    assert scheduled(lh.url)[v]["late_groups"] == []


def test_a_rank_behind_its_group_never_trains_a_change_before_its_step(procs: ProcessPool) -> None:
    """Found by the chaos suite (seed 905484450): a rank asked for the steps its group's other rank
    had left behind, after the manager's new lease came with segments only from the change's
    step on (the reply begins at the segment holding the highest step asked): the manager served
    the first segment's config, the change's, at steps below the change. A step below the
    snapshot's segments gets what an earlier lease promised for it, else the fallback."""
    lh = procs.lighthouse({"lr": 0.1})
    m = procs.manager(lh.address, "g0", cache_ttl=0.3, extra=["--poll"])
    worker_records(procs.worker(m.address, group="g0", rank=0, steps=40, step_interval=0.01))
    made = call_status(lh.url, "PATCH", "api/config", {"lr": 0.2})
    assert made.status == 200, made.body
    effective = made.json["effective_step"]
    assert effective is not None and effective >= 40, made.json
    # Rank 0 goes on past the change (a script may ask at some steps only): the new lease's
    # reply holds segments from the change's step on.
    jump = worker_records(procs.worker(m.address, group="g0", rank=0, steps=1, first_step=effective + 50))
    assert jump[0]["config"] == {"lr": "0.2"}, jump

    def fetches() -> int:
        return int(
            next(g for g in call(lh.url, "GET", "api/managers")["managers"] if g["replica_id"] == "g0")[
                "fetches"
            ]
        )

    # Another change, and the manager's refreshes (reporting that step) bring it: replies that begin
    # at the segment holding that step.
    assert call_status(lh.url, "PATCH", "api/config", {"other": 1}).status == 200
    seen = fetches()
    poll(lambda: fetches() >= seen + 2, 10, what="the manager's refreshes after the jump")
    # Rank 1, behind, asks the steps in between: none below the change gets it.
    behind = worker_records(
        procs.worker(m.address, group="g0", rank=1, steps=effective + 10 - 40, first_step=40)
    )
    assert [r["step"] for r in behind] == list(range(40, effective + 10))
    early = [r for r in behind if r["step"] < effective and r["config"].get("lr") == "0.2"]
    assert not early, early[:3]
    assert all(r["config"].get("lr") == "0.2" for r in behind if r["step"] >= effective), behind[-12:]
