"""``ManagerServer``: one gRPC relay per replica group between its workers and the lighthouse.

The lighthouse's load stays proportional to the number of groups: workers'
calls are answered from the cache (see ``upstream``), pinned per step (see
``pinning``), and a background loop refreshes the cache just before it expires,
carrying the manager's heartbeat on the same call. The ranks' reported metrics
ride on that status too (see ``metrics``), on the push stream as on a fetch.

Step leases (see ``lighthouse.jobs.leases``): each answer of the lighthouse promises
its config for every step up to a horizon H. A worker's call for a step up to H
is answered from that snapshot whatever the TTL, also while the lighthouse is
unreachable. Polling, the lease lasts about one cache TTL at the job's step rate;
on a live push stream only ``push_lease_seconds`` (or a few of the stream's round
trips), so that a change made now, which waits for the longest lease promised to
any group, is live in every group within about that (push-speed leases). The
background loop renews it once the group is half-way through it (so an outage
of half a lease changes nothing workers see) and the step's call never waits for
it. A call for a step above H waits for a renewal
(the deadline bounds it) and, without one, gets the fallback: a group that
cannot confirm its config must not train a step on one that may differ from
the other groups'. A lighthouse that answers a fetch for the group's step
without a lease (it cannot store a lease ceiling, a commit is under way) is
treated as a failing one: the following steps past the lease get the fallback
at once, and the background loop asks again each backoff until a lease comes.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

import grpc

from lighthouse.client import LighthouseClient
from manager.metrics import GroupMetrics
from manager.pinning import StepPins
from manager.push import PushStream
from manager.snapshot import CACHE, FALLBACK, STALE, Snapshot
from manager.upstream import FetchFailed, UpstreamCache
from protos import lighthouse_config_pb2 as pb
from protos.job_ids import DEFAULT_JOB, check_job_id
from protos.limits import PUSH_LEASE_SECONDS, STEP_WINDOW
from protos.probes import Probes
from protos.rpc import MANAGER_SERVICE, dialable_address, split_addresses, start_server, varint_field
from protos.tls import ServerCertificates, ServerTLS, TLSConfig, explain_rpc_error

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0
FINAL_REPORTS = 4  # heartbeats at shutdown, at most, to hand over the metrics still held
STREAM_END_WAIT = 1.0  # seconds to wait for a reset stream to end before looking again
# Answers in a row without a lease for the group's step, and for at least REFUSAL_BUDGET of the
# lighthouse deadline, after which its steps past the lease get the fallback at once. Counted in
# time too: with several lighthouses a call's first try is hedged at a quarter of the deadline, so
# a lighthouse waits an eighth of it for its ceiling, and two refusals were a quarter (a ceiling
# write slower than that at a run's first steps on a busy etcd gave the fallback: seed 1079626280).
REFUSALS_SETTLE = 2
REFUSAL_BUDGET = 0.5
# Push-speed leases: on a live push stream a lease is asked for this many of the stream's round trips
# (a renewal sent half-way has two of them to arrive), at least ``push_lease_seconds``, at most a TTL.
PUSH_LEASE_ROUND_TRIPS = 4
RTT_WEIGHT = 0.2  # of a new round trip in the stream's smoothed one
EARLIER_LEASES_KEPT = 8  # replaced leases kept for ranks behind their group (``_below_snapshot``)


_STABLE_THROUGH = pb.ManagerConfigResponse.STABLE_THROUGH_STEP_FIELD_NUMBER


class _Lease:
    """A snapshot and the highest step it is promised for (one object: read atomically), with that
    step serialized once for the workers' replies."""

    __slots__ = ("field", "snapshot", "through")

    def __init__(self, snapshot: Snapshot, through: int) -> None:
        self.snapshot = snapshot
        self.through = through
        self.field = varint_field(_STABLE_THROUGH, through)


def run_era(state_id: str) -> tuple[str, int]:
    """A served state id is the job's, with ``-rN`` once its runs began (N grows at every begin and
    end of a run): the job's state, and its era, to tell an earlier run's answer from a later one."""
    base, sep, era = state_id.rpartition("-r")
    if sep and era.isdigit():
        return base, int(era)
    return state_id, 0


def _older_run(state_id: str, than: str) -> bool:
    """Whether ``state_id`` names an earlier era of the same job state than ``than``."""
    (base, era), (other, later) = run_era(state_id), run_era(than)
    return base == other and era < later


