"""``ManagerClient``: what a training script calls at the start of every step.

``get_config`` never raises and never outlives its deadline unless asked to
(``strict=True``): an unreachable manager yields an empty ``Config`` with
``source="fallback"``, logged once per outage. A strict client also raises
when the manager itself could not confirm the step's config (it answered the
fallback or, with ``--serve-stale``, a stale one): under torchft, a group that
cannot confirm its config stops and is healed, rather than train a step with a
value the other groups may not use.

grpcio is not fork-safe: create the client in the process that uses it (torchrun
starts ranks as fresh processes, which is fine). A client inherited through
``fork()`` answers the fallback and logs an error instead of hanging.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc

from protos import lighthouse_config_pb2 as pb
from protos.rpc import MANAGER_GET_CONFIG, call_again_if_dropped, make_channel, seconds
from protos.tls import TLSConfig, tls_failure, tls_for
from worker_client.changes import ChangeWatcher, ConfigChange
from worker_client.config import Config
from worker_client.reports import ReportBuffer

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
MAX_STRIDE = 16  # largest step increment the prefetcher follows
# A call that fails this many seconds past its deadline was not failed at its deadline: its process
# stood still meanwhile (gRPC ends a call at its deadline, a little later on a busy host). It is asked
# once more, for at most FROZEN_RETRY seconds (see ``get_config``).
FROZEN_LATE = 0.2
FROZEN_RETRY = 0.5
CLOSE_FLUSH_TIMEOUT = 2.0  # close() sends the reports still waiting, within this (or the client's) deadline

_Request = pb.ManagerConfigRequest
_Response = pb.ManagerConfigResponse


UNCONFIRMED = frozenset({"fallback", "stale"})  # sources of a config the lighthouse did not confirm


class ConfigUnavailable(RuntimeError):
    """Raised by strict calls when no confirmed config came within the deadline: the manager did not
    answer, or it answered the fallback (or a stale config) because the lighthouse could not confirm
    one for the step; that answer is ``answer`` (None when the manager did not answer)."""

    def __init__(self, message: str, answer: Config | None = None) -> None:
        super().__init__(message)
        self.answer = answer


class _Decoder:
    """Turns reply bytes into a ``Config``, reusing the last decoded dict when the bytes repeat.

    Consecutive steps usually get byte-identical replies (same version, pinned),
    so the common case costs a bytes comparison and a dict copy, not a parse.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[bytes, dict[str, str], dict[str, Any]] | None = None

    def __call__(self, raw: bytes, step: int | None) -> Config:
        last = self._last
        if last is None or last[0] != raw:
            reply = _Response.FromString(raw)
            fields: dict[str, Any] = {
                "version": reply.version,
                "source": reply.source,
                "pinned": reply.pinned,
                "job": reply.job,
                "author": reply.author or None,
                "comment": reply.comment or None,
            }
            for name in _OPTIONAL:
                fields[name] = getattr(reply, name) if reply.HasField(name) else None
            last = self._last = (raw, dict(reply.config_data), fields)
        _, data, fields = last
        return Config(data, step=step, **fields)


# Reply fields that are absent when not known (None in the Config).
_OPTIONAL = ("stable_through_step", "pending_version", "pending_step", "effective_step")


