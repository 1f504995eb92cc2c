"""``ManagerClient``: what a training script calls at the start of every step.

``get_config`` never raises and never outlives its deadline unless asked to
(``strict=True``): an unreachable manager yields an empty ``Config`` with
``source="fallback"``, logged once per outage.

grpcio is not fork-safe: create the client in the process that uses it (torchrun
starts ranks as fresh processes, which is fine). A client inherited through
``fork()`` answers the fallback and logs an error instead of hanging.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from datetime import timedelta

import grpc

from protos import lighthouse_config_pb2 as pb
from protos.rpc import MANAGER_GET_CONFIG, make_channel, seconds
from worker_client.config import Config

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0

_Request = pb.ManagerConfigRequest
_Response = pb.ManagerConfigResponse


class ConfigUnavailable(RuntimeError):
    """Raised by strict calls when the manager did not answer within the deadline."""


def _to_config(reply: pb.ManagerConfigResponse, step: int | None) -> Config:
    return Config(
        dict(reply.config_data), version=reply.version, source=reply.source, step=step, pinned=reply.pinned
    )


class _Prefetcher:
    """Fetches the worker's next step in the background so the step's own call is a dict read.

    The step's path only reads and writes plain attributes: no lock, no thread
    wake-up, no system call. A daemon thread polls (at a fraction of the
    observed step time) for the step the worker consumed, then asks the manager
    for the next one, which is pinned and answered exactly as a direct call.
    """

    MIN_POLL = 0.0005
    MAX_POLL = 0.05

    def __init__(self, client: ManagerClient) -> None:
        self._client = weakref.ref(client)
        self.consumed: int | None = None  # last step the worker asked for (written by the worker)
        self.stride = 1
        self.ready: dict[int, Config] = {}  # step -> config (written by gRPC callbacks)
        self.in_flight: dict[int, grpc.Future] = {}
        self._poll = self.MAX_POLL
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="config-prefetch", daemon=True)
        self._thread.start()

    def take(self, step: int) -> Config | None:
        """The prefetched config for ``step``, if it arrived (worker thread; no blocking)."""
        previous = self.consumed
        if previous is not None and step > previous:
            self.stride = step - previous
        self.consumed = step
        return self.ready.pop(step, None)

    def future(self, step: int) -> grpc.Future | None:
        return self.in_flight.get(step)

    def _run(self) -> None:
        last_seen: int | None = None
        last_change = time.monotonic()
        while not self._stop.wait(self._poll):
            client = self._client()
            if client is None:
                return
            consumed = self.consumed
            if consumed is None:
                continue
            if consumed != last_seen:
                now = time.monotonic()
                # Poll at about a quarter of the step time: prompt, yet idle between steps.
                self._poll = min(self.MAX_POLL, max(self.MIN_POLL, (now - last_change) / 4))
                last_seen, last_change = consumed, now
                for stale in [s for s in self.ready if s <= consumed]:
                    self.ready.pop(stale, None)
            target = consumed + self.stride
            if target in self.ready or target in self.in_flight:
                continue
            self._start(client, target)
            del client

    def _start(self, client: ManagerClient, step: int) -> None:
        try:
            fut = client._call.future(
                _Request(group_rank=client.group_rank, step=step), timeout=client.timeout
            )
        except Exception:  # channel closed or the like: the direct path reports it
            return
        self.in_flight[step] = fut

        def done(f: grpc.Future, step: int = step) -> None:
            self.in_flight.pop(step, None)
            if f.cancelled() or f.exception() is not None:
                return
            self.ready[step] = _to_config(f.result(), step)

        fut.add_done_callback(done)

    def stop(self) -> None:
        self._stop.set()
        for fut in list(self.in_flight.values()):
            fut.cancel()


class ManagerClient:
    """One reusable, thread-safe channel to a group's manager.

    ``timeout`` is the default deadline of each ``get_config`` call; ``strict``
    makes calls raise ``ConfigUnavailable`` instead of answering the fallback;
    ``prefetch`` fetches step N+1 in the background after step N is asked for.
    """

    def __init__(
        self,
        addr: str,
        timeout: timedelta | float = timedelta(seconds=DEFAULT_TIMEOUT),
        *,
        group_rank: int = 0,
        strict: bool = False,
        prefetch: bool = False,
    ) -> None:
        self.addr = addr
        self.timeout = seconds(timeout, DEFAULT_TIMEOUT)
        self.group_rank = group_rank
        self.strict = strict
        self._channel = make_channel(addr)
        self._call = self._channel.unary_unary(
            MANAGER_GET_CONFIG,
            request_serializer=_Request.SerializeToString,
            response_deserializer=_Response.FromString,
        )
        self._outage_logged = False
        self._forked = False
        _live_clients.add(self)
        self._prefetch = _Prefetcher(self) if prefetch else None

    def get_config(
        self, step: int | None = None, timeout: timedelta | float | None = None, strict: bool | None = None
    ) -> Config:
        """The config for ``step`` (pinned: every rank of the group gets the same for a step)."""
        strict = self.strict if strict is None else strict
        if self._forked:
            return self._unavailable(
                "this ManagerClient was created before fork(); create one in the child", strict
            )
        prefetch = self._prefetch
        if prefetch is not None and step is not None:
            ready = prefetch.take(step)
            if ready is not None:
                return ready
        deadline = seconds(timeout, self.timeout)
        try:
            future = prefetch.future(step) if prefetch is not None and step is not None else None
            if future is not None:
                reply = future.result(timeout=deadline)
            else:
                request = _Request(group_rank=self.group_rank)
                if step is not None:
                    request.step = step
                reply = self._call(request, timeout=deadline)
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError) as exc:
            return self._unavailable(_describe(exc), strict)
        if self._outage_logged:
            logger.info("config manager %s reachable again", self.addr)
            self._outage_logged = False
        return _to_config(reply, step)

    def _unavailable(self, why: str, strict: bool) -> Config:
        if strict:
            raise ConfigUnavailable(f"config manager {self.addr} unavailable: {why}")
        if not self._outage_logged:
            self._outage_logged = True
            logger.warning("config manager %s unavailable (%s); using an empty config", self.addr, why)
        return Config(version=0, source="fallback")

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.stop()
        self._channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, grpc.FutureTimeoutError):
        return "DEADLINE_EXCEEDED"
    return type(exc).__name__


_live_clients: weakref.WeakSet[ManagerClient] = weakref.WeakSet()


def _mark_forked() -> None:
    for client in list(_live_clients):
        client._forked = True


os.register_at_fork(after_in_child=_mark_forked)
