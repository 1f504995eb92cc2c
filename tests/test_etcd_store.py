"""The etcd store backend on a real etcd: what the shared store suite (test_store.py) cannot show
with one store: two lighthouses' stores on one prefix, retried transactions, big rows, the shared
job step, the watch, and the ``--store`` URL."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from lighthouse.config.values import MAX_CONFIG_BYTES
from lighthouse.jobs.leases import LeaseGate
from lighthouse.jobs.registry import JobRegistry
from lighthouse.jobs.versions import ConfigStore, VersionConflict
from lighthouse.store.backend import Change, HeadMoved, SharedBackend, StoreUnavailable
from lighthouse.store.etcd import DEFAULT_PREFIX, EtcdBackend, open_etcd_store, parse_store_url
from lighthouse.store.sqlite import SqliteBackend
from protos.etcd import rpc_pb2, rpc_pb2_grpc
from protos.job_ids import DEFAULT_JOB
from tests.etcd_cluster import EtcdCluster, free_port
from tests.procs import ROOT, child_env, poll
from tests.store_edits import commit
from tests.threads import CheckedThread


@pytest.fixture
def prefix() -> str:
    return f"/test-etcd-store/{uuid.uuid4().hex}"


@pytest.fixture
def backends(etcd1: EtcdCluster, prefix: str) -> Iterator[list[EtcdBackend]]:
    """Two backends on one prefix: what two lighthouses on one etcd hold."""
    pair = [EtcdBackend(etcd1.endpoints, prefix=prefix) for _ in range(2)]
    try:
        yield pair
    finally:
        for b in pair:
            b.close()


def row(version: int, config: dict[str, object]) -> Change:
    return Change(version, "put", config, config, None, -1, time.time(), "test", "-", "")


def test_parse_store_url() -> None:
    url = parse_store_url("etcd://a:1,b:2/team/x/")
    assert (url.endpoints, url.prefix, url.tls) == (["a:1", "b:2"], "/team/x", False)
    assert parse_store_url("etcds://[::1]:2379").prefix == DEFAULT_PREFIX
    assert parse_store_url("etcds://[::1]:2379").tls
    assert parse_store_url("etcd://h:1/").prefix == DEFAULT_PREFIX
    for bad, says in [
        ("h:1", "expected etcd://"),
        ("http://h:1", "expected etcd://"),
        ("etcd:///p", "no etcd endpoint"),
        ("etcd://h/p", "not HOST:PORT"),
        ("etcd://h:x", "not HOST:PORT"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_store_url(bad)
    with pytest.raises(ValueError, match="etcds://"):
        open_etcd_store("etcd://h:1", ca="ca.pem")


def test_unreachable_etcd_is_store_unavailable_within_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no quorum"):
        EtcdBackend(f"127.0.0.1:{free_port()}", timeout=1.0)
    assert time.monotonic() - started < 5


def test_append_compares_the_head_and_recognises_its_own_retry(backends: list[EtcdBackend]) -> None:
    a, b = backends
    first = row(1, {"k": 1})
    a.append("j", [first], {"last_version": "1"}, expected_head=0)
    with pytest.raises(HeadMoved):
        b.append("j", [row(1, {"k": "other"})], {}, expected_head=0)
    # The same transaction again (what etcd_client does after a timeout that hid a success):
    # the head moved, but the row there is this one, so it counts as committed.
    a.append("j", [first], {"last_version": "1"}, expected_head=0)
    b.append("j", [row(2, {"k": 2})], {}, expected_head=1)
    with pytest.raises(HeadMoved):
        a.append("j", [row(2, {"k": "late"})], {}, expected_head=1)
    assert [r.config for r in b.load("j").rows] == [{"k": 1}, {"k": 2}]
    assert a.jobs() == b.jobs() == ["j"]
    a.delete_job("j")
    assert b.jobs() == [] and b.load("j").rows == []
    assert a.is_empty()


def test_only_the_etcd_backend_is_a_shared_backend(backends: list[EtcdBackend]) -> None:
    """The registry subscribes to a SharedBackend, the server shares managers over one: no other."""
    plain = SqliteBackend(None)
    try:
        assert [isinstance(b, SharedBackend) for b in (backends[0], plain)] == [True, False]
    finally:
        plain.close()


def test_is_empty(etcd1: EtcdCluster, prefix: str) -> None:
    backend = EtcdBackend(etcd1.endpoints, prefix=prefix)
    try:
        assert backend.is_empty()
        commit(ConfigStore(job="j", backend=backend), "put", {"a": 1}, source="t")
        assert not backend.is_empty()
        assert EtcdBackend(etcd1.endpoints, prefix=prefix + "-other").is_empty()
    finally:
        backend.close()


def test_stores_on_two_lighthouses_never_reuse_a_version(backends: list[EtcdBackend]) -> None:
    stores = [ConfigStore(job="j", backend=b) for b in backends]
    versions: list[int] = []
    lock = threading.Lock()

    def edit(store: ConfigStore, n: int) -> None:
        for i in range(n):
            v = commit(store, "patch", {f"k{id(store)}": i}, source="t").version
            with lock:
                versions.append(v)

    threads = [CheckedThread(edit, s, 15) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.check()
    assert sorted(versions) == list(range(1, 31))
    fresh = ConfigStore(job="j", backend=backends[0])
    assert [h["version"] for h in fresh.history()] == list(range(30, 0, -1))
    # Each commit resolved on top of the other lighthouse's latest: nothing was lost.
    assert fresh.live() == {f"k{id(s)}": 14 for s in stores}


def test_if_match_conflicts_across_lighthouses(backends: list[EtcdBackend]) -> None:
    a, b = (ConfigStore(job="j", backend=x) for x in backends)
    commit(a, "put", {"v": 1}, source="t")
    b.reload()
    commit(a, "put", {"v": 2}, source="t", if_match=1)
    with pytest.raises(VersionConflict) as err:  # b still believes 1 is the head
        commit(b, "put", {"v": 3}, source="t", if_match=1)
    assert err.value.head == 2
    assert b.live() == {"v": 2}  # and it learnt the new head


def test_a_change_made_at_once_applies_on_top_of_every_one_acknowledged_before_it(
    backends: list[EtcdBackend],
) -> None:
    """Lighthouses whose groups reached different steps: a took a change at step 500 and b has not
    learnt that step (the prefix stores steps a moment later), yet b's change, acknowledged after
    a's, applies on top of it (issue 29)."""
    a, b = backends
    store = ConfigStore(job="j", backend=b)
    store.advance_step(100)
    a.append("j", [Change(1, "patch", {"n": 1}, {"n": 1}, None, 500, time.time(), "api", "-", "")], {}, 0)
    second = commit(store, "patch", {"n": 2}, source="t")  # plans again once it finds version 1
    assert (second.version, second.config, second.order_step) == (2, {"n": 2}, 500)
    assert ConfigStore(job="j", backend=a).live() == {"n": 2}


