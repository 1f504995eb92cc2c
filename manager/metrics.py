"""The group's metrics on their way to the lighthouse: the ranks' reports, summarized per step.

Ranks' reports arrive with their calls (``ManagerClient.report``). Per step and
metric the manager keeps count, non-finite count, sum, min and max over the
ranks' values, and the manager's status (``ManagerServer._status``, sent once per
cache TTL or heartbeat) carries them, so reports cost the lighthouse no call.

* A step waits for one more status once first seen: the ranks of a group report a
  step within moments of each other, so a step usually reaches the lighthouse
  whole (a late value still goes, as a second summary the lighthouse merges).
* A batch is resent unchanged, with the same id, until a call carrying it
  succeeds; the lighthouse takes each id once. Ids increase over the manager's
  life and across restarts (they start at the wall clock in microseconds), so a
  duplicate that arrives late is recognized too.
* Bounded: at most MAX_STEPS steps wait (beyond, the oldest are dropped), at most
  MAX_METRICS names are kept, a batch holds at most MAX_BATCH_ENTRIES (step,
  metric) summaries of 36 bytes (about 108 KB: a status rides on a request, and
  requests are limited to 256 KiB, ``protos.rpc``). So a group forwards at most
  3,000 summaries per status (750 steps of 4 metrics per TTL); one that steps
  faster for long loses its oldest steps. Dropped values are counted, and the
  count rides on the status.
"""

from __future__ import annotations

import math
import threading
import time
from array import array
from collections.abc import Sequence
from typing import Any

from protos import lighthouse_config_pb2 as pb
from protos.metrics import COUNTS, MAX_METRICS, STEPS, VALUES, is_metric_name, pack

MAX_STEPS = 4096
MAX_BATCH_ENTRIES = 3000

# Per metric of one step: [count, nonfinite, sum, min, max] over the values (sum/min/max of finite ones).
Summary = list[Any]
Step = dict[str, Summary]


class GroupMetrics:
    """Thread-safe: ``add`` from workers' calls, ``take``/``ack`` around each status call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready: dict[int, Step] = {}  # steps seen before the previous status
        self._settling: dict[int, Step] = {}  # steps first seen since
        self._names: set[str] = set()
        self._in_flight: tuple[int, list[pb.MetricSummaries]] | None = None
        self._next_id = time.time_ns() // 1000
        self.dropped = 0  # values the group lost: ranks' full buffers and failed calls, and here

    def add(self, reports: Sequence[pb.StepMetrics], dropped: int = 0) -> None:
        """Take what one worker call carried."""
        with self._lock:
            self.dropped += dropped
            for report in reports:
                step = report.step
                values = report.values
                summaries = self._ready.get(step)
                if summaries is None:
                    summaries = self._settling.get(step)
                if summaries is None:
                    if step < 0:
                        self.dropped += len(values)
                        continue
                    summaries = self._settling[step] = {}
                for name, value in values.items():
                    summary = summaries.get(name)
                    if summary is None:
                        if name not in self._names:
                            if len(self._names) >= MAX_METRICS or not is_metric_name(name):
                                self.dropped += 1
                                continue
                            self._names.add(name)
                        summary = summaries[name] = [0, 0, 0.0, math.inf, -math.inf]
                    summary[0] += 1
                    if math.isfinite(value):
                        summary[2] += value
                        if value < summary[3]:
                            summary[3] = value
                        if value > summary[4]:
                            summary[4] = value
                    else:
                        summary[1] += 1
            self._bound()

    def _bound(self) -> None:
        """Drop the oldest steps (down to 3/4 of MAX_STEPS, so this runs rarely) past MAX_STEPS."""
        if len(self._ready) + len(self._settling) <= MAX_STEPS:
            return
        everything = sorted([*self._ready, *self._settling])
        for step in everything[: len(everything) - MAX_STEPS * 3 // 4]:
            gone = self._ready.pop(step, None) or self._settling.pop(step, None) or {}  # in one of them
            self.dropped += int(sum(s[0] for s in gone.values()))

    def take(self, everything: bool = False) -> tuple[list[pb.MetricSummaries], int]:
        """The batch the next status carries and its id (0: nothing to send).

        The batch in flight comes back until ``ack``ed. A new batch holds the steps seen
        before the previous ``take``; ``everything`` sends the newer ones too (the manager's
        last status, at shutdown).
        """
        with self._lock:
            if self._in_flight is None:
                if everything:
                    self._ready.update(self._settling)  # disjoint: a step is in one of them
                    self._settling = {}
                if self._ready:
                    batch, self._ready = _columns(self._ready, MAX_BATCH_ENTRIES)
                    self._in_flight = (self._next_id, batch)
                    self._next_id += 1
            self._ready.update(self._settling)
            self._settling = {}
            if self._in_flight is None:
                return [], 0
            batch_id, batch = self._in_flight
            return batch, batch_id

    @property
    def pending(self) -> bool:
        """Something is still to send."""
        return bool(self._in_flight or self._ready or self._settling)

    def ack(self, batch_id: int) -> None:
        """A call carrying batch ``batch_id`` succeeded: the lighthouse has it."""
        with self._lock:
            if self._in_flight is not None and self._in_flight[0] == batch_id:
                self._in_flight = None


def _columns(steps: dict[int, Step], limit: int) -> tuple[list[pb.MetricSummaries], dict[int, Step]]:
    """The oldest steps as one columnar summary per metric (at most ``limit`` entries), and the rest."""
    columns: dict[str, tuple[array[Any], ...]] = {}  # name -> steps, count, nonfinite, sum, min, max
    entries = 0
    order = sorted(steps)
    rest: dict[int, Step] = {}
    for i, step in enumerate(order):
        summaries = steps[step]
        if entries and entries + len(summaries) > limit:
            rest = {s: steps[s] for s in order[i:]}
            break
        for name, (count, nonfinite, total, low, high) in summaries.items():
            column = columns.get(name)
            if column is None:
                column = columns[name] = (
                    array(STEPS),
                    array(COUNTS),
                    array(COUNTS),
                    array(VALUES),
                    array(VALUES),
                    array(VALUES),
                )
            row: tuple[Any, ...] = (step, count, nonfinite, total, low, high)
            for values, value in zip(column, row, strict=True):
                values.append(value)
        entries += len(summaries)
    batch = [
        pb.MetricSummaries(
            name=name,
            steps=pack(s),
            count=pack(c),
            nonfinite=pack(nf),
            sum=pack(t),
            min=pack(lo),
            max=pack(hi),
        )
        for name, (s, c, nf, t, lo, hi) in columns.items()
    ]
    return batch, rest
