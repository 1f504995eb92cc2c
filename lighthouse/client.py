"""``LighthouseClient``: the gRPC client of the lighthouse, as torchft names it.

Training code normally goes through its group's manager; this client is for
direct use (tools, tests, single-process jobs) and for the manager itself.
Given several lighthouses (``"A,B,C"``, all serving the same store), it sticks
to one and moves to the next when a call fails, so losing one lighthouse host
costs a caller one failed attempt, not an outage.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import grpc

from protos import lighthouse_config_pb2 as pb
from protos.jobs import DEFAULT_JOB, check_job_id
from protos.rpc import LIGHTHOUSE_GET_CONFIG, LIGHTHOUSE_HEARTBEAT, make_channel, seconds, split_addresses
from protos.tls import TLSConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Codes that say "this lighthouse cannot answer now": try the next one. Others (a refused
# request, say) would be answered the same by every lighthouse.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class _Endpoint:
    """One lighthouse: its channel and the two methods."""

    def __init__(self, addr: str, tls: TLSConfig | None) -> None:
        self.addr = addr
        self.channel = make_channel(addr, tls)
        self.get_config = self.channel.unary_unary(
            LIGHTHOUSE_GET_CONFIG,
            request_serializer=pb.LighthouseConfigRequest.SerializeToString,
            response_deserializer=pb.LighthouseConfigResponse.FromString,
        )
        self.heartbeat = self.channel.unary_unary(
            LIGHTHOUSE_HEARTBEAT,
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )


class LighthouseClient:
    """Reusable channels to one or more lighthouses; thread-safe.

    ``addr`` accepts ``host:port``, ``[v6]:port`` and ``http://host:port``, or several
    of them separated by commas (lighthouses on one etcd store). ``spread_key`` (a
    manager's replica id) picks which one to start with, so many managers spread
    over the list instead of all using the first. ``job`` is the training job whose
    config it asks for (default: the job ``default``). Calls raise ``grpc.RpcError``
    when no lighthouse answers in time. ``tls`` dials lighthouses serving TLS
    (``protos.tls.explain_rpc_error`` says what failed).
    """

    def __init__(
        self,
        addr: str,
        connect_timeout: timedelta | float | None = None,
        *,
        job: str = DEFAULT_JOB,
        spread_key: str = "",
        tls: TLSConfig | None = None,
    ) -> None:
        self.addr = addr
        self.tls = tls
        self.job = check_job_id(job)
        self._wire_job = "" if self.job == DEFAULT_JOB else self.job  # what every lighthouse release reads
        addrs = split_addresses(addr)
        self._endpoints = [_Endpoint(a, tls) for a in addrs]
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
        self,
        *,
        timeout: timedelta | float,
        known_version: int = 0,
        known_state_id: str = "",
        status: pb.ManagerStatus | None = None,
        replica_id: str = "",
        lease_seconds: float = 0.0,
        lease_from_step: int | None = None,
    ) -> pb.LighthouseConfigResponse:
        """The full reply: version, per-step segments, and not_modified when ``known_version`` is current.

        With a ``status`` that reports a step (a manager), the reply carries a step lease
        (``stable_through_step``) sized for a renewal every ``lease_seconds``, covering
        ``lease_from_step`` when given (a step a worker waits for).
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
        deadline = seconds(timeout, 5.0)
        reply: pb.LighthouseConfigResponse = self._call(
            lambda e, t: e.get_config(request, timeout=t), deadline
        )
        return reply

    def heartbeat(
        self, status: pb.ManagerStatus, timeout: timedelta | float = 1.0
    ) -> pb.LighthouseHeartbeatResponse:
        request = pb.LighthouseHeartbeatRequest(status=status)
        reply: pb.LighthouseHeartbeatResponse = self._call(
            lambda e, t: e.heartbeat(request, timeout=t), seconds(timeout, 1.0)
        )
        return reply

    def _call(self, attempt: Callable[[_Endpoint, float], T], timeout: float) -> T:
        """Try the current lighthouse, then each other once, every attempt within ``timeout`` overall.

        A lighthouse that is down refuses at once, so the next one still gets most of the time;
        one that hangs uses up the deadline (the caller's bound holds either way).
        """
        deadline = time.monotonic() + timeout
        first = self._current
        count = len(self._endpoints)
        for k in range(count):
            index = (first + k) % count
            remaining = deadline - time.monotonic()
            endpoint = self._endpoints[index]
            try:
                result = attempt(endpoint, max(remaining, 0.001))
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                last = k == count - 1 or deadline - time.monotonic() <= 0.001
                if count == 1 or code not in FAILOVER_CODES or last:
                    raise
                logger.warning(
                    "lighthouse %s failed (%s): trying %s",
                    endpoint.addr,
                    code.name if code else exc,
                    self._endpoints[(index + 1) % count].addr,
                )
                continue
            if index != self._current:
                with self._lock:
                    self._current = index
                logger.info("now using lighthouse %s", endpoint.addr)
            return result
        raise AssertionError("unreachable: the last attempt returns or raises")

    def close(self) -> None:
        for endpoint in self._endpoints:
            endpoint.channel.close()

    def __enter__(self) -> LighthouseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
