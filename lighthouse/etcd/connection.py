"""The channels to one etcd cluster and the failover every call goes through.

Failover: every call goes to the current endpoint; when it fails with
UNAVAILABLE or DEADLINE_EXCEEDED (or takes longer than ``attempt_timeout``) the
client moves to the next endpoint and retries until the call's deadline, then
raises ``EtcdUnavailable``. With ``auth`` (etcd RBAC) every call carries the token
``Auth.Authenticate`` returned in its ``token`` metadata; when etcd no longer knows
the token (it expired, or etcd restarted) the client logs in again once and retries.
A retried
write may have been applied by the first attempt: put and delete are
idempotent, and a transaction's compare must let its caller recognise its own
earlier success (the failure branch can read the head it compared).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Self, TypeVar

import grpc

from lighthouse.etcd.errors import EtcdAuthFailed, EtcdError, EtcdUnavailable
from protos.etcd import rpc_pb2, rpc_pb2_grpc
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
_FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# etcd answers a request that ran out of its (our) deadline inside the server,
# e.g. waiting for a quorum, with the Go context's error and code UNKNOWN.
_FAILOVER_DETAILS = ("context deadline exceeded", "context canceled")
RETRY_PAUSE = 0.05
# What etcd answers a call whose token it does not know (expired, or issued before a restart)
# or whose token predates a change of users or roles: log in again and retry.
_STALE_TOKEN_DETAILS = ("invalid auth token", "revision of auth store is old")
_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"


@dataclass(frozen=True)
class EtcdAuth:
    """An etcd user and its password (never a command-line value: an env variable or a file)."""

    user: str
    password: str = field(repr=False)


def stale_token(details: str, watch: bool = False) -> bool:
    """etcd refused a call for its token (log in again), not for its content; etcd 3.4 cancels a
    watch whose token it does not know as "permission denied"."""
    texts = (*_STALE_TOKEN_DETAILS, "permission denied") if watch else _STALE_TOKEN_DETAILS
    return any(text in details for text in texts)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _TokenMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the current token to every call but the login itself."""

    def __init__(self, token: Callable[[], str | None]) -> None:
        self._token = token

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        token = self._token()
        if token is None or details.method == _AUTHENTICATE:
            return details
        return _CallDetails(details, (*(details.metadata or ()), ("token", token)))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


@dataclass
class Stubs:
    channel: grpc.Channel
    kv: Any
    watch: Any
    lease: Any
    maintenance: Any
    auth: Any


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h:p,h:p"`` or a list of addresses -> gRPC targets; ValueError when there is none."""
    text = endpoints if isinstance(endpoints, str) else ",".join(endpoints)
    return [grpc_target(item) for item in split_addresses(text, what="etcd endpoint")]


class Connection:
    """One channel per endpoint, opened when first used, and the endpoint in use. Thread-safe."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        attempt_timeout: timedelta | float = DEFAULT_ATTEMPT_TIMEOUT,
        tls: TLSConfig | None = None,
        auth: EtcdAuth | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = seconds(timeout, DEFAULT_TIMEOUT)
        self.attempt_timeout = seconds(attempt_timeout, DEFAULT_ATTEMPT_TIMEOUT)
        self._urgent = threading.local()  # ``attempts_within``: this thread's shorter attempts
        self._tls = tls
        self._auth = auth
        self._token: str | None = None
        self._login_lock = threading.Lock()
        self._lock = threading.Lock()
        self._stubs: dict[int, Stubs] = {}
        self._current = 0
        self._closed = False

    def _stubs_for(self, index: int) -> Stubs:
        with self._lock:
            if self._closed:
                raise EtcdUnavailable("etcd client is closed")
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
                calls = channel
                if self._auth is not None:
                    calls = grpc.intercept_channel(channel, _TokenMetadata(lambda: self._token))
                stubs = Stubs(
                    channel,
                    rpc_pb2_grpc.KVStub(calls),
                    rpc_pb2_grpc.WatchStub(calls),
                    rpc_pb2_grpc.LeaseStub(calls),
                    rpc_pb2_grpc.MaintenanceStub(calls),
                    rpc_pb2_grpc.AuthStub(calls),
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

    def login(self, stale: str | None = None, *, timeout: timedelta | float | None = None) -> None:
        """Get a token for ``auth`` (EtcdAuthFailed for a wrong user or password); with ``stale``, the
        token etcd refused, only if no other thread replaced it meanwhile."""
        if self._auth is None:
            return
        with self._login_lock:
            if stale is not None and self._token != stale:
                return
            request = rpc_pb2.AuthenticateRequest(name=self._auth.user, password=self._auth.password)
            try:
                reply = self._call(lambda s, t: s.auth.Authenticate(request, timeout=t), timeout, login=False)
            except EtcdError as exc:
                refused = f"login as {self._auth.user!r} refused: {exc.details}"
                raise EtcdAuthFailed(exc.code, refused) from None
            self._token = reply.token
            log.debug("logged in to etcd as %r", self._auth.user)

    def relogin_if_stale(self, details: str, watch: bool = False) -> bool:
        """After a stream ended with ``details``: log in again if etcd refused the token."""
        if self._auth is None or not stale_token(details, watch):
            return False
        try:
            self.login(self._token)
        except (EtcdError, EtcdUnavailable) as exc:
            log.warning("etcd login failed: %s", exc)
        return True

    def _call(
        self, fn: Callable[[Stubs, float], T], timeout: timedelta | float | None, *, login: bool = True
    ) -> T:
        """Run ``fn(stubs, attempt_timeout)`` on the current endpoint, failing over until the deadline;
        a refused token gets one new login and one retry."""
        if not login or self._auth is None:
            return self._attempts(fn, timeout)
        if self._token is None:
            self.login(None, timeout=timeout)
        token = self._token
        try:
            return self._attempts(fn, timeout)
        except EtcdError as exc:
            if not stale_token(exc.details):
                raise
        self.login(token, timeout=timeout)
        return self._attempts(fn, timeout)

    @contextlib.contextmanager
    def attempts_within(self, limit: float) -> Iterator[None]:
        """Calls made in this block by this thread give up on an endpoint after ``limit`` seconds
        (instead of ``attempt_timeout``) and go on to the next: for a write that must land before
        something runs out (a step-lease ceiling), which a hung member (stopped, or cut off without a
        FIN) would otherwise hold for the whole attempt timeout."""
        previous = getattr(self._urgent, "limit", None)
        self._urgent.limit = limit
        try:
            yield
        finally:
            self._urgent.limit = previous

    def _attempts(self, fn: Callable[[Stubs, float], T], timeout: timedelta | float | None) -> T:
        budget = seconds(timeout, self.timeout)
        deadline = time.monotonic() + budget
        index = self._current_index()
        tried = 0
        last = ""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            attempt = min(remaining, getattr(self._urgent, "limit", None) or self.attempt_timeout)
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
                time.sleep(min(RETRY_PAUSE, max(0.0, deadline - time.monotonic())))
        raise EtcdUnavailable(
            f"etcd store has no quorum or cannot be reached within {budget:g}s "
            f"(endpoints {','.join(self.endpoints)}; last error {last or 'deadline exceeded'})"
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stubs, self._stubs = list(self._stubs.values()), {}
        for s in stubs:
            s.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