def test_beside_an_earlier_release_a_change_sorts_at_the_step_stored_on_the_prefix(
    backends: list[EtcdBackend],
) -> None:
    """The release before step leases orders a change by the step it has seen (what the prefix
    stored, when its own groups lag), and does not look at the changes before it: this release's
    change must not sort at its own groups' higher step, or that release's next change, made
    after it, would apply below it (issue 29's rolling upgrade)."""
    old_backend, new_backend = backends
    gate = LeaseGate()
    gate.suspended_by = ("old-release:1",)
    new = ConfigStore(job="j", backend=new_backend, lease_gate=gate)
    new.adopt_step(100)  # the stored job step, as the watch hands it over
    new.advance_step(500)  # this lighthouse's groups lead, the prefix has not stored it yet
    first = commit(new, "patch", {"n": 1}, source="t")
    assert first.order_step == 100
    # The old release's next change, as it writes one: ordered at its own step, 100.
    old_row = Change(2, "patch", {"n": 2}, {"n": 2}, None, 100, time.time(), "api", "-", "")
    old_backend.append("j", [old_row], {}, expected_head=1)
    new.reload()  # what the watch does
    assert new.head == 2
    assert new.live() == {"n": 2}
    assert ConfigStore(job="j", backend=old_backend).live() == {"n": 2}


