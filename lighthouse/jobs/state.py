"""The lighthouse's live state: the store, the managers it hears from, and the reply it serves.

gRPC and HTTP both act through this one object, so a change made on the
dashboard is what the next manager fetch sees, with no second code path.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lighthouse.config.files import FileContent, load_initial, read_schema_file
from lighthouse.config.values import (
    ConfigError,
    ConfigTooLarge,
    TypeChanged,
    encode_config,
    type_changes,
    validate_object,
)
from lighthouse.jobs.guards import JobGuards
from lighthouse.jobs.leases import NO_LEASE
from lighthouse.jobs.schema_check import JobSchema
from lighthouse.jobs.series import JobSeries
from lighthouse.jobs.stall import Progress
from lighthouse.jobs.timeline import live_version
from lighthouse.jobs.versions import ConfigStore, Edit, Plan, Segment
from protos import lighthouse_config_pb2 as pb
from protos.rpc import MAX_REPLY_BYTES, varint_field

logger = logging.getLogger(__name__)

MAX_STEP_LEAP = 1_000_000  # steps between two reports of one manager that count at once
# A group's step rate is measured over at least this many seconds of its reports: two reports
# close together (a renewal right after a fetch) would give a rate far off.
RATE_WINDOW = 0.25
# Each sample moves a group's rate this far towards it. The job's rate is the highest group rate
# seen (decaying), so raw samples (a step more or less in a window, a report the machine delayed)
# would read high by their noise, and leases, and the wait for a change made now, with them. Too
# low a rate costs little: the manager renews at half its lease, whatever the lease's length.
RATE_SMOOTHING = 0.3
REPLY_HEADROOM = 4096  # bytes of a reply besides its configs (ids, steps, lease, keep-alive)
PAST_LEASE_SHOWN = 30.0  # seconds a group that served steps past its lease stays marked so
_CURRENT_STEP = pb.LighthouseConfigResponse.CURRENT_STEP_FIELD_NUMBER
_STABLE_THROUGH = pb.LighthouseConfigResponse.STABLE_THROUGH_STEP_FIELD_NUMBER


@dataclass
class ManagerRecord:
    """The latest status a manager reported, and when."""

    replica_id: str
    address: str = ""
    version: int = 0
    requests: int = 0
    cache_hits: int = 0
    step: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    fetches: int = 0
    lease_through: int = -1  # the highest step lease it holds (reported, or granted here)
    steps_past_lease: int = 0  # steps it served without a confirmed config (it reports them)
    past_lease: bool = False  # at its last report: at a step past its lease
    past_lease_at: float = float("-inf")  # when a report last showed more steps served past the lease
    rate: float = 0.0  # its steps per second: samples over RATE_WINDOW or more of its reports, smoothed
    rate_anchor: tuple[int, float] = (-1, 0.0)  # (step, time) the rate is measured from
    streams: int = 0  # its open push streams to this lighthouse (0: it polls)
    ttl: float = 0.0  # the cache TTL it asks leases for: how often a polling manager is heard from

    def to_json(self, now: float, head: int) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "address": self.address,
            "version": self.version,
            # pushed to: the open stream is its liveness (it reports only when something changed)
            "last_seen_s": 0 if self.streams else round(now - self.last_seen, 3),
            "mode": "push" if self.streams else "poll",
            "behind_versions": max(0, head - self.version),
            "requests": self.requests,
            "cache_hits": self.cache_hits,
            "step": self.step,
            "fetches": self.fetches,
            "lease_through_step": self.lease_through,
            "past_lease": self.past_lease or now - self.past_lease_at < PAST_LEASE_SHOWN,
            "steps_past_lease": self.steps_past_lease,
            "ttl_s": self.ttl,
        }


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The GetConfig replies for one (version, current segment), serialized once."""

    version: int
    config: dict[str, str]
    segments: tuple[Segment, ...]
    full_reply: bytes
    not_modified_reply: bytes
    instance_id: str = ""
    state_id: str = ""
    _from: dict[int, bytes] = field(default_factory=dict, repr=False)  # reply_from's, by segment

    def reply_from(self, step: int) -> bytes:
        """The reply for a group at ``step``: only the segments from the one holding ``step`` on, so
        its size does not grow with the history (a group never needs a step below the one it
        reports: those it served are pinned). Serialized once per first segment."""
        if step < 0 or len(self.segments) < 2 or step < self.segments[1].from_step:
            return self.full_reply
        first = first_segment(self.segments, step)
        cached = self._from.get(first)
        if cached is None:
            reply = config_reply(self.config, self.segments[first:], self.version)
            reply.instance_id, reply.state_id = self.instance_id, self.state_id
            cached = self._from[first] = reply.SerializeToString()
        return cached


