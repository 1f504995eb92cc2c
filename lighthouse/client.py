"""``LighthouseClient``: the gRPC client of the lighthouse, as torchft names it.

Training code normally goes through its group's manager; this client is for
direct use (tools, tests, single-process jobs) and for the manager itself.
Given several lighthouses (``"A,B,C"``, all serving the same store), it sticks
to one and moves to the next when a call fails or hangs, so losing one
lighthouse host costs a caller one failed or slow attempt, not an outage.

A hang (a frozen host, a long pause, a path that drops packets) keeps the
connection open and answers nothing, so waiting for an error would spend the
whole deadline. Calls are hedged instead: when the lighthouse in use has not
answered within ``HEDGE_FRACTION`` of the call's deadline, it is asked again
and the next one too (the one after it another fraction later), within the
same deadline; the first good answer wins and the client stays on the
lighthouse that gave it. A call sent on a connection the lighthouse had dropped
(this process stood still past its keep-alive) is asked again on a new one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import grpc

from protos import lighthouse_config_pb2 as pb
from protos.job_ids import DEFAULT_JOB, check_job_id
from protos.rpc import (
    LIGHTHOUSE_GET_CONFIG,
    LIGHTHOUSE_HEARTBEAT,
    LIGHTHOUSE_WATCH,
    call_again_if_dropped,
    connection_dropped,
    make_channel,
    seconds,
    split_addresses,
)
from protos.tls import TLSConfig, tls_for

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Codes that say "this lighthouse cannot answer now": try the next one. Others (a refused
# request, say) would be answered the same by every lighthouse. CANCELLED: a stopping gRPC server
# answers so the calls that arrive while it stops (a rolling upgrade; this client cancels only the
# hedged calls it no longer looks at), and the group served the fallback for a backoff instead.
FAILOVER_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)

# A lighthouse that has not answered within this fraction of a call's deadline is taken for hung,
# and the next one is asked too. A healthy lighthouse answers in milliseconds, so a quarter (250 ms
# of the manager's default 1 s) is far past its normal latency yet leaves the next lighthouse three
# quarters of the deadline; with three lighthouses the third is asked at half the deadline.
HEDGE_FRACTION = 0.25

Method = Callable[["_Endpoint"], "grpc.UnaryUnaryMultiCallable[Any, T]"]


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call (a lighthouse with manager tokens)."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._entry]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


class _Endpoint:
    """One lighthouse: its channel and the two methods."""

    def __init__(self, addr: str, tls: TLSConfig | None, token: str | None = None) -> None:
        self.addr = addr
        self.tls = tls
        self.channel = make_channel(addr, tls)
        calls = grpc.intercept_channel(self.channel, _BearerToken(token)) if token else self.channel
        self.get_config = calls.unary_unary(
            LIGHTHOUSE_GET_CONFIG,
            request_serializer=pb.LighthouseConfigRequest.SerializeToString,
            response_deserializer=pb.LighthouseConfigResponse.FromString,
        )
        self.heartbeat = calls.unary_unary(
            LIGHTHOUSE_HEARTBEAT,
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )
        self.watch = calls.stream_stream(
            LIGHTHOUSE_WATCH,
            request_serializer=pb.LighthouseConfigRequest.SerializeToString,
            response_deserializer=pb.LighthouseConfigResponse.FromString,
        )


class LighthouseClient:
    """Reusable channels to one or more lighthouses; thread-safe.

    ``addr`` accepts ``host:port``, ``[v6]:port`` and ``http://host:port``, or several
    of them separated by commas (lighthouses on one etcd store). ``spread_key`` (a
    manager's replica id) picks which one to start with, so many managers spread
    over the list instead of all using the first. ``job`` is the training job whose
    config it asks for (default: the job ``default``). Calls raise ``grpc.RpcError``
    when no lighthouse answers in time. ``tls`` dials lighthouses serving TLS
    (``protos.tls.explain_rpc_error`` says what failed); an ``https://`` address
    speaks TLS too, trusting the system's roots. ``token`` goes with every call
    (a lighthouse with ``--manager-tokens-file``).
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta | float | None = None,
        *,
        job: str = DEFAULT_JOB,
        spread_key: str = "",
        tls: TLSConfig | None = None,
        token: str | None = None,
    ) -> None:
        self.addr = addr
        self.job = check_job_id(job)
        self._wire_job = "" if self.job == DEFAULT_JOB else self.job  # what every lighthouse release reads
        addrs = split_addresses(addr)
        self._endpoints = [_Endpoint(a, tls_for(a, tls), token) for a in addrs]
        self.tls = next((e.tls for e in self._endpoints if e.tls is not None), None)
        self._current = zlib.crc32(spread_key.encode()) % len(addrs) if spread_key else 0
        self._lock = threading.Lock()
        if connect_timeout is not None:
            try:
                grpc.channel_ready_future(self._endpoints[self._current].channel).result(
                    timeout=seconds(connect_timeout, 0)
                )
            except grpc.FutureTimeoutError:
                self.close()
                raise TimeoutError(f"lighthouse {addr} not reachable within {connect_timeout}") from None

    @property
    def current(self) -> str:
        """The lighthouse calls go to first."""
        return self._endpoints[self._current].addr

    def get_config(self, timeout: timedelta | float = timedelta(seconds=5)) -> dict[str, str]:
        """The live config, encoded as ``dict[str, str]`` (torchft's config-sharing signature)."""
        reply = self.fetch(timeout=timeout)
        return dict(reply.config_data)

    def fetch(
        self, request: pb.LighthouseConfigRequest | None = None, *, timeout: timedelta | float
    ) -> pb.LighthouseConfigResponse:
        """One GetConfig with ``request`` (built by ``request``; none: a plain fetch of the live
        config), failing over as every call does. The full reply: version, per-step segments, and
        not_modified when the request's ``known_version`` is current; a step lease
        (``stable_through_step``) when its ``status`` reports a step."""
        reply: pb.LighthouseConfigResponse = self._call(
            lambda e: e.get_config, request or self.request(), seconds(timeout, 5.0)
        )
        return reply

    def request(
        self,
        *,
        known_version: int = 0,
        known_state_id: str = "",
        status: pb.ManagerStatus | None = None,
        replica_id: str = "",
        lease_seconds: float = 0.0,
        lease_from_step: int | None = None,
    ) -> pb.LighthouseConfigRequest:
        """A request for ``fetch`` (and a push stream), for this client's job.

        A ``status`` that reports a step (a manager) asks for a step lease sized for a renewal
        every ``lease_seconds``, covering ``lease_from_step`` when given (a step a worker waits for).
        """
        request = pb.LighthouseConfigRequest(
            replica_id=replica_id or (status.replica_id if status is not None else ""),
            known_version=known_version,
            known_state_id=known_state_id,
            status=status,
            job=self._wire_job,
            lease_seconds=lease_seconds,
        )
        if lease_from_step is not None:
            request.lease_from_step = lease_from_step
        return request

    def watch(
        self, requests: Iterator[pb.LighthouseConfigRequest]
    ) -> grpc.CallIterator[pb.LighthouseConfigResponse]:
        """A ``WatchConfig`` stream to the lighthouse in use (no deadline: it lasts until cancelled).

        The result is a ``grpc.Call`` as well: ``cancel()`` ends it. It raises ``grpc.RpcError``
        with UNIMPLEMENTED from a lighthouse release without push streams.
        """
        stream: grpc.CallIterator[pb.LighthouseConfigResponse] = self._endpoints[self._current].watch(
            requests
        )
        return stream

    def heartbeat(
        self, status: pb.ManagerStatus, timeout: timedelta | float = 1.0
    ) -> pb.LighthouseHeartbeatResponse:
        request = pb.LighthouseHeartbeatRequest(status=status)
        reply: pb.LighthouseHeartbeatResponse = self._call(
            lambda e: e.heartbeat, request, seconds(timeout, 1.0)
        )
        return reply

    def _call(self, method: Method[T], request: Any, timeout: float) -> T:
        """Ask the current lighthouse; past ``HEDGE_FRACTION`` of ``timeout`` without an answer, or
        at once when it fails, hedge over the others (``_hedged``); all within ``timeout``.

        The first attempt is a plain blocking call bounded by the hedge delay: the cost of a call
        to a healthy lighthouse stays that of one gRPC call (a gRPC future costs a thread start).
        """
        deadline = time.monotonic() + timeout
        count = len(self._endpoints)
        if count == 1:
            only = method(self._endpoints[0])
            try:
                return only(request, timeout=timeout)
            except grpc.RpcError as exc:
                return call_again_if_dropped(lambda left: only(request, timeout=left), exc, deadline)
        first = self._current
        delay = HEDGE_FRACTION * timeout
        try:
            return method(self._endpoints[first])(request, timeout=delay)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code not in FAILOVER_CODES:
                raise
            hung = code == grpc.StatusCode.DEADLINE_EXCEEDED
            logger.warning(
                "lighthouse %s %s: asking %s",
                self._endpoints[first].addr,
                f"has not answered within {delay:.2f}s" if hung else f"failed ({code.name if code else exc})",
                self._endpoints[(first + 1) % count].addr,
            )
            others = [(first + k) % count for k in range(1, count)]
            # One that is slow, not dead, may still answer: it is asked again beside the next one.
            # One whose connection was dropped (``connection_dropped``) is asked again last.
            order = [first, *others] if hung else [*others, first] if connection_dropped(exc) else others
            return self._hedged(method, request, order, 2 if hung else 1, deadline, delay, exc)

    def _hedged(
        self,
        method: Method[T],
        request: Any,
        order: list[int],
        at_once: int,
        deadline: float,
        delay: float,
        error: grpc.RpcError,
    ) -> T:
        """Ask ``order[:at_once]`` now and one more each time one fails or ``delay`` passes without
        an answer; the first answer wins (the others are cancelled) and its lighthouse is used
        first from then on. Raises the last failure when none answers before ``deadline``."""
        done: queue.SimpleQueue[tuple[int, grpc.Future[T]]] = queue.SimpleQueue()
        pending: dict[int, grpc.Future[T]] = {}
        queued = list(order)
        next_hedge = deadline

        def ask_next() -> None:
            nonlocal next_hedge
            index = queued.pop(0)
            future = method(self._endpoints[index]).future(
                request, timeout=max(deadline - time.monotonic(), 0.001)
            )
            pending[index] = future
            future.add_done_callback(lambda f: done.put((index, f)))
            next_hedge = time.monotonic() + delay

        for _ in range(at_once):
            ask_next()
        try:
            while pending:
                hedge = bool(queued) and next_hedge < deadline
                try:
                    # Each attempt carries the deadline, so gRPC ends it by then: no timeout needed.
                    index, future = done.get(timeout=max(next_hedge - time.monotonic(), 0) if hedge else None)
                except queue.Empty:
                    logger.warning(
                        "no lighthouse answered within %.2fs: asking %s too",
                        delay,
                        self._endpoints[queued[0]].addr,
                    )
                    ask_next()
                    continue
                del pending[index]
                failure = future.exception()
                if failure is None:
                    self._use(index)
                    return future.result()
                assert isinstance(failure, grpc.RpcError)
                code = failure.code() if isinstance(failure, grpc.Call) else None
                if code not in FAILOVER_CODES:
                    raise failure
                error = failure
                if queued and deadline - time.monotonic() > 0.001:
                    logger.warning(
                        "lighthouse %s failed (%s): trying %s",
                        self._endpoints[index].addr,
                        code.name if code else failure,
                        self._endpoints[queued[0]].addr,
                    )
                    ask_next()
        finally:
            for future in pending.values():
                future.cancel()
        raise error

    def move_on(self) -> None:
        """Call the next lighthouse first from now on: the current one answered, but with nothing
        the caller can use (a manager's, from a release that knows no runs of its job)."""
        if len(self._endpoints) > 1:
            self._use((self._current + 1) % len(self._endpoints))

    def _use(self, index: int) -> None:
        """Call the lighthouse that answered first from now on."""
        if index != self._current:
            with self._lock:
                self._current = index
            logger.info("now using lighthouse %s", self._endpoints[index].addr)

    def close(self) -> None:
        for endpoint in self._endpoints:
            endpoint.channel.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
