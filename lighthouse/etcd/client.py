"""A thin, typed, thread-safe etcd v3 client on the stubs generated from etcd's own protos.

Why its own module: the store backend needs only a handful of etcd calls (get,
put, delete, a compare-and-append transaction, leases, a prefix watch), each
with a deadline and failover across the cluster's endpoints; a maintained
Python client that fits grpcio threads and protobuf>=7 does not exist.

Failover: every call goes to the current endpoint; when it fails with
UNAVAILABLE or DEADLINE_EXCEEDED (or takes longer than ``attempt_timeout``) the
client moves to the next endpoint and retries until the call's deadline, then
raises ``StoreUnavailable``. A retried
write may have been applied by the first attempt: put and delete are
idempotent, and a transaction's compare must let its caller recognise its own
earlier success (the failure branch can read the head it compared).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import grpc

from protos.etcd import kv_pb2, rpc_pb2, rpc_pb2_grpc
from protos.rpc import (
    KEEPALIVE_OPTIONS,
    RECONNECT_OPTIONS,
    grpc_target,
    seconds,
    split_addresses,
)
from protos.tls import TLSConfig, tls_failure

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0
# A request that reached a follower while the leader died is lost inside etcd and only
# answered after etcd's own request timeout (5 s + 2 elections): give up on one
# endpoint after this long and retry, so an election costs about this much, not 7 s.
DEFAULT_ATTEMPT_TIMEOUT = 2.0

_CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    # etcd refuses requests above --max-request-bytes (1.5 MiB by default); a range
    # over a job's history can be much larger than one request.
    ("grpc.max_send_message_length", 4 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    *RECONNECT_OPTIONS,
    # A member that died or was cut off is noticed within seconds (the watch and lease streams
    # fail and move to another member) instead of after TCP's minutes.
    *KEEPALIVE_OPTIONS,
    # Only while a call is open (the watch always is, on the member in use): etcd permits a ping
    # every 5 s (--grpc-keepalive-min-time; our KEEPALIVE_TIME_MS is above it) but none on a
    # connection without streams, and answers one with a GOAWAY (too_many_pings).
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.enable_http_proxy", 0),
]
# etcd cancels a watch whose member lost its leader only when asked to (so a
# partitioned member's watch does not silently go quiet).
_REQUIRE_LEADER = (("hasleader", "true"),)
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# etcd answers a request that ran out of its (our) deadline inside the server,
# e.g. waiting for a quorum, with the Go context's error and code UNKNOWN.
_FAILOVER_DETAILS = ("context deadline exceeded", "context canceled")
_RETRY_PAUSE = 0.05
_WATCH_BACKOFF_MAX = 1.0
# A watch that hears nothing cannot tell a quiet prefix from a member that stopped sending (cut
# off, stuck, or answering pings but not the watch). So it asks for a progress notification every
# WATCH_PROGRESS_INTERVAL (etcd answers at once with its revision), and a stream that has sent
# nothing for WATCH_SILENCE_TIMEOUT is dropped and resumed on the next member.
WATCH_PROGRESS_INTERVAL = 2.0
WATCH_SILENCE_TIMEOUT = 3 * WATCH_PROGRESS_INTERVAL


class StoreUnavailable(Exception):
    """etcd has no quorum or none of its endpoints can be reached within the deadline."""


class EtcdError(Exception):
    """etcd refused a request (bad argument, unknown lease, compacted revision, too large...)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"etcd: {details} ({code.name})")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_pb(cls, kv: kv_pb2.KeyValue) -> KeyValue:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True)
class Event:
    """One change seen by a watch; for a delete, ``kv`` holds the key and the deletion's revision."""

    type: Literal["put", "delete"]
    kv: KeyValue

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


@dataclass(frozen=True)
class GetResult:
    kvs: list[KeyValue]
    revision: int  # the store's revision the read saw


