"""What a config store persists, and the interface every persistence backend implements.

``ConfigStore`` (one per job) keeps the logic (resolve, scheduling, pruning,
late groups); a backend only stores and returns records, so the logic never
knows whether it runs on the embedded SQLite file or on etcd.

A backend shared by several lighthouses (etcd) is also a ``SharedBackend``: the
job registry subscribes to it, to reload a job another lighthouse changed, adopt
the job step it stored and respect the step-lease ceiling it stored (see
``leases``); the server shares managers and series with the other lighthouses
over its etcd client.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from protos.job_ids import InvalidJobId, JobId, check_job_name

if TYPE_CHECKING:
    from lighthouse.etcd.client import EtcdClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Change:
    """One committed version."""

    version: int
    op: str
    change: dict[str, Any]
    config: dict[str, Any]  # resolve(version, FOREVER): the config once everything known applies
    effective_step: int | None
    order_step: int
    created_at: float
    source: str
    author: str
    comment: str
    # A change made now whose effective_step the lighthouse chose (above every step lease it
    # had granted), rather than one the operator scheduled at a step.
    made_now: bool = False

    @property
    def scheduled(self) -> bool:
        """Asked for at a step by the operator."""
        return self.effective_step is not None and not self.made_now

    def fields(self) -> dict[str, Any]:
        """Every field by name: what a backend's stored record is made from."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_fields(cls, record: Mapping[str, Any]) -> Change:
        """The Change a stored record (decoded) names field by field; its other keys are ignored."""
        return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record})

    def to_json(self, cancelled: bool = False) -> dict[str, Any]:
        return {
            "version": self.version,
            "config": self.config,
            "created_at": self.created_at,
            "source": self.source,
            "author": self.author,
            "comment": self.comment,
            "op": self.op,
            "change": self.change,
            "effective_step": self.effective_step,
            # Where it sorts among the changes applied at a step (with the version): what a
            # reader needs to replay the history's configs on its own.
            "order_step": self.order_step,
            "made_now": self.made_now,
            "scheduled": self.scheduled,
            "cancelled": cancelled,
        }


# (replica_id, version, step, previous_step): a group began serving `version` at `step`.
Switch = tuple[str, int, int, int]

JobChanged = Callable[[JobId, int], None]  # (job, head now; 0 when deleted, -1 when unknown)
StepChanged = Callable[[JobId, int], None]  # (job, step stored)
CeilingChanged = Callable[[JobId, str, int, int], None]  # (job, meta key, ceiling, revision)
GuardsChanged = Callable[[JobId], None]  # (job): a guard of it was written or dropped


@dataclass
class JobRecords:
    """Everything stored for one job, as loaded when its store opens."""

    rows: list[Change] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)
    # Versions whose ``config`` the backend did not keep (etcd, when change + config would not
    # fit in one request): the store recomputes them, ``config`` being a function of the rows.
    unresolved: set[int] = field(default_factory=set)
    # The store's revision these records were read at (etcd; 0 for a store with one writer): when,
    # not what, so two reads of the same records compare equal.
    revision: int = field(default=0, compare=False)


@dataclass(frozen=True)
class LeaseView:
    """What a commit assumed of the other lighthouses: none of their lease ceilings (every
    ``lease_ceiling*`` meta key but ``own_key``) changed after ``revision``, nor the runs record."""

    own_key: str
    revision: int
    # The job's runs record as the commit's plan saw it stored (``runs_checked``: compared too, on a
    # store others write): a change planned between runs applies at once, and one planned within a
    # run above its promises; another lighthouse's begin or end in between makes it plan again.
    runs_record: str | None = None
    runs_checked: bool = False


class HeadMoved(Exception):
    """Another writer (another lighthouse on the same store) appended a version first."""


class StoreUnavailable(Exception):
    """The backend cannot commit now (etcd without quorum); nothing was stored."""


class StoreFull(StoreUnavailable):
    """The store has no space for a write (a full disk or quota, etcd's NOSPACE alarm); nothing was
    stored. Reads and step leases go on (see ``SqliteBackend``'s ceiling file)."""


def stored_job(name: str) -> JobId | None:
    """A job id read from a store; None (logged) for a name no lighthouse writes (a foreign key),
    as a request naming it would be refused."""
    try:
        return check_job_name(name)
    except InvalidJobId as exc:
        logger.warning("a stored job ignored: %s", exc)
        return None


def stored_jobs(names: Iterable[str]) -> list[JobId]:
    """The job ids among names read from a store, sorted (see ``stored_job``)."""
    return sorted(job for job in map(stored_job, names) if job is not None)


