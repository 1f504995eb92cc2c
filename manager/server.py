"""``ManagerServer``: one gRPC relay per replica group between its workers and the lighthouse.

The lighthouse's load stays proportional to the number of groups: workers'
calls are answered from the cache (see ``upstream``), pinned per step (see
``pinning``), and a background loop refreshes the cache just before it expires,
carrying the manager's heartbeat on the same call. The ranks' reported metrics
ride on that status too (see ``metrics``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from lighthouse.client import LighthouseClient
from manager.metrics import GroupMetrics
from manager.pinning import StepPins
from manager.snapshot import Snapshot
from manager.upstream import FetchFailed, UpstreamCache
from protos import lighthouse_config_pb2 as pb
from protos.jobs import DEFAULT_JOB, check_job_id
from protos.rpc import dialable_address, start_server
from protos.tls import ServerCertificates, ServerTLS, TLSConfig, explain_rpc_error

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL = 1.0
FINAL_REPORTS = 4  # heartbeats at shutdown, at most, to hand over the metrics still held


class ManagerServer:
    """Starts serving on construction; ``address()`` is what the group's workers dial.

    Like torchft's ManagerServer it can live inside the group's rank 0 process,
    or run alone through the ``manager serve`` CLI. ``lighthouse_tls`` dials the
    lighthouse over TLS; ``tls`` serves the workers over TLS (plaintext by default).
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
        step_window: int = 1024,
        max_workers: int = 32,
        job: str = DEFAULT_JOB,
        lighthouse_tls: TLSConfig | None = None,
        tls: ServerTLS | None = None,
    ) -> None:
        if cache_ttl <= 0 or lighthouse_timeout <= 0 or backoff <= 0:
            raise ValueError("cache_ttl, lighthouse_timeout and backoff must be positive")
        self.job = check_job_id(job)
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
            lighthouse_addr, job=self.job, spread_key=replica_id or "", tls=lighthouse_tls
        )
        self._instance_id = ""
        self._lighthouse_step = -1  # the job's step as the lighthouse knows it
        self._last_contact = float("-inf")
        self._cache = UpstreamCache(
            self._fetch,
            ttl=cache_ttl,
            backoff=backoff,
            wait_timeout=lighthouse_timeout + 0.5,
            serve_stale=serve_stale,
            fallback=Snapshot.fallback(self.job),
        )
        handler = grpc.method_handlers_generic_handler(
            "lighthouse_config.ManagerService",
            {
                "GetConfig": grpc.unary_unary_rpc_method_handler(
                    self._get_config, request_deserializer=pb.ManagerConfigRequest.FromString
                )
            },
        )
        self._server: grpc.Server | None
        try:
            self._server, port = start_server(bind, [handler], max_workers, credentials)
        except BaseException:
            self._lighthouse.close()
            raise
        self._address = dialable_address(bind, port)
        self.replica_id = replica_id or self._address
        self._stopped = threading.Event()
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
        answer = self._cache.get()
        snapshot = answer.snapshot
        segment = snapshot.segment(step)
        if request.peek or self._pins.outside_window(step):  # peek: look, pin nothing, move no step
            return snapshot.reply(segment, False)
        if not answer.fetched:
            self.cache_hits = next(self._hit_count)
        pinned = self._pins.pin(step, snapshot, snapshot.reply(segment, True))
        return pinned if pinned is not None else snapshot.reply(segment, False)

    # ------------------------------------------------------------ upstream
    def _status(self, final: bool = False) -> pb.ManagerStatus:
        """What the lighthouse learns of this group with each call: also the ranks' metrics, so
        whatever carries the status (a fetch, a heartbeat) carries them. ``final``: the last one."""
        switches = self._pins.take_switches()
        metrics, batch = self._metrics.take(everything=final)
        return pb.ManagerStatus(
            replica_id=self.replica_id,
            address=self._address,
            version=self.serving_version(),
            requests=self.requests,
            cache_hits=self.cache_hits,
            step=self._pins.max_step,
            switches=[pb.StepSwitch(version=v, step=s, previous_step=p) for v, s, p in switches],
            job=self.job,
            metrics=metrics,
            metrics_batch=batch,
            metrics_dropped=self._metrics.dropped,
        )

    def serving_version(self) -> int:
        """The lighthouse version workers get now (0 while serving the fallback)."""
        good = self._cache.good
        if good is None or (self._cache.failing and not self._cache.serve_stale):
            return 0
        return good.version

    def _fetch(self, held: Snapshot | None) -> Snapshot:
        status = self._status()
        try:
            reply = self._lighthouse.fetch(
                timeout=self.lighthouse_timeout,
                known_version=held.version if held else 0,
                known_state_id=held.state_id if held else "",
                status=status,
            )
        except grpc.RpcError as exc:
            raise FetchFailed(explain_rpc_error(exc, self._lighthouse.tls is not None)) from None
        self._acked(status)
        self._lighthouse_step = reply.current_step
        if reply.instance_id != self._instance_id:
            if self._instance_id:
                logger.info("lighthouse restarted (instance %s)", reply.instance_id[:8])
            self._instance_id = reply.instance_id
        if reply.not_modified and held is not None:
            return held
        fresh = Snapshot.from_reply(reply, self.job)
        if held is not None and held.state_id == fresh.state_id and fresh.version < held.version:
            logger.warning(
                "lighthouse answered version %d, older than the served %d; keeping %d",
                fresh.version,
                held.version,
                held.version,
            )
            return held
        if held is not None and held.state_id != fresh.state_id:
            logger.warning(
                "lighthouse state was reset (new state %s): moving from version %d to %d",
                fresh.state_id[:8],
                held.version,
                fresh.version,
            )
        elif held is None or fresh.version != held.version:
            logger.info("serving config version %d", fresh.version)
        return fresh

    def _refresh_loop(self) -> None:
        """Refresh just before the cache expires; send a bare heartbeat when the TTL is longer than that."""
        cache = self._cache
        while not self._stopped.is_set():
            refresh_in = cache.next_refresh_in()
            heartbeat_in = self._last_contact + HEARTBEAT_INTERVAL - time.monotonic()
            if refresh_in <= 0:
                if cache.in_flight:  # a worker's call is fetching: let it finish
                    self._stopped.wait(0.005)
                else:
                    cache.refresh()
            elif heartbeat_in <= 0 and not cache.failing:
                self._heartbeat()
            else:
                self._stopped.wait(refresh_in if cache.failing else min(refresh_in, heartbeat_in))

    def _heartbeat(self, timeout: float | None = None, final: bool = False) -> bool:
        status = self._status(final)
        try:
            self._lighthouse.heartbeat(status, timeout=timeout or self.lighthouse_timeout)
        except grpc.RpcError:
            self._last_contact = time.monotonic()  # retried in a heartbeat interval; the fetch logs outages
            return False
        self._acked(status)
        return True

    def _acked(self, status: pb.ManagerStatus) -> None:
        """The lighthouse received ``status``: its switches and metrics need not be sent again."""
        self._pins.ack_switches([(w.version, w.step, w.previous_step) for w in status.switches])
        self._metrics.ack(status.metrics_batch)
        self._last_contact = time.monotonic()

    def stats(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "cache_hits": self.cache_hits,
            "upstream_fetches": self._cache.fetches,
            "upstream_failures": self._cache.failures,
            "pinned_steps": len(self._pins),
            "version": self.serving_version(),
        }

    def shutdown(self, grace: float | None = 0.5) -> None:
        """Stop serving; safe to call twice. A last report tells the lighthouse the group's final
        step and step switches (the replay and late-group views need them)."""
        first = not self._stopped.is_set()
        self._stopped.set()
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
