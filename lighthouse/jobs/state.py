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
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
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
from lighthouse.jobs.runs import STEP_BITS, Run
from lighthouse.jobs.schema_check import JobSchema
from lighthouse.jobs.series import JobSeries
from lighthouse.jobs.stall import Progress
from lighthouse.jobs.timeline import live_version
from lighthouse.jobs.versions import ConfigStore, Edit, Plan, Segment, first_segment
from protos import lighthouse_config_pb2 as pb
from protos.limits import (
    FOREVER,
    MAX_LEASE_SECONDS,
    SEGMENT_AUTHOR_CHARS,
    SEGMENT_COMMENT_CHARS,
    SWITCHES_HELD,
)
from protos.rpc import MAX_REPLY_BYTES, varint_field

logger = logging.getLogger(__name__)

MAX_STEP_LEAP = 1_000_000  # steps ahead a worker may ask a lease for (``lease_from_step``)
# What one report may do to the job's step (``plausible_step``): STEP_SLACK steps beyond the
# job's step or the group's last accepted step, plus what its rate makes plausible since then.
STEP_SLACK = 64
RATE_FACTOR = 4.0
# The rate assumed for a group whose rate is not measured yet, or is lower: a manager that reports
# once a second for a job of 100 steps/s leaps 100 steps per report before any rate is known, and
# must not be ignored (its job step would stall, and its leases with it); a step of 10^15 still is.
RATE_FLOOR = 1000.0
IGNORED_LOG_EVERY = 10.0  # seconds between two log lines about ignored reports, per job
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
# A run ends when every manager of the job has been gone, or has not stepped, for longer than
# RUN_END_TTLS x its lease's seconds (its cache TTL) + RUN_END_MARGIN: a manager's own lease lapses
# after one TTL without a step (it renews before serving the next), so none serves past the end.
RUN_END_TTLS = 2.0
RUN_END_MARGIN = 0.5
# Seconds between two looks at a live run (the health loop looks every second) that mean this
# process did not run meanwhile: it then decides nothing about the run from what it held before.
PAUSE_GAP = 2.0
RUN_STEP_LIMIT = (1 << STEP_BITS) - 1  # a run may begin at any step below
_CURRENT_STEP = pb.LighthouseConfigResponse.CURRENT_STEP_FIELD_NUMBER
_STABLE_THROUGH = pb.LighthouseConfigResponse.STABLE_THROUGH_STEP_FIELD_NUMBER


@dataclass(frozen=True)
class ManagerLimits:
    """How many manager records a job keeps, and how long: a flood of made-up replica ids must not
    grow the lighthouse."""

    max_managers: int = 1024
    """Records per job; a new one past it evicts the oldest-unseen without a stream (``--max-managers``)."""
    record_ttl: float = 3600.0
    """Seconds a manager unseen (and without a push stream) stays listed (``--manager-record-ttl``)."""


@dataclass
class ManagerRecord:
    """The latest status a manager reported, and when."""

    replica_id: str
    address: str = ""
    version: int = 0  # the newest version it holds
    live_version: int = 0  # the version its workers get at its step (0: not said, an older manager)
    pending: tuple[int, int] | None = None  # (version, step) of the change pending after its step
    requests: int = 0
    cache_hits: int = 0
    step: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    fetches: int = 0
    lease_through: int = -1  # the highest step lease it holds (reported, or granted here)
    steps_past_lease: int = 0  # steps it served without a confirmed config (it reports them)
    past_lease: bool = False  # at its last report: at a step past its lease
    past_lease_at: float = float("-inf")  # when a report last showed more steps served past the lease
    fallback: bool = False  # at its last report: its workers get the fallback (no version, or past the lease)
    rate: float = 0.0  # its steps per second: samples over RATE_WINDOW or more of its reports, smoothed
    rate_anchor: tuple[int, float] = (-1, 0.0)  # (step, time) the rate is measured from
    anchor_at_front: bool = False  # its step at the anchor was at the job's front
    front_rate: float = 0.0  # ``rate`` over windows spent at the job's front only: what sets leases
    served_run: int = -1  # the job's run when it was last served a config (GetConfig, push stream)
    streams: int = 0  # its open push streams to this lighthouse (0: it polls)
    ttl: float = 0.0  # the cache TTL it asks leases for: how often a polling manager is heard from
    accepted: tuple[int, float] = (-1, 0.0)  # (step, time) of its last report that counted
    moved_at: float = float("-inf")  # when a report of it last moved its step (it trains in the run)
    trained: bool = False  # a step it reported counted (plausible_step): its metrics count
    identity: str = ""  # the credential it called with ("" on an open lighthouse)

    def to_json(self, now: float, head: int) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "address": self.address,
            "version": self.version,  # the newest it holds (ahead of live_version while one is pending)
            # What its workers get at its step (tables name this one), and the change pending after it.
            "live_version": self.live_version or self.version,
            "pending_version": None if self.pending is None else self.pending[0],
            "pending_step": None if self.pending is None else self.pending[1],
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
            "fallback": self.fallback,
            "ttl_s": self.ttl,
            "identity": self.identity,
        }