def test_a_config_of_the_full_size_limit_fits(etcd1: EtcdCluster, prefix: str) -> None:
    """1 MiB of config plus a 1 MiB change is more than etcd takes in one request: the row is
    stored without its config, which the store recomputes on load."""
    backend = EtcdBackend(etcd1.endpoints, prefix=prefix)
    try:
        big = {"blob": "x" * (MAX_CONFIG_BYTES - 20)}
        assert len(json.dumps(big)) <= MAX_CONFIG_BYTES
        store = ConfigStore(job="j", backend=backend)
        commit(store, "put", {"small": 1}, source="t")
        commit(store, "put", big, source="t")
        commit(store, "patch", {"blob": "y"}, source="t")
        records = backend.load("j")
        assert records.unresolved == {2}
        reopened = ConfigStore(job="j", backend=backend)
        assert reopened.get(2).config == big
        assert reopened.get(3).config == {"blob": "y"}
        assert reopened.live() == {"blob": "y"}
    finally:
        backend.close()


def test_the_job_step_is_the_highest_any_lighthouse_stored(backends: list[EtcdBackend]) -> None:
    a, b = backends
    a.set_meta("j", {"current_step": "100"})
    b.set_meta("j", {"current_step": "40"})
    a.close()  # flushes its queue
    b.close()
    fresh = EtcdBackend(a.client.endpoints, prefix=a.prefix)
    try:
        assert fresh.load("j").meta["current_step"] == "100"
    finally:
        fresh.close()


def test_a_registry_serves_what_another_lighthouse_committed(backends: list[EtcdBackend]) -> None:
    a, b = backends
    here, there = JobRegistry(a), JobRegistry(b)
    try:
        there.default.change("put", {"lr": 1}, source="api")
        poll(lambda: here.default.snapshot.version == 1, 5, what="the edit on the other lighthouse")
        assert here.default.snapshot.config == {"lr": "1"}
        there.serve("newjob").change("put", {"x": 1}, source="api")
        poll(lambda: here.get("newjob") is not None and here.get("newjob").store.head == 1, 5, what="new job")  # type: ignore[union-attr]
        for step in (10, 11):  # steps close together: the last one is shared too
            there.default.store.advance_step(step)  # a manager of the other lighthouse reported it
        poll(lambda: here.default.store.current_step == 11, 5, what="the shared job step")
        assert here.default.view()["current_step"] == 11
        guard = {"version": 1, "metric": "loss", "factor": 1.5, "effective_step": 12, "steps": 200}
        b.save_guard(DEFAULT_JOB, {**guard, "status": "active"})
        listed = lambda: [g["version"] for g in here.default.guards.list()]  # noqa: E731
        poll(lambda: listed() == [1], 5, what="a guard stored through the other lighthouse")
        b.drop_guards(DEFAULT_JOB, [1])
        poll(lambda: listed() == [], 5, what="the guard dropped through the other lighthouse")
    finally:
        here.close()
        there.close()


