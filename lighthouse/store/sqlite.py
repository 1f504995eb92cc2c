"""The embedded store backend: every job's versions in one SQLite file, committed with fsync.

A state directory written before jobs existed (tables without a job column)
is migrated in one transaction on open: its versions become the job
``default``; one written before step leases gains the ``made_now`` column.

Job steps and step switches arrive with managers' calls; they are queued and
written by a background thread (all jobs in one transaction, at most once a
second), so a manager's call never waits for a disk write. Reads include what
is queued; a crash loses at most the last second of them (they are reports,
not acknowledged edits).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from lighthouse.store.backend import (
    Change,
    HeadMoved,
    JobRecords,
    LeaseView,
    StoreFull,
    StoreUnavailable,
    Switch,
    stored_jobs,
)
from lighthouse.store.ceiling_file import CeilingFile
from protos.job_ids import JobId

logger = logging.getLogger(__name__)

# PRAGMA user_version: 0 = the single-job layout, 2 = per-job tables, 3 = changes made now carry
# the effective step the lighthouse chose (made_now)
FORMAT_VERSION = 3
STORE_FILE = "lighthouse.db"  # the database file inside a --state-dir
STEP_SAVE_PAUSE = 1.0  # seconds between two writes of queued job steps (one transaction for all jobs)
LEASE_CEILING_KEY = "lease_ceiling"
CEILING_FILE = "lease_ceilings"  # beside STORE_FILE: the step-lease ceilings, written in place
# Below this many free bytes in the state directory the store shows as full (health): an edit
# needs a few pages of WAL, a checkpoint a few more.
LOW_SPACE = 1 << 20
# job_versions' columns: the job, and a Change's fields of the same names (read and written by name).
CHANGE_COLUMNS = (
    "job",
    "version",
    "op",
    "change",
    "config",
    "effective_step",
    "order_step",
    "created_at",
    "source",
    "author",
    "comment",
    "made_now",
)
# The columns a table of the single-job layout fills, in its order (it had no job nor made_now).
VERSION_COLUMNS = ", ".join(CHANGE_COLUMNS[:-1])
INSERT_CHANGE = "INSERT INTO job_versions ({}) VALUES ({})".format(
    ", ".join(CHANGE_COLUMNS), ", ".join(f":{c}" for c in CHANGE_COLUMNS)
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS job_meta (
    job TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL, PRIMARY KEY (job, key)
);
CREATE TABLE IF NOT EXISTS job_versions (
    job TEXT NOT NULL,
    version INTEGER NOT NULL,
    op TEXT NOT NULL CHECK (op IN ('put', 'patch', 'cancel')),
    change TEXT NOT NULL,
    config TEXT NOT NULL,
    effective_step INTEGER,
    order_step INTEGER NOT NULL,
    created_at REAL NOT NULL,
    source TEXT NOT NULL,
    author TEXT NOT NULL,
    comment TEXT NOT NULL,
    made_now INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job, version)
);
CREATE TABLE IF NOT EXISTS job_schemas (
    id INTEGER PRIMARY KEY,
    job TEXT NOT NULL,
    schema TEXT NOT NULL,
    created_at REAL NOT NULL,
    source TEXT NOT NULL,
    author TEXT NOT NULL,
    comment TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS job_guards (
    job TEXT NOT NULL, version INTEGER NOT NULL, record TEXT NOT NULL, PRIMARY KEY (job, version)
);
CREATE TABLE IF NOT EXISTS job_switches (
    job TEXT NOT NULL,
    replica_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    step INTEGER NOT NULL,
    previous_step INTEGER NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (job, replica_id, step, version)
);
"""

LEGACY_DEFAULT_JOB = "default"


class StateInUse(OSError):
    """Another lighthouse holds this state directory."""