def believable_switches(switches: Iterable[pb.StepSwitch], head: int) -> list[tuple[int, int, int]]:
    """The step switches of a report that a manager could have made: to a version this lighthouse
    has (0, the fallback, to ``head``), at a step after the one before it; the last
    ``SWITCHES_HELD`` (what a manager holds). Whatever reaches the port may lie: a switch to a
    version above the head is never pruned with the history, and each (step, version) is a row. A
    lighthouse that has not read another's newest version yet drops a true switch to it: a row the
    replay misses."""
    kept = [
        (s.version, s.step, s.previous_step)
        for s in switches
        if 0 <= s.version <= head and -1 <= s.previous_step < s.step
    ]
    return kept[-SWITCHES_HELD:]


def plausible_step(step: int, job_step: int, last_accepted: int, rate: float, elapsed: float) -> bool:
    """Whether a group's reported ``step`` may move the job's step (which orders every change).

    At most ``STEP_SLACK + max(rate, RATE_FLOOR) * elapsed * RATE_FACTOR`` beyond the higher of
    the job's step and the group's last accepted step (``rate``: the group's, else the job's;
    ``elapsed``: seconds since that accepted report, or for a group never accepted since any
    group's last). A job that never stepped takes its first step as reported.
    """
    if step < 0:
        return False
    if job_step < 0:
        return True
    base = max(job_step, last_accepted)
    allowance = STEP_SLACK + max(rate, RATE_FLOOR) * elapsed * RATE_FACTOR
    return step <= base + allowance


def lease_seconds(request: pb.LighthouseConfigRequest) -> float:
    """The renewal period a manager's lease is sized for: what it asked (its cache TTL), at most
    MAX_LEASE_SECONDS; 0 (the policy's default) for no ask, or one that is not a positive number.
    A caller may lie: asked for ever, a lease would hold every change made now back, and the run
    open, for as long as it says."""
    asked = request.lease_seconds
    return min(asked, MAX_LEASE_SECONDS) if asked > 0 else 0.0  # NaN > 0 is False


@dataclass(frozen=True, eq=False)
class ServedReplies:
    """The GetConfig replies for one (version, current segment), serialized once."""

    version: int
    config: dict[str, str]
    segments: tuple[Segment, ...]
    full_reply: bytes
    not_modified_reply: bytes
    instance_id: str = ""
    state_id: str = ""
    # The first step the full reply covers (-1: all of them, from step 0).
    full_from: int = -1
    run_start_step: int | None = None  # the live run's first step (None: no run is live)
    _from: dict[int, bytes] = field(default_factory=dict, repr=False)  # reply_from's, by segment

    def reply_from(self, step: int) -> bytes:
        """The reply for a group at ``step``: only the segments from the one holding ``step`` on, so
        its size does not grow with the history (a group never needs a step below the one it
        reports: those it served are pinned). Serialized once per first segment. No step (-1):
        the full reply, from the job's step on."""
        if step < 0 or len(self.segments) < 2:
            return self.full_reply
        first = max(0, bisect.bisect_right(self._starts, step) - 1)  # first_segment, held starts
        if self.segments[first].from_step == max(self.full_from, 0):
            return self.full_reply
        cached = self._from.get(first)
        if cached is None:
            reply = config_reply(self.config, self.segments[first:], self.version)
            reply.instance_id, reply.state_id = self.instance_id, self.state_id
            if self.run_start_step is not None:
                reply.run_start_step = self.run_start_step
            cached = self._from[first] = reply.SerializeToString()
        return cached

    @cached_property
    def _starts(self) -> list[int]:
        """Each segment's first step, listed once per snapshot: a long history holds thousands."""
        return [seg.from_step for seg in self.segments]


