"""``lighthouse migrate``: a SQLite history copied record for record into an empty store, never into one
that holds data."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from lighthouse.jobs.versions import FOREVER, ConfigStore
from lighthouse.store.etcd import EtcdBackend
from lighthouse.store.migrate import CopiedJob, CopyMismatch, TargetNotEmpty, check, migrate
from lighthouse.store.sqlite import SqliteBackend
from tests.etcd_cluster import EtcdCluster, require_etcd
from tests.procs import ProcessPool, child_env
from tests.store_edits import commit


def make_state(state_dir: Path) -> Path:
    """Two jobs: 'default' with a pruned history (folded base, a pruned cancel), a pending scheduled
    change, a job step, step switches and a file hash; 'llm' with its own versions, switches,
    two schema changes and a guarded change's guard."""
    db = state_dir / "lighthouse.db"
    backend = SqliteBackend(db)
    s = ConfigStore(job="default", backend=backend, history_limit=3)
    commit(s, "put", {"lr": 0.1, "bs": 32}, source="api", author="alice", comment="first")
    commit(s, "patch", {"lr": 0.2}, source="api")
    at50 = commit(s, "patch", {"bs": 64}, source="api", effective_step=50)
    at80 = commit(s, "patch", {"wd": 0.1}, source="api", effective_step=80)
    s.advance_step(60)
    s.record_switches("g0", [(1, 0, -1), (at50.version, 50, 49)])
    commit(s, "cancel", {"version": at80.version}, source="api")
    commit(s, "patch", {"lr": 0.3, "name": "ünï"}, source="file", comment="cfg.json")
    commit(s, "put", {"lr": 0.4, "bs": 64, "nested": {"a": [1, None]}}, source="rollback")
    commit(s, "patch", {"x": 1}, source="api", effective_step=100)
    s.record_switches("g1", [(7, 61, 60)])
    s.set_file_hash("/etc/cfg.json", "abc")
    s.close()
    llm = ConfigStore(job="llm", backend=backend)
    commit(llm, "put", {"lr": 3e-4}, source="api", author="bob")
    commit(llm, "patch", {"warmup": 100}, source="api", effective_step=10)
    llm.advance_step(12)
    llm.record_switches("w0", [(1, 0, -1), (2, 10, 9)])
    llm.set_schema({"type": "object"}, source="api", author="carol")
    llm.set_schema({"type": "object", "required": ["lr"]}, source="file", comment="llm.schema.json")
    llm.close()
    backend.save_guard("llm", {"version": 2, "metric": "loss", "factor": 1.5, "status": "passed"})
    meta = backend.load("default").meta
    assert [r.version for r in backend.load("default").rows] == [6, 7, 8]  # the first 5 were pruned
    assert "base" in meta
    backend.close()
    return db


def test_migrate_copies_every_job_exactly(tmp_path: Path) -> None:
    source = SqliteBackend(make_state(tmp_path))
    target = SqliteBackend(None)
    assert target.is_empty()
    copied = migrate(source, target)
    assert copied == [CopiedJob("default", 3, 6, 8, 2), CopiedJob("llm", 2, 1, 2, 2)]
    assert target.jobs() == source.jobs() == ["default", "llm"]
    for job in ("default", "llm"):
        assert target.load(job) == source.load(job)  # rows (version numbers included) and meta
        assert target.switches(job) == source.switches(job)
        assert target.guards(job) == source.guards(job)
        before, after = ConfigStore(job=job, backend=source), ConfigStore(job=job, backend=target)
        assert after.history() == before.history()
        assert after.segments() == before.segments() and after.scheduled() == before.scheduled()
        assert (after.state_id, after.current_step, after.head) == (
            before.state_id,
            before.current_step,
            before.head,
        )
        for step in (0, 49, 50, 79, 80, 100, FOREVER):
            assert after.resolve(after.head, step) == before.resolve(before.head, step)
    # The next version continues the source's numbering.
    store = ConfigStore(job="default", backend=target)
    assert commit(store, "patch", {"y": 2}, source="api").version == 9


