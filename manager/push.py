"""The manager's ``WatchConfig`` stream: the lighthouse pushes every new version the moment it is committed.

While the stream is live the manager's snapshot is always the newest, so the cache TTL no
longer bounds how fast a change arrives; the manager's reports and step-lease renewals travel
on the same stream. Whenever it is not live (the lighthouse is down, hung, or an older release
without ``WatchConfig``), the manager polls ``GetConfig`` as before: ``live`` says which.

One thread per manager holds the stream: it sends what ``send`` queues and hands every reply
to ``on_reply``. A stream that ends or fails is opened again (to the lighthouse the client uses
now, so failover moves it too) after a short backoff, resuming from the version the manager holds.
A stream stays with the lighthouse the client uses: when the client moves (a call to the one the
stream was opened to hung or failed), the stream is ended at its next message and opened to the
new one. Otherwise a stream opened to a hung lighthouse just before the move goes live when that
host resumes, and the manager's renewals and reports go back to it.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from lighthouse.client import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from protos.streams import StreamThread

logger = logging.getLogger(__name__)

RETRY_MIN = 0.1  # seconds before opening a failed stream again, doubling up to RETRY_MAX
RETRY_MAX = 2.0
RETRY_UNSUPPORTED = 60.0  # a lighthouse without WatchConfig: polled; asked again this much later
OPEN_TIMEOUT = 5.0  # a stream the lighthouse has not answered by then is given up (a hung one)


class PushStream:
    """``first_request()`` opens each stream (the version held, the status); ``on_reply`` takes every
    message; ``on_down(reason)`` is told when a live stream ended. A stream unanswered after
    ``open_timeout`` seconds is cancelled and opened again to the lighthouse the client uses then."""

    def __init__(
        self,
        client: LighthouseClient,
        first_request: Callable[[], pb.LighthouseConfigRequest],
        on_reply: Callable[[pb.LighthouseConfigResponse], None],
        on_down: Callable[[str], None],
        open_timeout: float = OPEN_TIMEOUT,
    ) -> None:
        self._client = client
        self._first_request = first_request
        self._on_reply = on_reply
        self._on_down = on_down
        self._open_timeout = open_timeout
        self._requests: queue.SimpleQueue[pb.LighthouseConfigRequest | None] | None = None
        self._lock = threading.Lock()
        self.live = False  # a stream is open and has answered
        self.address = ""  # the lighthouse the current stream was opened to
        self.last_message = float("-inf")  # monotonic time of the last message received
        self.keepalive = 0.0  # the lighthouse's keep-alive interval (seconds), from its messages
        # Per address: that lighthouse has no WatchConfig until then. Per address, not per manager:
        # an old release first in the list must not keep the manager polling the healthy one.
        self.unsupported_until: dict[str, float] = {}
        self._stream = StreamThread(self._run, "manager-push")
        self._stream.start()

    def send(self, request: pb.LighthouseConfigRequest) -> bool:
        """Queue ``request`` on the live stream; False when there is none (poll instead)."""
        with self._lock:
            requests = self._requests if self.live else None
        if requests is None:
            return False
        requests.put(request)
        return True

    def silent_for(self) -> float:
        """Seconds since the stream last said anything."""
        return time.monotonic() - self.last_message

    def reset(self, why: str) -> None:
        """End the stream (it is silent past its deadline): the manager polls, and a new one opens."""
        if self._stream.cancel():
            logger.warning("push stream from %s dropped: %s", self.address, why)

    def stop(self) -> None:
        self._stream.stop()

    # ------------------------------------------------------------------ the stream's thread
    def _run(self) -> None:
        retry = RETRY_MIN
        while not self._stream.stopped.is_set():
            wait = self.unsupported_until.get(self._client.current, float("-inf")) - time.monotonic()
            if wait > 0:  # looked at again soon: the client may move to another lighthouse
                self._stream.stopped.wait(min(wait, RETRY_MAX))
                continue
            answered = self._stream_once()
            retry = RETRY_MIN if answered else min(retry * 2, RETRY_MAX)
            # Jittered: when a lighthouse restarts, its thousands of managers lost their streams
            # at the same moment and would otherwise all come back at the same moments too.
            self._stream.stopped.wait(retry * random.uniform(0.5, 1.0))

    def _stream_once(self) -> bool:
        """One stream, until it ends; whether the lighthouse answered on it."""
        requests: queue.SimpleQueue[pb.LighthouseConfigRequest | None] = queue.SimpleQueue()
        requests.put(self._first_request())
        address = self._client.current
        call = self._client.watch(_until_none(requests))
        with self._lock:
            self._requests, self.address = requests, address
        self._stream.reading(call)
        answered = False
        why = "ended"
        # A hung lighthouse (it accepts and never answers) must not hold the stream forever.
        timer = threading.Timer(self._open_timeout, lambda: answered or call.cancel())
        timer.daemon = True
        timer.start()
        try:
            for reply in call:
                if self._client.current != address:
                    why = f"the manager moved to lighthouse {self._client.current}"
                    call.cancel()
                    break
                self.last_message = time.monotonic()
                self.keepalive = reply.keepalive_ms / 1000
                if not answered:
                    answered = True
                    with self._lock:
                        self.live = True
                    logger.info("push stream from %s open", address)
                self._on_reply(reply)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            why = code.name if code is not None else str(exc)
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self.unsupported_until[address] = time.monotonic() + RETRY_UNSUPPORTED
                logger.info("lighthouse %s has no push streams (an older release): polling it", address)
        finally:
            timer.cancel()
            with self._lock:
                self.live = False
                self._requests = None
            self._stream.reading(None)
            requests.put(None)  # ends the request iterator gRPC reads from
        if answered:
            self._on_down(why)
        return answered


def _until_none(
    requests: queue.SimpleQueue[pb.LighthouseConfigRequest | None],
) -> Iterator[pb.LighthouseConfigRequest]:
    """The requests of one stream, as gRPC reads them (on its own thread), until None."""
    while True:
        request = requests.get()
        if request is None:
            return
        yield request