def test_a_guard_written_elsewhere_reloads_the_guards_not_the_job(backends: list[EtcdBackend]) -> None:
    """A guard's keys (made, given its baseline, decided, dropped) call ``on_guards`` alone: a reload
    of the job read every kept version again, three times per guarded change, the writer's too."""
    watcher, writer = backends
    store = ConfigStore(job="j", backend=writer)
    commit(store, "put", {"lr": 1}, source="t")
    changed: list[tuple[str, int]] = []
    guarded: list[str] = []
    watcher.subscribe(
        lambda job, head: changed.append((job, head)), lambda job, step: None, lambda *_: None, guarded.append
    )
    poll(lambda: changed == [("j", 1)], 10, what="the commit's head")
    writer.save_guard("j", {"version": 1, "metric": "loss", "factor": 1.5, "status": "active"})
    poll(lambda: guarded == ["j"], 10, what="the guard's event")
    writer.drop_guards("j", [1])
    poll(lambda: guarded == ["j", "j"], 10, what="the drop's event")
    commit(store, "put", {"lr": 2}, source="t")  # events come in order: every guard event is in
    poll(lambda: changed[-1] == ("j", 2), 10, what="the next commit's head")
    assert changed == [("j", 1), ("j", 2)] and guarded == ["j", "j"]  # no reload for the guards


def test_a_watch_that_missed_compacted_revisions_reloads_every_job(
    etcd1: EtcdCluster, backends: list[EtcdBackend]
) -> None:
    late, writer = backends  # ``late`` read the store before the writes below
    store = ConfigStore(job="j", backend=writer)
    for i in range(3):
        commit(store, "put", {"i": i}, source="t")
    revision = writer.client.get("/").revision
    with grpc.insecure_channel(etcd1.endpoints.split(",")[0]) as channel:
        rpc_pb2_grpc.KVStub(channel).Compact(rpc_pb2.CompactionRequest(revision=revision, physical=True))
    changed: list[tuple[str, int]] = []
    late.subscribe(lambda job, head: changed.append((job, head)), lambda job, step: None, lambda *_: None)
    poll(lambda: ("j", -1) in changed, 10, what="a reload of every job after the compaction")


# ------------------------------------------------------------------ lease ceilings across lives

# A lighthouse life in a child process: it promises steps of job j, prints the horizon, then waits
# to be killed (SIGKILL: no close, its ceiling key is left to expire with its etcd lease).
CRASHING_LIFE = """
import sys, threading
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.etcd import EtcdBackend
endpoints, prefix, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
holder = []
def write(book):
    wanted = book.wanted
    holder[0].save_lease_ceiling(wanted, book.served_version)
    book.ceiling_stored(wanted)
backend = EtcdBackend(endpoints, prefix=prefix, ceiling_lease_ttl=1.0)
store = ConfigStore(backend, job="j", request_ceiling=write)
holder.append(store)
store.leases.publish("snapshot", store.head)
store.advance_step(step)
store.leases.grant(step, 1.0)
print(store.leases.grant(step, 1.0)[1], flush=True)
threading.Event().wait()
"""


def etcd_store_with_ceilings(etcd1: EtcdCluster, prefix: str) -> ConfigStore:
    """A lighthouse life on ``prefix``: its ceiling writes are stored at once (the lighthouse does
    it in a thread)."""
    holder: list[ConfigStore] = []

    def write(book: Any) -> None:
        wanted = book.wanted
        holder[0].save_lease_ceiling(wanted, book.served_version)
        book.ceiling_stored(wanted)

    backend = EtcdBackend(etcd1.endpoints, prefix=prefix, ceiling_lease_ttl=1.0)
    store = ConfigStore(backend, job="j", request_ceiling=write)
    holder.append(store)
    store.leases.publish("snapshot", store.head)
    return store


