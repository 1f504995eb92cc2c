"""The lighthouse's gRPC service (``GetConfig``, ``Heartbeat``, ``WatchConfig``), on the server's event loop.

The handlers are coroutines that do microseconds of work on the loop (the store's
writes they cause, job steps and step switches, are queued for its writer); the
rare slow part (opening a job from the store, a step lease that needs a ceiling
write or waits for a commit) runs on a thread.

Push (``WatchConfig``, one stream per manager): a stream is one coroutine
waiting on one event, which three things set: a request of its manager (a
status report or a step-lease renewal, answered at once), a new snapshot of its
job (sent at once; versions committed meanwhile coalesce into the newest, so a
slow manager never has more than one reply queued here), and the keep-alive
timer. Writes are flow-controlled per stream: a manager that does not
read holds up its own stream only. Idle, a stream costs a coroutine, a reader
task and a keep-alive message every ``keepalive`` seconds.

Every reply is built by ``LighthouseState.answer`` exactly as for ``GetConfig``
(same bytes, same step lease), plus ``keepalive_ms``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
from collections import defaultdict
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from lighthouse.jobs.registry import JobRegistry, TooManyJobs
from lighthouse.jobs.state import LighthouseState
from lighthouse.rpc.manager_access import Denied, ManagerAccess
from protos import lighthouse_config_pb2 as pb
from protos.job_ids import InvalidJobId, JobId, check_job_id
from protos.limits import MAX_ID_BYTES
from protos.rpc import varint_field
from protos.torchft_seed import JOB_METADATA, SEED_SERVICE, SeedConfigRequest, seed_config_reply

logger = logging.getLogger(__name__)

KEEPALIVE = 15.0  # seconds: at least one message this often on every stream (a dead peer is
# noticed sooner by the transport's keepalive pings: see protos/rpc.py)
MAX_LEASE_WAIT = 1.0  # seconds a call may wait for a lease (a first ceiling write, a commit)
MAX_QUEUED_REQUESTS = 64  # a manager sending faster than it is answered: older reports are dropped
_KEEPALIVE_MS = pb.LighthouseConfigResponse.KEEPALIVE_MS_FIELD_NUMBER
_STEPLESS = pb.LighthouseConfigRequest()  # what the seed's call counts as: no status, no step
EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]  # what read() returns at the stream's end


class _Stream:
    """One manager's open stream."""

    __slots__ = (
        "closed",
        "identity",
        "keepalive_due",
        "peer",
        "replica",
        "request",
        "requests",
        "sent",
        "step",
        "wake",
    )

    def __init__(self, first: pb.LighthouseConfigRequest, peer: str, identity: str) -> None:
        self.peer = peer
        self.identity = identity
        self.replica = first.status.replica_id or peer
        self.wake = asyncio.Event()
        self.requests: list[pb.LighthouseConfigRequest] = [first]
        self.request = first  # the latest: its lease seconds and replica id serve pushes too
        self.sent = (first.known_version, first.known_state_id)  # what the manager holds
        self.step = -1  # the step its lease should cover, from its latest request
        self.keepalive_due = False
        self.closed = False