def first_segment(segments: tuple[Segment, ...], step: int) -> int:
    """Index of the segment that holds ``step`` (the first from step 0)."""
    return max(0, bisect.bisect_right([s.from_step for s in segments], step) - 1)


def config_reply(
    live: dict[str, str], segments: tuple[Segment, ...], version: int
) -> pb.LighthouseConfigResponse:
    """A reply with ``live`` and ``segments`` (the ones a receiver can still use)."""
    reply = pb.LighthouseConfigResponse(config_data=live, version=version)
    for seg in segments:
        reply.segments.add(from_step=seg.from_step, config_data=encode_config(seg.config))
    return reply


class LighthouseState:
    def __init__(
        self,
        store: ConfigStore,
        config_path: Path | None = None,
        strict: bool = False,
        schema_path: Path | None = None,
    ) -> None:
        self.store = store
        self.job = store.job
        self.instance_id = uuid.uuid4().hex
        self.config_path = config_path.resolve() if config_path is not None else None
        self.file_error: str | None = None
        self.schema = JobSchema(store, schema_path)  # checks every commit below
        self.series = JobSeries(self.job)  # what the job's ranks report (ManagerClient.report)
        if store.backend.shared:
            self.series.share()  # other lighthouses take what this one's managers send (peer_series)
        # Changes that roll themselves back when a metric regresses, as a change made here.
        self.guards = JobGuards(store, self.series, self._revert_change)
        self.get_config_calls = 0
        self.heartbeat_calls = 0
        self.progress = Progress()  # when the job's step last moved: a stalled job is shown as such
        self._get_config_count = itertools.count(1)  # next() is atomic: no call lost across threads
        self._heartbeat_count = itertools.count(1)
        self._lock = threading.Lock()
        self._managers: dict[str, ManagerRecord] = {}
        # Managers of this job that talk to other lighthouses on the same store (None: no peers),
        # and this lighthouse's name for its own managers in the merged table.
        self.peers: Callable[[], list[dict[str, Any]]] | None = None
        self.lighthouse = ""
        self._refresh_lock = threading.Lock()
        self._served_changed = threading.Condition()  # notified by refresh(): admin API blocking queries
        # Called after refresh() served a new snapshot (the push streams; set by the job registry).
        self.on_served: Callable[[], None] | None = None
        self.watch_messages = 0  # requests received on push streams
        self.open_streams = 0  # push streams of this job's managers open now
        self._watch_message_count = itertools.count(1)
        self._snapshot = self._build_snapshot()
        store.leases.publish(self._snapshot, self._snapshot.version)
        self._step_field = varint_field(_CURRENT_STEP, store.current_step)
        initial = load_initial(config_path, strict) if config_path is not None else None
        if schema_path is not None:
            schema_file = read_schema_file(schema_path)
            if schema_file.error is not None and strict:
                raise ConfigError(schema_file.error)
            self.schema.apply_initial_file(schema_file, initial, self.config_path)
        if initial is not None:
            self.apply_file(initial, startup=True)

    # ------------------------------------------------------------ serving
    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def _build_snapshot(self) -> Snapshot:
        store = self.store
        version = store.head
        segments = tuple(store.segments(version))
        live = encode_config(store.resolve(version, max(store.current_step, 0)))
        scheduled = len(segments) > 1 or encode_config(segments[0].config) != live
        reply = config_reply(live, segments if scheduled else (), version)
        reply.instance_id, reply.state_id = self.instance_id, store.state_id
        not_modified = pb.LighthouseConfigResponse(
            version=version, not_modified=True, instance_id=self.instance_id, state_id=store.state_id
        )
        return Snapshot(
            version,
            live,
            segments,
            reply.SerializeToString(),
            not_modified.SerializeToString(),
            self.instance_id,
            store.state_id,
        )

    def refresh(self) -> None:
        """Rebuild the served reply after a change (or when the job's step crossed a scheduled step).

        Serialized: a build that read an older head must never replace a newer snapshot. Step
        leases are granted with the snapshot published here (see ``leases.LeaseBook``).
        """
        with self._refresh_lock:
            snapshot = self._build_snapshot()
            self._snapshot = snapshot
            self.store.leases.publish(snapshot, snapshot.version)
        with self._served_changed:
            self._served_changed.notify_all()
        on_served = self.on_served
        if on_served is not None:
            on_served()  # the push streams: send the new version now

    def wait_for_version(self, after: int, timeout: float) -> bool:
        """Block until the job has a version newer than ``after`` (True) or ``timeout`` passed (False).

        Every change, also one arriving from another lighthouse on the store, lands in refresh(),
        which wakes the waiters: a watching operator sees a version as soon as it is served.
        """
        with self._served_changed:
            return self._served_changed.wait_for(lambda: self.store.head > after, timeout)

    def receive(self, request: pb.LighthouseConfigRequest, peer: str, stream: bool = False) -> int:
        """Take in a fetch (a GetConfig call, or a request on a push stream): count it, record the
        manager's status; the step a lease should cover (-1: none, no step reported)."""
        if stream:
            self.watch_messages = next(self._watch_message_count)
        else:
            self.get_config_calls = next(self._get_config_count)
        if not request.HasField("status"):
            return -1
        step = self.observe(request.status, peer, fetch=True)
        if request.lease_seconds > 0:
            with self._lock:
                record = self._managers.get(request.status.replica_id or peer)
                if record is not None:
                    record.ttl = request.lease_seconds
        if step < 0 <= self.store.current_step:
            # A new manager of a job that steps (a group restarting, say): store a ceiling for its
            # first lease now, so its first steps need not wait for a store write. Not for a job
            # that never stepped: a stored ceiling is a possible promise, and would make changes
            # wait for steps that may never come (a job whose workers ask without a step).
            self.store.leases.prepare(self.store.current_step, request.lease_seconds)
        if request.HasField("lease_from_step"):
            wanted = request.lease_from_step  # a step a worker waits for, beyond those served
            if 0 <= wanted <= max(step, self.store.current_step, 0) + MAX_STEP_LEAP:
                step = max(step, wanted)
        return step

    def answer(
        self,
        known_version: int,
        known_state_id: str,
        step: int,
        request: pb.LighthouseConfigRequest,
        peer: str,
        wait: float = 0.0,
    ) -> tuple[bytes, int] | None:
        """The serialized reply for a manager holding ``known_version``, with a step lease covering
        ``step`` (-1: none), and the version it carries. None when that lease needs a wait (the
        job's first ceiling write, a commit under way) and ``wait`` is 0: an event loop asks again
        from a thread."""
        if step >= 0:
            snap, horizon = self.store.leases.grant(step, request.lease_seconds, wait)
            if horizon == NO_LEASE and wait == 0.0:
                return None
            self._note_lease(request.status.replica_id or peer, horizon)
        else:
            snap, horizon = self._snapshot, NO_LEASE
        if known_version == snap.version and known_state_id == self.store.state_id:
            body = snap.not_modified_reply
        else:
            body = snap.reply_from(request.status.step if request.HasField("status") else -1)
        return body + self._step_field + varint_field(_STABLE_THROUGH, horizon), snap.version

    def watched(self, replica_id: str, opened: int, version: int | None = None) -> None:
        """A push stream of ``replica_id`` opened (1) or closed (-1), or (0) delivered ``version``."""
        with self._lock:
            self.open_streams += opened
            record = self._managers.get(replica_id)
            if record is None:
                return
            record.streams = max(0, record.streams + opened)
            record.last_seen = time.monotonic()
            if version is not None:
                record.version = version

    def _note_lease(self, replica_id: str, horizon: int) -> None:
        with self._lock:
            record = self._managers.get(replica_id)
            if record is not None and horizon > record.lease_through:
                record.lease_through = horizon

    def count_heartbeat(self) -> None:
        self.heartbeat_calls = next(self._heartbeat_count)

    def observe(self, status: pb.ManagerStatus, peer: str, fetch: bool = False) -> int:
        """Record a manager's status (from a heartbeat or riding on a fetch); returns its step when
        plausible (a step lease may cover it), else -1."""
        replica_id = status.replica_id or peer
        now = time.monotonic()
        rate = 0.0
        with self._lock:
            record = self._managers.get(replica_id)
            if record is None:
                record = self._managers[replica_id] = ManagerRecord(replica_id)
                logger.info("manager %s (%s) joined", replica_id, status.address or peer)
            record.address = status.address or peer
            record.version = status.version
            record.requests = status.requests
            record.cache_hits = status.cache_hits
            previous, record.step = record.step, status.step
            plausible = self._plausible_step(previous, status.step)
            if status.HasField("lease_through_step"):  # a manager with leases says what it holds
                record.lease_through = status.lease_through_step
            record.past_lease = 0 <= record.lease_through < status.step
            if status.steps_past_lease > record.steps_past_lease:
                record.past_lease_at = now
            record.steps_past_lease = status.steps_past_lease
            anchor_step, anchor_time = record.rate_anchor
            if not plausible or status.step < anchor_step or anchor_step < 0:
                record.rate_anchor = (status.step, now)  # (re)start measuring from here
            elif now - anchor_time >= RATE_WINDOW:
                sample = (status.step - anchor_step) / (now - anchor_time)
                smoothed = record.rate + RATE_SMOOTHING * (sample - record.rate) if record.rate else sample
                rate = record.rate = smoothed
                record.rate_anchor = (status.step, now)
            record.last_seen = now
            record.fetches += int(fetch)
        if rate > 0:
            self.store.leases.observe_rate(rate)
        if status.metrics or status.metrics_dropped:
            self.series.take_status(replica_id, status)
        if status.switches:
            self.store.record_switches(
                replica_id, [(s.version, s.step, s.previous_step) for s in status.switches]
            )
        if plausible and self.store.advance_step(status.step):
            self._step_moved()
        return status.step if plausible else -1

    def _step_moved(self) -> None:
        self.progress.moved(self.store.current_step)
        # Appended to every reply: protobuf keeps the last value of a field, so the
        # serialized snapshots stay as they are.
        self._step_field = varint_field(_CURRENT_STEP, self.store.current_step)
        if len(self._snapshot.segments) > 1:
            self._maybe_refresh_for_step()

    def adopt_step(self, step: int) -> None:
        """A job step another lighthouse on the same store reached: served and ordered by here too."""
        if self.store.adopt_step(step):
            self._step_moved()

    def reload(self) -> None:
        """Serve what the store holds now (another lighthouse on the same store changed the job)."""
        self.store.reload()
        self.schema.reload()
        self.guards.reload()
        self._step_field = varint_field(_CURRENT_STEP, self.store.current_step)
        self.refresh()

    def _plausible_step(self, previous: int, step: int) -> bool:
        """Whether a manager's reported step may move the job's step (which orders every change).

        A leap of more than MAX_STEP_LEAP counts only once the same manager reports a step
        near it again, so one stray report cannot move the job far ahead for good.
        """
        if step < 0:
            return False
        near_job = step <= max(self.store.current_step, 0) + MAX_STEP_LEAP
        confirmed = previous >= 0 and 0 <= step - previous <= MAX_STEP_LEAP
        return near_job or confirmed

    def _maybe_refresh_for_step(self) -> None:
        step = self.store.current_step
        live = next(s for s in reversed(self._snapshot.segments) if s.from_step <= step)
        if encode_config(live.config) != self._snapshot.config:
            self.refresh()

    def managers(self) -> list[dict[str, Any]]:
        """Every manager of the job; with peers, also those of other lighthouses, each saying which
        lighthouse it talks to (a group seen by two lighthouses: the one that heard from it last)."""
        local = self._records(time.monotonic())
        peers = self.peers
        if peers is None:
            return local
        merged: dict[str, dict[str, Any]] = {}
        for m in [*local, *peers()]:
            m.setdefault("lighthouse", self.lighthouse)
            known = merged.get(m["replica_id"])
            if known is None or m["last_seen_s"] < known["last_seen_s"]:
                merged[m["replica_id"]] = m
        return [merged[r] for r in sorted(merged)]

    def stall(self) -> str | None:
        """Why the job is stalled (every rank gone, or no step progress), None when it is not."""
        return self.progress.stall(self.managers())

    def _records(self, now: float) -> list[dict[str, Any]]:
        """The managers that talk to this lighthouse, by replica id, ages from ``now`` (monotonic)."""
        head = self.store.head
        with self._lock:
            return [m.to_json(now, head) for m in sorted(self._managers.values(), key=lambda m: m.replica_id)]

    def local_managers(self) -> list[dict[str, Any]]:
        """The managers that talk to this lighthouse, with ``seen_at`` on the wall clock (other
        lighthouses do not share this process's monotonic clock)."""
        records = self._records(time.monotonic())
        wall = time.time()
        for m in records:
            m["seen_at"] = round(wall - m.pop("last_seen_s"), 3)
        return records

    # ------------------------------------------------------------ changes
    def change(
        self,
        op: str,
        body: Any,
        *,
        source: str,
        author: str = "-",
        comment: str = "",
        effective_step: int | None = None,
        if_match: int | None = None,
        dry_run: bool = False,
        allow_type_change: bool = False,
    ) -> Plan:
        """Validate, check against the schema and durably commit a put/patch (a dry run stops
        before writing); the reply served to managers follows at once. A key whose JSON type
        it alters refuses it (TypeChanged) unless ``allow_type_change``."""
        config = validate_object(body)
        edit = Edit(op, config, source, author, comment, effective_step)
        check = self._check if allow_type_change else self._check_types
        return self._apply([edit], if_match=if_match, dry_run=dry_run, check=check)

    def _check_types(self, plan: Plan) -> None:
        self._check(plan)  # first: a schema's violation (or the size) says more than a type change
        changed = type_changes(plan.before, plan.after)
        if changed:
            raise TypeChanged(changed)

    def _revert_change(
        self,
        op: str,
        body: Any,
        *,
        source: str,
        author: str = "-",
        comment: str = "",
        if_match: int | None = None,
    ) -> Plan:
        """A guard's rollback: explicit by nature, so it may put a key's old type back."""
        return self.change(
            op, body, source=source, author=author, comment=comment, if_match=if_match, allow_type_change=True
        )

    def _check(self, plan: Plan) -> None:
        """Refuse a commit that breaks the schema, or whose reply to a group at the job's step would
        pass the gRPC message limit (413 now, rather than acknowledged and then failing every call)."""
        self.schema.check(plan)
        segments = plan.segments_after
        used = segments[first_segment(segments, plan.step) :] if len(segments) > 1 else ()
        size = config_reply(encode_config(plan.live), used, plan.row.version).ByteSize()
        if size > MAX_REPLY_BYTES - REPLY_HEADROOM:
            raise ConfigTooLarge(
                f"the reply to a manager would be {size} bytes, more than the {MAX_REPLY_BYTES} a gRPC "
                "message may carry (cancel or merge changes scheduled ahead)"
            )

    def rollback(self, version: int, *, author: str = "-", comment: str = "", dry_run: bool = False) -> Plan:
        """A new version with ``version``'s content; cancels pending scheduled changes made after it.

        The cancels and the new version are one commit: refused (or dry run) all together.
        """
        store = self.store
        with store.lock:
            store.get(version)  # NotFound when it never existed or was pruned
            # A pending change already promised to the groups stays (it cannot be withdrawn); the
            # rollback, made now, takes effect above it and so overrides it from then on.
            edits = [
                Edit(
                    "cancel",
                    {"version": item["version"]},
                    "api",
                    author,
                    f"cancelled by rollback to {version}",
                    optional=True,
                )
                for item in store.scheduled()
                if item["status"] == "pending" and item["version"] > version
            ]
            # What that version gave at the job's current step: its own pending scheduled changes
            # stay scheduled (they apply at their step, on top), they are not applied now.
            content = store.resolve(version, store.current_step)
            edits.append(Edit("put", content, "rollback", author, comment or f"rollback to {version}"))
        # Applied outside the read lock: the commit waits for the backend, readers must not.
        return self._apply(edits, dry_run=dry_run)

    def cancel(self, version: int, *, author: str = "-", comment: str = "") -> Plan:
        edit = Edit("cancel", {"version": version}, "api", author, comment or f"cancel {version}")
        return self._apply([edit])

    def _apply(
        self,
        edits: list[Edit],
        *,
        if_match: int | None = None,
        dry_run: bool = False,
        check: Callable[[Plan], None] | None = None,
    ) -> Plan:
        if self.store.backend.shared:  # another lighthouse may have changed the schema a moment ago
            self.schema.reload()  # (read before the store's lock: an etcd outage never blocks readers)
        plan = self.store.apply(
            edits,
            if_match=if_match,
            check=check or self._check,
            dry_run=dry_run,
            committed=self.refresh,
        )
        if not dry_run:
            row = plan.row
            when = "" if row.effective_step is None else f", takes effect at step {row.effective_step}"
            logger.info(
                "config version %d (%s by %s, %s%s)", row.version, row.op, row.author, row.source, when
            )
        return plan

    def apply_file(self, content: FileContent, startup: bool = False) -> Plan | None:
        """A new version from the config file when its content is new; a bad file only sets file_error."""
        path = self.config_path
        assert path is not None
        if content.error is not None:
            self.file_error = content.error
            if not startup:
                logger.error("config file edit ignored, live config unchanged: %s", content.error)
            return None
        self.file_error = None
        assert content.config is not None and content.digest is not None
        if self.store.file_hash(str(path)) == content.digest:
            return None  # unchanged since last loaded: the stored (maybe edited) version stays live
        try:
            plan = self.change("put", content.config, source="file", author="-", comment=str(path))
        except ConfigError as exc:  # too large, bad key, violates the schema: like any other bad file
            self.file_error = f"{path}: {exc}"
            logger.error("config file not loaded, live config unchanged: %s", self.file_error)
            return None
        self.store.set_file_hash(str(path), content.digest)
        return plan

    # -------------------------------------------------------------- views
    def view(self) -> dict[str, Any]:
        """GET /api/config: the live config with its original JSON types.

        ``upcoming``: the config once the changes made now that are still pending (they take
        effect above the step leases) have taken effect, None when there are none. An editor
        edits that one: editing the live config would undo them.
        """
        store = self.store
        pending = [s for s in store.scheduled() if s["status"] == "pending"]
        with store.lock:  # version and config from the same instant
            latest = store.latest()
            config = store.live()
            served = live_version(store.held_changes(), store.current_step)
            made_now = [s["effective_step"] for s in pending if not s["scheduled"]]
            upcoming = None
            if latest is not None and made_now:
                at = max(made_now)
                upcoming = {
                    "version": latest.version,
                    "effective_step": at,
                    "config": store.resolve(latest.version, at),
                }
        next_change = min(pending, key=lambda s: (s["effective_step"], s["version"]), default=None)
        return {
            "version": latest.version if latest else 0,
            # The version whose config ``config`` is (served at the job's step); the head
            # (``version``) differs while a change is pending, which ``pending`` names apart.
            "live_version": served,
            "pending": None
            if next_change is None
            else {"version": next_change["version"], "effective_step": next_change["effective_step"]},
            "config": config,
            "updated_at": latest.created_at if latest else None,
            "source": latest.source if latest else None,
            "author": latest.author if latest else None,
            "comment": latest.comment if latest else None,
            "current_step": self.store.current_step,
            # The highest step groups may have been promised: a change made now takes effect after
            # it, and nothing can be scheduled at or below it (-1: no group holds a lease).
            "lease_horizon": self.store.leases.horizon,
            # How far this lighthouse may promise without another store write (its stored ceiling):
            # what carries the groups through a store that cannot write (etcd without quorum).
            "lease_ceiling": self.store.leases.stored,
            "scheduled": pending,
            "upcoming": upcoming,
            "file": {
                "path": str(self.config_path) if self.config_path else None,
                "error": "; ".join(e for e in (self.file_error, self.schema.error) if e) or None,
                "schema_path": str(self.schema.path) if self.schema.path else None,
            },
            "schema": self.schema.schema is not None,
            "instance_id": self.instance_id,
            "state_id": self.store.state_id,
        }
