"""ConfigStore (versioned store, resolve semantics) and the change paths of LighthouseState.

Every test that takes ``open_store`` (or ``store``) runs on both backends: SQLite and a real
etcd (one prefix per test). Tests about the SQLite file itself say so and take paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lighthouse.client import LighthouseClient
from lighthouse.config.files import FileContent, read_config_file
from lighthouse.config.values import ConfigError
from lighthouse.jobs.guards import GuardWatch, JobGuards
from lighthouse.jobs.series import JobSeries
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import FOREVER, ConfigStore, NotFound, VersionConflict
from lighthouse.server import LighthouseServer
from lighthouse.store.backend import Change, StoreBackend
from lighthouse.store.etcd import EtcdBackend
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb
from tests.procs import poll
from tests.store_edits import commit

StoreOpener = Callable[..., ConfigStore]


@pytest.fixture(params=["sqlite", "etcd"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreOpener]:
    """``open_store(name=None, history_limit=None, keep_steps=None)``: a store; the same ``name``
    reopens the same records (a SQLite file, or an etcd prefix), as a restarted lighthouse would;
    no name: a fresh one.

    Reopening first closes the backend the previous store of that name used (a restarted
    lighthouse's previous process is gone: its queued writes are flushed, its lock released).
    """
    backends: dict[str, StoreBackend] = {}
    endpoints = request.getfixturevalue("etcd1").endpoints if request.param == "etcd" else ""
    run = uuid.uuid4().hex

    def open_(
        name: str | None = None, history_limit: int | None = None, keep_steps: int | None = None
    ) -> ConfigStore:
        fresh = name is None
        name = name or uuid.uuid4().hex
        if name in backends:
            backends[name].close()
        backend: StoreBackend
        if request.param == "sqlite":
            backend = SqliteBackend(None if fresh else tmp_path / f"{name}.db")
        else:
            backend = EtcdBackend(endpoints, prefix=f"/test-store/{run}/{name}")
        backends[name] = backend
        return ConfigStore(backend, history_limit=history_limit, keep_steps=keep_steps)

    yield open_
    for backend in backends.values():
        backend.close()


@pytest.fixture
def store(open_store: StoreOpener) -> ConfigStore:
    return open_store()


def put(store: ConfigStore, config: dict[str, Any], **kw: Any) -> int:
    return commit(store, "put", config, source="test", **kw).version


def patch(store: ConfigStore, change: dict[str, Any], **kw: Any) -> int:
    return commit(store, "patch", change, source="test", **kw).version


# ------------------------------------------------------------------ versions and durability


def test_empty_store(store: ConfigStore) -> None:
    assert store.head == 0
    assert store.latest() is None
    assert store.live() == {}
    assert store.resolve(0, 0) == {}
    assert store.history() == []
    assert store.current_step == -1
    assert [(s.from_step, s.config) for s in store.segments()] == [(0, {})]


def test_versions_increase_by_one_and_rows_are_complete(store: ConfigStore) -> None:
    v1 = put(store, {"a": 1})
    row = commit(store, "patch", {"b": "x"}, source="api", author="alice", comment="why")
    assert (v1, row.version) == (1, 2)
    assert store.head == 2
    assert row.op == "patch" and row.change == {"b": "x"} and row.config == {"a": 1, "b": "x"}
    assert (row.source, row.author, row.comment, row.effective_step) == ("api", "alice", "why", None)
    assert store.latest() == row
    assert store.get(1).config == {"a": 1}


def test_versions_strictly_increase_across_reopen(open_store: StoreOpener) -> None:
    seen: list[int] = []
    state_ids: set[str] = set()
    for round_ in range(3):
        s = open_store("db")
        state_ids.add(s.state_id)
        assert s.head == (seen[-1] if seen else 0)
        for i in range(3):
            seen.append(put(s, {"round": round_, "i": i}))
        s.close()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert len(state_ids) == 1  # same records, same state
    s = open_store("db")
    assert s.live() == {"round": 2, "i": 2}
    assert [h["version"] for h in s.history()] == seen[::-1]
    s.close()
    assert open_store("other").state_id not in state_ids  # a fresh state


def test_versions_never_reused_after_pruning_and_reopen(open_store: StoreOpener) -> None:
    s = open_store("db", history_limit=1)
    last = 0
    for i in range(5):
        last = put(s, {"i": i})
    s.close()
    s = open_store("db", history_limit=1)
    assert s.head == last
    assert put(s, {"i": "next"}) == last + 1
    s.close()


def test_a_change_reads_back_field_for_field(store: ConfigStore) -> None:
    """Every field of a Change, each with a value no other field has, comes back in its own field."""
    row = Change(
        version=1,
        op="patch",
        change={"a": 1},
        config={"a": 1, "b": 2},
        effective_step=7,
        order_step=5,
        created_at=1234.5,
        source="api",
        author="ann",
        comment="why",
        made_now=True,
    )
    store.backend.append("round-trip", [row], {}, expected_head=0)
    assert store.backend.load("round-trip").rows == [row]
    later = dataclasses.replace(row, version=2, effective_step=None, made_now=False, config={"c": None})
    store.backend.append("round-trip", [later], {}, expected_head=1)
    assert store.backend.load("round-trip").rows == [row, later]


def test_commit_is_durable_without_close(tmp_path: Path) -> None:
    """SQLite only: reads the database file with another connection."""
    db = tmp_path / "lighthouse.db"
    s = ConfigStore(SqliteBackend(db))
    put(s, {"k": "v"})
    # Another connection sees the committed row at once (what a crash would leave on disk).
    rows = sqlite3.connect(str(db)).execute("SELECT version, config FROM job_versions").fetchall()
    assert rows == [(1, json.dumps({"k": "v"}))]
    s.close()
    s.backend.close()


def test_current_step_survives_reopen(open_store: StoreOpener) -> None:
    s = open_store("db")
    assert s.advance_step(5) is True
    assert s.advance_step(3) is False
    assert s.advance_step(5) is False
    assert s.current_step == 5
    s.close()
    s2 = open_store("db")
    assert s2.current_step == 5
    s2.close()


def test_unicode_and_nested_values_round_trip(open_store: StoreOpener) -> None:
    config = {"学习率": 0.5, "émoji🚀": {"nested": [1, None, {"ключ": "значение"}]}, "s": "ü"}
    s = open_store("db")
    put(s, config)
    s.close()
    s = open_store("db")
    assert s.live() == config
    s.close()


def test_close_twice_is_safe(open_store: StoreOpener) -> None:
    s = open_store("x")
    s.close()
    s.close()


def test_bad_arguments(store: ConfigStore) -> None:
    with pytest.raises(ValueError, match="history_limit"):
        ConfigStore(store.backend, history_limit=0)
    with pytest.raises(ValueError, match="unknown op"):
        commit(store, "replace", {}, source="t")
    with pytest.raises(ConfigError, match="effective_step"):
        commit(store, "put", {}, source="t", effective_step=-1)
    assert store.head == 0  # nothing committed by refused calls
    with pytest.raises(NotFound):
        store.get(1)


# ------------------------------------------------------------------ put / patch / if-match


def test_put_replaces_patch_merges_null_deletes(store: ConfigStore) -> None:
    put(store, {"a": 1, "b": 2, "c": {"x": 1}})
    patch(store, {"b": 3, "d": "new", "c": {"y": 2}})  # merge is shallow: c is replaced
    assert store.live() == {"a": 1, "b": 3, "c": {"y": 2}, "d": "new"}
    patch(store, {"a": None, "missing": None})
    assert store.live() == {"b": 3, "c": {"y": 2}, "d": "new"}
    put(store, {"only": True})
    assert store.live() == {"only": True}
    assert [store.get(v).config for v in (1, 2, 3, 4)] == [
        {"a": 1, "b": 2, "c": {"x": 1}},
        {"a": 1, "b": 3, "c": {"y": 2}, "d": "new"},
        {"b": 3, "c": {"y": 2}, "d": "new"},
        {"only": True},
    ]


def test_patch_on_empty_store(store: ConfigStore) -> None:
    patch(store, {"a": 1})
    assert store.live() == {"a": 1}


def test_if_match(store: ConfigStore) -> None:
    put(store, {"a": 1})
    put(store, {"a": 2}, if_match=1)
    with pytest.raises(VersionConflict) as err:
        put(store, {"a": 3}, if_match=1)
    assert err.value.head == 2
    assert "1" in str(err.value) and "2" in str(err.value)
    assert store.head == 2 and store.live() == {"a": 2}


def test_history_newest_first_with_limit(store: ConfigStore) -> None:
    for i in range(5):
        commit(store, "put", {"i": i}, source="api", author=f"u{i}", comment=f"c{i}")
    history = store.history(limit=3)
    assert [h["version"] for h in history] == [5, 4, 3]
    first = history[0]
    assert first["config"] == {"i": 4} and first["author"] == "u4" and first["comment"] == "c4"
    assert first["source"] == "api" and isinstance(first["created_at"], float)
    assert {"version", "config", "created_at", "source", "author", "comment"} <= set(first)
    assert len(store.history()) == 5


# ------------------------------------------------------------------ scheduled changes and resolve


def test_scheduled_change_applies_from_its_step(store: ConfigStore) -> None:
    put(store, {"lr": 1, "a": 1})
    store.advance_step(10)
    v2 = patch(store, {"lr": 2}, effective_step=100)
    assert store.get(v2).scheduled
    assert store.resolve(v2, 10) == {"lr": 1, "a": 1}
    assert store.resolve(v2, 99) == {"lr": 1, "a": 1}
    assert store.resolve(v2, 100) == {"lr": 2, "a": 1}
    assert store.resolve(v2, FOREVER) == {"lr": 2, "a": 1}
    assert store.get(v2).config == {"lr": 2, "a": 1}  # row.config: once everything known applies
    assert store.live() == {"lr": 1, "a": 1}  # the job is at step 10
    assert [(s.from_step, s.config) for s in store.segments()] == [
        (0, {"lr": 1, "a": 1}),
        (100, {"lr": 2, "a": 1}),
    ]
    assert store.resolve(1, 100) == {"lr": 1, "a": 1}  # older versions do not see it
    store.advance_step(100)
    assert store.live() == {"lr": 2, "a": 1}


def test_edit_before_the_step_does_not_undo_a_scheduled_change(store: ConfigStore) -> None:
    put(store, {"lr": 1, "a": 1})
    store.advance_step(10)
    patch(store, {"lr": 2}, effective_step=100)
    store.advance_step(20)
    v3 = put(store, {"x": 1})  # unrelated full replace made at step 20 < 100
    assert store.resolve(v3, 50) == {"x": 1}
    assert store.resolve(v3, 100) == {"x": 1, "lr": 2}  # the scheduled patch lands on top
    v4 = patch(store, {"lr": 3})  # an immediate edit of the same key at step 20
    assert store.resolve(v4, 50) == {"x": 1, "lr": 3}
    assert store.resolve(v4, 100) == {"x": 1, "lr": 2}  # still scheduled after it


def test_edit_after_the_step_overrides_the_scheduled_change(store: ConfigStore) -> None:
    put(store, {"lr": 1})
    patch(store, {"lr": 2}, effective_step=100)
    store.advance_step(150)
    v3 = patch(store, {"lr": 4})
    assert store.resolve(v3, 200) == {"lr": 4}
    assert store.resolve(v3, 120) == {"lr": 4}  # an immediate change applies to every step
    assert store.live() == {"lr": 4}


def test_scheduled_put_replaces_from_its_step(store: ConfigStore) -> None:
    put(store, {"a": 1, "b": 1})
    v2 = put(store, {"c": 3}, effective_step=50)
    assert store.resolve(v2, 49) == {"a": 1, "b": 1}
    assert store.resolve(v2, 50) == {"c": 3}


def test_two_scheduled_changes_give_three_segments(store: ConfigStore) -> None:
    put(store, {"lr": 1})
    patch(store, {"lr": 3}, effective_step=300)
    patch(store, {"lr": 2}, effective_step=200)
    assert [(s.from_step, s.config) for s in store.segments()] == [
        (0, {"lr": 1}),
        (200, {"lr": 2}),
        (300, {"lr": 3}),
    ]
    assert [(s.from_step, s.config) for s in store.segments(2)] == [(0, {"lr": 1}), (300, {"lr": 3})]
    assert [(s.from_step, s.config) for s in store.segments(1)] == [(0, {"lr": 1})]


def test_scheduled_at_step_already_passed_applies_everywhere_after(store: ConfigStore) -> None:
    put(store, {"lr": 1})
    store.advance_step(500)
    v = patch(store, {"lr": 9}, effective_step=100)
    assert store.resolve(v, 500) == {"lr": 9}
    assert store.resolve(v, 99) == {"lr": 1}
    assert store.live() == {"lr": 9}


def test_scheduled_statuses(store: ConfigStore) -> None:
    put(store, {"lr": 1})
    v_a = patch(store, {"lr": 2}, effective_step=10)
    v_b = patch(store, {"lr": 3}, effective_step=20)
    v_c = patch(store, {"lr": 4}, effective_step=30)
    commit(store, "cancel", {"version": v_c}, source="t")
    store.advance_step(15)
    status = {s["version"]: s["status"] for s in store.scheduled()}
    assert status == {v_a: "in_effect", v_b: "pending", v_c: "cancelled"}


# ------------------------------------------------------------------ cancel


def test_a_change_that_leaves_the_config_as_it_was_still_names_its_steps(store: ConfigStore) -> None:
    """A segment is named by the newest change with an effect at its first step, so a change whose
    config equals the one before starts a segment too: merged into the one before, its steps were
    named by the change before, until the fold passed its step and named them by it (two groups
    switched versions one step apart: benchmarks/month on etcd)."""
    put(store, {"lr": 1})
    same = patch(store, {"lr": 1}, effective_step=100)
    other = patch(store, {"lr": 2}, effective_step=200)
    named = [(s.from_step, s.config, s.version) for s in store.segments()]
    assert named == [(0, {"lr": 1}, 1), (100, {"lr": 1}, same), (200, {"lr": 2}, other)]
    patch(store, {"lr": 2}, effective_step=300)
    assert store.from_step() == 200  # the head's config comes at 200, not at the no-op's 300


def test_cancel_withdraws_a_pending_change(store: ConfigStore) -> None:
    put(store, {"lr": 1})
    v2 = patch(store, {"lr": 2}, effective_step=100)
    cancel = commit(store, "cancel", {"version": v2}, source="t")
    assert cancel.version == 3 and cancel.config == {"lr": 1}
    assert store.resolve(3, 200) == {"lr": 1}
    assert store.resolve(2, 200) == {"lr": 2}  # history still replays the version before the cancel
    # The cancel has its effect at 100: a segment starts there, same config, named by the cancel,
    # so step 100 is version 3's in every reply (named from 0 on, a reply built before the fold
    # passed 100 and one after would name it 1 and 3).
    assert [(s.from_step, s.config, s.version) for s in store.segments()] == [
        (0, {"lr": 1}, 1),
        (100, {"lr": 1}, 3),
    ]
    assert {h["version"]: h["cancelled"] for h in store.history()} == {3: False, 2: True, 1: False}


def test_cancel_refusals(store: ConfigStore) -> None:
    put(store, {"lr": 1})
    v2 = patch(store, {"lr": 2}, effective_step=100)
    v3 = patch(store, {"lr": 3}, effective_step=50)
    with pytest.raises(ConfigError, match="not a scheduled change"):
        commit(store, "cancel", {"version": 1}, source="t")
    with pytest.raises(NotFound):
        commit(store, "cancel", {"version": 99}, source="t")
    commit(store, "cancel", {"version": v2}, source="t")
    with pytest.raises(ConfigError, match="already cancelled"):
        commit(store, "cancel", {"version": v2}, source="t")
    store.advance_step(60)
    with pytest.raises(ConfigError, match="took effect at step 50"):
        commit(store, "cancel", {"version": v3}, source="t")
    assert store.head == 4  # only the one accepted cancel


def test_cancel_survives_reopen(open_store: StoreOpener) -> None:
    s = open_store("db")
    put(s, {"lr": 1})
    v2 = patch(s, {"lr": 2}, effective_step=100)
    commit(s, "cancel", {"version": v2}, source="t")
    s.close()
    s = open_store("db")
    assert s.resolve(s.head, 200) == {"lr": 1}
    with pytest.raises(ConfigError, match="already cancelled"):
        commit(s, "cancel", {"version": v2}, source="t")
    s.close()


# ------------------------------------------------------------------ history_limit pruning


def test_pruning_keeps_the_limit_and_the_content(open_store: StoreOpener) -> None:
    s = open_store("db", history_limit=3)
    put(s, {"a": 0, "keep": "me"})
    for i in range(1, 10):
        patch(s, {"a": i, f"k{i}": i})
    expected = {"a": 9, "keep": "me", **{f"k{i}": i for i in range(1, 10)}}
    assert s.live() == expected
    assert [h["version"] for h in s.history()] == [10, 9, 8]
    with pytest.raises(NotFound):
        s.get(1)
    with pytest.raises(NotFound, match="pruned"):
        s.resolve(2, 0)
    assert s.resolve(9, 0) == {k: v for k, v in expected.items() if k != "k9"} | {"a": 8}
    s.close()
    s = open_store("db", history_limit=3)  # the folded base is durable
    assert s.live() == expected
    assert len(s.history()) == 3
    s.close()


def test_pruning_never_drops_the_head(open_store: StoreOpener) -> None:
    s = open_store(history_limit=1)
    for i in range(5):
        patch(s, {"a": i}) if i else put(s, {"a": i})
        assert s.history()[0]["version"] == s.head
        assert len(s.history()) == 1
        assert s.live() == {"a": i}


def test_pruning_keeps_scheduled_changes_in_place(open_store: StoreOpener) -> None:
    s = open_store(history_limit=2)
    put(s, {"lr": 1})
    s.advance_step(10)
    v_sched = patch(s, {"lr": 2}, effective_step=100)
    for i in range(4):
        patch(s, {"other": i})
    head = s.head
    assert s.resolve(head, 50) == {"lr": 1, "other": 3}
    assert s.resolve(head, 100) == {"lr": 2, "other": 3}
    assert s.get(v_sched).effective_step == 100


def test_pruning_continues_after_a_cancelled_schedule(open_store: StoreOpener) -> None:
    # A cancelled scheduled change (and its cancel) no longer affects any step: it must not stop
    # --history-limit from bounding the history for the rest of the lighthouse's life.
    s = open_store(history_limit=3)
    put(s, {"a": 0})
    s.advance_step(10)
    v2 = patch(s, {"b": 1}, effective_step=50)
    commit(s, "cancel", {"version": v2}, source="t")
    for i in range(20):
        patch(s, {"a": i})
    assert s.live() == {"a": 19}
    assert len(s.history(limit=1000)) <= 3 + 2  # at most the limit (allow the cancel pair to linger)


def test_pruned_cancels_leave_nothing_behind(open_store: StoreOpener) -> None:
    # A controller that schedules a change and withdraws it, for weeks: once both are pruned, no
    # trace of them may stay in what every prune rewrites and every resolve reads (the set of
    # pruned cancels grew with the job's age, one entry per cancel ever made).
    s = open_store("db", history_limit=4)
    put(s, {"a": 0})
    s.advance_step(10)

    def withdraw(rounds: int) -> int:
        for _ in range(rounds):
            version = patch(s, {"b": 1}, effective_step=10**6)
            commit(s, "cancel", {"version": version}, source="t")
            patch(s, {"a": version})
        return len(json.dumps(s.backend.load(s.job).meta))

    early = withdraw(20)
    late = withdraw(200)
    assert late <= early + 16, (early, late)  # the version numbers grow a digit, not the meta
    assert len(s.history(limit=1000)) <= 4 + 2
    assert s.live() == {"a": s.head - 2}  # the last patch names the change withdrawn before it
    s.close()
    s = open_store("db", history_limit=4)  # the reopened store resolves as before
    assert s.live() == {"a": s.head - 2}
    assert s.resolve(s.head, 10**6) == {"a": s.head - 2}


def test_decided_guards_of_pruned_versions_are_forgotten(open_store: StoreOpener) -> None:
    # A controller guarding each of its changes for weeks: the guards of versions the history no
    # longer holds go once decided (from memory, the store and the list), as the watch looks;
    # an active one stays until decided, whatever its version.
    s = open_store("db", history_limit=5)
    guards = JobGuards(s, JobSeries(s.job), lambda *args, **kw: None)
    put(s, {"lr": 0})
    guarded = []
    for i in range(60):
        guarded.append(patch(s, {"lr": i + 1}))
        guards.add(
            {"version": guarded[-1], "metric": "loss", "factor": 2.0, "steps": 10, "effective_step": 0}
            | {"status": "active", "changes": {"lr": {"before": i, "after": i + 1}}}
        )
        if i > 0:
            guards.cancel(guarded[-1], "t")  # decided; the first stays active
    pruned_through = s.retention()["pruned_through"]
    assert pruned_through >= guarded[40]
    watch = GuardWatch(lambda: [guards], interval=0.02)
    watch.start()
    try:
        expected = {guarded[0]} | {v for v in guarded if v > pruned_through}
        poll(lambda: {g["version"] for g in guards.list()} == expected, 10, what="pruned guards forgotten")
    finally:
        watch.stop()
    assert {int(g["version"]) for g in s.backend.guards(s.job)} == expected
    s.close()
    s = open_store("db", history_limit=5)  # what a restarted lighthouse reads
    assert {g["version"] for g in JobGuards(s, JobSeries(s.job), lambda *args, **kw: None).list()} == expected


# ------------------------------------------------------------------ switches


def test_switches_and_served_at(store: ConfigStore) -> None:
    store.record_switches("g0", [(1, 0, -1), (2, 10, 9)])
    store.record_switches("g1", [(1, 0, -1), (2, 12, 11)])
    store.record_switches("g1", [(2, 12, 11)])  # duplicates ignored
    store.record_switches("g2", [])
    assert store.served_at(5) == {"g0": 1, "g1": 1}
    assert store.served_at(11) == {"g0": 2, "g1": 1}
    assert store.served_at(12) == {"g0": 2, "g1": 2}


# ------------------------------------------------------------------ LighthouseState: rollback, file hash


def state_with(store: ConfigStore, path: Path | None = None) -> LighthouseState:
    return LighthouseState(store, path)


def test_rollback_makes_a_new_version_with_old_content(store: ConfigStore) -> None:
    state = state_with(store)
    state.change("put", {"lr": 1, "name": "a"}, source="api")
    state.change("patch", {"lr": 2, "name": None}, source="api")
    row = state.rollback(1, author="bob").row
    assert row.version == 3
    assert row.config == {"lr": 1, "name": "a"}
    assert row.source == "rollback" and row.author == "bob" and "1" in row.comment
    assert store.live() == {"lr": 1, "name": "a"}
    assert state.snapshot.version == 3 and state.snapshot.config == {"lr": "1", "name": "a"}
    with pytest.raises(NotFound):
        state.rollback(99)
    assert store.head == 3


def test_rollback_cancels_pending_changes_made_after_the_target(store: ConfigStore) -> None:
    state = state_with(store)
    state.change("put", {"lr": 1}, source="api")
    state.change("patch", {"lr": 5}, source="api", effective_step=1000)
    state.rollback(1)
    assert store.resolve(store.head, 2000) == {"lr": 1}
    assert [s["status"] for s in store.scheduled()] == ["cancelled"]


def test_state_change_validates_and_refreshes_snapshot(store: ConfigStore) -> None:
    state = state_with(store)
    assert state.snapshot.version == 0 and state.snapshot.config == {}
    state.change("put", {"lr": 0.001, "n": {"a": 1}}, source="api")
    assert state.snapshot.version == 1
    assert state.snapshot.config == {"lr": "0.001", "n": '{"a":1}'}
    with pytest.raises(ConfigError):
        state.change("put", {"": 1}, source="api")
    with pytest.raises(ConfigError):
        state.change("put", [1, 2], source="api")
    assert store.head == 1
    state.change("put", {"x": None}, source="api")  # null is a value in a put, served as "null"
    assert state.snapshot.config == {"x": "null"}


@pytest.mark.parametrize("backend", ["sqlite", "etcd"])
def test_get_config_is_conditional_on_version_and_state_id(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Through the real gRPC path: a manager holding the current version of this store's state is
    told ``not_modified``; the same version of another state (a fresh store) gets the config."""
    store_backend = (
        EtcdBackend(request.getfixturevalue("etcd1").endpoints, prefix=f"/test-store/{uuid.uuid4().hex}")
        if backend == "etcd"
        else SqliteBackend(tmp_path / "lh.db")
    )
    with LighthouseServer("127.0.0.1:0", backend=store_backend) as lh:
        state = lh.jobs.default
        state.change("put", {"k": "v"}, source="api")
        with LighthouseClient(lh.address()) as client:
            full = client.fetch(timeout=5)
            assert dict(full.config_data) == {"k": "v"} and full.version == 1 and not full.not_modified
            same = client.request(known_version=1, known_state_id=full.state_id)
            assert client.fetch(same, timeout=5).not_modified
            other_state = client.request(known_version=1, known_state_id="not-this-state")
            again = client.fetch(other_state, timeout=5)
        assert not again.not_modified and dict(again.config_data) == {"k": "v"}
        assert full.state_id == state.store.state_id
        assert state.get_config_calls == 3


def file_content(path: Path, text: str) -> FileContent:
    path.write_text(text, encoding="utf-8")
    return read_config_file(path)


def test_apply_file_only_on_new_content(tmp_path: Path, open_store: StoreOpener) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"lr": 1}')
    store = open_store("db")
    state = state_with(store, path)
    assert store.head == 1 and store.latest() is not None and store.latest().source == "file"  # type: ignore[union-attr]
    assert store.file_hash(str(path.resolve())) == hashlib.sha256(b'{"lr": 1}').hexdigest()

    assert state.apply_file(read_config_file(path)) is None  # same bytes: no new version
    assert store.head == 1

    plan = state.apply_file(file_content(path, '{"lr": 2}'))
    row = plan.row if plan else None
    assert row is not None and row.version == 2 and row.config == {"lr": 2} and row.source == "file"

    assert state.apply_file(file_content(path, '{"lr": ')) is None  # broken edit: live unchanged
    assert state.file_error is not None and str(path) in state.file_error
    assert store.head == 2 and store.live() == {"lr": 2}

    assert state.apply_file(file_content(path, '{"lr": 3}')) is not None
    assert state.file_error is None and store.live() == {"lr": 3}
    store.close()


