"""The thread that reads a gRPC stream, and how another thread stops it: the etcd watch and the
manager's push stream both read one stream after another until stopped, and a read blocks until
the call is cancelled."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol


class Cancellable(Protocol):
    def cancel(self) -> bool: ...


class StreamThread:
    """A daemon thread running ``run``; ``stop()`` sets ``stopped``, cancels the call being read and
    joins. ``run`` loops while ``stopped`` is clear and hands each call it opens to ``reading``."""

    def __init__(self, run: Callable[[], None], name: str) -> None:
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: Cancellable | None = None
        self._thread = threading.Thread(target=run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def reading(self, call: Cancellable | None) -> None:
        """``call`` is the stream read now (None: none); cancelled at once if ``stop()`` already ran,
        as stop() may have looked before it was set."""
        with self._lock:
            self._call = call
        if call is not None and self.stopped.is_set():
            call.cancel()

    def cancel(self) -> bool:
        """End the stream read now (``run`` goes on with the next one); False when there is none or
        it ended already (so a stream many callers find silent is ended, and logged, once)."""
        with self._lock:
            call = self._call
        return call is not None and bool(call.cancel())

    def stop(self) -> None:
        self.stopped.set()
        self.cancel()
        self._thread.join(timeout=5)