R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def frees_refused_requests(handler: Handler[R]) -> Handler[R]:
    """A handler whose refused calls free their request at once, not at the next garbage collection.

    ``context.abort`` raises an exception that grpc keeps on the call (the call, the exception, its
    traceback, the handler's frames holding the request and the call): a cycle that only Python's
    cyclic collector frees, and with the young generation ``serve`` sets (50,000 objects,
    ``protos.daemon``) it runs once every ~1,500 refused calls. Each one kept its request bytes and
    what they were parsed into until then: 400 heartbeats with 100 KB ids, refused by the id limit,
    grew the lighthouse from 54 to 210 MB (and 4 MB requests would have kept gigabytes). Dropping
    the traceback breaks the cycle: the request is freed as the call ends.
    """

    @functools.wraps(handler)
    async def run(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        call = handler(self, request, context)
        del request  # this frame is in the traceback of the re-raise below: it must not hold the request
        try:
            return await call
        except grpc.aio.AbortError as exc:
            raise exc.with_traceback(None) from None

    return run


class LighthouseService:
    """The handlers, and every open push stream by job; lives on the gRPC server's event loop."""

    def __init__(
        self, jobs: JobRegistry, keepalive: float = KEEPALIVE, access: ManagerAccess | None = None
    ) -> None:
        self.jobs = jobs
        self.access = access or ManagerAccess(None)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, known from the first stream on
        self.keepalive = keepalive
        self._keepalive_field = varint_field(_KEEPALIVE_MS, round(keepalive * 1000))
        self._streams: dict[JobId, set[_Stream]] = defaultdict(set)
        jobs.on_served(self._served)

    def streams(self, job: JobId) -> int:
        """Open streams of ``job`` (for /metrics; read from any thread)."""
        return len(self._streams.get(job, ()))

    def _served(self, job: JobId) -> None:
        """A new snapshot of ``job`` (from any thread: a commit, another lighthouse's change)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_job, job)

    def _wake_job(self, job: JobId) -> None:
        for stream in self._streams.get(job, ()):
            stream.wake.set()

    @frees_refused_requests
    async def get_config(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """``GetConfig``: the reply already serialized (no per-call protobuf work on the hot path)."""
        request = await _parse(pb.LighthouseConfigRequest, raw, context)
        state, identity = await self._state(request.job, context)
        peer = context.peer()
        step = state.receive(request, peer, identity=identity)
        why = self.jobs.cannot_promise(state, step) if step >= 0 else None
        if why is not None:  # the manager moves to another lighthouse of its list
            message = f"this lighthouse cannot promise step {step} now ({why}): ask another"
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        reply = await _answer(
            state, request.known_version, request.known_state_id, step, request, peer, context
        )
        return reply[0]

    @frees_refused_requests
    async def seed_get_config(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The seed's ``torchft.LighthouseService/GetConfig``: the live config of the job named in
        ``lighthouse-job`` metadata (none: ``default``), a stepless fetch like any other."""
        try:
            SeedConfigRequest.FromString(raw)
        except DecodeError as exc:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a torchft.LighthouseConfigRequest: {exc}"
            )
        job = next((v for k, v in context.invocation_metadata() or () if k == JOB_METADATA), "")
        state, _ = await self._state(job if isinstance(job, str) else "", context)
        state.receive(_STEPLESS, context.peer())
        return seed_config_reply(state.snapshot.config)

    @frees_refused_requests
    async def heartbeat(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> pb.LighthouseHeartbeatResponse:
        request = await _parse(pb.LighthouseHeartbeatRequest, raw, context)
        state, identity = await self._state(request.status.job, context)
        state.count_heartbeat()
        state.observe(request.status, context.peer(), identity=identity)
        return pb.LighthouseHeartbeatResponse(version=state.store.head, instance_id=state.instance_id)

    @frees_refused_requests
    async def watch(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        """``WatchConfig``: one manager's push stream, until it ends."""
        self.loop = asyncio.get_running_loop()
        raw = await context.read()
        if raw is EOF:
            return
        first = await _parse(pb.LighthouseConfigRequest, raw, context)
        state, identity = await self._state(first.job, context)
        job = state.job
        stream = _Stream(first, context.peer(), identity)
        streams = self._streams[job]
        streams.add(stream)
        reader = asyncio.create_task(self._read(context, stream))
        opened = False
        try:
            while True:
                reply = await self._reply(state, stream)
                if reply is not None:
                    await context.write(reply[0] + self._keepalive_field)
                    if not opened:  # the first request made its manager known: count its stream
                        state.watched(stream.replica, 1, reply[1])
                        opened = True
                    else:
                        state.watched(stream.replica, 0, reply[1])
                if stream.closed:
                    return
                try:
                    # Jittered: after a fan-out every stream's timer restarts at once, and would
                    # keep firing together (thousands of keep-alives in one burst).
                    async with asyncio.timeout(self.keepalive * random.uniform(0.8, 1.0)):
                        await stream.wake.wait()
                except TimeoutError:
                    stream.keepalive_due = True
                stream.wake.clear()
        finally:
            reader.cancel()
            streams.discard(stream)
            if not streams:
                self._streams.pop(job, None)
            if opened:
                state.watched(stream.replica, -1)

    async def _state(self, job: str, context: grpc.aio.ServicerContext) -> tuple[LighthouseState, str]:
        """The job a call names (where its id and the caller's credential are checked), and that
        credential; a job this lighthouse does not hold is NOT_FOUND for an anonymous call (a flood of
        made-up ids creates nothing), else served (empty) from now on, opened from the store off the
        loop, or the call is refused (a bad id or credential, too many jobs)."""
        try:
            checked = check_job_id(job)
            identity = self.access.identify(checked, context)
        except InvalidJobId as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("context.abort raises") from None
        except Denied as exc:
            await context.abort(exc.code, str(exc))
            raise AssertionError("context.abort raises") from None
        state = self.jobs.get(checked)
        if state is not None:
            return state, identity
        if not identity:  # jobs are made by an operator, the config directory or an authenticated manager
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no job {checked!r} on this lighthouse: an operator creates it (PUT "
                f"/api/jobs/{checked}/config, lighthouse config set --create, --config-dir), "
                "or a manager with its token",
            )
        try:
            state = await asyncio.get_running_loop().run_in_executor(None, self.jobs.serve, checked)
            return state, identity
        except TooManyJobs as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        raise AssertionError("context.abort raises")

    async def _read(self, context: grpc.aio.ServicerContext, stream: _Stream) -> None:
        """The manager's requests, queued for the stream; its end (or a broken stream) closes it."""
        try:
            while True:
                raw = await context.read()
                if raw is EOF:
                    break
                try:
                    request = pb.LighthouseConfigRequest.FromString(raw)
                except DecodeError:
                    logger.warning("push stream of %s: a malformed request, ignored", stream.replica)
                    continue
                problem = refused(request)
                if problem:
                    logger.warning("push stream of %s: %s, ignored", stream.replica, problem)
                    continue
                stream.requests.append(request)
                del stream.requests[:-MAX_QUEUED_REQUESTS]
                stream.wake.set()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        finally:
            stream.closed = True
            stream.wake.set()

    async def _reply(self, state: LighthouseState, stream: _Stream) -> tuple[bytes, int] | None:
        """What to send now: an answer to the manager's requests, else a new version or a keep-alive."""
        requests, stream.requests = stream.requests, []
        for request in requests:  # every report counts (its step switches, its counters)
            stream.step = state.receive(request, stream.peer, stream=True, identity=stream.identity)
            stream.request = request
        snapshot = state.snapshot
        changed = stream.sent != (snapshot.version, snapshot.state_id)
        if not requests and not changed and not stream.keepalive_due:
            return None
        stream.keepalive_due = False
        reply = await _answer(state, *stream.sent, stream.step, stream.request, stream.peer, streamed=True)
        stream.sent = (reply[1], state.snapshot.state_id)
        return reply


M = TypeVar("M", pb.LighthouseConfigRequest, pb.LighthouseHeartbeatRequest)


async def _parse(kind: type[M], raw: bytes, context: grpc.aio.ServicerContext) -> M:
    """A request parsed here, so junk bytes get INVALID_ARGUMENT and say why (a deserializer that
    fails gives the caller only UNKNOWN)."""
    try:
        request = kind.FromString(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a {kind.__name__}: {exc}")
        raise AssertionError("context.abort raises") from None
    problem = refused(request)
    if problem:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    return request


def refused(request: pb.LighthouseConfigRequest | pb.LighthouseHeartbeatRequest) -> str:
    """Why a request is refused ("" when it is not): an id past MAX_ID_BYTES (records stay small),
    a lease asked for a time that is no number of seconds (NaN, infinite, negative)."""
    for name in ("replica_id", "address"):
        if len(getattr(request.status, name).encode()) > MAX_ID_BYTES:
            return f"status.{name} is longer than {MAX_ID_BYTES} bytes"
    seconds = getattr(request, "lease_seconds", 0.0)
    if not (math.isfinite(seconds) and seconds >= 0):
        return f"lease_seconds is {seconds!r}: a finite number of seconds, 0 or more"
    return ""


def lease_wait(time_remaining: float | None) -> float:
    """How long a call may wait for its step lease: at most half of its remaining deadline."""
    return MAX_LEASE_WAIT if time_remaining is None else max(0.001, min(MAX_LEASE_WAIT, time_remaining / 2))


async def _answer(
    state: LighthouseState,
    known_version: int,
    known_state_id: str,
    step: int,
    request: pb.LighthouseConfigRequest,
    peer: str,
    context: grpc.aio.ServicerContext | None = None,
    streamed: bool = False,
) -> tuple[bytes, int]:
    """``state.answer`` on the loop; when its step lease needs a wait (the job's first ceiling write,
    a commit under way), on a thread, waiting at most half the call's remaining time."""
    answer = partial(state.answer, known_version, known_state_id, step, request, peer, streamed=streamed)
    reply = answer()
    if reply is None:
        wait = lease_wait(context.time_remaining() if context is not None else None)
        reply = await asyncio.get_running_loop().run_in_executor(None, partial(answer, wait=wait))
    assert reply is not None  # with a wait, always an answer
    return reply


def seed_handler(service: LighthouseService) -> grpc.GenericRpcHandler:
    """The seed's GetConfig alone, so a handler for torchft's other methods can sit beside it."""
    return grpc.method_handlers_generic_handler(
        SEED_SERVICE, {"GetConfig": grpc.unary_unary_rpc_method_handler(service.seed_get_config)}
    )
