"""What a rank reports (``ManagerClient.report``): a bounded memory buffer emptied into its next call.

``report(step, loss=...)`` must cost a training loop nothing it would notice: it
appends to a deque and returns (no lock, no I/O, no thread wake-up). The entries
ride on the client's next request to its manager (the step's own ``get_config``,
or with ``prefetch=True`` the background fetch of a following step), so reporting
never adds a round trip. The buffer holds ``MAX_PENDING`` reports: when the rank
reports faster than it calls its manager, or the manager is unreachable, the
oldest go first, and each one dropped (or lost with a failed call) is counted and
told to the manager with the next call.
"""

from __future__ import annotations

import operator
import threading
from collections import deque

from protos import lighthouse_config_pb2 as pb
from protos.metrics import MAX_METRICS, check_metric_name

MAX_PENDING = 4096  # reports held until a call carries them (oldest dropped beyond)
MAX_CALL_BYTES = 64 * 1024  # reports one request carries, about (requests are limited to 256 KiB)


class ReportBuffer:
    """Reports waiting for the next call; ``add`` from any thread, ``drain_into`` from the calling one."""

    def __init__(self, capacity: int = MAX_PENDING) -> None:
        self._pending: deque[tuple[int, dict[str, float]]] = deque(maxlen=capacity)
        self._lock = threading.Lock()  # only for the drop counter, off the common path
        self._unsent_drops = 0
        self.dropped = 0  # over the client's life: full buffer, or lost with a failed call

    def add(self, step: int, metrics: dict[str, float]) -> None:
        step = operator.index(step)  # an int (numpy's too); a float is a TypeError
        if step < 0:
            raise ValueError(f"report step must be >= 0, got {step}")
        if len(metrics) > MAX_METRICS:
            raise ValueError(f"a report holds at most {MAX_METRICS} metrics, got {len(metrics)}")
        values = {check_metric_name(name): float(value) for name, value in metrics.items()}
        pending = self._pending
        if len(pending) == pending.maxlen:  # the append below pushes the oldest out
            self.count_lost(1)
        pending.append((step, values))

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
                    step, values = pending.popleft()  # atomic: a concurrent drain takes others
                except IndexError:
                    break
                batch.add(step=step, values=values)
                taken += 1
                size += 16 + sum(len(name) + 13 for name in values)  # encoded: tags, lengths, doubles
        if self._unsent_drops:
            with self._lock:
                request.metrics_dropped, self._unsent_drops = self._unsent_drops, 0
        return taken