@dataclass(frozen=True)
class Compare:
    """``target(key) op value``: e.g. ``Compare(b"head", "mod", "==", 7)``.

    A key that does not exist has mod/create revision and version 0. With ``range_end``
    the compare holds for every key in [key, range_end) (true when there is none).
    """

    key: str | bytes
    target: Literal["mod", "create", "version", "value"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes | str
    range_end: str | bytes | None = None


@dataclass(frozen=True)
class Get:
    key: str | bytes
    prefix: bool = False


@dataclass(frozen=True)
class Put:
    key: str | bytes
    value: str | bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """One key, every key under it (``prefix``), or the keys in [key, ``range_end``)."""

    key: str | bytes
    prefix: bool = False
    range_end: str | bytes | None = None


Op = Get | Put | Delete


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    gets: list[list[KeyValue]]  # one list per Get of the branch that ran, in order


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _range_end(key: bytes, prefix: bool) -> bytes:
    return prefix_end(key) if prefix else b""


_TARGETS = {
    "mod": rpc_pb2.Compare.MOD,
    "create": rpc_pb2.Compare.CREATE,
    "version": rpc_pb2.Compare.VERSION,
    "value": rpc_pb2.Compare.VALUE,
}
_RESULTS = {
    "==": rpc_pb2.Compare.EQUAL,
    "!=": rpc_pb2.Compare.NOT_EQUAL,
    "<": rpc_pb2.Compare.LESS,
    ">": rpc_pb2.Compare.GREATER,
}


def _compare_pb(c: Compare) -> rpc_pb2.Compare:
    msg = rpc_pb2.Compare(key=_bytes(c.key), target=_TARGETS[c.target], result=_RESULTS[c.op])
    if c.range_end is not None:
        msg.range_end = _bytes(c.range_end)
    if c.target == "value":
        if isinstance(c.value, int):
            raise TypeError("a value compare takes str or bytes")
        msg.value = _bytes(c.value)
    else:
        if not isinstance(c.value, int):
            raise TypeError(f"a {c.target} compare takes an int")
        setattr(msg, {"mod": "mod_revision", "create": "create_revision"}.get(c.target, "version"), c.value)
    return msg


def _op_pb(op: Op) -> rpc_pb2.RequestOp:
    if isinstance(op, Get):
        key = _bytes(op.key)
        return rpc_pb2.RequestOp(
            request_range=rpc_pb2.RangeRequest(key=key, range_end=_range_end(key, op.prefix))
        )
    if isinstance(op, Put):
        return rpc_pb2.RequestOp(
            request_put=rpc_pb2.PutRequest(key=_bytes(op.key), value=_bytes(op.value), lease=op.lease)
        )
    key = _bytes(op.key)
    end = _bytes(op.range_end) if op.range_end is not None else _range_end(key, op.prefix)
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=end))


@dataclass
class _Stubs:
    channel: grpc.Channel
    kv: Any
    watch: Any
    lease: Any
    maintenance: Any


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h:p,h:p"`` or a list of addresses -> gRPC targets; ValueError when there is none."""
    text = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
    return [grpc_target(item) for item in split_addresses(text, what="etcd endpoint")]