def test_restart_with_unchanged_file_keeps_api_edits(tmp_path: Path, open_store: StoreOpener) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"lr": 1}')
    store = open_store("db")
    state = state_with(store, path)
    state.change("patch", {"lr": 7}, source="api")
    store.close()

    store = open_store("db")
    state = state_with(store, path)  # same file bytes: the stored (edited) version stays live
    assert store.head == 2 and store.live() == {"lr": 7}
    store.close()

    path.write_text('{"lr": 8}')
    store = open_store("db")
    state = state_with(store, path)  # the file changed while the lighthouse was down: it wins
    assert store.head == 3 and store.live() == {"lr": 8}
    assert state.snapshot.config == {"lr": "8"}
    store.close()


def test_invalid_file_at_startup_keeps_stored_config(tmp_path: Path, open_store: StoreOpener) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"lr": 1}')
    store = open_store("db")
    state_with(store, path)
    store.close()
    path.write_text("not json")
    store = open_store("db")
    state = state_with(store, path)
    assert store.live() == {"lr": 1}
    assert state.file_error is not None and str(path) in state.file_error
    store.close()
    with pytest.raises(ConfigError):
        LighthouseState(open_store(), path, strict=True)


def random_change(rnd: random.Random, stores: tuple[ConfigStore, ...], i: int, at: int) -> None:
    """The same random change on every store (the first tells what is pending): a patch scheduled
    at step ``at`` (none when it is negative), a cancel of a pending change, or a put or a patch
    (maybe a delete) made now. Values repeat (0): some change nothing at their step."""
    roll, key, value = rnd.random(), rnd.choice("xyz"), rnd.choice([i, 0])
    if roll < 0.3:
        if at >= 0:
            for st in stores:
                commit(st, "patch", {key: value}, source="t", effective_step=at)
    elif roll < 0.45:
        pending = [x["version"] for x in stores[0].scheduled() if x["status"] == "pending"]
        if pending:
            target = rnd.choice(pending)
            for st in stores:
                commit(st, "cancel", {"version": target}, source="t")
    else:
        op = rnd.choice(["patch", "patch", "put"])
        change = {key: None if op == "patch" and rnd.random() < 0.2 else value}
        for st in stores:
            commit(st, op, change, source="t")