def config_reply(
    live: dict[str, str], segments: tuple[Segment, ...], version: int
) -> pb.LighthouseConfigResponse:
    """A reply with ``live`` and ``segments`` (the ones a receiver can still use)."""
    reply = pb.LighthouseConfigResponse(config_data=live, version=version)
    for seg in segments:
        reply.segments.add(
            from_step=seg.from_step,
            config_data=_encoded(seg.config),
            version=seg.version,
            author="" if seg.author == "-" else seg.author[:SEGMENT_AUTHOR_CHARS],  # "-": not known
            comment=seg.comment[:SEGMENT_COMMENT_CHARS],
        )
    return reply


_ENCODED: OrderedDict[int, tuple[dict[str, Any], dict[str, str]]] = OrderedDict()
_ENCODED_KEPT = 8  # a commit's few segments from the job's step on; big configs: keep few
_encoded_lock = threading.Lock()


def _encoded(config: dict[str, Any]) -> dict[str, str]:
    """``encode_config`` of a segment's config, remembered for the segments recently encoded: a
    commit checks its reply's size and then builds it, and each reply from a step encodes the
    segments from it on again; a segment's config dict is never changed once made (the store
    remembers its segments), and the entry keeps it alive, so its id names it."""
    with _encoded_lock:
        hit = _ENCODED.get(id(config))
        if hit is not None and hit[0] is config:
            _ENCODED.move_to_end(id(config))
            return hit[1]
    encoded = encode_config(config)
    with _encoded_lock:
        _ENCODED[id(config)] = (config, encoded)
        while len(_ENCODED) > _ENCODED_KEPT:
            _ENCODED.popitem(last=False)
    return encoded


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
        if store.shared:
            self.series.share()  # other lighthouses take what this one's managers send (peer_series)
        # Changes that roll themselves back when a metric regresses, as a change made here.
        self.guards = JobGuards(store, self.series, self._revert_change)
        self.get_config_calls = 0
        self.heartbeat_calls = 0
        self.progress = Progress()  # when the job's step last moved: a stalled job is shown as such
        self._get_config_count = itertools.count(1)  # next() is atomic: no call lost across threads
        self._heartbeat_count = itertools.count(1)
        self._lock = threading.Lock()
        self._accepted_at = time.monotonic()  # when a group's reported step was last accepted
        self._started_at = self._accepted_at  # a live run with no manager heard of is gone from here
        self._looked_at = self._accepted_at  # the last check_run: a longer gap than PAUSE_GAP is a pause
        self._run_began_at = float("-inf")  # when this lighthouse began the live run
        self._managers: dict[str, ManagerRecord] = {}
        self.limits = ManagerLimits()  # set by the job registry
        self._ignored_steps = 0
        self._ignored_logged = float("-inf")
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
        self.late_switches = 0  # changes groups took up after their effective step (store.late_switches)
        self._watch_message_count = itertools.count(1)
        self._snapshot = self._build_snapshot()
        store.lowest_group_step = self.lowest_group_step
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
    def snapshot(self) -> ServedReplies:
        return self._snapshot

    def _build_snapshot(self) -> ServedReplies:
        """The replies for the head. The full one (for a manager that reports no step yet) carries
        the segments from the one holding the job's step on: none below it is served by a manager
        without a step, and a group behind the job reports its step, and gets its own reply
        (``reply_from``). So no reply grows with the history, and a commit encodes only those."""
        store = self.store
        version = store.head
        segments = tuple(store.segments(version))
        job_step = max(store.current_step, 0)
        live = encode_config(store.resolve(version, job_step))
        first = first_segment(segments, job_step)
        used = segments[first:]
        # One segment that names a version other than the head (the head cancelled a change not
        # yet in effect), or who made it and why: sent too, so that what is served is named.
        named = used[0].version not in (0, version) or used[0].author not in ("", "-") or used[0].comment
        scheduled = len(used) > 1 or encode_config(used[0].config) != live or bool(named)
        reply = config_reply(live, used if scheduled else (), version)
        state_id, run_start = store.served_run()
        reply.instance_id, reply.state_id = self.instance_id, state_id
        if run_start is not None:
            reply.run_start_step = run_start
        not_modified = pb.LighthouseConfigResponse(
            version=version, not_modified=True, instance_id=self.instance_id, state_id=state_id
        )
        return ServedReplies(
            version,
            live,
            segments,
            reply.SerializeToString(),
            not_modified.SerializeToString(),
            self.instance_id,
            state_id,
            full_from=used[0].from_step if first else -1,
            run_start_step=run_start,
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

    def receive(
        self, request: pb.LighthouseConfigRequest, peer: str, stream: bool = False, identity: str = ""
    ) -> int:
        """Take in a fetch (a GetConfig call, or a request on a push stream): count it, record the
        manager's status; the step a lease should cover (-1: none, no step reported)."""
        if stream:
            self.watch_messages = next(self._watch_message_count)
        else:
            self.get_config_calls = next(self._get_config_count)
        if not request.HasField("status"):
            return -1
        asked = request.lease_from_step if request.HasField("lease_from_step") else -1
        step = self.observe(
            request.status, peer, fetch=True, identity=identity, wanted=asked, held=request.known_state_id
        )
        seconds = lease_seconds(request)
        if seconds > 0:
            with self._lock:
                record = self._managers.get(request.status.replica_id or peer)
                if record is not None:
                    record.ttl = seconds
        generation = self.store.leases.generation  # before the look at the runs (see ``grant``)
        if step < 0 <= self.store.current_step and not self.store.runs.between:
            # A new manager of a job that steps (a group restarting, say): store a ceiling for its
            # first lease now, so its first steps need not wait for a store write. Not for a job
            # that never stepped: a stored ceiling is a possible promise, and would make changes
            # wait for steps that may never come (a job whose workers ask without a step). Nor between
            # runs: nothing is promised then, and a ceiling of the ended run's step would place the
            # changes made meanwhile above it (the chaos suite, seed 2394: a job restarting).
            self.store.leases.prepare(self.store.current_step, seconds, generation)
        if request.HasField("lease_from_step") and not self._earlier_run(request.status):
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
        streamed: bool = False,
    ) -> tuple[bytes, int] | None:
        """The serialized reply for a manager holding ``known_version``, with a step lease covering
        ``step`` (-1: none), and the version it carries. None when that lease needs a wait (the
        job's first ceiling write, a commit under way) and ``wait`` is 0: an event loop asks again
        from a thread. ``streamed``: asked on a push stream (``LeasePolicy.stream_min_steps``)."""
        # The generation first, then the runs: a run's end after this look makes the grant promise
        # nothing, even when it waited for its ceiling across the end (chaos seed 403984614).
        generation = self.store.leases.generation
        if step >= 0 and not self.store.runs.between:  # no run is live: nothing to promise to
            seconds = lease_seconds(request)
            snap, horizon = self.store.leases.grant(step, seconds, wait, generation, streamed)
            if horizon == NO_LEASE and wait == 0.0 and not self.store.leases.gate.suspended:
                return None  # suspended: no wait brings a lease
            self._note_lease(request.status.replica_id or peer, horizon)
        else:
            snap, horizon = self._snapshot, NO_LEASE
        # From the lowest step the manager may still serve from it: its step or the lease's.
        steps = [s for s in (request.status.step if request.HasField("status") else -1, step) if s >= 0]
        lowest = min(steps, default=-1)
        # A manager that holds this version from a stepless reply (segments from the job's step on)
        # and now serves a lower step (a group restarted behind the job) gets the segments it lacks.
        below_full = 0 <= lowest < snap.full_from
        if known_version == snap.version and known_state_id == snap.state_id and not below_full:
            body = snap.not_modified_reply
        else:
            body = snap.reply_from(lowest)
        if horizon == NO_LEASE and self.store.leases.gate.suspended:
            # Answered as a release without leases does: the manager serves by its TTL, no fallback.
            return body + self._step_field, snap.version
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

    def observe(
        self,
        status: pb.ManagerStatus,
        peer: str,
        fetch: bool = False,
        identity: str = "",
        wanted: int = -1,
        held: str | None = None,
    ) -> int:
        """Record a manager's status (from a heartbeat or riding on a fetch); returns its step when
        plausible (a step lease may cover it), else -1. ``wanted``: a step its workers wait for;
        ``held``: the state id of the snapshot it serves (None: a heartbeat does not say).

        A run id the job never had ends the live run; with no run live, a manager that steps (its
        step moved under the state served now, or its workers wait for one) begins the next run,
        at any step. A step of an earlier run's id (a group still stepping in the run a new id
        ended) is not the live run's: -1, and it moves no job step."""
        replica_id = status.replica_id or peer
        self._run_for(status, replica_id, wanted, held)
        earlier_run = self._earlier_run(status)
        now = time.monotonic()
        rate = 0.0
        with self._lock:
            record = self._managers.get(replica_id)
            if record is None:
                record = self._new_record(replica_id, now)
                logger.info("manager %s (%s) joined", replica_id, status.address or peer)
            record.identity = identity
            record.address = status.address or peer
            served_before = record.live_version or record.version  # 0 for a new record: not known
            record.version = status.version
            record.live_version = status.live_version
            record.pending = (
                (status.pending_version, status.pending_step)
                if status.HasField("pending_version") and status.HasField("pending_step")
                else None
            )
            record.requests = status.requests
            record.cache_hits = status.cache_hits
            record.step = status.step
            last_step, last_time = record.accepted
            plausible = not earlier_run and plausible_step(
                status.step,
                self.store.current_step,
                last_step,
                record.rate or self.store.leases.rate,
                # A group not accepted yet (new, or every group after a lighthouse restart) is
                # judged by the time since any group's step was last accepted here.
                now - (last_time if last_step >= 0 else self._accepted_at),
            )
            if status.HasField("lease_through_step"):  # a manager with leases says what it holds
                record.lease_through = status.lease_through_step
            record.past_lease = 0 <= record.lease_through < status.step
            if status.steps_past_lease > record.steps_past_lease:
                record.past_lease_at = now
            record.steps_past_lease = status.steps_past_lease
            # Version 0 is served only as the fallback; a step past the lease got it (or, serving stale,
            # the last good config): what a step past the lease gets while the lighthouse grants none.
            record.fallback = status.version == 0 or record.past_lease
            if plausible:
                record.trained = True
                if status.step > last_step:
                    record.moved_at = now
                record.accepted = (status.step, now)
                self._accepted_at = now
                anchor_step, anchor_time = record.rate_anchor
                # Only a group at the job's front sets the job's rate (its leases' length): one
                # replaying old steps after a rewind of its own runs far faster than the job trains
                # (1,000 steps/s against 66 stretched every lease to 2,222 steps, issue 36).
                front = status.step + STEP_SLACK >= self.store.current_step
                if status.step < anchor_step or anchor_step < 0:
                    record.rate_anchor = (status.step, now)  # (re)start measuring from here
                    record.anchor_at_front = front
                elif now - anchor_time >= RATE_WINDOW:
                    sample = (status.step - anchor_step) / (now - anchor_time)
                    smoothed = (
                        record.rate + RATE_SMOOTHING * (sample - record.rate) if record.rate else sample
                    )
                    record.rate = smoothed
                    if front and record.anchor_at_front:
                        last = record.front_rate
                        rate = record.front_rate = last + RATE_SMOOTHING * (sample - last) if last else sample
                    else:
                        record.front_rate = 0.0  # measured afresh once it is back at the front
                    record.rate_anchor = (status.step, now)
                    record.anchor_at_front = front
            elif status.step >= 0 and not earlier_run:
                self._ignored(replica_id, status.step, now)
            record.last_seen = now
            record.fetches += int(fetch)
            if fetch:
                record.served_run = self.store.runs.number
            # Its metrics count (series, guards) once it trained a step here and was served a config
            # of this run: a made-up replica that only heartbeats plausible steps steers no guard.
            trained = record.trained and record.served_run == self.store.runs.number
        if rate > 0:
            self.store.leases.observe_rate(rate)
        if (status.metrics or status.metrics_dropped) and trained:  # none: it trained no step here
            self.series.take_status(replica_id, status)
        switches = believable_switches(status.switches, self.store.head) if status.switches else []
        if switches:
            self.store.record_switches(replica_id, switches)
            late = self.store.late_switches(served_before, switches)
            if late:
                logger.warning(
                    "job %s: manager %s took up %d change(s) after their step", self.job, replica_id, late
                )
                with self._lock:
                    self.late_switches += late
        if plausible and self.store.advance_step(status.step):
            self._step_moved()
        return status.step if plausible else -1

    # ------------------------------------------------------------ runs
    def _earlier_run(self, status: pb.ManagerStatus) -> bool:
        """Whether ``status`` names another run id than the live run's (which has one): a run before
        it, as a new id ends the live run. Its steps are not the live run's."""
        live = self.store.runs.live
        return live is not None and bool(live.run_id) and bool(status.run_id) and status.run_id != live.run_id

    def _run_for(self, status: pb.ManagerStatus, replica_id: str, wanted: int, held: str | None) -> None:
        """End the live run on a new run id; begin one for a manager that steps while none is live."""
        runs = self.store.runs
        live = runs.live
        run_id = status.run_id
        if live is not None and run_id and run_id != live.run_id and not runs.known_id(run_id):
            self.end_run(f"run id {run_id!r}")
            live = None
        if live is not None:
            return
        with self._lock:
            record = self._managers.get(replica_id)
            before = record.step if record is not None else -1
        # The first step of the new run: the one its workers wait for, or a step served since the
        # manager's last report from the snapshot served now. A step served from an earlier state's
        # (a report of the ended run's last steps, sent before the end reached the manager) is no
        # new run: it began one there, a few steps past where the workers resumed.
        moved = status.step > before and held == self.store.served_state_id
        starts = [s for s in (wanted, status.step if moved else -1) if s >= 0]
        start = min(starts, default=-1)
        if 0 <= start <= RUN_STEP_LIMIT:
            self.begin_run(start, run_id, status)

    def begin_run(self, step: int, run_id: str = "", status: pb.ManagerStatus | None = None) -> Run | None:
        """Begin the next run at ``step`` (None: one is live already); served at once."""
        self._run_began_at = time.monotonic()
        run = self.store.begin_run(step, run_id)
        if run is None:
            return None
        logger.info(
            "job %s: run %d began at step %d%s%s",
            self.job,
            run.number,
            step,
            f" (run id {run_id!r})" if run_id else "",
            f", manager {status.replica_id}" if status is not None and status.replica_id else "",
        )
        self._step_field = varint_field(_CURRENT_STEP, self.store.current_step)
        self.progress = Progress()  # the new run's steps start over, maybe lower
        self.progress.moved(step)
        self.refresh()
        return run

    def end_run(self, reason: str, idle_only: bool = False) -> Run | None:
        """End the live run (None: none is live, or it goes on): its step leases end, a change made
        now applies at once, and the changes promised to it apply from the next run's first step."""
        store = self.store
        run = store.end_run(reason, idle_only=idle_only)
        if run is None:
            return None
        logger.info("job %s: run %d ended at step %d (%s)", self.job, run.number, run.end_step, reason)
        if store.promised_to(run):
            # What it was promised, pending or in effect, now holds at every step: a version says so
            # (the versions served within the run replay as they were served, at-step and the history
            # stay exact). Without it, a run resuming below a change already in effect was served
            # the config without it, and the next edit changed what that run had been promised.
            edit = Edit(
                "patch",
                {},
                "run",
                "-",
                f"run {run.number} ended ({reason}): the changes promised to it hold now",
            )
            self._apply([edit])
        else:
            self.refresh()
        return run

    def check_run(self) -> Run | None:
        """End the live run once no manager's step has moved for longer than its lease lasts
        (``RUN_END_TTLS`` x the longest TTL its managers ask for, + ``RUN_END_MARGIN``): every
        manager gone, or none stepping (a paused job). A lighthouse that just started gives them as
        long to come back. The ended run, else None."""
        now = time.monotonic()
        looked, self._looked_at = self._looked_at, now
        live = self.store.runs.live
        if live is None:
            return None
        if now - looked > PAUSE_GAP:
            # This process was stopped (SIGSTOP, a paused VM) or starved: what it holds of the
            # managers and the job's step is as old as the gap, and the groups may have stepped on
            # through another lighthouse. It decides nothing from that view: as after a start, the
            # managers (and the store's watch) get the run's whole lease to be heard again.
            self._started_at = now
            return None
        with self._lock:
            records = list(self._managers.values())
        ttl = max([live.ttl, *(r.ttl for r in records)])
        if ttl > live.ttl:
            self.store.note_run_ttl(ttl)  # after a restart, the record says how long to wait
        policy = self.store.leases.policy
        bound = max(RUN_END_TTLS * (ttl or policy.default_seconds) + RUN_END_MARGIN, policy.run_end_after)
        # The job's step moving counts too: on an etcd prefix the groups may talk to other lighthouses.
        job_moved = self.progress.at if self.progress.at is not None else float("-inf")
        moved = max([self._started_at, self._run_began_at, job_moved, *(r.moved_at for r in records)])
        # A run another lighthouse began (read from the store) gets the whole bound too, from its
        # start: this one has heard none of its managers yet (the chaos suite: a lighthouse back
        # from a cut ended three runs the other began, each within 100 ms of its start).
        if now - moved > bound and time.time() - live.started_at > bound:
            ended = self.end_run("managers gone", idle_only=True)
            if ended is None and self.store.runs.live is not None:
                # Its groups step through another lighthouse (or another changed the store first):
                # a whole bound again before the next look, not one per call (the job's stored step
                # may stand still meanwhile: the other lighthouse stores it when the store lets it).
                self._started_at = now
            return ended
        return None

    def runs(self) -> list[dict[str, Any]]:
        """The job's runs, oldest first (``GET /api/config/runs``)."""
        self.check_run()
        return self.store.runs.to_json()

    def _new_record(self, replica_id: str, now: float) -> ManagerRecord:
        """A record for a new manager (under the lock): records unseen for ``record_ttl`` go first;
        at ``max_managers``, the oldest-unseen without a push stream makes room (a flood of made-up
        ids evicts itself: real managers are seen every few seconds)."""
        self._expire(now)
        if len(self._managers) >= self.limits.max_managers:
            idle = [m for m in self._managers.values() if not m.streams]
            if idle:
                del self._managers[min(idle, key=lambda m: m.last_seen).replica_id]
        record = self._managers[replica_id] = ManagerRecord(replica_id, last_seen=now)
        return record

    def lowest_group_step(self) -> int | None:
        """The lowest step a manager of the live run stands at, of those that trained a step here
        and were heard from within ``record_ttl`` (None: none): the store keeps every step from
        there on as scheduled (its fold step stays below it)."""
        now, run = time.monotonic(), self.store.runs.number
        with self._lock:
            steps = [
                m.step
                for m in self._managers.values()
                if m.trained
                and m.served_run == run
                and m.step >= 0
                and now - m.last_seen <= self.limits.record_ttl
            ]
        return min(steps, default=None)

    def _expire(self, now: float) -> None:
        """Drop records unseen for ``record_ttl`` (under the lock)."""
        stale = [
            r
            for r, m in self._managers.items()
            if not m.streams and now - m.last_seen > self.limits.record_ttl
        ]
        for replica_id in stale:
            del self._managers[replica_id]

    def _ignored(self, replica_id: str, step: int, now: float) -> None:
        """Log (at most every IGNORED_LOG_EVERY seconds per job) a reported step that did not count."""
        self._ignored_steps += 1
        if now - self._ignored_logged >= IGNORED_LOG_EVERY:
            logger.warning(
                "job %s: manager %s reported step %d, beyond what the job's step %d and its rate make "
                "plausible; ignored (%d such reports since the last line)",
                self.job,
                replica_id,
                step,
                self.store.current_step,
                self._ignored_steps,
            )
            self._ignored_logged, self._ignored_steps = now, 0

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
        run = self.store.runs.number
        self.store.reload()
        if self.store.runs.number != run:  # a run another lighthouse began: its steps start over
            self.progress = Progress()
            self.progress.moved(self.store.current_step)
        self.schema.reload()
        self.guards.reload()
        self._step_field = varint_field(_CURRENT_STEP, self.store.current_step)
        self.refresh()

    def _maybe_refresh_for_step(self) -> None:
        step = self.store.current_step
        live = next(s for s in reversed(self._snapshot.segments) if s.from_step <= step)
        if encode_config(live.config) != self._snapshot.config:
            self.refresh()

    def live_and_pending(self) -> tuple[int, dict[str, int] | None]:
        """The version served at the job's step, and the next pending change ({version,
        effective_step}; None: none): what the card, the managers table and the timeline name."""
        store = self.store
        pending = [s for s in store.scheduled() if s["status"] == "pending"]
        with store.lock:
            return self._live_and_next(pending)

    def _live_and_next(self, pending: list[dict[str, Any]]) -> tuple[int, dict[str, int] | None]:
        store = self.store
        served = live_version(store, store.held_changes(), store.current_step)
        following = min(pending, key=lambda s: (s["effective_step"], s["version"]), default=None)
        if following is None:
            return served, None
        return served, {"version": following["version"], "effective_step": following["effective_step"]}

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
            self._expire(now)
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
        it alters refuses it (TypeChanged) unless ``allow_type_change``.

        ``if_match``: the change was made from that version's config as ``view`` shows it (every
        pending change applied); refused (VersionConflict) unless that version is still the
        head and the change lands on that config as read, every pending change kept where it was
        (PendingConflict: see ``ConfigStore._check_read``).
        """
        config = validate_object(body)
        read_step = None if if_match is None else FOREVER
        edit = Edit(op, config, source, author, comment, effective_step, read_step=read_step)
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
        read_step: int | None = None,
    ) -> Plan:
        """A guard's rollback: explicit by nature, so it may put a key's old type back. Made from
        the head's config at ``read_step`` (``ConfigStore.made_now_base``), not at every step."""
        edit = Edit(op, validate_object(body), source, author, comment, read_step=read_step)
        return self._apply([edit], if_match=if_match, check=self._check)

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
        self.check_run()  # a run whose managers are all gone ends first: the change applies at once
        if self.store.shared:  # another lighthouse may have changed the schema a moment ago
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
        """GET /api/config: a version and its config, and apart the live one, with their JSON types.

        ``version`` is the head and ``config`` its config: every change up to it applied, the
        pending ones too (changes made now take effect above the step leases; scheduled ones at
        their step), as the history shows that version. Every group gets it from ``from_step``
        on (None: at the job's step already). ``live`` is what groups get at the job's step, the
        config of ``live_version`` there. An editor edits ``config`` and sends ``If-Match:
        version``: editing ``live`` would undo the pending changes.
        """
        self.check_run()
        store = self.store
        pending = [s for s in store.scheduled() if s["status"] == "pending"]
        with store.lock:  # every version and config from the same instant
            latest = store.latest()
            live = store.live()
            from_step = store.from_step()
            step = store.current_step
            served, next_change = self._live_and_next(pending)
        return {
            "version": latest.version if latest else 0,
            "config": dict(latest.config) if latest else {},  # that version's, as its history entry shows it
            "from_step": from_step,
            # The version served at the job's step and its config there (what workers get now);
            # ``pending`` names the next change to take effect after it.
            "live_version": served,
            "live": live,
            "pending": next_change,
            "updated_at": latest.created_at if latest else None,
            "source": latest.source if latest else None,
            "author": latest.author if latest else None,
            "comment": latest.comment if latest else None,
            "current_step": step,
            # The live run (None: no run is live, a change made now applies at once).
            "run": None if (run := self.store.runs.live) is None else run.to_json(),
            # The highest step groups may have been promised: a change made now takes effect after
            # it, and nothing can be scheduled at or below it (-1: no group holds a lease).
            "lease_horizon": self.store.leases.horizon,
            # How far this lighthouse may promise without another store write (its stored ceiling):
            # what carries the groups through a store that cannot write (etcd without quorum).
            "lease_ceiling": self.store.leases.stored,
            # Lighthouses on the store that do not honour step leases (none: leases are granted).
            "step_leases_suspended_by": list(self.store.leases.gate.suspended_by),
            "scheduled": pending,
            "file": {
                "path": str(self.config_path) if self.config_path else None,
                "error": "; ".join(e for e in (self.file_error, self.schema.error) if e) or None,
                "schema_path": str(self.schema.path) if self.schema.path else None,
            },
            "schema": self.schema.schema is not None,
            "instance_id": self.instance_id,
            "state_id": self.store.state_id,
        }
