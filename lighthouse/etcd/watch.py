"""A prefix watch that follows etcd from one revision on, across members and compactions."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from lighthouse.etcd.connection import RETRY_PAUSE, Connection
from lighthouse.etcd.errors import EtcdUnavailable
from lighthouse.etcd.types import Event, KeyValue, as_bytes, range_end_for
from protos.etcd import kv_pb2, rpc_pb2
from protos.streams import StreamThread

log = logging.getLogger(__name__)

# etcd cancels a watch whose member lost its leader only when asked to (so a
# partitioned member's watch does not silently go quiet).
_REQUIRE_LEADER = (("hasleader", "true"),)
_WATCH_BACKOFF_MAX = 1.0
# A watch that hears nothing cannot tell a quiet prefix from a member that stopped sending (cut
# off, stuck, or answering pings but not the watch). So it asks for a progress notification every
# WATCH_PROGRESS_INTERVAL (etcd answers at once with its revision), and a stream that has sent
# nothing for WATCH_SILENCE_TIMEOUT is dropped and resumed on the next member.
WATCH_PROGRESS_INTERVAL = 2.0
WATCH_SILENCE_TIMEOUT = 3 * WATCH_PROGRESS_INTERVAL


class Watcher(Connection):
    """The watch call of ``EtcdClient``."""

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
        return Watch(self, as_bytes(key), prefix, start_revision, on_events, on_compacted)


class Watch:
    """A prefix watch that reconnects to the next endpoint on failure and resumes where it left off.

    A failure includes silence: the stream asks for progress notifications, so a member that
    sends nothing past ``WATCH_SILENCE_TIMEOUT`` is taken for cut off (keepalive catches a dead
    connection; this catches a live one whose watch went quiet).
    """

    def __init__(
        self,
        client: Connection,
        key: bytes,
        prefix: bool,
        start_revision: int,
        on_events: Callable[[list[Event]], None],
        on_compacted: Callable[[], int],
    ) -> None:
        self._client = client
        self._key = key
        self._range_end = range_end_for(key, prefix)
        self._on_events = on_events
        self._on_compacted = on_compacted
        self._lock = threading.Lock()
        self._next_revision = start_revision
        self._heard_at = time.monotonic()  # when the stream last sent anything
        self.created = threading.Event()  # set while a stream is established (startup, tests)
        self._stream = StreamThread(self._run, "etcd-watch")
        self._stream.start()

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
                self._stream.cancel()
                return
            yield rpc_pb2.WatchRequest(progress_request=rpc_pb2.WatchProgressRequest())

    def _run(self) -> None:
        backoff = RETRY_PAUSE
        while not self._stream.stopped.is_set():
            index = self._client._current_index()
            try:
                stubs = self._client._stubs_for(index)
            except EtcdUnavailable:
                return  # client closed
            done, silent = threading.Event(), threading.Event()
            self._heard_at = time.monotonic()
            call = stubs.watch.Watch(
                self._requests(self.next_revision, done, silent), metadata=_REQUIRE_LEADER
            )
            self._stream.reading(call)
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
            if self._stream.stopped.is_set():
                return
            if silent.is_set():
                reason = f"nothing heard for {WATCH_SILENCE_TIMEOUT:g}s"
            if reason == "compacted":
                continue  # same endpoint, from the revision the reload returned
            # A token etcd no longer knows (expired, or etcd restarted) refuses the watch's creation
            # (etcd 3.4 says "permission denied"): log in again and retry on the same endpoint.
            if not self._client.relogin_if_stale(reason, watch=True):
                log.info("etcd watch on %s lost (%s); reconnecting", self._client.endpoints[index], reason)
                self._client._move_on(index)
            # Back off only while no stream gets established (every endpoint down or leaderless).
            backoff = RETRY_PAUSE if established else min(backoff * 2, _WATCH_BACKOFF_MAX)
            self._stream.stopped.wait(backoff)

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
        self._stream.stop()