@pytest.mark.parametrize("seed", range(60))
def test_pruning_never_changes_what_any_step_resolves_to(seed: int, open_store: StoreOpener) -> None:
    # Random histories of puts, patches (with deletes), scheduled changes, cancels and step
    # progress: a pruned store must resolve every step exactly like one that keeps everything,
    # also once reopened from its records.
    rnd = random.Random(seed)
    full, pruned = open_store(), open_store("pruned", history_limit=rnd.randint(1, 5))
    stores = (full, pruned)
    for st in stores:
        commit(st, "put", {"x": 0}, source="t")
    for i in range(40):
        if rnd.random() < 0.2:
            step = rnd.randint(0, 100)
            for st in stores:
                st.advance_step(step)
        else:
            random_change(rnd, stores, i, rnd.randint(0, 120))
        for step in (-1, 0, 10, 50, 99, 100, 120, 10**9):
            assert full.resolve(full.head, step) == pruned.resolve(pruned.head, step), (i, step)
    assert len(pruned.history(limit=1000)) <= len(full.history(limit=1000))
    pruned.close()
    reopened = open_store("pruned")
    for step in (-1, 0, 10, 50, 99, 100, 120, 10**9):
        assert full.resolve(full.head, step) == reopened.resolve(reopened.head, step), step


