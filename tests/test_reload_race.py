"""A lighthouse on a shared store (etcd) reloads a job's guards and schema from the store when its
watch says one changed, and the watch reports its own writes too. A reload that read the store
just before this lighthouse stored a guard or a schema must not put what it read back over that
write: the guard a PATCH had just made was missing from the lighthouse's own guard list (seen with
three test processes, test_etcd_metrics), and a schema just set could be replaced by the old one,
letting a commit the new one refuses through until the store's next event.

The read is held open at the exact point (a store whose read waits for the test), so the
interleaving is the one that raced, every time.
"""

from __future__ import annotations

import threading
from typing import Any

from lighthouse.jobs.guards import GuardSpec, JobGuards
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.sqlite import SqliteBackend
from tests.threads import CheckedThread

SCHEMA = {"type": "object", "properties": {"lr": {"type": "number", "maximum": 1}}}


class HeldReads(SqliteBackend):
    """A store whose next guard or schema read, once armed, waits (after reading) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.read = threading.Event()
        self.release = threading.Event()

    def _held(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.armed:
            self.armed = False
            self.read.set()
            assert self.release.wait(10), "the test never released the read"
        return rows

    def guards(self, job: str) -> list[dict[str, Any]]:
        return self._held(super().guards(job))

    def schemas(self, job: str, limit: int) -> list[dict[str, Any]]:
        return self._held(super().schemas(job, limit))


def race(backend: HeldReads, reload: Any, write: Any) -> None:
    """``reload`` reads the store, then ``write`` stores, then the reload takes what it read."""
    backend.armed = True
    reloading = CheckedThread(reload, name="reload")
    reloading.start()
    assert backend.read.wait(10), "the reload never read the store"
    writing = CheckedThread(write, name="write")
    writing.start()
    writing.join(0.3)  # the write lands now (before the fix) or waits for the reload (after it)
    backend.release.set()
    reloading.check(timeout=10)
    writing.check(timeout=10)


def test_a_reload_that_read_before_a_guard_was_stored_keeps_the_guard() -> None:
    backend = HeldReads()
    state = LighthouseState(ConfigStore(backend))
    state.change("put", {"lr": 0.01}, source="api")
    plan = state.change("patch", {"lr": 0.02}, source="api")
    guard = JobGuards.draft(plan, GuardSpec("loss", 1.5), "alice")

    race(backend, state.guards.reload, lambda: state.guards.add(guard))

    assert [g["version"] for g in state.guards.list()] == [plan.version]


def test_a_reload_that_read_before_a_schema_was_set_keeps_the_schema() -> None:
    backend = HeldReads()
    state = LighthouseState(ConfigStore(backend))
    state.change("put", {"lr": 0.01}, source="api")

    race(backend, state.schema.reload, lambda: state.schema.set(SCHEMA, source="api"))

    assert state.schema.schema is not None, "the old schema (none) was put back over the new one"
    assert state.schema.schema.violations({"lr": 5})  # a commit the new schema refuses is refused