class _Prefetcher:
    """Fetches the worker's next step in the background so the step's own call is a dict read.

    A step served from memory only pops from a dict and writes attributes: no lock, no
    thread wake-up, no system call. A daemon thread notices the step the worker
    took (polling at an eighth of the step time, backing off while the worker
    pauses) and asks the manager for the next one, which is pinned and answered
    exactly like a direct call; when the worker is already waiting for a step,
    its reply starts the next fetch at once. ``AHEAD`` steps ahead: a change made
    now still reaches the worker within that many extra steps (under a step lease it takes
    effect at a step promised ahead anyway).

    After a pause (an evaluation, a checkpoint) the thread sleeps on ``_wake``, and the worker's
    first ask sets it (so does a step not ready, which waits for the manager anyway): the step it
    asks for was fetched before the pause (pinned, so still its config) and the next ones are
    fetched at once.
    """

    MIN_POLL = 0.0002
    FIRST_POLL = 0.001
    FIRST_WINDOW = 0.1  # seconds of FIRST_POLL after a step while the step time is not known
    MAX_POLL = 0.05
    AHEAD = 3  # steps fetched ahead of the worker's
    # With short steps, as many steps as this many seconds: a thread woken late or a round trip
    # slowed on a loaded machine (2 cores shared: several milliseconds) still finds the next
    # step fetched; 3 steps of 2 ms left 96.5% from memory at a load of 8, goal 99%.
    AHEAD_SECONDS = 0.02
    MAX_AHEAD = 16

    def __init__(self, client: ManagerClient) -> None:
        self._client = weakref.ref(client)
        self.consumed: int | None = None  # last step the worker asked for (written by the worker)
        self.ready: dict[int, Config] = {}  # step -> config (written by gRPC callbacks)
        self.in_flight: dict[int, grpc.Future] = {}
        self.acted_on: int | None = None  # the last asked step the thread has fetched for, if it had to
        self._stride = 1
        self._last_delta = 1
        self._step_time: float | None = None  # moving average of the worker's step time
        self._last_change = time.monotonic()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by the worker's ask while the thread backs off
        self._idle = False  # the thread backs off: the worker paused
        self.hits = 0  # steps asked for and answered from memory
        self.asks = 0  # steps asked for
        self.looks = 0  # times the thread woke to look at the worker's step (its cost while idle)
        self._thread = threading.Thread(target=self._run, name="config-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_seen: int | None = None
        wait = 0.01
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            self.looks += 1
            if self._stop.is_set():
                return
            client = self._client()
            if client is None:
                return
            consumed = self.consumed
            now = time.monotonic()
            if consumed is not None and consumed != last_seen:
                self._observe(last_seen, consumed, now)
                last_seen = consumed
                self._ahead(client, consumed)
                self.acted_on = consumed
            del client
            wait = self._next_wait(now)

    def asked(self, step: int) -> None:
        """The worker asks for ``step`` (called on its thread, so that every ask counts: this
        thread samples ``consumed`` and, on a busy machine, sees every other step only, which
        would read as a stride of 2 and fetch a step the worker never asks for)."""
        previous = self.consumed
        if self._idle:
            self._idle = False
            self._wake.set()
        if previous is not None and step > previous:
            # A regular stride (the same small jump twice) is followed; any other jump (a restore
            # from a checkpoint, say) must not make us fetch, and pin, a step far ahead.
            delta = step - previous
            self._stride = delta if delta == self._last_delta and delta <= MAX_STRIDE else 1
            self._last_delta = delta
        self.consumed = step

    def behind(self) -> None:
        """The step asked for was not ready (the thread slept through steps on a loaded machine, or
        the worker came back from a pause): wake the thread, which fetches ahead meanwhile."""
        self._wake.set()

    def _observe(self, previous: int | None, consumed: int, now: float) -> None:
        if previous is not None and consumed > previous:
            interval = now - self._last_change
            if self._step_time is None:
                self._step_time = interval
            elif interval <= 3 * self._step_time:  # a pause is not a step: it would slow the polling
                self._step_time = 0.8 * self._step_time + 0.2 * interval
        self._last_change = now
        for stale in [s for s in list(self.ready) if s <= consumed]:  # callbacks insert meanwhile
            self.ready.pop(stale, None)

    def _next_wait(self, now: float) -> float:
        step_time = self._step_time
        if step_time is None:
            # Until the step time is known (the worker's second step), look every FIRST_POLL: at
            # 10 ms the first steps fetched ran out before the next look (a miss at the 5th step).
            # Before the first ask, and once no second step came for FIRST_WINDOW (a slow loop, or
            # one ask alone), back off: an ask that finds nothing ready wakes the thread anyway.
            if self.consumed is None or now - self._last_change > self.FIRST_WINDOW:
                return self.MAX_POLL
            return self.FIRST_POLL
        since = now - self._last_change
        if since > 3 * step_time:
            self._idle = True  # the worker paused: back off; its next ask wakes the thread
            return min(self.MAX_POLL, max(self.MIN_POLL, since / 4))
        return min(self.MAX_POLL, max(self.MIN_POLL, step_time / 8))

    def _ahead(self, client: ManagerClient, consumed: int) -> None:
        """Fetch the next ``AHEAD`` steps not held or on their way (more for short steps: as many
        as ``AHEAD_SECONDS`` of steps, at most ``MAX_AHEAD``): the later ones absorb a slow round
        trip or a late wake-up (on a loaded machine) without the worker waiting."""
        ahead = self.AHEAD
        step_time = self._step_time
        if step_time is not None and step_time > 0:
            ahead = max(ahead, min(self.MAX_AHEAD, math.ceil(self.AHEAD_SECONDS / step_time)))
        for k in range(1, ahead + 1):
            target = consumed + k * self._stride
            if target not in self.ready and target not in self.in_flight:
                self._start(client, target)

    def _start(self, client: ManagerClient, step: int) -> None:
        request = _Request(group_rank=client.group_rank, step=step)
        reports = client._reports
        reports.drain_into(request)  # the rank's reports ride on the fetch of a following step
        try:
            fut = client._call.future(request, timeout=client.timeout)
        except Exception:  # channel closed or the like: the direct path reports it
            reports.failed(request)
            return
        self.in_flight[step] = fut
        decode = client._decode

        def done(f: grpc.Future, step: int = step) -> None:
            self.in_flight.pop(step, None)
            if f.cancelled() or f.exception() is not None:
                reports.failed(request)
                return
            self.ready[step] = decode(f.result(), step)
            consumed = self.consumed
            if consumed is not None and consumed >= step and not self._stop.is_set():
                # The worker is already at this step (it waited for this reply): go on at once.
                client = self._client()
                if client is not None:
                    self._ahead(client, consumed)

        fut.add_done_callback(done)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for fut in list(self.in_flight.values()):
            fut.cancel()


class ManagerClient:
    """One reusable, thread-safe channel to a group's manager.

    ``timeout`` is the default deadline of each ``get_config`` call; ``strict``
    makes calls raise ``ConfigUnavailable`` instead of answering the fallback;
    ``prefetch`` fetches step N+1 in the background after step N is asked for;
    ``tls`` dials a manager serving TLS (plaintext by default: same host or pod; an
    ``https://`` address speaks TLS trusting the system's roots).
    ``report`` hands the rank's training metrics to the group's manager (see ``report``).
    ``on_change(change)`` runs once per new version, at the first step it is served (see
    ``worker_client.changes``; ready adapters in ``worker_client.trackers``).
    """

    def __init__(
        self,
        addr: str,
        timeout: timedelta | float = timedelta(seconds=DEFAULT_TIMEOUT),
        *,
        group_rank: int = 0,
        strict: bool = False,
        prefetch: bool = False,
        tls: TLSConfig | None = None,
        on_change: Callable[[ConfigChange], object] | None = None,
    ) -> None:
        self.addr = addr
        self.tls = tls_for(addr, tls)
        self.timeout = seconds(timeout, DEFAULT_TIMEOUT)
        self.group_rank = group_rank
        self.strict = strict
        self._channel = make_channel(addr, self.tls)
        self._call = self._channel.unary_unary(
            MANAGER_GET_CONFIG,
            request_serializer=_Request.SerializeToString,
            response_deserializer=None,  # raw bytes: _Decoder skips the parse when they repeat
        )
        self._decode = _Decoder()
        self._reports = ReportBuffer()
        self._outage_logged = False
        self._forked = False
        _live_clients.add(self)
        self._prefetch = _Prefetcher(self) if prefetch else None
        self._changes = ChangeWatcher(on_change) if on_change is not None else None  # see changes.py

    def get_config(
        self,
        step: int | None = None,
        timeout: timedelta | float | None = None,
        strict: bool | None = None,
        peek: bool = False,
    ) -> Config:
        """The config for ``step`` (pinned: every rank of the group gets the same for a step).

        ``peek=True`` looks without pinning or moving the group's step (for tools, not training).
        """
        prefetch = self._prefetch
        strict = self.strict if strict is None else strict
        if prefetch is not None and step is not None and not self._forked and not peek:
            ready = prefetch.ready.pop(step, None)  # with prefetch, usually the step's whole cost
            prefetch.asked(step)
            prefetch.asks += 1
            if ready is None:
                prefetch.behind()
            else:
                prefetch.hits += 1
                if self._changes is not None:
                    self._changes.seen(ready)
                return self._unconfirmed(ready) if strict and ready.source in UNCONFIRMED else ready
        if self._forked:
            return self._unavailable(
                "this ManagerClient was created before fork(); create one in the child", strict
            )
        deadline = seconds(timeout, self.timeout)
        began = time.monotonic()
        try:
            future = (
                prefetch.in_flight.get(step)
                if prefetch is not None and step is not None and not peek
                else None
            )
            raw = future.result(timeout=deadline) if future is not None else self._ask(step, peek, deadline)
        except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError) as exc:
            try:
                raw = self._ask_again(exc, step, peek, began, deadline)
            except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError) as final:
                return self._unavailable(_describe(final, self.tls is not None), strict)
        if self._outage_logged:
            logger.info("config manager %s reachable again", self.addr)
            self._outage_logged = False
        config = self._decode(raw, step)
        if self._changes is not None and not peek:
            self._changes.seen(config)
        return self._unconfirmed(config) if strict and config.source in UNCONFIRMED else config

    def _ask(self, step: int | None, peek: bool, deadline: float) -> bytes:
        """One call to the manager for ``step``, carrying the rank's reports (kept on a failure)."""
        request = _Request(group_rank=self.group_rank, peek=peek)
        if step is not None:
            request.step = step
        if not peek:
            self._reports.drain_into(request)
        try:
            raw: bytes = self._call(request, timeout=deadline)
        except grpc.RpcError:
            self._reports.failed(request)
            raise
        return raw

    def _ask_again(
        self, failure: BaseException, step: int | None, peek: bool, began: float, timeout: float
    ) -> bytes:
        """After a failed call (``failure``), ask again where the failure may not stand, rather than
        train the step on the fallback while the group's other ranks train its config (the chaos
        suite's rank_stop); else raise ``failure``. The failed call ``began`` (monotonic) with ``timeout``.

        - The call failed well after its deadline: this process stood still meanwhile (SIGSTOP, a
          paused VM, a long swap) and its deadline passed while it did; the manager's answer may
          be waiting, unread. Asked again briefly (at most FROZEN_RETRY).
        - It was sent on a connection the manager had dropped (``call_again_if_dropped``): the
          manager stops waiting for a client whose keep-alive ping goes unanswered.
        """
        now = time.monotonic()
        deadline = began + timeout
        if now > deadline + FROZEN_LATE:
            deadline = now + min(timeout, FROZEN_RETRY)
            try:
                return self._ask(step, peek, deadline - now)
            except grpc.RpcError as again:
                failure = again
        return call_again_if_dropped(lambda left: self._ask(step, peek, left), failure, deadline)

    def _unconfirmed(self, config: Config) -> Config:
        """A strict call answered with a config the lighthouse did not confirm: raise."""
        where = "" if config.step is None else f" for step {config.step}"
        raise ConfigUnavailable(
            f"config manager {self.addr} has no confirmed config{where} (it answered {config.source}: "
            "the lighthouse did not answer, or could not promise this step)",
            config,
        )

    def report(self, step: int, **metrics: float) -> None:
        """Report this rank's values for ``step``, e.g. ``client.report(step, loss=0.71, grad_norm=1.3)``.

        A memory append: it never blocks, makes no call and never raises. The reports ride on
        this client's next call to its manager (the next ``get_config``, or with ``prefetch=True``
        its background fetch), which aggregates the group's ranks per step (mean, min, max,
        count, non-finite) and forwards them to the lighthouse with its status; ``close()`` sends
        what is left. At most ``MAX_PENDING`` (4,096) reports wait: beyond, the oldest are
        dropped and counted (``reports_dropped``). Names are ``[A-Za-z_][A-Za-z0-9_]*`` (at most
        64 characters, 32 metrics a report) and values are converted with ``float()`` when the
        report is sent: a report that breaks a rule is dropped, counted and logged. Pass Python
        numbers (``loss.item()``): converting a GPU tensor would wait for the GPU.
        """
        self._reports.add(step, metrics)

    @property
    def steps_from_memory(self) -> tuple[int, int]:
        """With ``prefetch``: (steps answered from memory, steps asked for) so far; (0, 0) without."""
        prefetch = self._prefetch
        return (prefetch.hits, prefetch.asks) if prefetch is not None else (0, 0)

    @property
    def reports_dropped(self) -> int:
        """Reports this client dropped (buffer full) or lost with a failed call, so far."""
        return self._reports.dropped

    def _unavailable(self, why: str, strict: bool) -> Config:
        if strict:
            raise ConfigUnavailable(f"config manager {self.addr} unavailable: {why}")
        if not self._outage_logged:
            self._outage_logged = True
            logger.warning("config manager %s unavailable (%s); using an empty config", self.addr, why)
        return Config(version=0, source="fallback")

    def close(self) -> None:
        """Send the reports still waiting (one call, bounded by a short deadline), then close."""
        if self._prefetch is not None:
            self._prefetch.stop()
        deadline = time.monotonic() + min(self.timeout, CLOSE_FLUSH_TIMEOUT)
        while len(self._reports) and not self._forked and time.monotonic() < deadline:
            request = _Request(group_rank=self.group_rank, peek=True)  # pins nothing, moves no step
            self._reports.drain_into(request)
            try:
                self._call(request, timeout=max(0.001, deadline - time.monotonic()))
            except grpc.RpcError as exc:
                self._reports.failed(request)
                logger.info("reports not sent before closing: %s", _describe(exc, self.tls is not None))
                break
        self._channel.close()

    def __enter__(self) -> ManagerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _describe(exc: BaseException, tls: bool) -> str:
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {tls_failure(exc.details() or '', tls) or exc.details()}"
    if isinstance(exc, grpc.FutureTimeoutError):
        return "DEADLINE_EXCEEDED"
    return type(exc).__name__


_live_clients: weakref.WeakSet[ManagerClient] = weakref.WeakSet()


def _mark_forked() -> None:
    for client in list(_live_clients):
        client._forked = True


os.register_at_fork(after_in_child=_mark_forked)