class EtcdClient:
    """Calls to one etcd cluster with failover across its endpoints. Safe to share between threads."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        attempt_timeout: timedelta | float = DEFAULT_ATTEMPT_TIMEOUT,
        tls: TLSConfig | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = seconds(timeout, DEFAULT_TIMEOUT)
        self.attempt_timeout = seconds(attempt_timeout, DEFAULT_ATTEMPT_TIMEOUT)
        self._tls = tls
        self._lock = threading.Lock()
        self._stubs: dict[int, _Stubs] = {}
        self._current = 0
        self._closed = False

    # -- plumbing --------------------------------------------------------------

    def _stubs_for(self, index: int) -> _Stubs:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("etcd client is closed")
            stubs = self._stubs.get(index)
            if stubs is None:
                target = self.endpoints[index]
                if self._tls is None:
                    channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
                else:
                    channel = grpc.secure_channel(
                        target,
                        self._tls.channel_credentials(),
                        options=[*_CHANNEL_OPTIONS, *self._tls.channel_options()],
                    )
                stubs = _Stubs(
                    channel,
                    rpc_pb2_grpc.KVStub(channel),
                    rpc_pb2_grpc.WatchStub(channel),
                    rpc_pb2_grpc.LeaseStub(channel),
                    rpc_pb2_grpc.MaintenanceStub(channel),
                )
                self._stubs[index] = stubs
            return stubs

    def _current_index(self) -> int:
        with self._lock:
            return self._current

    def _move_on(self, failed: int) -> int:
        """Next endpoint after ``failed`` (unless another thread already moved on)."""
        with self._lock:
            if self._current == failed:
                self._current = (failed + 1) % len(self.endpoints)
            return self._current

    def _call(self, fn: Callable[[_Stubs, float], T], timeout: timedelta | float | None) -> T:
        """Run ``fn(stubs, attempt_timeout)`` on the current endpoint, failing over until the deadline."""
        budget = seconds(timeout, self.timeout)
        deadline = time.monotonic() + budget
        index = self._current_index()
        tried = 0
        last = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempt = min(remaining, self.attempt_timeout)
            try:
                return fn(self._stubs_for(index), attempt)
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
                details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
                if code not in _FAILOVER_CODES and details not in _FAILOVER_DETAILS:
                    raise EtcdError(code, details) from None
                reason = tls_failure(details, self._tls is not None)  # a refusal is not an outage
                last = f"{self.endpoints[index]}: {f'{reason} ({details})' if reason else details}"
                log.debug("etcd call failed on %s", last)
            tried += 1
            index = self._move_on(index)
            if tried % len(self.endpoints) == 0:  # every endpoint failed: pause before the next round
                time.sleep(min(_RETRY_PAUSE, max(0.0, deadline - time.monotonic())))
        raise StoreUnavailable(
            f"etcd store has no quorum or cannot be reached within {budget:g}s "
            f"(endpoints {','.join(self.endpoints)}; last error {last or 'deadline exceeded'})"
        )

    # -- key-value -------------------------------------------------------------

    def get(
        self,
        key: str | bytes,
        *,
        prefix: bool = False,
        revision: int = 0,
        serializable: bool = False,
        limit: int = 0,
        keys_only: bool = False,
        timeout: timedelta | float | None = None,
    ) -> GetResult:
        """The key (or every key under the prefix, sorted by key) at ``revision`` (0: latest).

        ``serializable`` reads the answering member's local copy: it works without a
        quorum but may be stale; the default read is linearizable (needs a quorum).
        ``limit`` caps how many keys come back (0: all); ``keys_only`` leaves values empty.
        """
        k = _bytes(key)
        request = rpc_pb2.RangeRequest(
            key=k,
            range_end=_range_end(k, prefix),
            revision=revision,
            serializable=serializable,
            limit=limit,
            keys_only=keys_only,
        )
        reply = self._call(lambda s, t: s.kv.Range(request, timeout=t), timeout)
        return GetResult([KeyValue.from_pb(kv) for kv in reply.kvs], reply.header.revision)

    def put(
        self,
        key: str | bytes,
        value: str | bytes,
        *,
        lease: int = 0,
        timeout: timedelta | float | None = None,
    ) -> int:
        """Store ``value`` at ``key``; returns the revision of the write."""
        request = rpc_pb2.PutRequest(key=_bytes(key), value=_bytes(value), lease=lease)
        reply = self._call(lambda s, t: s.kv.Put(request, timeout=t), timeout)
        return int(reply.header.revision)

    def delete(
        self, key: str | bytes, *, prefix: bool = False, timeout: timedelta | float | None = None
    ) -> int:
        """Delete the key (or every key under the prefix); returns how many were deleted."""
        k = _bytes(key)
        request = rpc_pb2.DeleteRangeRequest(key=k, range_end=_range_end(k, prefix))
        reply = self._call(lambda s, t: s.kv.DeleteRange(request, timeout=t), timeout)
        return int(reply.deleted)

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout: timedelta | float | None = None,
    ) -> TxnResult:
        """Atomically: if every compare holds run ``success``, else ``failure``."""
        request = rpc_pb2.TxnRequest(
            compare=[_compare_pb(c) for c in compare],
            success=[_op_pb(op) for op in success],
            failure=[_op_pb(op) for op in failure],
        )
        reply = self._call(lambda s, t: s.kv.Txn(request, timeout=t), timeout)
        gets = [
            [KeyValue.from_pb(kv) for kv in r.response_range.kvs]
            for r in reply.responses
            if r.WhichOneof("response") == "response_range"
        ]
        return TxnResult(bool(reply.succeeded), int(reply.header.revision), gets)

    # -- leases ----------------------------------------------------------------

    def lease_grant(self, ttl: float, *, timeout: timedelta | float | None = None) -> int:
        """A new lease living ``ttl`` seconds (rounded up, etcd counts whole seconds); returns its id."""
        request = rpc_pb2.LeaseGrantRequest(TTL=max(1, int(-(-ttl // 1))))
        reply = self._call(lambda s, t: s.lease.LeaseGrant(request, timeout=t), timeout)
        if reply.error:
            raise EtcdError(grpc.StatusCode.UNKNOWN, reply.error)
        return int(reply.ID)

    def lease_revoke(self, lease_id: int, *, timeout: timedelta | float | None = None) -> None:
        """End the lease now: its keys are deleted."""
        request = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        self._call(lambda s, t: s.lease.LeaseRevoke(request, timeout=t), timeout)

    def lease_keepalive_once(self, lease_id: int, *, timeout: timedelta | float | None = None) -> int:
        """Refresh the lease; returns its remaining TTL in seconds (0 or less: it has expired)."""

        def once(s: _Stubs, t: float) -> int:
            replies = s.lease.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)]), timeout=t)
            try:
                return int(next(replies).TTL)
            finally:
                replies.cancel()

        return self._call(once, timeout)

    def keep_alive(self, lease_id: int, ttl: float, on_lost: Callable[[], None] | None = None) -> KeepAlive:
        """Refresh the lease every ``ttl / 3`` s in a background thread until ``stop()``."""
        return KeepAlive(self, lease_id, ttl, on_lost)

    # -- watch -----------------------------------------------------------------

    def watch(
        self,
        key: str | bytes,
        *,
        start_revision: int,
        on_events: Callable[[list[Event]], None],
        on_compacted: Callable[[], int],
        prefix: bool = True,
    ) -> Watch:
        """Deliver every change under ``key`` from ``start_revision`` on, in a background thread.

        ``on_events`` gets the events of one etcd response, in revision order. When the
        revision to resume from was compacted away, ``on_compacted`` must reload the
        state and return the revision it read; the watch resumes after it.
        """
        return Watch(self, _bytes(key), prefix, start_revision, on_events, on_compacted)

    # -- cluster ---------------------------------------------------------------

    def status(self, endpoint: int, *, timeout: timedelta | float | None = None) -> rpc_pb2.StatusResponse:
        """The Maintenance.Status of one endpoint (by index), without failover."""
        stubs = self._stubs_for(endpoint)
        t = seconds(timeout, self.timeout)
        try:
            reply: rpc_pb2.StatusResponse = stubs.maintenance.Status(rpc_pb2.StatusRequest(), timeout=t)
        except grpc.RpcError as exc:
            raise StoreUnavailable(
                f"etcd endpoint {self.endpoints[endpoint]} cannot be reached: {exc}"
            ) from None
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stubs, self._stubs = list(self._stubs.values()), {}
        for s in stubs:
            s.channel.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KeepAlive:
    """Background refresh of one lease; ``on_lost`` runs once if etcd says the lease is gone."""

    def __init__(
        self, client: EtcdClient, lease_id: int, ttl: float, on_lost: Callable[[], None] | None
    ) -> None:
        self.lease_id = lease_id
        self._client = client
        self._interval = max(0.1, ttl / 3)
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-keepalive-{lease_id:x}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                left = self._client.lease_keepalive_once(self.lease_id, timeout=self._interval)
            except (StoreUnavailable, EtcdError) as exc:
                log.warning("etcd lease %x keepalive failed: %s", self.lease_id, exc)
                continue
            if left <= 0:
                log.warning("etcd lease %x expired", self.lease_id)
                if self._on_lost is not None:
                    self._on_lost()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Watch:
    """A prefix watch that reconnects to the next endpoint on failure and resumes where it left off.

    A failure includes silence: the stream asks for progress notifications, so a member that
    sends nothing past ``WATCH_SILENCE_TIMEOUT`` is taken for cut off (keepalive catches a dead
    connection; this catches a live one whose watch went quiet).
    """

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        prefix: bool,
        start_revision: int,
        on_events: Callable[[list[Event]], None],
        on_compacted: Callable[[], int],
    ) -> None:
        self._client = client
        self._key = key
        self._range_end = _range_end(key, prefix)
        self._on_events = on_events
        self._on_compacted = on_compacted
        self._lock = threading.Lock()
        self._next_revision = start_revision
        self._call: Any = None
        self._heard_at = time.monotonic()  # when the stream last sent anything
        self._stopped = threading.Event()
        self.created = threading.Event()  # set while a stream is established (startup, tests)
        self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
        self._thread.start()

    @property
    def next_revision(self) -> int:
        """The revision the watch resumes from after a reconnect."""
        with self._lock:
            return self._next_revision

    def _requests(
        self, start: int, done: threading.Event, silent: threading.Event
    ) -> Iterator[rpc_pb2.WatchRequest]:
        """Create the watch, then ask for progress until the stream is dropped; drop it (setting
        ``silent``) when the member has sent nothing for ``WATCH_SILENCE_TIMEOUT``."""
        yield rpc_pb2.WatchRequest(
            create_request=rpc_pb2.WatchCreateRequest(
                key=self._key, range_end=self._range_end, start_revision=start, progress_notify=True
            )
        )
        while not done.wait(WATCH_PROGRESS_INTERVAL):
            if time.monotonic() - self._heard_at > WATCH_SILENCE_TIMEOUT:
                silent.set()
                with self._lock:
                    call = self._call
                call.cancel()
                return
            yield rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())

    def _run(self) -> None:
        backoff = _RETRY_PAUSE
        while not self._stopped.is_set():
            index = self._client._current_index()
            try:
                stubs = self._client._stubs_for(index)
            except StoreUnavailable:
                return  # client closed
            done, silent = threading.Event(), threading.Event()
            self._heard_at = time.monotonic()
            call = stubs.watch.Watch(
                self._requests(self.next_revision, done, silent), metadata=_REQUIRE_LEADER
            )
            with self._lock:
                self._call = call
            if self._stopped.is_set():  # stop() ran before the call was visible to it
                call.cancel()
            reason = "stream ended"
            try:
                reason = self._consume(call) or reason
            except grpc.RpcError as exc:
                reason = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
            except Exception:  # a callback failed: resume from the last revision it took
                log.exception("etcd watch callback failed")
                reason = "callback failed"
            finally:
                done.set()
                call.cancel()
                established = self.created.is_set()
                self.created.clear()
            if self._stopped.is_set():
                return
            if silent.is_set():
                reason = f"nothing heard for {WATCH_SILENCE_TIMEOUT:g}s"
            if reason == "compacted":
                continue  # same endpoint, from the revision the reload returned
            log.info("etcd watch on %s lost (%s); reconnecting", self._client.endpoints[index], reason)
            self._client._move_on(index)
            # Back off only while no stream gets established (every endpoint down or leaderless).
            backoff = _RETRY_PAUSE if established else min(backoff * 2, _WATCH_BACKOFF_MAX)
            self._stopped.wait(backoff)

    def _consume(self, call: Iterator[rpc_pb2.WatchResponse]) -> str | None:
        """Read one stream until it ends; returns why etcd cancelled it (None when it just ended)."""
        for reply in call:
            self._heard_at = time.monotonic()
            if reply.created:
                self.created.set()
            if reply.compact_revision:
                log.warning("etcd watch: revision %d compacted; reloading", self.next_revision)
                resume = self._on_compacted() + 1
                with self._lock:
                    self._next_revision = resume
                return "compacted"
            if reply.events:
                events = [
                    Event("delete" if e.type == kv_pb2.Event.DELETE else "put", KeyValue.from_pb(e.kv))
                    for e in reply.events
                ]
                self._on_events(events)
                with self._lock:
                    self._next_revision = events[-1].revision + 1
                self._heard_at = time.monotonic()  # a slow callback is no silence of etcd's
            if reply.canceled:
                return reply.cancel_reason or "cancelled by etcd"
        return None

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5)
