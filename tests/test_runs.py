"""Runs (issue 25): a job's training as a sequence of runs, and a resume at any step.

The store- and state-level tests here drive ``ConfigStore`` and ``LighthouseState``
directly (cheap); ``test_runs_procs.py`` runs the real lighthouse, managers and workers.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lighthouse.jobs.leases import LeaseBook, LeasePolicy
from lighthouse.jobs.runs import RUNS_META, Runs, pack, unpack
from lighthouse.jobs.state import RUN_END_MARGIN, RUN_END_TTLS, LighthouseState
from lighthouse.jobs.versions import ConfigStore, NotCancellable, StepPromised
from lighthouse.store.etcd import EtcdBackend
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb
from tests.etcd_cluster import EtcdCluster
from tests.procs import poll
from tests.store_edits import commit
from tests.threads import CheckedThread


def store_with_ceilings(path: Path | None = None, backend: EtcdBackend | None = None) -> ConfigStore:
    """A store (SQLite at ``path``, or ``backend``) whose ceiling writes are stored at once (the
    lighthouse does it in a thread)."""
    holder: list[ConfigStore] = []

    def write(book: LeaseBook[Any]) -> None:
        wanted = book.wanted
        holder[0].save_lease_ceiling(wanted, book.served_version)
        book.ceiling_stored(wanted)

    store = ConfigStore(backend or SqliteBackend(path), request_ceiling=write)
    holder.append(store)
    store.leases.publish("snapshot", store.head)
    return store


def train_to(store: ConfigStore, step: int) -> int:
    """The job steps to ``step`` with a lease granted there; the horizon promised."""
    store.advance_step(step)
    _, horizon = store.leases.grant(step, 1.0)
    return horizon


def test_pack_keeps_max_semantics_across_runs() -> None:
    assert pack(0, 299) == pack(1, 299) == 299 and unpack(299) == (0, 299)  # the first run: plain
    assert unpack(pack(3, 100)) == (3, 100)
    assert pack(2, 100) > pack(1, 10**9) > pack(1, 299)  # a later run's low step stores above
    assert Runs.decode(None, job_step=500).begin(10, 1).number == 2  # after the implicit run 0
    assert pack(5, -1) == -1 and unpack(-1) == (0, -1)


def test_the_rewind_a_resume_from_a_checkpoint_gets_the_config_as_the_operator_left_it(
    tmp_path: Path,
) -> None:
    """Crash at 299, lr lowered, resume from the checkpoint at 100: the new lr from 100; a change
    scheduled at 150 while the job is down is accepted and taken at 150; one the dead run was
    promised at a later step holds from 100."""
    db = tmp_path / "state.db"
    store = store_with_ceilings(db)
    commit(store, "put", {"lr": 0.1, "wd": 0.0}, source="t")
    assert store.begin_run(0) is not None
    horizon = train_to(store, 299)
    promised = commit(store, "patch", {"wd": 0.01}, source="t")  # made now, pending above the lease
    assert promised.made_now and promised.effective_step == horizon + 1
    assert store.resolve(store.head, 299)["wd"] == 0.0

    ended = store.end_run("managers gone")
    assert ended is not None and ended.end_step == 299 and not ended.live
    assert store.leases.horizon == -1  # the promises ended with the run
    # With no run live a change made now is live at once, also for stepless readers.
    lowered = commit(store, "patch", {"lr": 0.01}, source="t")
    assert lowered.effective_step is None and store.live()["lr"] == 0.01
    assert store.live()["wd"] == 0.01  # what the dead run was promised holds now
    # ... at every step of the runs after it: no cancel takes it back (before issue 35 one was
    # taken while its old step lay above the next run's promises, and that run's steps changed).
    with pytest.raises(NotCancellable, match="promised to a run that ended"):
        commit(store, "cancel", {"version": promised.version}, source="t")
    # And a change may be scheduled at any step: 409 only against promises of a live run.
    at_150 = commit(store, "patch", {"warmup": 5}, source="t", effective_step=150)
    assert at_150.effective_step == 150

    run = store.begin_run(100)
    assert run is not None and run.number == 2 and run.start_step == 100
    assert store.current_step == 100  # the job's step starts over with the run
    assert store.resolve(store.head, 100) == {"lr": 0.01, "wd": 0.01}
    assert store.resolve(store.head, 149) == {"lr": 0.01, "wd": 0.01}
    assert store.resolve(store.head, 150) == {"lr": 0.01, "wd": 0.01, "warmup": 5}
    assert [s.from_step for s in store.segments()] == [0, 150]
    # A change the new run makes now lands on top of everything an earlier run left.
    horizon = train_to(store, 120)
    later = commit(store, "patch", {"lr": 0.02}, source="t")
    assert later.made_now and later.effective_step == horizon + 1
    assert store.resolve(store.head, horizon)["lr"] == 0.01
    assert store.resolve(store.head, horizon + 1)["lr"] == 0.02
    with pytest.raises(StepPromised):
        commit(store, "patch", {"lr": 0.5}, source="t", effective_step=110)  # promised to this run
    store.close()
    store.backend.close()

    # Durable: the runs, the run's step and its config come back from the file.
    again = ConfigStore(SqliteBackend(db))
    assert [r.number for r in again.runs.runs] == [1, 2] and again.runs.live is not None
    assert again.current_step == 120
    assert again.resolve(again.head, horizon + 1) == store.resolve(store.head, horizon + 1)
    assert again.leases.floor >= horizon  # the live run's ceiling still bounds its promises
    again.close()
    again.backend.close()


def test_a_run_begins_at_any_step_and_a_new_run_id_begins_a_new_run() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend()))
    state.change("put", {"lr": 0.1}, source="t")

    def report(step: int, run_id: str = "", wanted: int = -1, replica: str = "g0") -> int:
        status = pb.ManagerStatus(replica_id=replica, step=step, run_id=run_id)
        return state.observe(status, "peer", wanted=wanted)

    assert report(-1, run_id="0", wanted=5000) == -1  # a fresh manager asks a lease for step 5,000
    runs = state.store.runs
    assert runs.live is not None and (runs.live.number, runs.live.start_step, runs.live.run_id) == (
        1,
        5000,
        "0",
    )
    assert report(5001, run_id="0") == 5001
    assert report(5002, run_id="0", replica="g1") == 5002
    # The training script restarted (torchelastic's restart count): a new run, from its checkpoint
    # at a much lower step, which the plausible-step check must not ignore.
    assert report(-1, run_id="1", wanted=100) == -1
    runs = state.store.runs
    assert [(r.number, r.start_step, r.run_id, r.live) for r in runs.runs] == [
        (1, 5000, "0", False),
        (2, 100, "1", True),
    ]
    assert runs.runs[0].end_reason == "run id '1'" and runs.runs[0].end_step == 5002
    assert report(101, run_id="1") == 101 and state.store.current_step == 101
    # A report of the old run's id (a group that did not restart yet) begins no run, and its step
    # is not run 2's: no lease may cover it and the job's step stays the new run's.
    assert report(5003, run_id="0", replica="g1") == -1
    assert state.store.runs.number == 2 and state.store.current_step == 101
    stale = pb.LighthouseConfigRequest(
        status=pb.ManagerStatus(replica_id="g1", step=5003, run_id="0"),
        lease_seconds=1.0,
        lease_from_step=5004,
    )
    assert state.receive(stale, "peer") == -1 and state.store.current_step == 101
    view = state.view()
    assert view["run"]["number"] == 2 and view["run"]["start_step"] == 100


def test_a_run_ends_once_no_manager_steps_for_longer_than_its_lease() -> None:
    state = LighthouseState(ConfigStore(SqliteBackend(), lease_policy=LeasePolicy(run_end_after=0.0)))
    state.change("put", {"lr": 0.1}, source="t")
    ttl = 0.2
    request = pb.LighthouseConfigRequest(
        status=pb.ManagerStatus(replica_id="g0", step=10), lease_seconds=ttl, lease_from_step=11
    )
    step = state.receive(request, "peer")
    assert step == 11 and state.store.runs.live is not None
    run_1_state = state.snapshot.state_id
    began = time.monotonic()
    assert state.check_run() is None  # it just stepped
    # The same step reported again (a paused job's manager, alive) is no progress: the run ends.
    request.ClearField("lease_from_step")
    assert state.receive(request, "peer") == 10  # step 10 again: plausible, but the job did not move
    ended = poll(lambda: state.receive(request, "peer") and state.check_run(), timeout=10, what="run end")
    assert time.monotonic() - began >= RUN_END_TTLS * ttl + RUN_END_MARGIN
    assert ended.end_reason == "managers gone" and state.store.runs.live is None
    assert state.snapshot.state_id != state.store.state_id  # managers drop the run's leases
    # No run is live: a manager's stale step gets no promise.
    body, _ = state.answer(0, "", 10, request, "peer") or (b"", 0)
    assert pb.LighthouseConfigResponse.FromString(body).stable_through_step == -1
    # The paused manager's reports of its old step begin no run: a change made now is live at once.
    state.receive(request, "peer")
    assert state.store.runs.live is None
    plan = state.change("patch", {"lr": 0.05}, source="t")
    assert plan.row.effective_step is None and state.view()["config"]["lr"] == 0.05
    # A late report of a step it served in the ended run (it holds that run's state: the end had
    # not reached it) begins no run; run 2 would begin there, past where its workers resume.
    request.known_state_id, request.status.step = run_1_state, 11
    state.receive(request, "peer")
    assert state.store.runs.live is None
    # When it steps again under the state served now, the next run begins at the step it resumes at.
    request.known_state_id, request.status.step = state.snapshot.state_id, 12
    state.receive(request, "peer")
    live = state.store.runs.live
    assert live is not None and live.number == 2 and live.start_step == 12  # it served 12 in run 2
    assert state.snapshot.config["lr"] == "0.05"


def test_an_operator_ends_the_run_and_stepless_readers_see_a_change_at_once() -> None:
    state = LighthouseState(store_with_ceilings())
    state.change("put", {"lr": 0.1}, source="t")
    state.observe(pb.ManagerStatus(replica_id="g0", step=40), "peer", held=state.snapshot.state_id)
    _, horizon = state.store.leases.grant(40, 1.0)
    pending = state.change("patch", {"lr": 0.2}, source="t")
    view = state.view()
    assert pending.row.effective_step == horizon + 1 and view["live"]["lr"] == 0.1
    assert (view["version"], view["config"]["lr"], view["from_step"]) == (pending.version, 0.2, horizon + 1)
    assert state.end_run("operator") is not None
    assert state.end_run("operator") is None  # none is live any more
    view = state.view()
    assert view["config"]["lr"] == 0.2 and view["run"] is None
    # A version says that the run's promised change now holds at once (the run's versions replay
    # as they were served: the pending one at its step).
    marker = state.store.latest()
    assert marker is not None and marker.source == "run" and view["live_version"] == marker.version
    assert state.store.resolve(pending.version, horizon)["lr"] == 0.1
    assert state.store.resolve(marker.version, horizon)["lr"] == 0.2
    assert Runs.decode(state.store.runs.encode()).to_json() == state.store.runs.to_json()


def test_a_change_made_now_in_effect_when_the_run_ends_holds_from_the_next_runs_first_step() -> None:
    """Issue 35's finding: the run's end committed its version only while a change made now was
    pending. One already in effect (the job passed its step) was then served to a run resuming
    below that step without it, with a lease, and the next edit changed what that lease promised."""
    state = LighthouseState(store_with_ceilings())
    state.change("put", {"lr": 0.1}, source="t")
    state.observe(pb.ManagerStatus(replica_id="g0", step=100), "peer", held=state.snapshot.state_id)
    _, horizon = state.store.leases.grant(100, 1.0)
    made_now = state.change("patch", {"lr": 0.2}, source="t")
    assert made_now.row.effective_step == horizon + 1
    past = horizon + 5  # the job trains past the change's step: in effect, no longer pending
    state.observe(pb.ManagerStatus(replica_id="g0", step=past), "peer", held=state.snapshot.state_id)
    assert [s["status"] for s in state.store.scheduled()] == ["in_effect"]
    head = state.store.head
    assert state.end_run("operator") is not None
    marker = state.store.latest()
    assert marker is not None and marker.source == "run" and marker.version == head + 1
    # The resumed run, at step 50 (below the change's step), is served lr 0.2 from its first step,
    # and a later edit of another key does not change what step 50 gets.
    assert state.store.begin_run(50) is not None
    assert state.store.resolve(state.store.head, 50)["lr"] == 0.2
    state.change("patch", {"wd": 0.01}, source="t")
    assert state.store.resolve(state.store.head, 50)["lr"] == 0.2
    # The version served within the ended run still replays as it was served.
    assert state.store.resolve(made_now.version, horizon)["lr"] == 0.1


def test_lighthouses_on_one_etcd_prefix_agree_on_runs(etcd1: EtcdCluster) -> None:
    """Two stores of one job on one etcd prefix (what two lighthouses hold): B follows the runs A
    begins and ends, its job step starts over with a new run, and a step of the run before is
    not taken for the new run's."""
    prefix = f"/test-runs/{uuid.uuid4().hex}"
    backends = [EtcdBackend(etcd1.endpoints, prefix=prefix) for _ in range(2)]
    # B's callbacks run on its watch thread, which logs what they raise and goes on: kept here,
    # and raised in the test's thread by every look at B.
    errors: list[BaseException] = []

    def kept(callback: Callable[..., object]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            try:
                callback(*args)
            except BaseException as exc:
                errors.append(exc)
                raise

        return call

    def b_shows(check: Callable[[], bool]) -> Callable[[], bool]:
        def look() -> bool:
            if errors:
                raise AssertionError(f"b's watch callback failed: {errors[0]!r}") from errors[0]
            return check()

        return look

    try:
        a = ConfigStore(backends[0])
        commit(a, "put", {"lr": 0.1}, source="t")
        b = ConfigStore(backends[1])
        backends[1].subscribe(
            kept(lambda job, head: b.reload()),
            kept(lambda job, step: b.adopt_step(step)),
            kept(lambda *_: None),
        )
        assert a.begin_run(0) is not None
        a.advance_step(50)
        poll(b_shows(lambda: b.runs.live is not None and b.current_step == 50), 10, what="b in run 1 at 50")
        a.end_run("operator")
        assert a.begin_run(10) is not None  # a resume from a checkpoint at step 10
        poll(b_shows(lambda: b.runs.number == 2 and b.runs.live is not None), 10, what="b in run 2")
        assert b.current_step == 10 and b.served_state_id == a.served_state_id
        assert not b.adopt_step(pack(1, 60))  # run 1's step: not this run's
        assert not b.adopt_step(60)
        assert b.adopt_step(pack(2, 12)) and b.current_step == 12
        assert not errors, errors  # nor did one fail since
    finally:
        for backend in backends:
            backend.close()


def test_a_restart_between_runs_keeps_no_promise_of_the_ended_run(tmp_path: Path) -> None:
    """The ended run's stored ceiling is no floor once it ended: after a restart between runs a
    change made now applies at once, and a schedule below the dead run's promises is accepted
    (before issue 35 the restarted store placed the change above the old ceiling, at step 109
    for a run that had ended at step 100, and the next run got it only there)."""
    db = tmp_path / "state.db"
    store = store_with_ceilings(db)
    commit(store, "put", {"lr": 0.1}, source="t")
    assert store.begin_run(0) is not None
    horizon = train_to(store, 100)
    assert store.end_run("managers gone") is not None
    store.close()
    store.backend.close()
    store = store_with_ceilings(db)  # a restarted lighthouse, no run live
    assert store.runs.between and store.leases.horizon == -1
    now = commit(store, "patch", {"lr": 0.2}, source="t")
    assert now.effective_step is None and store.live()["lr"] == 0.2
    scheduled = commit(store, "patch", {"wd": 0.5}, source="t", effective_step=horizon - 50)
    assert scheduled.effective_step == horizon - 50
    assert store.begin_run(10) is not None
    assert store.resolve(store.head, 10)["lr"] == 0.2
    store.close()
    store.backend.close()


def test_an_etcd_lighthouse_between_runs_keeps_no_promise_of_the_ended_run(etcd1: EtcdCluster) -> None:
    """Issue 36's finding on etcd: once the run ended, re-reading the prefix (every watch event)
    raised the floor again from the ended run's ceiling keys, so a schedule below its promises got
    409 and a change made now waited above them, where SQLite applied both at once."""
    backend = EtcdBackend(etcd1.endpoints, prefix=f"/test-runs/{uuid.uuid4().hex}")
    store = store_with_ceilings(backend=backend)
    try:
        commit(store, "put", {"lr": 0.1}, source="t")
        store.leases.publish("snapshot", store.head)  # etcd stores a ceiling for the head served
        assert store.begin_run(0) is not None
        horizon = train_to(store, 300)
        assert store.end_run("managers gone") is not None
        store.flush_runs()  # the record says the run ended, as a watch event would bring it
        store.reload()  # what a watch event does
        assert store.leases.horizon == -1
        scheduled = commit(store, "patch", {"wd": 0.5}, source="t", effective_step=horizon // 2)
        assert scheduled.effective_step == horizon // 2
        store.reload()
        now = commit(store, "patch", {"lr": 0.2}, source="t")
        assert now.effective_step is None and store.live()["lr"] == 0.2
    finally:
        store.close()
        backend.close()


def test_a_run_begun_before_the_ended_run_s_version_is_stored_serves_its_promises_rebased(
    tmp_path: Path,
) -> None:
    """Found by the chaos suite (an operator's run end on etcd): the run's end stores its record,
    then commits a version saying its promises hold now; another lighthouse began the next run in
    between and served the head's state without them (the ended run's config at steps past the
    resume), while a group that asked after the version came got them: two configs at one step.
    The head's state is served in the current runs, with or without that version."""
    store = store_with_ceilings(tmp_path / "state.db")
    commit(store, "put", {"lr": 0.1}, source="t")
    assert store.begin_run(0) is not None
    horizon = train_to(store, 200)
    promised = commit(store, "patch", {"lr": 0.2}, source="t")  # made now: above the lease
    assert promised.made_now and promised.effective_step == horizon + 1
    head = store.head
    assert store.end_run("operator") is not None  # the record only: the version comes after
    assert store.begin_run(150) is not None  # the next run, before that version
    assert store.head == head
    assert store.resolve(store.head, 150) == {"lr": 0.2}  # as it will be once the version is stored
    assert store.segments()[0].config == {"lr": 0.2}
    # The ended run's versions replay as they were served once a newer one is stored.
    commit(store, "patch", {"other": 1}, source="t")
    assert store.resolve(head, 150) == {"lr": 0.1}


def test_a_run_another_lighthouse_began_is_not_ended_before_its_managers_could_be_heard(
    etcd1: EtcdCluster,
) -> None:
    """Found by the chaos soak (seed 1470347390): a lighthouse back from a cut had heard no manager
    for long (they had moved to the other) and ended, "managers gone", three runs the other
    lighthouse began, each within 100 ms of its start; the rebasing of each end split the groups.
    A run gets the whole bound from its start, whichever lighthouse began it."""
    prefix = f"/test-runs/{uuid.uuid4().hex}"
    backends = [EtcdBackend(etcd1.endpoints, prefix=prefix) for _ in range(2)]
    try:
        a = LighthouseState(ConfigStore(backends[0], lease_policy=LeasePolicy(run_end_after=0.0)))
        a.change("put", {"lr": 0.1}, source="t")
        b = LighthouseState(ConfigStore(backends[1], lease_policy=LeasePolicy(run_end_after=0.0)))
        b._started_at = time.monotonic() - 3600  # b has heard no manager for an hour
        request = pb.LighthouseConfigRequest(
            status=pb.ManagerStatus(replica_id="g0", step=10), lease_seconds=0.2, lease_from_step=11
        )
        a.receive(request, "peer")  # a's manager steps: a begins run 1
        assert a.store.runs.live is not None
        a.store.flush_runs()
        b.store.reload()
        assert b.store.runs.live is not None
        assert b.check_run() is None and b.check_run() is None  # just begun: not b's to end
        assert b.store.runs.live is not None
    finally:
        for backend in backends:
            backend.close()


def test_a_run_whose_groups_step_elsewhere_waits_a_whole_bound_before_the_next_look(
    etcd1: EtcdCluster,
) -> None:
    """Found by the chaos soak (seed 733702840): a lighthouse back from a cut saw the job's stored
    step ahead of its own and let the run go on, then 60 ms later, the stored step unchanged (the
    other lighthouse could not store newer ones yet), ended it "managers gone" while its groups
    stepped, and their leases of the run ended with it: one group trained another config at the
    next step. Having seen the groups step elsewhere, it waits a whole bound again."""
    prefix = f"/test-runs/{uuid.uuid4().hex}"
    backends = [EtcdBackend(etcd1.endpoints, prefix=prefix) for _ in range(2)]
    try:
        a = LighthouseState(ConfigStore(backends[0], lease_policy=LeasePolicy(run_end_after=0.0)))
        a.change("put", {"lr": 0.1}, source="t")
        request = pb.LighthouseConfigRequest(
            status=pb.ManagerStatus(replica_id="g0", step=10), lease_seconds=0.2, lease_from_step=11
        )
        a.receive(request, "peer")
        assert a.store.runs.live is not None
        a.store.flush_runs()
        b = LighthouseState(ConfigStore(backends[1], lease_policy=LeasePolicy(run_end_after=0.0)))
        assert b.store.runs.live is not None
        live = b.store.runs.live
        b.store.runs = Runs(
            (dataclasses.replace(live, started_at=live.started_at - 3600),)
        )  # as after a long cut
        b._started_at = time.monotonic() - 3600  # b has heard no manager for an hour
        a.store.advance_step(500)  # the groups step through a, stored in the background
        poll(lambda: backends[1].stored_step("default") >= 500, 5, what="the job's step stored")
        assert b.check_run() is None  # stepped elsewhere: the run goes on
        assert b.check_run() is None  # and the stored step standing still ends nothing at once
        assert b.store.runs.live is not None
    finally:
        for backend in backends:
            backend.close()


class SlowRunsRecord(SqliteBackend):
    """A store that holds each write of the runs record until ``release`` (an etcd answering slowly):
    the window in which the lighthouse's watch may re-read the store under it."""

    def __init__(self) -> None:
        super().__init__()
        self.writing = threading.Event()
        self.release = threading.Event()

    def replace_meta(
        self, job: str, key: str, expected: str | None, items: dict[str, str], head: int | None = None
    ) -> bool:
        if key == RUNS_META and not self.release.is_set():
            self.writing.set()
            assert self.release.wait(10), "the runs record's write was never let through"
        return super().replace_meta(job, key, expected, items, head)


def test_a_re_read_of_the_store_while_the_begun_run_is_written_keeps_the_run_and_its_promises() -> None:
    """Chaos seed 434906234: a lighthouse began a run and granted its groups leases while the run's
    record was still being written; its watch re-read the store then (another lighthouse's commit)
    and took the stored record, the run before. Its runs went back to the ended one, its promises
    with them (a new run for its leases), and a change made through it right after applied at once,
    under the steps it had just promised: two groups trained another config than the third. A
    re-read keeps the run this lighthouse began until its record is stored, and then reads it."""
    backend = SlowRunsRecord()
    holder: list[ConfigStore] = []

    def write(book: LeaseBook[Any]) -> None:
        holder[0].save_lease_ceiling(book.wanted, book.served_version)
        book.ceiling_stored(book.wanted)

    store = ConfigStore(backend, request_ceiling=write)
    holder.append(store)
    store.leases.publish("snapshot", store.head)
    try:
        commit(store, "put", {"lr": 1}, source="t")
        run = store.begin_run(100)  # its record is written on a thread: held in the write
        assert run is not None and backend.writing.wait(5)
        generation, era = store.leases.generation, store.served_state_id
        store.reload()  # the watch, while the record is in flight
        assert store.runs.live is not None and store.runs.live.number == run.number
        assert (store.leases.generation, store.served_state_id) == (generation, era)
        backend.release.set()

        def stored() -> Runs:
            return Runs.decode(backend.load(store.job).meta.get(RUNS_META), -1)

        poll(lambda: stored().live == run, 5, what="the run's record stored")
        _, horizon = store.leases.grant(100, 1.0)  # promised within the run, and kept:
        store.reload()
        promised = store.leases.horizon
        assert promised >= horizon >= 100
        made = commit(store, "patch", {"lr": 2}, source="t")  # a change made now lands above them
        assert made.effective_step == promised + 1, (made, promised)
    finally:
        backend.release.set()
        store.close()
        backend.close()


def test_a_lease_asked_in_a_run_and_waiting_for_its_ceiling_across_the_run_s_end_promises_nothing() -> None:
    """Chaos seed 403984614: a lighthouse back from a cut from etcd answered a manager of the live
    run; its lease waited for a ceiling (the store had been out of reach) and the operator ended the
    run meanwhile. The grant asked for a ceiling again after the end, got it stored, and promised
    steps to no run: the horizon it left placed a change made between runs above them (effective
    at step 2188), and the resumed run, begun at 1996, trained without it until there. A grant
    that waits across a run's end or begin promises nothing, and nothing is wanted for it."""
    asked: list[LeaseBook[Any]] = []  # the ceiling writer's queue: stored below, by hand
    store = ConfigStore(SqliteBackend(), request_ceiling=asked.append)
    state = LighthouseState(store)
    try:
        state.change("put", {"lr": 1}, source="t")
        assert store.begin_run(0) is not None
        store.flush_runs()
        store.advance_step(5)
        request = pb.LighthouseConfigRequest(status=pb.ManagerStatus(replica_id="g0", step=5))
        replies: list[tuple[bytes, int] | None] = []
        thread = CheckedThread(lambda: replies.append(state.answer(0, "", 5, request, "g0", wait=5.0)))
        thread.start()
        poll(lambda: asked, 5, what="the grant waiting for its ceiling")
        assert state.end_run("the operator") is not None

        def write() -> None:  # what the ceiling writer does with each book asked of it
            for book in list(asked):
                ceiling, generation = book.wanted, book.generation
                if ceiling > book.stored:
                    store.save_lease_ceiling(ceiling, book.served_version)
                    book.ceiling_stored(ceiling, generation)

        deadline = time.monotonic() + 3
        while thread.is_alive() and time.monotonic() < deadline:
            write()
            time.sleep(0.01)
        thread.check(timeout=5)
        (reply,) = replies
        assert reply is not None
        answered = pb.LighthouseConfigResponse.FromString(reply[0])
        assert answered.stable_through_step == -1, answered.stable_through_step
        write()
        assert store.leases.horizon == -1  # nothing promised between runs
        made = commit(store, "patch", {"lr": 2}, source="t")
        assert made.effective_step is None and store.live() == {"lr": 2}  # at once, between runs
    finally:
        store.close()
        store.backend.close()