@pytest.mark.slow
def test_lighthouse_lives_leave_a_bounded_number_of_ceiling_keys_and_every_promise_holds(
    etcd1: EtcdCluster, prefix: str
) -> None:
    """Each life's ceiling key lives on its etcd lease (revoked at close, expiring after a crash);
    the job's one floor key keeps what every life promised: a restarted lighthouse and a peer that
    starts later both commit a change made now above every promise ever made. Keys an older release
    left without a lease are folded into the floor."""
    ceilings = f"{prefix}/jobs/j/meta/lease_ceiling"
    client = EtcdBackend(etcd1.endpoints, prefix=prefix).client
    try:
        keys = lambda: [kv.key.decode()[len(ceilings) :] for kv in client.get(ceilings, prefix=True).kvs]  # noqa: E731
        client.put(f"{ceilings}/an-old-release-life", "50")  # never deleted by that release
        promised, step, lives = 50, 1000, 8
        killed: set[str] = set()
        for life in range(lives):
            if life == lives // 2:  # one life is killed: no close, nothing revoked
                proc = subprocess.Popen(
                    [sys.executable, "-c", CRASHING_LIFE, etcd1.endpoints, prefix, str(step)],
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                    env=child_env(),
                )
                try:
                    assert proc.stdout is not None
                    horizon = int(proc.stdout.readline())
                    assert horizon > step  # it promised past its step
                    killed = set(keys()) - {"_floor"}
                    assert len(killed) == 1  # beside the floor, its own key only
                finally:
                    proc.kill()
                    proc.wait()
                promised, step = horizon, step + 1000
                continue
            store = etcd_store_with_ceilings(etcd1, prefix)
            try:
                assert store.leases.floor >= promised  # it knows every earlier life's promise
                if store.head == 0:
                    commit(store, "put", {"lr": 0.0}, source="t")
                row = commit(store, "patch", {"lr": float(life)}, source="t")
                assert row.effective_step is not None and row.effective_step > promised
                store.leases.publish("snapshot", store.head)  # what the lighthouse serves now
                store.advance_step(step)
                store.leases.grant(step, 1.0)  # the first asks for a ceiling
                horizon = store.leases.grant(step, 1.0)[1]
                assert horizon > step and horizon > promised
                assert "an-old-release-life" not in "".join(keys())  # folded at the first load
                # The floor and this life's key, however many lived before (and, until its lease
                # expires, the killed life's key).
                assert set(keys()) - killed == {"_floor", "/" + store.owner}
                promised, step = horizon, step + 1000
            finally:
                store.close()
                store.backend.close()
        # The killed life's key expires with its lease; a closed life's went at once.
        poll(lambda: keys() == ["_floor"], 15, what="only the floor key left")
        assert int(client.get(ceilings + "_floor").kvs[0].value) >= promised
        late = etcd_store_with_ceilings(etcd1, prefix)  # a peer that starts after every life
        try:
            row = commit(late, "patch", {"lr": 99.0}, source="t")
            assert row.effective_step is not None and row.effective_step > promised
        finally:
            late.close()
            late.backend.close()
    finally:
        client.close()


def test_the_runs_record_is_changed_by_compare_and_set(backends: list[EtcdBackend]) -> None:
    """Two lighthouses that each saw no run live begin one (a group on each): the first record
    stored wins and the other follows it, rather than both writing a run of the same number from
    different steps (the chaos suite saw "run 4 began at step 1428" on one and "at step 1407" on
    the other, each serving its own). The same for an end the other lighthouse made first."""
    a, b = (ConfigStore(job="j", backend=x) for x in backends)
    commit(a, "put", {"lr": 0.1}, source="t")
    b.reload()
    assert a.begin_run(1407) is not None and b.begin_run(1428) is not None  # both, from their view
    # Each also writes its record in the background (a run begins on the gRPC path): whichever is
    # stored first wins, a's or b's (a loaded host once stored b's before a's flush), and the other,
    # comparing the record it began from, follows it.
    a.flush_runs()
    b.flush_runs()
    stored = [(r.number, r.start_step) for r in ConfigStore(job="j", backend=backends[0]).runs.runs]
    assert stored in ([(1, 1407)], [(1, 1428)]), stored
    first, second = (a, b) if stored == [(1, 1407)] else (b, a)
    for store in (first, second):
        assert (
            store.runs.live is not None and [(store.runs.live.number, store.runs.live.start_step)] == stored
        )
    ended = first.end_run("operator")
    assert ended is not None and ended.end_reason == "operator"
    assert second.runs.live is not None  # it has not read the end yet
    assert second.end_run("managers gone") is None  # the end is stored: it follows, ends nothing of its own
    assert second.runs.live is None and second.runs.last is not None
    assert second.runs.last.end_reason == "operator"


