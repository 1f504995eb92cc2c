"""What a rank reports (``ManagerClient.report``): a bounded memory buffer emptied into its next call.

``report(step, loss=...)`` must cost a training loop nothing it would notice: it
appends ``(step, metrics)`` to a deque and returns (no lock, no I/O, no thread
wake-up, no checking). The entries ride on the client's next request to its
manager (the step's own ``get_config``, or with ``prefetch=True`` the background
fetch of a following step), so reporting never adds a round trip; they are
checked there: a report with a bad step, name or value is dropped, counted, and
logged once per kind of mistake (a training loop must not die of a metric).

The buffer holds ``MAX_PENDING`` reports: when the rank reports faster than it
calls its manager, or the manager is unreachable, the oldest go first. Every
report dropped (or lost with a failed call) is counted and told to the manager
with the next call.
"""

from __future__ import annotations

import logging
import operator
import threading
from collections import deque
from typing import Any

from protos import lighthouse_config_pb2 as pb
from protos.metrics import MAX_METRICS, METRIC_NAME_RULE, is_metric_name

logger = logging.getLogger(__name__)

MAX_PENDING = 4096  # reports held until a call carries them (oldest dropped beyond)
MAX_CALL_BYTES = 64 * 1024  # reports one request carries, about (requests are limited to 256 KiB)


class ReportBuffer:
    """Reports waiting for the next call; ``add`` from the training loop, ``drain_into`` from
    whichever thread makes the next call (both may run at once)."""

    def __init__(self, capacity: int = MAX_PENDING) -> None:
        self._pending: deque[tuple[Any, dict[str, Any]]] = deque(maxlen=capacity)
        self._capacity = capacity
        self._lock = threading.Lock()  # the drop counters only, off the common path
        self._unsent_drops = 0
        self._warned: set[str] = set()  # kinds of bad report logged already
        self.dropped = 0  # over the client's life: full buffer, bad report, or lost with a failed call

    def add(self, step: Any, metrics: dict[str, Any]) -> None:
        """Queue ``metrics`` of ``step`` as they are (``report``'s ``**metrics`` is a new dict)."""
        pending = self._pending
        if len(pending) == self._capacity:  # the append below pushes the oldest out
            self.count_lost(1)
        pending.append((step, metrics))

    def count_lost(self, n: int, unsent_drops: int = 0) -> None:
        """``n`` reports will never reach the manager; ``unsent_drops`` earlier drops not told yet."""
        with self._lock:
            self._unsent_drops += n + unsent_drops
            self.dropped += n

    def failed(self, request: pb.ManagerConfigRequest) -> None:
        """The call carrying ``request`` failed: its reports are lost, its drop count told again."""
        if request.metrics or request.metrics_dropped:
            self.count_lost(len(request.metrics), request.metrics_dropped)

    def __len__(self) -> int:
        return len(self._pending)

    def drain_into(self, request: pb.ManagerConfigRequest) -> int:
        """Move the oldest reports, up to about MAX_CALL_BYTES, into ``request``; returns how many."""
        pending = self._pending
        taken = size = 0
        if pending:
            batch = request.metrics
            while size < MAX_CALL_BYTES:
                try:
                    step, metrics = pending.popleft()  # atomic: a concurrent drain takes others
                except IndexError:
                    break
                values = self._checked(step, metrics)
                if values is None:
                    self.count_lost(1)
                    continue
                batch.add(step=step, values=values)
                taken += 1
                size += 16 + sum(len(name) + 13 for name in values)  # encoded: tags, lengths, doubles
        if self._unsent_drops:
            with self._lock:
                request.metrics_dropped, self._unsent_drops = self._unsent_drops, 0
        return taken

    def _checked(self, step: Any, metrics: dict[str, Any]) -> dict[str, float] | None:
        """The report's values as floats, or None (logged once per kind) when it cannot be sent."""
        try:
            if isinstance(step, bool) or operator.index(step) < 0:
                raise ValueError(f"the step must be an int >= 0, got {step!r}")
            if len(metrics) > MAX_METRICS:
                raise ValueError(f"a report holds at most {MAX_METRICS} metrics, got {len(metrics)}")
            for name in metrics:
                if not is_metric_name(name):
                    raise ValueError(f"{name[:80]!r} is not a metric name: {METRIC_NAME_RULE}")
            return {name: float(value) for name, value in metrics.items()}
        except (TypeError, ValueError) as exc:
            kind = type(exc).__name__ + str(exc)[:40]
            if kind not in self._warned and len(self._warned) < 100:
                self._warned.add(kind)
                logger.error("report(step=%r, ...) dropped: %s", step, exc)
            return None