class StoreBackend(Protocol):
    """Durable records of every job. ``append`` returns only once the record is committed."""

    # How often a store hands the job's step over (``set_meta("current_step")``): a backend that
    # queues steps and writes them in the background takes every one (0).
    step_save_interval: float

    def jobs(self) -> list[JobId]:
        """Jobs with at least one stored version, sorted."""
        ...

    def load(self, job: str) -> JobRecords: ...

    def append(
        self,
        job: str,
        rows: list[Change],
        meta: dict[str, str],
        expected_head: int,
        leases: LeaseView | None = None,
    ) -> None:
        """Store ``rows`` (consecutive versions after ``expected_head``) and ``meta`` in one
        transaction if the job's head is still ``expected_head`` (and, on a shared store, no other
        lighthouse raised its lease ceiling since ``leases.revision``), else raise HeadMoved
        (storing nothing); StoreUnavailable when it cannot commit now."""
        ...

    def space_problem(self) -> str | None:
        """Why writes fail for lack of space now (None: they do not): health shows it."""
        ...

    def write_problem(self) -> str | None:
        """Why a write could not commit now (None: it could), from one cheap look bounded well under
        a second that writes nothing: the store's gRPC health (``lighthouse.store``) shows it."""
        ...

    def lease_ceiling_key(self, owner: str) -> str:
        """The meta key holding the lease ceiling of lighthouse ``owner`` (one per process life)."""
        ...

    def save_lease_ceiling(self, job: str, owner: str, ceiling: int, served_head: int) -> None:
        """Store ``owner``'s lease ceiling of ``job`` durably; on a shared store only while the job's
        head is still ``served_head`` (the version the lighthouse serves), else HeadMoved."""
        ...

    def set_meta(self, job: str, items: dict[str, str]) -> None: ...

    def replace_meta(
        self, job: str, key: str, expected: str | None, items: dict[str, str], head: int | None = None
    ) -> bool:
        """Write ``items`` (``current_step`` as ``set_meta`` does) only if ``key`` still holds
        ``expected`` (None: no value), and the job's head is still ``head`` when given, in one
        transaction; False, writing nothing, when not (another lighthouse changed it first). What
        the runs record is written with (a run's end names the head it ended at)."""
        ...

    def stored_step(self, job: str) -> int:
        """The job's step as stored now (its packed form; -1: none), read from the store."""
        ...

    def add_switches(self, job: str, switches: list[Switch]) -> None:
        """Remember step switches (duplicates are ignored)."""
        ...

    def switches(self, job: str) -> list[Switch]:
        """Every stored switch of the job, ordered by (replica_id, step, version)."""
        ...

    def add_schema(self, job: str, record: dict[str, Any]) -> None:
        """Append a schema change (``schema``, ``created_at``, ``source``, ``author``, ``comment``)."""
        ...

    def schemas(self, job: str, limit: int) -> list[dict[str, Any]]:
        """The job's schema changes, newest first, each with an increasing ``id``."""
        ...

    def save_guard(self, job: str, record: dict[str, Any]) -> None:
        """Store a guarded change's guard (``record["version"]`` is its id), replacing an older state."""
        ...

    def guards(self, job: str) -> list[dict[str, Any]]:
        """The job's guards, by version."""
        ...

    def drop_guards(self, job: str, versions: list[int]) -> None:
        """Delete the guards of ``versions`` (decided ones of pruned versions)."""
        ...

    def prune(self, job: str, gone: set[int], meta: dict[str, str], oldest_kept: int) -> None:
        """Delete versions ``gone`` and store ``meta``; drop switches to versions before
        ``oldest_kept`` except each group's latest one (it still says what the group served)."""
        ...

    def delete_job(self, job: str) -> None:
        """Forget the job: its versions, meta, switches, schemas and guards."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class SharedBackend(StoreBackend, Protocol):
    """What only a backend several lighthouses write has (etcd): a watch of the others' writes,
    and the etcd client and key prefix they share managers and series under (``peers``)."""

    client: EtcdClient
    prefix: str

    def subscribe(
        self,
        on_job_changed: JobChanged,
        on_step: StepChanged,
        on_lease_ceiling: CeilingChanged,
        on_guards: GuardsChanged = lambda job: None,
    ) -> None:
        """Call ``on_job_changed(job, head)`` when another writer moved a job's head (0: deleted,
        -1: unknown, reload), ``on_step(job, step)`` when a job step is stored,
        ``on_lease_ceiling(job, key, ceiling, revision)`` when a lease ceiling is and
        ``on_guards(job)`` when a guard was written or dropped (a reload reads them too)."""
        ...