def test_check_finds_a_record_that_differs(tmp_path: Path) -> None:
    source = SqliteBackend(make_state(tmp_path))
    for tamper, what in (
        (lambda b: b.set_meta("llm", {"current_step": "13"}), r"meta differs.*\(current_step\)"),
        (lambda b: b.add_switches("llm", [("w9", 2, 11, 10)]), "step switches differ"),
        (lambda b: b.prune("default", {6}, {}, 7), "versions differ"),
        (lambda b: b.save_guard("llm", {"version": 2, "status": "active"}), "guards differ"),
    ):
        target = SqliteBackend(None)
        migrate(source, target)
        tamper(target)
        with pytest.raises(CopyMismatch, match=what):
            check(source, target)


def test_check_accepts_a_row_whose_config_the_target_left_out(tmp_path: Path) -> None:
    source = SqliteBackend(make_state(tmp_path))
    target = SqliteBackend(None)
    migrate(source, target)
    row = target.load("llm").rows[-1]
    target.delete_job("llm")
    first = source.load("llm").rows[0]
    target.append("llm", [first], {}, expected_head=0)
    bare = dataclasses.replace(row, config={})  # as etcd keeps a row too large for one request
    target.append("llm", [bare], source.load("llm").meta, expected_head=first.version)
    target.add_switches("llm", source.switches("llm"))
    for schema in reversed(source.schemas("llm", 10)):
        target.add_schema("llm", {k: v for k, v in schema.items() if k != "id"})
    for guard in source.guards("llm"):
        target.save_guard("llm", guard)
    check(source, target)


def test_migrate_refuses_a_store_that_holds_data(tmp_path: Path) -> None:
    source = SqliteBackend(make_state(tmp_path))
    target = SqliteBackend(None)
    commit(ConfigStore(job="other", backend=target), "put", {"a": 1}, source="api")
    held = target.load("other")
    with pytest.raises(TargetNotEmpty):
        migrate(source, target)
    assert target.jobs() == ["other"] and target.load("other") == held


def test_a_store_with_only_meta_or_switches_is_not_empty() -> None:
    for fill in (
        lambda b: b.set_meta("j", {"current_step": "3"}),
        lambda b: b.add_switches("j", [("g0", 1, 0, -1)]),
    ):
        backend = SqliteBackend(None)
        assert backend.is_empty()
        fill(backend)
        assert not backend.is_empty()


def run_migrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lighthouse", "migrate", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )


def test_cli_refuses_a_directory_without_state(tmp_path: Path) -> None:
    done = run_migrate("--state-dir", str(tmp_path), "--store", "etcd://127.0.0.1:1/x")
    assert done.returncode == 1
    assert "no lighthouse.db" in done.stderr


@pytest.mark.slow
def test_cli_refuses_a_state_dir_a_running_lighthouse_holds(tmp_path: Path, procs: ProcessPool) -> None:
    make_state(tmp_path / "state")
    procs.lighthouse(state_dir=tmp_path / "state")
    done = run_migrate("--state-dir", str(tmp_path / "state"), "--store", "etcd://127.0.0.1:1/x")
    assert done.returncode == 1
    assert "in use" in done.stderr and "stop that lighthouse" in done.stderr


def test_cli_refuses_a_malformed_store_url(tmp_path: Path) -> None:
    make_state(tmp_path)
    done = run_migrate("--state-dir", str(tmp_path), "--store", "http://127.0.0.1:2379")
    assert done.returncode == 1
    assert "expected etcd://HOST:PORT" in done.stderr


@pytest.mark.slow
def test_cli_migrates_into_an_empty_etcd_prefix_only(tmp_path: Path) -> None:
    require_etcd()
    db = make_state(tmp_path / "state")
    with EtcdCluster(tmp_path / "etcd", size=3) as cluster:
        url = f"etcd://{cluster.endpoints}/migrated"
        done = run_migrate("--state-dir", str(db.parent), "--store", url)
        assert done.returncode == 0, done.stderr
        assert "migrated 2 job(s)" in done.stdout
        source = SqliteBackend(db)
        target = EtcdBackend(cluster.endpoints, "/migrated")
        try:
            assert target.jobs() == ["default", "llm"]
            for job in ("default", "llm"):
                assert target.load(job) == source.load(job)
                assert target.switches(job) == source.switches(job)
        finally:
            target.close()
            source.close()
        again = run_migrate("--state-dir", str(db.parent), "--store", url)
        assert again.returncode == 1
        assert "already holds data" in again.stderr