class ManagerServer:
    """Starts serving on construction; ``address()`` is what the group's workers dial.

    Like torchft's ManagerServer it can live inside the group's rank 0 process,
    or run alone through the ``manager serve`` CLI. ``lighthouse_tls`` dials the
    lighthouse over TLS; ``tls`` serves the workers over TLS (plaintext by default);
    ``lighthouse_token`` is its job's manager token (a lighthouse with ``--manager-tokens-file``).
    """

    def __init__(
        self,
        lighthouse_addr: str,
        bind: str = "[::]:0",
        replica_id: str | None = None,
        *,
        cache_ttl: float = 1.0,
        lighthouse_timeout: float = 1.0,
        backoff: float = 1.0,
        serve_stale: bool = False,
        step_window: int = STEP_WINDOW,
        max_workers: int = 32,
        job: str = DEFAULT_JOB,
        lighthouse_tls: TLSConfig | None = None,
        tls: ServerTLS | None = None,
        lighthouse_token: str | None = None,
        push: bool = True,
        push_lease_seconds: float = PUSH_LEASE_SECONDS,
        run_id: str = "",
    ) -> None:
        if cache_ttl <= 0 or lighthouse_timeout <= 0 or backoff <= 0:
            raise ValueError("cache_ttl, lighthouse_timeout and backoff must be positive")
        if not (math.isfinite(push_lease_seconds) and push_lease_seconds >= 0):
            raise ValueError("push_lease_seconds must be a finite number of seconds, 0 or more")
        # The seconds of steps a lease asked on a live push stream covers (0: a TTL, as when polling).
        self.push_lease_seconds = push_lease_seconds
        self.push_round_trip: float | None = None  # the stream's smoothed round trip (seconds)
        self.job = check_job_id(job)
        self.run_id = run_id  # the training script's run id: a new one begins a new run of the job
        self._stepped_at = float("-inf")  # when a worker last asked for a new highest step
        self.lighthouse_timeout = lighthouse_timeout
        self.requests = 0
        self.cache_hits = 0
        self._request_count = itertools.count(1)
        self._hit_count = itertools.count(1)
        self._pins = StepPins(step_window)
        self._metrics = GroupMetrics()
        credentials = ServerCertificates(tls).grpc_credentials() if tls is not None else None
        # Several lighthouses ("A,B,C"): start at one picked by the replica id, so groups spread.
        self._lighthouse = LighthouseClient(
            lighthouse_addr,
            job=self.job,
            spread_key=replica_id or "",
            tls=lighthouse_tls,
            token=lighthouse_token,
        )
        self._instance_id = ""
        self._era_began = time.monotonic()  # when the held snapshot's run era began here (``_knows_no_runs``)
        self._lighthouse_step = -1  # the job's step as the lighthouse knows it
        self._last_contact = float("-inf")  # last call to the lighthouse, answered or not
        self._last_answer = float("-inf")  # last call the lighthouse answered
        self._lease: _Lease | None = None
        # Leases the current one replaced in the same state, newest first: what holds at a step
        # below the current snapshot's first segment (a rank behind its group's others).
        self._earlier_leases: collections.deque[_Lease] = collections.deque(maxlen=EARLIER_LEASES_KEPT)
        self._leases_supported: bool | None = None  # None until the lighthouse first answered
        self._step_wanted = -1  # a step a worker waits for, beyond the lease (asked of the lighthouse)
        self._renew_at = 0  # the step from which the background loop renews the lease
        self._refused_at: float | None = None  # a fetch for the group's step got no lease (None: one came)
        self._refusals = 0  # such answers in a row: see REFUSALS_SETTLE
        self._refusing_since = 0.0  # when the first of them came
        self._renew = threading.Event()  # wakes the background loop: a lease to renew, or stop
        self.steps_past_lease = 0
        self._past_lease_count = itertools.count(1)
        self._probes = Probes(MANAGER_SERVICE)  # NOT_SERVING until a lighthouse gave a config
        self._serving_lock = threading.Lock()  # a health report judges and sets under it (_report_serving)
        self._take_lock = threading.Lock()  # answers arrive from a fetch and from the push stream
        self._push_base = -1  # the step the last request on the push stream asked a lease for
        self._push_asked: float | None = None  # when a request on the stream went out unanswered
        self._push_switches: list[tuple[int, int, int]] = []  # step switches sent on the stream
        self._push_metrics = 0  # the metrics batch sent on the stream, not acknowledged yet
        self._reported: tuple[int, ...] = ()  # what the last report on the stream said
        self._reported_at = float("-inf")
        self._cache = UpstreamCache(
            self._fetch_and_report,
            ttl=cache_ttl,
            backoff=backoff,
            wait_timeout=lighthouse_timeout + 0.5,
            serve_stale=serve_stale,
            fallback=Snapshot.fallback(self.job),
        )
        handler = grpc.method_handlers_generic_handler(
            MANAGER_SERVICE,
            {
                "GetConfig": grpc.unary_unary_rpc_method_handler(
                    self._get_config, request_deserializer=pb.ManagerConfigRequest.FromString
                ),
                "GetStatus": grpc.unary_unary_rpc_method_handler(
                    self._get_status,
                    request_deserializer=pb.ManagerInfoRequest.FromString,
                    response_serializer=pb.ManagerInfo.SerializeToString,
                ),
            },
        )
        self._server: grpc.Server | None
        try:
            self._server, port = start_server(bind, [handler], max_workers, credentials, self._probes)
        except BaseException:
            self._lighthouse.close()
            raise
        self._address = dialable_address(bind, port)
        self.replica_id = replica_id or self._address
        self._stopped = threading.Event()
        self._push = (
            PushStream(
                self._lighthouse,
                self._push_request,
                self._pushed,
                self._push_down,
                open_timeout=max(1.0, 2 * lighthouse_timeout),
            )
            if push
            else None
        )
        self._loop = threading.Thread(target=self._refresh_loop, name="manager-refresh", daemon=True)
        self._loop.start()
        logger.info(
            "manager %s of job %s serving on %s, lighthouse %s",
            self.replica_id,
            self.job,
            self._address,
            lighthouse_addr,
        )

    def address(self) -> str:
        return self._address

    # --------------------------------------------------------- worker calls
    def _get_config(self, request: pb.ManagerConfigRequest, context: grpc.ServicerContext) -> bytes:
        self.requests = next(self._request_count)  # atomic: no increment lost across threads
        if request.metrics or request.metrics_dropped:  # the rank's reports ride on its calls
            self._metrics.add(request.metrics, request.metrics_dropped)
        if not request.HasField("step"):
            answer = self._cache.get()
            snapshot = answer.snapshot
            # Not pinned: the config at the job's step (matters only when changes are scheduled).
            segment = snapshot.segment(max(self._pins.max_step, self._lighthouse_step))
            if not answer.fetched:
                self.cache_hits = next(self._hit_count)
                return snapshot.reply(segment, False)
            return snapshot.fresh_reply(segment, False)
        step = request.step
        pinned = self._pins.get(step)
        if pinned is not None:
            self.cache_hits = next(self._hit_count)
            return pinned
        lease = self._lease
        if lease is not None and step > self._pins.max_step:
            now = time.monotonic()
            # No step for a TTL and no push stream (which would bring the end of the job's run, a
            # new state id): the run may have ended, and its leases with it. Renew first.
            if now - self._stepped_at > self._cache.ttl and not (self._push is not None and self._push.live):
                lease = self._lease = None
            self._stepped_at = now
        elif step > self._pins.max_step:
            self._stepped_at = time.monotonic()
        if lease is not None and step <= lease.through:  # promised: no TTL, no outage matters
            snapshot, fetched = lease.snapshot, False
        elif request.peek or self._leases_supported is False:  # a lighthouse without leases: the TTL
            answer = self._cache.get()
            snapshot, fetched = answer.snapshot, answer.fetched
        else:
            snapshot, fetched = self._renew_for(step)
            lease = self._lease
        # The answer says how far the group's config is promised (nothing for a fallback).
        promised = lease.field if lease is not None and snapshot is lease.snapshot else b""
        if step < snapshot.from_steps[0]:
            snapshot, promised = self._below_snapshot(step)
        segment = snapshot.segment(step)
        if request.peek or self._pins.outside_window(step):  # peek: look, pin nothing, move no step
            return snapshot.reply(segment, False) + promised
        if not fetched:
            self.cache_hits = next(self._hit_count)
        pinned = self._pins.pin(
            step, snapshot, snapshot.reply(segment, True) + promised, snapshot.segment_version(segment)
        )
        if step >= self._renew_at:
            self._renew.set()  # half-way through the lease: the background loop renews it
        return pinned if pinned is not None else snapshot.reply(segment, False) + promised

    def _below_snapshot(self, step: int) -> tuple[Snapshot, bytes]:
        """A step below every segment of the snapshot chosen for it (its reply began at a step a
        rank ahead of this one asked for): the lease promised for it before, in the same state,
        holds (a promise is for steps, not for a time); without one, the fallback. Never the first
        segment's config, which holds only from its own step on."""
        state_id = self._lease.snapshot.state_id if self._lease is not None else None
        for earlier in list(self._earlier_leases):
            held = earlier.snapshot
            if held.state_id == state_id and held.from_steps[0] <= step <= earlier.through:
                return held, earlier.field
        self.steps_past_lease = next(self._past_lease_count)
        return self._cache.fallback(), b""

    def _renew_for(self, step: int) -> tuple[Snapshot, bool]:
        """A step beyond the lease: wait for a renewal that covers it (bounded by the lighthouse
        deadline); without one the fallback, counted as a step past the lease."""

        def settled() -> bool:
            lease = self._lease
            if lease is not None and step <= lease.through:
                return True
            # Asked again before each try: an answer that began a new run of the job cleared the
            # steps wanted in the run before, and with them this one if it came while in flight.
            if step > self._step_wanted:
                self._step_wanted = step
            # The lighthouse answered the group's step without a lease, again and for half a deadline:
            # no wait brings one now (the background loop asks again each backoff), so refusals cost
            # half a deadline, not one a step. Once is not enough: a ceiling write slower than the
            # lighthouse's wait for it (a busy disk or etcd) is stored by a later answer, and the step
            # gets its lease, not the fallback.
            return (
                self._refusals >= REFUSALS_SETTLE
                and time.monotonic() - self._refusing_since >= REFUSAL_BUDGET * self.lighthouse_timeout
            )

        answer = self._cache.renew(settled)
        lease = self._lease
        if lease is not None and step <= lease.through:
            return lease.snapshot, answer.fetched
        if self._leases_supported is False:  # the lighthouse turned out to be a release without leases
            return answer.snapshot, answer.fetched
        self.steps_past_lease = next(self._past_lease_count)
        return self._cache.fallback(), False

    # ------------------------------------------------------------ upstream
    def _status(self, final: bool = False, metrics: bool = True) -> pb.ManagerStatus:
        """What the lighthouse learns of this group with each call: also the ranks' metrics, so
        whatever carries the status (a fetch, a heartbeat, the push stream) carries them.
        ``final``: the last one (every metric held goes); ``metrics=False``: none (a look)."""
        switches = self._pins.take_switches()
        batch, batch_id = self._metrics.take(everything=final) if metrics else ([], 0)
        live, pending = self.live_at_step()
        return pb.ManagerStatus(
            live_version=live,
            pending_version=None if pending is None else pending[0],
            pending_step=None if pending is None else pending[1],
            replica_id=self.replica_id,
            address=self._address,
            version=self.serving_version(),
            requests=self.requests,
            cache_hits=self.cache_hits,
            step=self._pins.max_step,
            switches=[pb.StepSwitch(version=v, step=s, previous_step=p) for v, s, p in switches],
            job=self.job,
            lease_through_step=self.lease_through_step(),
            steps_past_lease=self.steps_past_lease,
            metrics=batch,
            metrics_batch=batch_id,
            metrics_dropped=self._metrics.dropped,
            run_id=self.run_id,
        )

    def lease_through_step(self) -> int:
        """The highest step the lighthouse promised this group's config for (-1: none)."""
        lease = self._lease
        return lease.through if lease is not None else -1

    def _promised(self) -> Snapshot | None:
        """The snapshot the group's next step is promised with (None: beyond the lease, or none)."""
        lease = self._lease
        return lease.snapshot if lease is not None and self._pins.max_step < lease.through else None

    def serving_version(self) -> int:
        """The lighthouse version workers get now (0 while serving the fallback)."""
        served = self._served()
        return served.version if served is not None else 0

    def _served(self) -> Snapshot | None:
        """The snapshot workers get now (None while serving the fallback)."""
        promised = self._promised()
        if promised is not None:
            return promised  # served whether the lighthouse answers or not
        good = self._cache.good
        return good if good is not None and self._gives_config(good, self._cache.failing) else None

    def live_at_step(self) -> tuple[int, tuple[int, int] | None]:
        """The version whose config workers get at the group's step (without one, the job's), and
        (version, step) of the change pending after it (None: none); (0, None) for the fallback."""
        served = self._served()
        if served is None:
            return 0, None
        step = self._pins.max_step if self._pins.max_step >= 0 else max(self._lighthouse_step, 0)
        return served.segment_version(served.segment(step)), served.pending(step)

    def _gives_config(self, good: Snapshot | None, failing: bool) -> bool:
        """Whether workers get a lighthouse's config (the live one, or with ``serve_stale`` the last
        good one, or one still within its TTL) rather than the empty fallback: what the health
        service reports as SERVING."""
        cache = self._cache
        return good is not None and (not failing or cache.serve_stale or cache.fresh)

    def _fetch_and_report(self, held: Snapshot | None) -> Snapshot:
        """The cache's fetch; the health status follows its outcome. A failure judges by the snapshot
        held now, not ``held``: the push stream may have brought one while this fetch was in flight."""
        try:
            snapshot = self._fetch(held)
        except FetchFailed:  # still serving while the step lease covers the group, or with serve_stale
            self._report_serving(
                lambda: self._promised() is not None or self._gives_config(self._cache.good, failing=True)
            )
            raise
        self._report_serving(lambda: True)
        return snapshot

    def _report_serving(self, serving: Callable[[], bool]) -> None:
        """Tell the health service what ``serving()`` judges now, under one lock with every other
        report: a failed fetch judges by the snapshot held when it reports, and a push that brought
        the first snapshot meanwhile (it offers it, then reports) never has its SERVING overwritten by
        a judgement made before (NOT_SERVING for good once the lighthouse is gone, config held)."""
        with self._serving_lock:
            self._probes.set_serving(serving())

    def _request(self, held: Snapshot | None, lease_seconds: float) -> tuple[pb.LighthouseConfigRequest, int]:
        """A request for the lighthouse (a fetch, or a report on the push stream) asking a step lease
        for ``lease_seconds`` of steps, and the step that lease should cover."""
        status = self._status()
        wanted = self._step_wanted
        request = self._lighthouse.request(
            known_version=held.version if held else 0,
            known_state_id=held.state_id if held else "",
            status=status,
            lease_seconds=lease_seconds,
            lease_from_step=wanted if wanted > status.step else None,
        )
        return request, max(status.step, wanted)

    def _fetch(self, held: Snapshot | None) -> Snapshot:
        request, base = self._request(held, self._cache.ttl)  # polled: renewed every half TTL at most
        try:
            reply = self._lighthouse.fetch(request, timeout=self.lighthouse_timeout)
        except grpc.RpcError as exc:
            raise FetchFailed(explain_rpc_error(exc, self._lighthouse.tls is not None)) from None
        if self._knows_no_runs(reply, self._cache.good or held):
            lighthouse = self._lighthouse.current
            self._lighthouse.move_on()
            raise FetchFailed(
                f"lighthouse {lighthouse} knows no runs (a release before them) and the job's runs "
                "began: its answers would be another config than the job's; asking the next one"
            )
        self._acked(request.status)
        with self._take_lock:
            before = self._cache.good or held
            snapshot = self._take_reply(reply, before)
            self._take_lease(reply, snapshot, base)
            if (
                self._leases_supported
                and reply.stable_through_step < base
                and before is not None
                and before.state_id == snapshot.state_id == (reply.state_id or snapshot.state_id)
            ):
                # Asked for the group's step, in the state the request was made in: the lighthouse
                # cannot promise it now. Not judged on a push, whose lease is for its last request.
                self._refused_at = time.monotonic()
                if not self._refusals:
                    self._refusing_since = self._refused_at
                self._refusals += 1
        return snapshot

    # ------------------------------------------------------------ push
    def _push_request(self) -> pb.LighthouseConfigRequest:
        """A request for the push stream: its first one (the version held), a report, a renewal."""
        request, self._push_base = self._request(self._cache.good, self.stream_lease_seconds())
        self._push_switches += [(w.version, w.step, w.previous_step) for w in request.status.switches]
        self._push_metrics = request.status.metrics_batch or self._push_metrics
        self._reported = self._report_key(request.status)
        self._reported_at = time.monotonic()
        return request

    def stream_lease_seconds(self) -> float:
        """The seconds of steps a lease asked on the push stream covers: a change made now waits for
        the longest lease promised to any group, so with every group on a stream it takes effect
        within about this, not a TTL. Renewed half-way, it must outlast the renewal's round trip:
        PUSH_LEASE_ROUND_TRIPS of the stream's, at least ``push_lease_seconds``, at most the TTL."""
        ttl = self._cache.ttl
        if not self.push_lease_seconds:
            return ttl
        round_trip = self.push_round_trip or 0.0
        return min(ttl, max(self.push_lease_seconds, PUSH_LEASE_ROUND_TRIPS * round_trip))

    def _pushed(self, reply: pb.LighthouseConfigResponse) -> None:
        """A message of the push stream: a new version, an answer to a report or renewal, a keep-alive."""
        with self._take_lock:
            snapshot = self._take_reply(reply, self._cache.good)
            self._take_lease(reply, snapshot, self._push_base)
        self._cache.offer(snapshot)
        asked, self._push_asked = self._push_asked, None
        if asked is not None:  # the answer to a request (or a push that crossed it: a shorter sample)
            sample = time.monotonic() - asked
            held = self.push_round_trip
            self.push_round_trip = sample if held is None else held + RTT_WEIGHT * (sample - held)
        if self._lease is not None and self._pins.max_step >= self._renew_at:
            self._renew.set()  # the group passed half of the new lease while it came: renew now
        sent, self._push_switches = self._push_switches, []
        self._pins.ack_switches(sent)
        self._metrics.ack(self._push_metrics)
        self._report_serving(lambda: True)

    def _push_down(self, why: str) -> None:
        """The push stream ended: poll from now on, fetching at once; the cache is kept for its TTL."""
        self._push_asked = None
        self._cache.stream_ended()
        self._renew.set()

    def _push_step(self) -> float:
        """With a live push stream: renew or report on it when due; seconds until to look again."""
        push = self._push
        assert push is not None
        now = time.monotonic()
        asked = self._push_asked
        # After a reset, wait for the stream's end (``_push_down`` wakes this loop) rather than
        # spin: until the stream's thread runs, ``live`` still says True, and a loop looking again
        # at once held the GIL from that very thread (seen at load 14: the reopening took a minute).
        if asked is not None and now - asked > self.lighthouse_timeout:
            push.reset(f"no answer to a request within {self.lighthouse_timeout:g}s")
            return STREAM_END_WAIT
        deadline = 2 * push.keepalive + self.lighthouse_timeout
        if push.keepalive and push.silent_for() > deadline:
            push.reset(f"silent for {push.silent_for():.1f}s (keep-alive every {push.keepalive:g}s)")
            return STREAM_END_WAIT
        renew = self._lease is not None and self._pins.max_step >= self._renew_at and self._refused_at is None
        changed = self._report_key(self._status(metrics=False)) != self._reported
        changed = changed or self._metrics.pending
        due = renew or (changed and now - self._reported_at >= HEARTBEAT_INTERVAL)
        if asked is None and due and push.send(self._push_request()):
            self._push_asked = now
        return min(HEARTBEAT_INTERVAL, self.lighthouse_timeout / 2)

    @staticmethod
    def _report_key(status: pb.ManagerStatus) -> tuple[int, ...]:
        """What a report tells the lighthouse that changes (not its time)."""
        return (
            status.version,
            status.live_version,
            status.pending_version,
            status.requests,
            status.step,
            len(status.switches),
            status.steps_past_lease,
        )

    def _take_lease(self, reply: pb.LighthouseConfigResponse, snapshot: Snapshot, base: int) -> None:
        """Hold the lease that came with ``snapshot`` (the newest snapshot is valid for every step
        promised before, within one lighthouse state), and renew it half-way through."""
        if reply.state_id and reply.state_id != snapshot.state_id:
            return  # an answer of an earlier run, kept out (``_take_reply``): its lease is not ours
        self._leases_supported = reply.HasField("stable_through_step")
        held = self._lease
        through = reply.stable_through_step if self._leases_supported else -1
        if held is not None and held.snapshot.state_id == snapshot.state_id:
            following = self._pins.max_step + 1
            if (
                held.snapshot is not snapshot
                and following <= held.through
                and not held.snapshot.same_configs(snapshot, following, held.through)
            ):
                # Not the config promised for the group's next steps: a reply whose segments
                # begin above them (a push answered for the job's step, before the stream heard
                # of this group's). The promise is kept with the snapshot it was made with; the
                # step past it renews, and that reply covers the group's step.
                return
            through = max(through, held.through)
            if held.snapshot is not snapshot:
                self._earlier_leases.appendleft(held)
        else:
            self._earlier_leases.clear()  # another state (a run began or ended): its promises are gone
        self._lease = _Lease(snapshot, through) if through >= 0 else None
        granted = reply.stable_through_step
        if granted >= base >= 0:
            self._renew_at = base + max(1, (granted - base + 1) // 2)
            self._refused_at, self._refusals = None, 0

    def _knows_no_runs(self, reply: pb.LighthouseConfigResponse, held: Snapshot | None) -> bool:
        """Whether ``reply`` comes from a lighthouse of a release before runs (its state id has no
        run era) while the job's runs began: past a run's first step such a lighthouse reads steps
        and promises as no run (a packed step as a step, a change an ended run was promised at its
        old step), and in the first one it cannot tell its answers from before it. An answer of no
        era crosses the first run's begin only within two deadlines of it (a fetch in flight then)."""
        if held is None or reply.not_modified or not reply.state_id:
            return False
        (base, era), (held_base, held_era) = run_era(reply.state_id), run_era(held.state_id)
        crossing = time.monotonic() - self._era_began < 2 * self.lighthouse_timeout
        return era == 0 and held_era > 0 and base == held_base and not (held_era == 1 and crossing)

    def _take_reply(self, reply: pb.LighthouseConfigResponse, held: Snapshot | None) -> Snapshot:
        """The snapshot to serve after ``reply`` (the held one when not modified or older)."""
        self._last_contact = self._last_answer = time.monotonic()
        self._lighthouse_step = reply.current_step
        if reply.instance_id != self._instance_id:
            if self._instance_id:
                logger.info("lighthouse restarted (instance %s)", reply.instance_id[:8])
            self._instance_id = reply.instance_id
        if reply.not_modified and held is not None:
            return held
        fresh = Snapshot.from_reply(reply, self.job)
        if held is not None and _older_run(fresh.state_id, held.state_id):
            return held  # an answer from before the job's current run (a push and a fetch crossed)
        if held is not None and held.state_id == fresh.state_id and fresh.version < held.version:
            logger.warning(
                "lighthouse answered version %d, older than the served %d; keeping %d",
                fresh.version,
                held.version,
                held.version,
            )
            return held
        if held is None or run_era(fresh.state_id)[1] > run_era(held.state_id)[1]:
            self._era_began = time.monotonic()
        if held is not None and _older_run(held.state_id, fresh.state_id):
            self._unpin_for(reply, held)
            self._step_wanted = -1  # and the step a worker waited for, too
        if held is not None and held.state_id != fresh.state_id:
            self._refused_at, self._refusals = None, 0  # a refusal in the state before: ask anew
            logger.info(
                "a new run of the job, or its state was reset (state %s): moving from version %d to %d",
                fresh.state_id[:8],
                held.version,
                fresh.version,
            )
        elif held is None or fresh.version != held.version:
            logger.info("serving config version %d", fresh.version)
        return fresh

    def _unpin_for(self, reply: pb.LighthouseConfigResponse, held: Snapshot) -> None:
        """A run of the job ended or began (``reply`` is of a later era than ``held``): forget the
        steps pinned that are the new run's (``StepPins.run_changed``)."""
        held_era = run_era(held.state_id)[1]
        start = reply.run_start_step if reply.HasField("run_start_step") else None
        self._pins.run_changed(start, served_between=held_era > 0 and held_era % 2 == 0)

    def _refresh_loop(self) -> None:
        """With a live push stream, report and renew on it; else refresh just before the cache
        expires, and renew the step lease once the group is half-way through it; send a bare
        heartbeat when the TTL is longer than that."""
        cache = self._cache
        while not self._stopped.is_set():
            # A fetch for the group's step got no lease: fetch again a backoff later, also beside a
            # push stream (a fetch's answer is judged), and not half-way through the lease meanwhile.
            refused = self._refused_at
            retry_in = math.inf
            if refused is not None and not cache.failing:
                retry_in = refused + cache.backoff - time.monotonic()
            if self._push is not None and self._push.live and retry_in > 0:
                self._renew.wait(min(self._push_step(), retry_in))
                self._renew.clear()
                continue
            refresh_in = min(cache.next_refresh_in(), retry_in)
            renew = self._lease is not None and self._pins.max_step >= self._renew_at and refused is None
            if renew and not cache.failing:
                refresh_in = 0.0  # half the lease is used up
            heartbeat_in = self._last_contact + HEARTBEAT_INTERVAL - time.monotonic()
            if refresh_in <= 0:
                if cache.in_flight:  # a worker's call is fetching: let it finish
                    self._stopped.wait(0.005)
                else:
                    cache.refresh()
            elif heartbeat_in <= 0 and not cache.failing:
                self._heartbeat()
            else:
                self._renew.wait(refresh_in if cache.failing else min(refresh_in, heartbeat_in))
                self._renew.clear()

    def _heartbeat(self, timeout: float | None = None, final: bool = False) -> bool:
        status = self._status(final)
        try:
            self._lighthouse.heartbeat(status, timeout=timeout or self.lighthouse_timeout)
        except grpc.RpcError:
            self._last_contact = time.monotonic()  # retried in a heartbeat interval; the fetch logs outages
            return False
        self._acked(status)
        self._last_contact = self._last_answer = time.monotonic()
        return True

    def _acked(self, status: pb.ManagerStatus) -> None:
        """The lighthouse received ``status``: its switches and metrics need not be sent again."""
        self._pins.ack_switches([(w.version, w.step, w.previous_step) for w in status.switches])
        self._metrics.ack(status.metrics_batch)

    def _get_status(self, request: pb.ManagerInfoRequest, context: grpc.ServicerContext) -> pb.ManagerInfo:
        return self.info()

    def info(self) -> pb.ManagerInfo:
        """What this manager serves and why (``manager status``): never calls the lighthouse."""
        cache = self._cache
        good = cache.good
        lease = self._lease
        if (good is not None and (not cache.failing or cache.fresh)) or (
            lease is not None and self._pins.max_step <= lease.through
        ):
            source = CACHE  # also through an outage, while the step lease covers the group
        else:
            source = STALE if cache.serve_stale and good is not None else FALLBACK
        age = cache.age()
        now = time.monotonic()
        live, pending = self.live_at_step()
        return pb.ManagerInfo(
            live_version=live,
            pending_version=None if pending is None else pending[0],
            pending_step=None if pending is None else pending[1],
            replica_id=self.replica_id,
            job=self.job,
            address=self._address,
            source=source,
            version=self.serving_version(),
            cache_age_s=-1.0 if age is None else round(age, 3),
            cache_ttl_s=cache.ttl,
            lighthouse=self._lighthouse.current,
            lighthouses=split_addresses(self._lighthouse.addr),
            last_answer_age_s=round(now - self._last_answer, 3)
            if self._last_answer > float("-inf")
            else -1.0,
            last_error=cache.last_error,
            pinned_steps=len(self._pins),
            first_pinned_step=self._pins.lowest(),
            last_pinned_step=self._pins.max_step,
            lighthouse_step=self._lighthouse_step,
            requests=self.requests,
            cache_hits=self.cache_hits,
            upstream_fetches=cache.fetches,
            upstream_failures=cache.failures,
            lease_through_step=self.lease_through_step(),
        )

    def shutdown(self, grace: float | None = 0.5) -> None:
        """Stop serving; safe to call twice. A last report tells the lighthouse the group's final
        step and step switches (the replay and late-group views need them)."""
        first = not self._stopped.is_set()
        self._stopped.set()
        self._renew.set()
        if self._push is not None:
            self._push.stop()
        self._probes.shutdown()  # health watchers hear NOT_SERVING before the port closes
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
        self._loop.join(timeout=self.lighthouse_timeout + 1)
        if first and not self._cache.failing:
            for _ in range(FINAL_REPORTS):  # the last steps' metrics too (a batch is bounded)
                sent = self._heartbeat(timeout=min(self.lighthouse_timeout, 0.5), final=True)
                if not sent or not self._metrics.pending:
                    break
        self._lighthouse.close()

    def __enter__(self) -> ManagerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