@pytest.mark.parametrize("seed", range(30))
def test_folding_resolves_every_kept_step_exactly_and_older_ones_as_the_fold(
    seed: int, open_store: StoreOpener
) -> None:
    # The same random histories, with the steps behind the job folded (keep_steps) and versions
    # pruned: every step at or above the fold step resolves as in a store that keeps everything,
    # every step below it as the fold step does; a reopened store (another lighthouse, a
    # restart) resolves alike. (The history's bound: test_a_months_history_keeps_...)
    rnd = random.Random(seed)
    keep, limit = rnd.randint(3, 20), rnd.choice([rnd.randint(1, 8), 1000])  # 1,000: never pruned
    full, folded = open_store(), open_store("folded", history_limit=limit, keep_steps=keep)
    stores = (full, folded)
    for st in stores:
        commit(st, "put", {"x": 0}, source="t")
    step, folds = 0, set()
    for i in range(60):
        roll, head = rnd.random(), folded.head
        if roll < 0.3:
            step += rnd.randint(0, 12)
            for st in stores:
                st.advance_step(step)
        else:
            random_change(rnd, stores, i, step + rnd.randint(-15, 20))
        fold = folded.fold_step  # moved by commits only: it may lag a step advanced since
        assert fold == -1 or fold <= step - keep, (fold, step, keep)
        if folded.head != head and step >= 2 * keep:  # a commit: it moved the fold if it lagged
            assert fold >= step - 2 * keep, (fold, step, keep)
        folds.add(fold)
        for at in {0, 1, fold, fold + 1, step - keep, step, step + 1, step + 25, 10**9}:
            if at >= 0:
                expected = full.resolve(full.head, max(at, fold))
                assert folded.resolve(folded.head, at) == expected, (i, at, fold)
        # The segments kept commit by commit (carried over a fold step that moved, extended by a
        # change) are those a lighthouse computes afresh from the store, names included.
        fresh = ConfigStore(folded.backend, history_limit=limit, keep_steps=keep)
        assert fresh.fold_step == fold
        assert fresh.segments() == folded.segments(), i
        assert len(folded.history(limit=1000)) <= len(full.history(limit=1000))
    assert len(folds) > 1 or step < 2 * keep, "the fold step never moved"
    fold = folded.fold_step
    folded.close()
    reopened = open_store("folded", history_limit=limit, keep_steps=keep)
    assert reopened.fold_step == fold
    for at in (0, fold, fold + 1, step, step + 25, 10**9):
        if at >= 0:
            assert reopened.resolve(reopened.head, at) == full.resolve(full.head, max(at, fold)), at


