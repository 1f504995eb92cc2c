"""Every training job one lighthouse serves: one ``LighthouseState`` per job over one shared store backend.

Jobs share nothing but the backend and this table: versions, history,
scheduled changes, job step and managers are per job, so nothing done to one
job is visible in another. A job exists once it stored a version, a config file
names it, or a manager asked for it: such a job is served an empty config
(version 0) and listed, so an operator sees groups waiting for a config.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from lighthouse.config.files import FileContent
from lighthouse.jobs.leases import CeilingWriter, LeaseBook, LeaseGate, LeasePolicy
from lighthouse.jobs.runs import same_run, unpack
from lighthouse.jobs.state import LighthouseState, ManagerLimits
from lighthouse.jobs.versions import ConfigStore, NotFound
from lighthouse.store.backend import HeadMoved, SharedBackend, StoreBackend, StoreUnavailable
from protos.job_ids import DEFAULT_JOB, JobId

logger = logging.getLogger(__name__)

MAX_JOBS = 10_000  # jobs held in memory; a flood of made-up job ids must not exhaust it
LIVE_MANAGER_SECONDS = 60.0  # a job with a manager heard from this recently cannot be deleted


class TooManyJobs(Exception):
    pass


class JobBusy(Exception):
    """The job cannot be deleted now (a manager is live, or a config file defines it)."""


# A ceiling wanted for longer than this and still not stored: the store is out of this lighthouse's
# reach (a ceiling write takes milliseconds), and a group past its promises is better served by
# another lighthouse on the store than by a lease-less answer here.
CEILING_OVERDUE = 0.5


class JobRegistry:
    def __init__(
        self,
        backend: StoreBackend,
        *,
        history_limit: int | None = None,
        keep_steps: int | None = None,
        default_config_path: Path | None = None,
        default_schema_path: Path | None = None,
        strict: bool = False,
        lease_policy: LeasePolicy | None = None,
        manager_limits: ManagerLimits | None = None,
    ) -> None:
        self.backend = backend
        self._manager_limits = manager_limits or ManagerLimits()
        self._history_limit = history_limit
        self._keep_steps = keep_steps
        self._lease_policy = lease_policy or LeasePolicy()
        self.owner = uuid.uuid4().hex  # this lighthouse life, owner of its step-lease ceilings
        self.lease_gate = LeaseGate()  # shut while an earlier release shares the store (peers.features)
        # The other lighthouses live on the store (instance ids): on etcd, peers.features says which.
        self.peer_lighthouses: Callable[[], set[str]] = set
        self._ceilings = CeilingWriter(
            self._save_ceiling, retry=(HeadMoved,), unavailable=(StoreUnavailable,)
        )
        self._lock = threading.Lock()
        self._states: dict[JobId, LighthouseState] = {}
        self._peers: Callable[[JobId], list[dict[str, Any]]] | None = None
        self._served_listener: Callable[[JobId], None] | None = None
        self._lighthouse = ""
        for job in backend.jobs():
            if job != DEFAULT_JOB:
                self._states[job] = self._new_state(job)
        self._states[DEFAULT_JOB] = self._new_state(
            DEFAULT_JOB, default_config_path, default_schema_path, strict
        )
        if isinstance(backend, SharedBackend):  # other lighthouses write it too (etcd)
            backend.subscribe(
                self._job_changed, self._step_stored, self._ceiling_stored, self._guards_changed
            )

    def _job_changed(self, job: JobId, head: int) -> None:
        """Another lighthouse changed ``job`` (its head is now ``head``): serve what the store holds.

        StoreUnavailable propagates (the watch delivers the change again); any other failure
        is this job's alone and must not stall the watch of every job.
        """
        try:
            state = self._states.get(job)
            if state is None:
                if head != 0:
                    self.serve(job)  # opens it from the store
                return
            # A head at or below ours is our own write, one read already, or the event of an earlier
            # write of ours arriving after a later one committed (every commit compares the head,
            # so another lighthouse's version is above ours); one above ours may be the commit of
            # ours being appended (its event came first): nothing to read. Reading anyway loaded
            # every kept version again, per commit (benchmarks/history --store etcd). 0 (deleted)
            # and -1 (re-read: pruned, a run, a schema or a guard, or a head deleted and written
            # again) always read.
            if head <= 0 or (head > state.store.head and not state.store.skips_event(head)):
                state.reload()
                logger.info("job %s: version %d from the shared store", job, state.store.head)
        except StoreUnavailable:
            raise
        except Exception:
            logger.exception("job %s: change from the shared store not taken", job)

    def _guards_changed(self, job: JobId) -> None:
        """A guard of ``job`` was written or dropped (maybe by another lighthouse): list what is
        stored. StoreUnavailable propagates, as for ``_job_changed``."""
        state = self._states.get(job)
        try:
            if state is not None:
                state.guards.reload()
        except StoreUnavailable:
            raise
        except Exception:
            logger.exception("job %s: guards from the shared store not taken", job)

    def _step_stored(self, job: JobId, step: int) -> None:
        state = self._states.get(job)
        if state is not None:
            state.adopt_step(step)

    def _ceiling_stored(self, job: JobId, key: str, ceiling: int, revision: int) -> None:
        """A lighthouse stored a step-lease ceiling of ``job``: another one's bounds our changes."""
        state = self._states.get(job)
        if state is not None and key != self.backend.lease_ceiling_key(self.owner):
            run, step = unpack(ceiling)
            generation = state.store.leases.generation  # before the look at the runs (see ``grant``)
            runs = state.store.runs
            # Another run's promises ended with it; between runs, so did the ended run's (a ceiling
            # of it stored late would place changes made now above steps nobody holds a lease for).
            if same_run(run, runs.number) and not runs.between:
                state.store.leases.raise_floor(step, revision, generation)

    def _save_ceiling(self, job: JobId, ceiling: int, served_version: int) -> None:
        state = self._states.get(job)
        if state is not None:
            state.store.save_lease_ceiling(ceiling, served_version)

    def _request_ceiling(self, job: JobId, book: LeaseBook[object]) -> None:
        self._ceilings.request(job, book)

    def _new_state(
        self,
        job: JobId,
        config_path: Path | None = None,
        schema_path: Path | None = None,
        strict: bool = False,
    ) -> LighthouseState:
        store = ConfigStore(
            self.backend,
            job=job,
            history_limit=self._history_limit,
            keep_steps=self._keep_steps,
            owner=self.owner,
            lease_policy=self._lease_policy,
            request_ceiling=partial(self._request_ceiling, job),
            lease_gate=self.lease_gate,
        )
        state = LighthouseState(store, config_path, strict=strict, schema_path=schema_path)
        state.limits = self._manager_limits
        self._attach(state)
        return state

    def set_peers(self, peers: Callable[[JobId], list[dict[str, Any]]], lighthouse: str) -> None:
        """Merge ``peers(job)`` (the job's managers that talk to other lighthouses on the same store)
        into every job's managers table; ``lighthouse`` names this one in that table."""
        with self._lock:
            self._peers, self._lighthouse = peers, lighthouse
            for state in self._states.values():
                self._attach(state)

    def on_served(self, listener: Callable[[JobId], None]) -> None:
        """Call ``listener(job)`` whenever a job serves a new snapshot (every job, also later ones)."""
        with self._lock:
            self._served_listener = listener
            for state in self._states.values():
                self._attach(state)

    def _attach(self, state: LighthouseState) -> None:
        if self._peers is not None:
            state.peers = partial(self._peers, state.job)
            state.lighthouse = self._lighthouse
        if self._served_listener is not None:
            state.on_served = partial(self._served_listener, state.job)

    # ------------------------------------------------------------- lookup
    @property
    def default(self) -> LighthouseState:
        return self._states[DEFAULT_JOB]

    def get(self, job: JobId) -> LighthouseState | None:
        """The job's state if this lighthouse holds it (the hot path: one dict lookup)."""
        return self._states.get(job)

    def serve(self, job: JobId) -> LighthouseState:
        """The state a manager of ``job`` is served from, held from now on (empty until configured);
        TooManyJobs past MAX_JOBS."""
        state = self._states.get(job)
        if state is not None:
            return state
        with self._lock:
            state = self._states.get(job)
            if state is None:
                if len(self._states) >= MAX_JOBS:
                    raise TooManyJobs(f"this lighthouse holds {MAX_JOBS} jobs already")
                state = self._states[job] = self._new_state(job)
                logger.info("job %s: first request", job)
            return state

    def existing(self, job: JobId) -> LighthouseState:
        """A job that exists (the job ``default`` always does); else NotFound."""
        state = self._states.get(job)
        if state is None or not (job == DEFAULT_JOB or _exists(state)):
            raise NotFound(f"no job {job!r} on this lighthouse")
        return state

    def names(self) -> list[JobId]:
        """Jobs that exist, sorted (``default`` only when it exists or is alone)."""
        names = [job for job, state in list(self._states.items()) if _exists(state)]
        return sorted(names) or [DEFAULT_JOB]

    def states(self) -> list[LighthouseState]:
        return [self._states[job] for job in self.names() if job in self._states]

    # ------------------------------------------------------------- changes
    def apply_file(self, job: JobId, path: Path, content: FileContent, startup: bool = False) -> None:
        """A ``--config-dir`` file of ``job``: creates the job when new, else a new version when changed."""
        state = self.serve(job)
        state.config_path = path.resolve()
        state.apply_file(content, startup=startup)

    def apply_schema_file(
        self, job: JobId, path: Path, content: FileContent, config: FileContent | None, startup: bool = False
    ) -> None:
        """A ``--config-dir`` schema file of ``job``; at startup ``config`` is the job's config file
        read at the same time (a schema and a config edited together while down both load)."""
        state = self.serve(job)
        state.schema.path = path.resolve()
        if startup:
            config_path = path.with_name(f"{job}.json").resolve()
            state.schema.apply_initial_file(content, config, config_path)
        else:
            state.schema.apply_file(content)

    def delete(self, job: JobId) -> None:
        """Forget a job and its history; JobBusy while a manager of it is live or a file defines it."""
        state = self.existing(job)
        recent = [m for m in state.managers() if m["last_seen_s"] < LIVE_MANAGER_SECONDS]
        if recent:
            names = ", ".join(m["replica_id"] for m in recent[:5])
            raise JobBusy(
                f"job {job} has managers that reported in the last {LIVE_MANAGER_SECONDS:.0f} s ({names}):"
                " stop them first"
            )
        if state.config_path is not None and state.config_path.exists():
            raise JobBusy(f"job {job} is loaded from {state.config_path}: remove that file first")
        with self._lock:
            self.backend.delete_job(job)  # first: a store that cannot delete now leaves the job as it was
            self._states.pop(job, None)
            state.store.discard()
            if job == DEFAULT_JOB:
                self._states[DEFAULT_JOB] = self._new_state(DEFAULT_JOB)
        logger.info("job %s deleted", job)

    def overview(self) -> list[dict[str, Any]]:
        """GET /api/jobs: one line per job."""
        return [self.summary(state) for state in self.states()]

    @staticmethod
    def summary(state: LighthouseState) -> dict[str, Any]:
        """One job's line of the jobs list (GET /api/jobs/{job})."""
        store = state.store
        latest = store.latest()
        managers = state.managers()
        scheduled = store.scheduled()  # reads the step switches from the backend: once
        stall = state.progress.stall(managers)
        run = store.runs.last
        return {
            "job": store.job,
            "version": store.head,
            "updated_at": latest.created_at if latest else None,
            "author": latest.author if latest else None,
            "source": latest.source if latest else None,
            "managers": len(managers),
            "managers_live": sum(1 for m in managers if m["last_seen_s"] < LIVE_MANAGER_SECONDS),
            "managers_behind": sum(1 for m in managers if m["version"] < store.head),
            "late_groups": len({g["replica_id"] for s in scheduled for g in s.get("late_groups", [])}),
            "current_step": store.current_step,
            "scheduled": sum(1 for s in scheduled if s["status"] == "pending"),
            "file_error": state.file_error,
            "stalled": stall is not None,
            "stall_reason": stall,
            # The latest run (0: none yet): live, or ended and the next not begun (a paused job).
            "run": run.number if run is not None else 0,
            "run_live": run is not None and run.live,
            "run_start_step": run.start_step if run is not None else None,
        }

    def check_runs(self) -> None:
        """End the runs whose managers are all gone (the health loop, every second)."""
        for state in self.states():
            try:
                state.check_run()
            except Exception:  # a store that cannot write now: the next look tries again
                logger.exception("job %s: ending its run failed", state.job)

    def cannot_promise(self, state: LighthouseState, step: int) -> str | None:
        """Why this lighthouse cannot promise ``step`` of ``state``'s job now while another on the
        store might (its ceiling cannot be stored: cut off from etcd, say), else None. Its managers
        are better served by the others: a lease-less answer keeps them here, on the fallback."""
        leases = state.store.leases
        if not isinstance(self.backend, SharedBackend) or step <= leases.promisable:
            return None
        why = self._ceilings.failing.get(state.job)
        if why is None and leases.overdue(CEILING_OVERDUE):
            why = f"its step-lease ceiling is not stored after {CEILING_OVERDUE:g} s"
        return why

    def unpromised(self) -> dict[JobId, str]:
        """Jobs whose groups step past every promise this lighthouse can make, as their step-lease
        ceiling cannot be stored (and why): their workers get no config for those steps."""
        stuck = {}
        for job, why in list(self._ceilings.failing.items()):
            state = self._states.get(job)
            if state is not None and state.store.leases.promisable < state.store.current_step:
                stuck[job] = why
        return stuck

    def close(self) -> None:
        self._ceilings.stop()
        for state in list(self._states.values()):
            state.store.close()
        self.backend.close()


def _exists(state: LighthouseState) -> bool:
    """A job exists once it stored a version, a manager asked for it, or a config file names it
    (one that never loaded still shows, with its file error)."""
    return state.store.head > 0 or state.config_path is not None or bool(state.managers())