def _lock_exclusively(path: Path) -> IO[str]:
    """Hold an exclusive lock on ``path`` for the process's life: two lighthouses writing one
    database would interleave version numbers and break each other's commits."""
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise StateInUse(f"state directory {path.parent} is in use by {holder}") from None
    handle.seek(0)
    handle.truncate()
    try:  # who holds it, for the message above; a full disk leaves it unsaid
        handle.write(f"lighthouse pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
    except OSError:
        pass
    return handle


class SqliteBackend:
    """One SQLite database for every job; ``path=None`` keeps it in memory (lost on exit)."""

    step_save_interval = 0.0  # every step is queued; the writer thread coalesces them

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()  # one connection, used by every job's store
        self._closed = False
        self._queue_lock = threading.Lock()  # the queued steps only: never held across a disk write
        self._pending_steps: dict[str, int] = {}
        self._pending_switches: list[tuple[str, str, int, int, int, float]] = []
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._lock_file: IO[str] | None = None
        self._ceilings: CeilingFile | None = None
        self._space_problem: str | None = None  # the last write failed for lack of space
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_file = _lock_exclusively(path.with_name(path.name + ".lock"))
        try:
            if path is not None:
                self._ceilings = CeilingFile(path.with_name(CEILING_FILE))
            self._db = sqlite3.connect(
                str(path) if path is not None else ":memory:", check_same_thread=False, isolation_level=None
            )
            # WAL + FULL: a commit is on disk before we acknowledge it; readers never block the writer.
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._open_schema()
        except BaseException as exc:
            if self._ceilings is not None:
                self._ceilings.close()
            if self._lock_file is not None:
                self._lock_file.close()
            if isinstance(exc, sqlite3.Error | OSError) and self._no_space(exc):
                raise StoreFull(f"cannot open {path}: its disk is full ({exc}); free space there") from None
            if isinstance(exc, sqlite3.Error):
                raise OSError(f"cannot open {path}: {exc}") from None
            raise
        self._writer = threading.Thread(target=self._write_steps, name="sqlite-steps", daemon=True)
        self._writer.start()

    def _open_schema(self) -> None:
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        (user_version,) = self._db.execute("PRAGMA user_version").fetchone()
        if user_version > FORMAT_VERSION:
            raise OSError(
                f"{self.path} was written by a newer lighthouse (format {user_version}, "
                f"this one reads up to {FORMAT_VERSION})"
            )
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)
            if "job_versions" in tables and user_version < 3:  # written before step leases
                self._db.execute("ALTER TABLE job_versions ADD COLUMN made_now INTEGER NOT NULL DEFAULT 0")
            if "versions" in tables:  # the single-job layout: its state is the job "default"
                job = LEGACY_DEFAULT_JOB
                self._db.execute(
                    f"INSERT INTO job_versions ({VERSION_COLUMNS}) SELECT ?, * FROM versions", (job,)
                )
                self._db.execute("INSERT INTO job_meta SELECT ?, key, value FROM meta", (job,))
                self._db.execute("INSERT INTO job_switches SELECT ?, * FROM switches", (job,))
                for table in ("versions", "meta", "switches"):
                    self._db.execute(f"DROP TABLE {table}")
            self._db.execute(f"PRAGMA user_version = {FORMAT_VERSION}")

    # ------------------------------------------------------------------ reads
    def jobs(self) -> list[JobId]:
        with self._lock:
            return stored_jobs(r[0] for r in self._db.execute("SELECT DISTINCT job FROM job_versions"))

    def load(self, job: str) -> JobRecords:
        with self._lock:
            cursor = self._db.cursor()
            cursor.row_factory = sqlite3.Row
            cursor.execute("SELECT * FROM job_versions WHERE job = ? ORDER BY version", (job,))
            rows = [_row(r) for r in cursor]
            meta = dict(self._db.execute("SELECT key, value FROM job_meta WHERE job = ?", (job,)).fetchall())
        with self._queue_lock:
            step = self._pending_steps.get(job)
        if step is not None and step > int(meta.get("current_step", "-1")):
            meta["current_step"] = str(step)  # queued, not written yet: still the job's step
        if self._ceilings is not None:  # the file's, or one a lighthouse before it stored in meta
            ceiling = max(self._ceilings.get(job), int(meta.get(LEASE_CEILING_KEY, "-1")))
            if ceiling >= 0:
                meta[LEASE_CEILING_KEY] = str(ceiling)
        return JobRecords(rows, meta)

    # ------------------------------------------------------------------ space
    def space_problem(self) -> str | None:
        """A write that failed for lack of space, until one commits or space is free again; or
        less than LOW_SPACE free in the state directory now."""
        if self.path is None:
            return None
        try:
            stat = os.statvfs(self.path.parent)
        except OSError:
            return self._space_problem
        free = stat.f_bavail * stat.f_frsize
        if free < LOW_SPACE:
            return f"the state directory {self.path.parent} is full ({free} bytes free)"
        self._space_problem = None
        return None

    def write_problem(self) -> str | None:
        """A local file has no quorum to lose: only space (``space_problem``) stops its writes."""
        return self.space_problem()

    @contextmanager
    def _space_checked(self) -> Iterator[None]:
        """A write: one refused for lack of space raises StoreFull (the transaction rolled back)."""
        try:
            yield
        except (sqlite3.Error, OSError) as exc:
            if not self._no_space(exc):
                raise
            where = self.path.parent if self.path is not None else "memory"
            self._space_problem = f"the state directory {where} is full ({exc})"
            raise StoreFull(f"{self._space_problem}; nothing was stored: free space there") from None
        self._space_problem = None

    def _no_space(self, exc: BaseException) -> bool:
        if isinstance(exc, OSError):
            return exc.errno in (errno.ENOSPC, errno.EDQUOT)
        code = getattr(exc, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL:
            return True
        # An I/O error (the WAL index could not grow, say) on a disk with no space left.
        return code is not None and code & 0xFF == sqlite3.SQLITE_IOERR and self.space_problem() is not None

    def is_empty(self) -> bool:
        """No job holds anything (a store ``lighthouse migrate`` may copy into)."""
        self._flush_steps()  # a queued job step counts
        with self._lock:
            return not any(
                self._db.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone()
                for table in ("job_versions", "job_meta", "job_switches", "job_guards")
            )

    def switches(self, job: str) -> list[Switch]:
        # The queue is read under the database lock: a flush takes switches out of the queue and
        # stores them while holding it, so each switch is seen in one of the two.
        with self._lock:
            with self._queue_lock:
                queued = {(r, v, st, pr) for j, r, v, st, pr, _ in self._pending_switches if j == job}
            stored = {
                (r[0], r[1], r[2], r[3])
                for r in self._db.execute(
                    "SELECT replica_id, version, step, previous_step FROM job_switches WHERE job = ?", (job,)
                )
            }
        return sorted(stored | queued, key=lambda sw: (sw[0], sw[2], sw[1]))

    # ----------------------------------------------------------------- writes
    def append(
        self,
        job: str,
        rows: list[Change],
        meta: dict[str, str],
        expected_head: int,
        leases: LeaseView | None = None,
    ) -> None:
        # ``leases`` is moot: no other lighthouse writes this database
        with self._lock, self._space_checked(), self._db:  # one transaction: the rows and their meta
            self._db.execute("BEGIN IMMEDIATE")
            (head,) = self._db.execute(
                "SELECT COALESCE(MAX(version), 0) FROM job_versions WHERE job = ?", (job,)
            ).fetchone()
            if head != expected_head:
                raise HeadMoved(f"job {job}: head is {head}, expected {expected_head}")
            self._db.executemany(INSERT_CHANGE, [_row_params(job, row) for row in rows])
            self._set_meta(job, meta)

    def set_meta(self, job: str, items: dict[str, str]) -> None:
        """``current_step`` is queued for the writer thread (a manager's call never waits for the
        disk, not even for the lock a commit holds through its fsync); the rest is written now."""
        items = dict(items)
        step = items.pop("current_step", None)
        if step is not None:
            with self._queue_lock:
                if int(step) > self._pending_steps.get(job, -1):
                    self._pending_steps[job] = int(step)
            self._wake.set()
        if items:
            with self._lock, self._space_checked():
                if not self._closed:
                    self._set_meta(job, items)

    def replace_meta(
        self, job: str, key: str, expected: str | None, items: dict[str, str], head: int | None = None
    ) -> bool:
        # One writer: nothing else changes the record or the head meanwhile; compared all the same.
        items = dict(items)
        step = items.pop("current_step", None)
        with self._lock, self._space_checked():
            if self._closed:
                return False
            row = self._db.execute(
                "SELECT value FROM job_meta WHERE job = ? AND key = ?", (job, key)
            ).fetchone()
            if (row[0] if row else None) != expected:
                return False
            if head is not None:
                top = self._db.execute(
                    "SELECT MAX(version) FROM job_versions WHERE job = ?", (job,)
                ).fetchone()
                if (top[0] or 0) != head:
                    return False
            self._set_meta(job, items)
        if step is not None:
            self.set_meta(job, {"current_step": step})
        return True

    def stored_step(self, job: str) -> int:
        with self._queue_lock:
            pending = self._pending_steps.get(job, -1)
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM job_meta WHERE job = ? AND key = 'current_step'", (job,)
            ).fetchone()
        return max(pending, int(row[0]) if row else -1)

    def lease_ceiling_key(self, owner: str) -> str:
        """One key whatever the owner: a single lighthouse writes this database, and each life
        stores at least what the one before it had (see ``leases``)."""
        return LEASE_CEILING_KEY

    def save_lease_ceiling(self, job: str, owner: str, ceiling: int, served_head: int) -> None:
        """In the ceiling file (in place: no space needed); in meta for a database in memory."""
        if self._ceilings is None:
            self.set_meta(job, {LEASE_CEILING_KEY: str(ceiling)})
            return
        try:
            self._ceilings.save(job, ceiling)
        except OSError as exc:
            if self._no_space(exc):
                raise StoreFull(f"no slot for job {job}'s step-lease ceiling: {exc}") from None
            raise StoreUnavailable(f"the step-lease ceiling of job {job} cannot be written: {exc}") from None

    def _write_steps(self) -> None:
        """Write queued job steps, every job in one transaction, at most once per STEP_SAVE_PAUSE."""
        failing = False
        while not self._stopping.is_set():
            self._wake.wait()
            self._wake.clear()
            try:
                self._flush_steps()
            except (sqlite3.Error, OSError) as exc:  # a full disk, say: the steps stay queued, tried again
                if not failing:
                    logger.warning("job steps not saved yet (tried again each second): %s", exc)
                failing = True
                self._wake.set()
            else:
                if failing:
                    logger.info("job steps saved again")
                failing = False
            self._stopping.wait(STEP_SAVE_PAUSE)

    def _flush_steps(self) -> None:
        """Write the queued job steps and step switches in one transaction (taken from the queue
        under the database lock: a reader holding it sees each switch queued or stored)."""
        with self._lock:
            with self._queue_lock:
                steps, switches = self._pending_steps, self._pending_switches
                self._pending_steps, self._pending_switches = {}, []
            if (not steps and not switches) or self._closed:
                return
            self._write_queued(steps, switches)

    def _write_queued(
        self, steps: dict[str, int], switches: list[tuple[str, str, int, int, int, float]]
    ) -> None:
        items = [(job, "current_step", str(step)) for job, step in steps.items()]
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                # Max semantics: a queued step never lowers one stored meanwhile (a commit stores one).
                self._db.executemany(
                    "INSERT INTO job_meta VALUES (?1, ?2, ?3) ON CONFLICT (job, key) DO UPDATE"
                    " SET value = ?3 WHERE CAST(value AS INTEGER) < CAST(?3 AS INTEGER)",
                    items,
                )
                self._db.executemany("INSERT OR IGNORE INTO job_switches VALUES (?, ?, ?, ?, ?, ?)", switches)
        except BaseException:
            with self._queue_lock:  # put back what was not written (newer steps win)
                for job, step in steps.items():
                    if step > self._pending_steps.get(job, -1):
                        self._pending_steps[job] = step
                self._pending_switches[:0] = switches
            raise

    def add_switches(self, job: str, switches: list[Switch]) -> None:
        """Queued for the writer thread (a manager's call never waits for the disk)."""
        now = time.time()
        with self._queue_lock:
            self._pending_switches.extend((job, r, v, s, p, now) for r, v, s, p in switches)
        self._wake.set()

    def add_schema(self, job: str, record: dict[str, Any]) -> None:
        with self._lock, self._space_checked(), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT INTO job_schemas (job, schema, created_at, source, author, comment)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    job,
                    json.dumps(record["schema"], ensure_ascii=False),
                    record["created_at"],
                    record["source"],
                    record["author"],
                    record["comment"],
                ),
            )

    def schemas(self, job: str, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, schema, created_at, source, author, comment FROM job_schemas"
                " WHERE job = ? ORDER BY id DESC LIMIT ?",
                (job, limit),
            ).fetchall()
        keys = ("id", "schema", "created_at", "source", "author", "comment")
        return [{**dict(zip(keys, r, strict=True)), "schema": json.loads(r[1])} for r in rows]

    def save_guard(self, job: str, record: dict[str, Any]) -> None:
        with self._lock, self._space_checked():
            self._db.execute(
                "INSERT OR REPLACE INTO job_guards VALUES (?, ?, ?)",
                (job, int(record["version"]), json.dumps(record, ensure_ascii=False)),
            )

    def guards(self, job: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM job_guards WHERE job = ? ORDER BY version", (job,)
            ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def drop_guards(self, job: str, versions: list[int]) -> None:
        with self._lock, self._space_checked(), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "DELETE FROM job_guards WHERE job = ? AND version = ?", [(job, v) for v in versions]
            )

    def prune(self, job: str, gone: set[int], meta: dict[str, str], oldest_kept: int) -> None:
        with self._space_checked():
            self._flush_steps()  # queued switches first: the pruning below decides which to keep
        with self._lock, self._space_checked(), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "DELETE FROM job_versions WHERE job = ? AND version = ?", [(job, v) for v in gone]
            )
            self._set_meta(job, meta)
            self._db.execute(
                "DELETE FROM job_switches WHERE job = ?1 AND version < ?2 AND step < ("
                " SELECT MAX(step) FROM job_switches t"
                " WHERE t.job = ?1 AND t.replica_id = job_switches.replica_id AND t.version < ?2)",
                (job, oldest_kept),
            )

    def delete_job(self, job: str) -> None:
        with self._queue_lock:
            self._pending_steps.pop(job, None)
            self._pending_switches = [sw for sw in self._pending_switches if sw[0] != job]
        with self._lock, self._space_checked(), self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for table in ("job_versions", "job_meta", "job_switches", "job_schemas", "job_guards"):
                self._db.execute(f"DELETE FROM {table} WHERE job = ?", (job,))
        if self._ceilings is not None:
            self._ceilings.delete(job)

    def close(self) -> None:
        """Write the queued job steps, then close the database."""
        self._stopping.set()
        self._wake.set()
        self._writer.join(timeout=5)
        with self._lock:
            if self._closed:
                return
        try:
            self._flush_steps()
        except sqlite3.Error as exc:
            logger.warning("closing with job steps unsaved: %s", exc)
        with self._lock:
            self._closed = True
            self._db.close()
            if self._ceilings is not None:
                self._ceilings.close()
            if self._lock_file is not None:
                self._lock_file.close()  # releases the lock

    def _set_meta(self, job: str, items: dict[str, str]) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO job_meta VALUES (?, ?, ?)", [(job, k, v) for k, v in items.items()]
        )


def _row_params(job: str, row: Change) -> dict[str, Any]:
    """``row`` of ``job`` as its job_versions row (INSERT_CHANGE's parameters)."""
    dumps = json.dumps
    return {
        **row.fields(),
        "job": job,
        "change": dumps(row.change, ensure_ascii=False),
        "config": dumps(row.config, ensure_ascii=False),
        "made_now": int(row.made_now),
    }


def _row(r: sqlite3.Row) -> Change:
    """The Change a job_versions row holds."""
    return Change.from_fields(
        {
            **dict(zip(r.keys(), r, strict=True)),
            "change": json.loads(r["change"]),
            "config": json.loads(r["config"]),
            "made_now": bool(r["made_now"]),
        }
    )