def test_a_resumed_run_gets_the_schedule_of_its_steps_again(open_store: StoreOpener) -> None:
    # A warm-up schedule the first run passed long ago (folded there) applies step by step again
    # in a run that resumes from a checkpoint before it: a run begins with no fold step.
    s = open_store(keep_steps=10)
    commit(s, "put", {"lr": 0.0}, source="t")
    for at in (10, 20, 30):
        commit(s, "patch", {"lr": at / 100}, source="t", effective_step=at)
    s.begin_run(0)
    for step in range(0, 500, 5):
        s.advance_step(step)
        commit(s, "patch", {"n": step}, source="t")
    assert s.fold_step >= 470 - 20
    assert s.resolve(s.head, 15) == s.resolve(s.head, s.fold_step), "a folded step resolves as the fold"
    s.end_run("operator")
    s.begin_run(12)  # resumed from a checkpoint at step 12
    assert s.fold_step == -1
    assert s.resolve(s.head, 12)["lr"] == 0.1
    assert s.resolve(s.head, 25)["lr"] == 0.2
    assert s.resolve(s.head, 30)["lr"] == 0.3


def test_the_fold_step_stays_below_the_group_furthest_behind(open_store: StoreOpener) -> None:
    # What the live run's groups may still ask for is kept: a group 80 steps behind the front
    # (keep_steps 10) still gets every step's config as scheduled; one more than LAG_KEPT x
    # keep_steps behind (a made-up replica reporting an old step, say) holds nothing back.
    store = open_store(keep_steps=10)
    state = LighthouseState(store)
    commit(store, "put", {"lr": -1}, source="t")

    def step_to(front: int, slow: int) -> None:
        for replica, step in (("front", front), ("slow", slow)):
            state.observe(pb.ManagerStatus(replica_id=replica, step=step), "peer", fetch=True)
        commit(store, "patch", {"lr": front}, source="t", effective_step=front + 1)

    for front in range(0, 300, 5):
        step_to(front, min(front, 220))
    assert 100 <= store.fold_step < 220, store.fold_step  # it moved, and not past the slow group
    assert state.lowest_group_step() == 220
    for at in (220, 221, 250, 296):
        assert store.resolve(store.head, at) == {"lr": (at - 1) // 5 * 5}, at
    for front in range(300, 500, 5):
        step_to(front, 220)
    assert store.fold_step >= 495 - 10 * 10 - 10, store.fold_step


def test_a_months_history_keeps_the_segments_and_rows_bounded(open_store: StoreOpener) -> None:
    # A controller's change every 10 steps for 3,000 changes: the per-step segments stay those of
    # the kept steps (one per change within 2x keep_steps, and the fold's), the rows within the
    # history limit and its slack.
    s = open_store(history_limit=200, keep_steps=100)
    commit(s, "put", {"lr": 0}, source="t")
    for i in range(1, 3000):
        s.advance_step(10 * i)
        commit(s, "patch", {"lr": i}, source="t", effective_step=10 * i + 2)
        assert len(s.history(limit=10**5)) <= 220
    assert len(s.segments()) <= 2 * 100 // 10 + 2
    assert s.resolve(s.head, 0) == s.resolve(s.head, s.fold_step)
    assert s.resolve(s.head, 29_992) == {"lr": 2999}
    assert s.resolve(s.head, 29_991) == {"lr": 2998}


def test_late_groups_are_those_that_served_steps_past_s_with_an_older_version(store: ConfigStore) -> None:
    commit(store, "put", {"lr": 1}, source="t")
    scheduled = commit(store, "patch", {"lr": 2}, source="t", effective_step=100).version
    store.record_switches("on-time", [(1, 0, -1), (scheduled, 50, 49)])  # knew before S
    store.record_switches("late", [(1, 0, -1), (scheduled, 130, 129)])  # served 100..129 without it
    store.record_switches("jumped", [(1, 0, -1), (scheduled, 150, 19)])  # restored past S: never served old
    store.record_switches("fresh", [(scheduled, 400, -1)])  # started after S
    store.advance_step(400)
    (item,) = store.scheduled()
    assert item["late_groups"] == [{"replica_id": "late", "switched_at_step": 130, "late_by_steps": 30}]


def test_pruning_also_bounds_the_step_switches(open_store: StoreOpener) -> None:
    s = open_store(history_limit=3)
    commit(s, "put", {"a": 0}, source="t")
    for i in range(1, 60):
        commit(s, "patch", {"a": i}, source="t")
        s.record_switches("g", [(s.head, i * 10, i * 10 - 1)])
    count = len(s.backend.switches(s.job))
    assert count <= 4  # the retained versions' switches and one before them
    assert s.served_at(10**6) == {"g": s.head}
    assert s.served_at(s.head * 10 - 15) == {"g": s.head - 1}