def test_a_lighthouse_whose_feature_record_expired_is_not_taken_for_an_earlier_release(
    etcd1: EtcdCluster, prefix: str
) -> None:
    """Found by the chaos suite: a lighthouse cut off from etcd for longer than its lease lost its
    feature record, published its managers summary again before the record, and meanwhile every
    other lighthouse suspended step leases ("an earlier release"): changes applied at once, inside
    promises. What an instance honours is known for its whole life; an instance never seen with a
    record (a release before records) still suspends them."""
    from lighthouse.etcd.client import EtcdClient
    from lighthouse.peers.features import FeatureRecords

    gate = LeaseGate()
    peers = {"cut-off": "127.0.0.1:1", "old": "127.0.0.1:2"}
    with EtcdClient(etcd1.endpoints) as client:
        records = FeatureRecords(client, prefix, "me", "127.0.0.1:3", gate, lambda: dict(peers))
        record = json.dumps({"level": 4, "features": ["step-leases", "ceilings", "ordered-commits", "runs"]})
        records._take(f"{records.root}cut-off".encode(), record.encode())
        records.decide()
        assert gate.suspended_by == ("127.0.0.1:2",)  # "old" never wrote one: an earlier release
        del peers["old"]
        records.decide()
        assert gate.suspended_by == ()
        records._take(f"{records.root}cut-off".encode(), None)  # its lease expired: the key is gone
        records.decide()  # its managers summary is back before its record
        assert gate.suspended_by == ()


def test_a_commit_planned_between_runs_plans_again_when_a_run_began_meanwhile(
    backends: list[EtcdBackend],
) -> None:
    """Found by the chaos suite (seed 4 replayed): a lighthouse that had not yet read the run another
    one began committed a change made "at once" (between runs), 2 ms after that run's first
    leases were promised: every group went on training the promised config at steps where the
    history says the change applied. A commit compares the runs record it was planned under."""
    a, b = (ConfigStore(job="j", backend=x) for x in backends)
    commit(a, "put", {"lr": 0.1}, source="t")
    assert a.begin_run(10) is not None
    a.flush_runs()
    assert a.end_run("operator") is not None
    b.reload()
    assert b.runs.between  # b saw the run end
    assert a.begin_run(40) is not None
    a.flush_runs()  # the next run is stored; b has not read it
    assert b.runs.between
    plan = commit(b, "patch", {"lr": 0.2}, source="t")
    # Its first plan (at once, between runs) was refused by the store; it read the run and planned
    # again in it, ordered after the run's step (a change at once between runs sorts at -1).
    assert b.runs.live is not None and b.runs.live.start_step == 40
    assert plan.order_step >= 40, plan


def test_a_lighthouse_that_did_not_hear_the_groups_does_not_end_their_run(
    backends: list[EtcdBackend],
) -> None:
    """Found by the chaos suite: a lighthouse cut off from etcd saw its managers leave (for the other
    lighthouse) and ended the run "managers gone" from its stale view, naming a head that missed
    three versions committed meanwhile. Such an end is refused while the job's stored step shows
    the groups stepping elsewhere, and whenever the head moved past the one it names."""
    a, b = (ConfigStore(job="j", backend=x) for x in backends)
    commit(a, "put", {"lr": 0.1}, source="t")
    assert a.begin_run(0) is not None
    a.flush_runs()
    b.reload()
    a.advance_step(500)  # the groups step on through a (stored in the background)
    poll(lambda: backends[1].stored_step("j") >= 500, 5, what="the job's step stored")
    assert b.end_run("managers gone", idle_only=True) is None
    assert b.runs.live is not None and b.current_step == 500  # b took the job's step instead
    commit(a, "patch", {"lr": 0.2}, source="t")  # b has not read it
    assert b.end_run("operator") is None  # its end names a head the store is past: refused
    assert b.runs.live is not None
    b.reload()
    ended = b.end_run("operator")
    assert ended is not None and ended.end_version == a.head
