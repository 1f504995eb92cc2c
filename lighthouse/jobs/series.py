"""Each job's training metrics as the lighthouse keeps them: per metric and step, across replica
groups, in memory bounded whatever the run length.

Per metric:

* **Recent steps, exact, per group** (``Trail``): each group's summaries of the
  newest ``RECENT_STEPS`` to ``2 * RECENT_STEPS`` steps, as columnar arrays sorted
  by step (36 bytes a step). Taking a manager's batch is an array extend when its
  steps follow the group's last one (the usual case); anything else (a late value
  for a step already taken, steps out of order) is merged step by step.
* **Older steps, coarser, across groups** (``Coarse``): once the newest step is
  ``2 * RECENT_STEPS`` past the oldest recent one, the older half of every trail is
  folded into at most ``COARSE_BUCKETS`` buckets of equal width (a power of two,
  doubled by merging neighbours whenever the run outgrows them), each summing every
  group's values of its steps.
* **The job's per-step view** (``exact``): the recent steps merged across groups
  when read, and kept until data arrives for a step it covers. Taking a batch does
  no per-step Python work in the usual case; a read does it once.

A summary is (count, non-finite count, sum, min, max) and merges exactly, so a
value that arrives late, in two parts, or through another lighthouse lands where
it belongs. The mean is over the finite values.

Bound per job, whatever its length: ``MAX_METRICS`` metrics; ``MAX_TRAILS``
per-group trails (groups beyond share one trail per metric: their values still
count, without per-group detail); a trail holds at most ``2 * RECENT_STEPS`` steps
(18 KiB). Per metric besides: the buckets (40 KiB), the merged recent steps (18
KiB) and the shared trail (18 KiB, and up to 512 steps waiting to be merged, about
100 KiB). At most about 1,024 x 18 KiB + 32 x 176 KiB = 24 MiB for a job; 100
groups x 4 metrics hold at most 400 x 18 KiB + 4 x 176 KiB = 7.7 MiB
(``benchmarks/reporting.py`` measures 4.6 MiB after a million steps).
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from protos import lighthouse_config_pb2 as pb
from protos.limits import FOREVER
from protos.metrics import COUNTS, MAX_METRICS, STEPS, VALUES, is_metric_name, unpack

RECENT_STEPS = 256
COARSE_BUCKETS = 1024
MAX_TRAILS = 1024
OVERFLOW = "*"  # the trail of the groups beyond MAX_TRAILS
MAX_OUTBOX = 4096  # batches waiting to be shared with other lighthouses (oldest dropped beyond)
MAX_INBOX = 4096  # batches waiting for the lock (taken in at once, unless a read holds it)

INF = math.inf

# One step of one column set: (step, count, nonfinite, total, low, high).
Row = tuple[int, int, int, float, float, float]
# A point of a series: (from step, to step, count, nonfinite, total, low, high); from == to when exact.
Point = tuple[int, int, int, int, float, float, float]


class Columns:
    """Summaries by step, columnar: entry i of every array belongs to ``steps[i]``."""

    __slots__ = ("count", "high", "low", "nonfinite", "steps", "total")

    TYPECODES = (STEPS, COUNTS, COUNTS, VALUES, VALUES, VALUES)

    def __init__(self, arrays: Sequence[array[Any]] | None = None) -> None:
        steps, count, nonfinite, total, low, high = arrays or [array(code) for code in self.TYPECODES]
        self.steps = steps
        self.count = count
        self.nonfinite = nonfinite
        self.total = total
        self.low = low
        self.high = high

    def arrays(self) -> tuple[array[Any], ...]:
        return (self.steps, self.count, self.nonfinite, self.total, self.low, self.high)

    def __len__(self) -> int:
        return len(self.steps)

    def append(self, step: int, summary: Sequence[float]) -> None:
        self.steps.append(step)
        self.count.append(int(summary[0]))
        self.nonfinite.append(int(summary[1]))
        self.total.append(summary[2])
        self.low.append(summary[3])
        self.high.append(summary[4])

    def rows(self, start: int = 0, stop: int | None = None) -> Iterable[Row]:
        """(step, count, nonfinite, total, low, high) of entries ``start:stop``."""
        return zip(*(islice(a, start, stop) for a in self.arrays()), strict=True)

    def cut(self, index: int) -> Columns:
        """Remove the entries before ``index`` and return them."""
        return self._remove(slice(None, index))

    def tail(self, index: int) -> Columns:
        """Remove the entries from ``index`` on and return them."""
        return self._remove(slice(index, None))

    def _remove(self, part: slice) -> Columns:
        removed = Columns()
        for mine, theirs in zip(self.arrays(), removed.arrays(), strict=True):
            theirs.extend(mine[part])
            del mine[part]
        return removed

    def index(self, step: int) -> int:
        """Position of the first entry at or after ``step`` (steps are sorted)."""
        return bisect_left(self.steps, step)

    def last_step(self) -> int:
        """The newest step held (-1: none)."""
        return self.steps[-1] if len(self) else -1


def merged_rows(rows: Iterable[Row], into: dict[int, list[float]] | None = None) -> dict[int, list[float]]:
    """Per step, the merged summary [count, nonfinite, total, low, high] of ``rows`` (merged into
    ``into`` when given)."""
    out: dict[int, list[float]] = {} if into is None else into
    for step, count, nonfinite, total, low, high in rows:
        known = out.get(step)
        if known is None:
            out[step] = [count, nonfinite, total, low, high]
        else:
            known[0] += count
            known[1] += nonfinite
            known[2] += total
            if low < known[3]:
                known[3] = low
            if high > known[4]:
                known[4] = high
    return out


def _columns_of(merged: dict[int, list[float]]) -> Columns:
    cols = Columns()
    steps = sorted(merged)
    cols.steps.extend(steps)
    for i, column in enumerate(cols.arrays()[1:]):
        column.extend([merged[step][i] for step in steps])
    return cols


class Trail(Columns):
    """One group's recent summaries of one metric: sorted by step, one entry a step."""

    __slots__ = ()

    def take(self, batch: Columns) -> None:
        """Add ``batch`` (sorted by step): appended when it follows, else merged from the first
        step it touches on. A trail grown past its bound (batches repeating steps) is merged
        whole again: the bound holds whatever a client sends."""
        steps, first = self.steps, batch.steps[0]
        if steps and first <= steps[-1]:
            touched = self.tail(self.index(first))
            batch = _columns_of(merged_rows([*touched.rows(), *batch.rows()]))
        for mine, theirs in zip(self.arrays(), batch.arrays(), strict=True):
            mine.extend(theirs)
        if len(steps) > 2 * RECENT_STEPS + len(batch.steps):
            whole = self.tail(0)
            self.take(_columns_of(merged_rows(whole.rows())))


class SharedTrail(Trail):
    """The groups beyond MAX_TRAILS of one metric, merged per step (no per-group detail). Their
    batches interleave on the same steps, so each is merged into a dict as it comes (no array
    rebuilt per batch), and the dict into the sorted arrays when they are read."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[int, list[float]] = {}

    def take(self, batch: Columns) -> None:
        merged_rows(batch.rows(), self._pending)
        if len(self._pending) > 2 * RECENT_STEPS:
            self._sync()

    def _sync(self) -> None:
        pending = self._pending
        if pending:
            self._pending = {}
            super().take(_columns_of(pending))

    def __len__(self) -> int:
        self._sync()
        return super().__len__()

    def index(self, step: int) -> int:
        self._sync()
        return super().index(step)

    def last_step(self) -> int:
        self._sync()
        return super().last_step()


class Coarse:
    """Older steps across every group: at most COARSE_BUCKETS buckets of ``width`` steps each
    (bucket k holds steps k*width to (k+1)*width - 1); the width doubles as the run grows."""

    __slots__ = ("count", "high", "low", "nonfinite", "total", "width")

    def __init__(self) -> None:
        self.width = 1
        self.count = array("q", bytes(8 * COARSE_BUCKETS))
        self.nonfinite = array("q", bytes(8 * COARSE_BUCKETS))
        self.total = array("d", bytes(8 * COARSE_BUCKETS))
        self.low = array("d", [INF]) * COARSE_BUCKETS
        self.high = array("d", [-INF]) * COARSE_BUCKETS

    def _widen(self) -> None:
        """Double the width: bucket k takes the old buckets 2k and 2k+1."""
        half = COARSE_BUCKETS // 2
        for column, fold, empty in (
            (self.count, operator.add, 0),
            (self.nonfinite, operator.add, 0),
            (self.total, operator.add, 0.0),
            (self.low, min, INF),
            (self.high, max, -INF),
        ):
            pairs = array(column.typecode, map(fold, column[0::2], column[1::2]))
            column[:] = pairs + array(column.typecode, [empty]) * half
        self.width *= 2

    def add(self, cols: Columns) -> None:
        """Fold ``cols`` (sorted by step) in, one bucket's run of entries at a time."""
        n = len(cols)
        if not n:
            return
        while max(cols.steps) >= COARSE_BUCKETS * self.width:
            self._widen()
        width = self.width
        i = 0
        while i < n:
            bucket = max(0, cols.steps[i] // width)
            j = bisect_left(cols.steps, (bucket + 1) * width, i + 1, n)  # > i: ends on any input
            self.count[bucket] += sum(cols.count[i:j])
            self.nonfinite[bucket] += sum(cols.nonfinite[i:j])
            self.total[bucket] += sum(cols.total[i:j])
            self.low[bucket] = min(self.low[bucket], min(cols.low[i:j]))
            self.high[bucket] = max(self.high[bucket], max(cols.high[i:j]))
            i = j

    def buckets(self, first: int, last: int, below: int) -> list[Point]:
        """Non-empty buckets holding steps in [first, last]: (from, to, count, nonfinite, total,
        low, high); ``to`` stops before ``below`` (steps from there on are not folded in yet)."""
        width = self.width
        out = []
        for k in range(max(0, first // width), min(COARSE_BUCKETS - 1, last // width) + 1):
            if self.count[k]:
                start, end = k * width, min((k + 1) * width, below) - 1
                out.append(
                    (start, end, self.count[k], self.nonfinite[k], self.total[k], self.low[k], self.high[k])
                )
        return out


class MetricSeries:
    """One metric of one job (not thread-safe: ``JobSeries`` holds the lock)."""

    def __init__(self) -> None:
        self.trails: dict[str, Trail] = {}
        self.coarse = Coarse()
        self.horizon = 0  # steps before it are in ``coarse`` only
        self.newest = -1
        self._exact = Columns()  # the trails merged (steps >= horizon), up to date below _dirty_from
        self._dirty_from: int | None = None

    def take(self, key: str, batch: Columns) -> None:
        """Add one group's summaries (sorted by step, not empty) under trail ``key``."""
        if batch.steps[0] < self.horizon:  # steps already folded: they join their buckets
            self.coarse.add(batch.cut(batch.index(self.horizon)))
            if not batch.steps:
                return
        trail = self.trails.get(key)
        if trail is None:
            trail = self.trails[key] = SharedTrail() if key == OVERFLOW else Trail()
        trail.take(batch)
        first, last = batch.steps[0], batch.steps[-1]
        self._dirty_from = first if self._dirty_from is None else min(self._dirty_from, first)
        if last > self.newest:
            self.newest = last
            if last - self.horizon >= 2 * RECENT_STEPS:
                self._fold(last - RECENT_STEPS + 1)

    def _fold(self, horizon: int) -> None:
        """Move every step before ``horizon`` from the trails into the coarse buckets."""
        for key, trail in list(self.trails.items()):
            self.coarse.add(trail.cut(trail.index(horizon)))
            if not len(trail):
                del self.trails[key]  # a group gone quiet frees its place
        self._exact.cut(self._exact.index(horizon))
        self.horizon = horizon

    def settled(self) -> int:
        """The newest step every group with recent steps has reported (-1: none): newer steps may
        still miss a group's values. A group gone quiet drops out once its steps are folded."""
        return min((step for t in self.trails.values() if (step := t.last_step()) >= 0), default=-1)

    def exact(self) -> Columns:
        """The recent steps merged across groups (recomputed from the lowest step that changed)."""
        dirty = self._dirty_from
        if dirty is not None:
            keep = self._exact.index(dirty)
            for column in self._exact.arrays():
                del column[keep:]
            tails = (row for trail in self.trails.values() for row in trail.rows(trail.index(dirty)))
            merged = merged_rows(tails)
            for step in sorted(merged):
                self._exact.append(step, merged[step])
            self._dirty_from = None
        return self._exact

    def points(self, first: int, last: int) -> list[Point]:
        """Steps ``first`` to ``last``: older ones as coarse buckets, recent ones exact."""
        out: list[Point] = []
        if first < self.horizon:
            out.extend(self.coarse.buckets(first, min(last, self.horizon - 1), self.horizon))
        exact = self.exact()
        out.extend(_points(exact, exact.index(max(first, self.horizon)), exact.index(last + 1)))
        return out

    def last_point(self) -> Point | None:
        """The newest settled step across groups (see ``settled``)."""
        step = self.settled()
        exact = self.exact()
        at = exact.index(step)
        return next(iter(_points(exact, at, at + 1)), None) if step >= 0 else None

    def group_points(self, first: int, last: int) -> dict[str, list[Point]]:
        """Each group's exact steps ``first`` to ``last`` (the recent ones only)."""
        return {
            key: list(_points(trail, trail.index(first), trail.index(last + 1)))
            for key, trail in sorted(self.trails.items())
        }

    def entries(self) -> dict[str, int]:
        return {
            "trails": len(self.trails),
            "trail_steps": sum(len(t) for t in self.trails.values()),
            "exact_steps": len(self._exact),
            "coarse_buckets": sum(1 for c in self.coarse.count if c),
            "bucket_steps": self.coarse.width,
            "recent_from": self.horizon,
        }


def _points(cols: Columns, start: int, stop: int | None = None) -> Iterable[Point]:
    """Entries ``start:stop`` of ``cols`` as points of one step each."""
    return ((s, s, c, nf, t, lo, hi) for s, c, nf, t, lo, hi in cols.rows(start, stop))


def batch_of(summaries: pb.MetricSummaries) -> Columns | None:
    """A manager's summaries as columns sorted by step (a memory copy and a check, when they come
    sorted as managers send them); None when empty or malformed (columns of unequal length, a
    negative step)."""
    s = summaries
    wire = (s.steps, s.count, s.nonfinite, s.sum, s.min, s.max)  # each access copies: once
    n = len(wire[0]) // 8
    if not n or [len(data) for data in wire] != [8 * n, 4 * n, 4 * n, 8 * n, 8 * n, 8 * n]:
        return None
    cols = Columns([unpack(code, data) for code, data in zip(Columns.TYPECODES, wire, strict=True)])
    order = cols.steps.tolist()
    if order != sorted(order):  # not as a manager sends them: merged step by step
        cols = _columns_of(merged_rows(cols.rows()))
    return cols if cols.steps[0] >= 0 else None


def point_json(point: Point) -> dict[str, Any]:
    """A point as the API gives it: mean, min and max of the finite values (null when none)."""
    start, end, count, nonfinite, total, low, high = point
    finite = count - nonfinite
    row: dict[str, Any] = {
        "step": start,
        "mean": _number(total / finite) if finite > 0 else None,
        "min": _number(low) if finite > 0 else None,
        "max": _number(high) if finite > 0 else None,
        "count": count,
        "nonfinite": nonfinite,
    }
    if end != start:
        row["to_step"] = end  # a coarse bucket: steps `step` to `to_step`
    return row


def _number(value: float) -> float | None:
    """JSON has no NaN or infinity (only a malformed batch or an overflowing sum makes one)."""
    return value if math.isfinite(value) else None


def thin(points: list[Point], max_points: int) -> list[Point]:
    """At most ``max_points`` points: neighbours merged into buckets of equal step width."""
    if len(points) <= max_points:
        return points
    first, last = points[0][0], points[-1][1]
    width = -(-(last - first + 1) // max_points)
    out: list[Point] = []
    for start, end, count, nonfinite, total, low, high in points:
        bucket = first + (start - first) // width * width
        if out and out[-1][0] == bucket:
            _, _, c, nf, t, lo, hi = out[-1]
            out[-1] = (bucket, end, c + count, nf + nonfinite, t + total, min(lo, low), max(hi, high))
        else:
            out.append((bucket, end, count, nonfinite, total, low, high))
    return out


@dataclass(frozen=True)
class LastValue:
    step: int
    mean: float | None
    nonfinite: int


class JobSeries:
    """Every metric of one job; thread-safe (managers' calls write, pages and guards read).

    A manager's batch goes to an inbox (a deque append) and is taken in under the lock at once
    when the lock is free, else by whoever holds it next: the lighthouse's event loop, which
    delivers every manager's status, never waits for a page or a guard reading the series.
    """

    def __init__(self, job: str) -> None:
        self.job = job
        self._lock = threading.Lock()
        self._metrics: dict[str, MetricSeries] = {}
        self._inbox: deque[tuple[str, list[pb.MetricSummaries]]] = deque()
        self._batches: dict[str, int] = {}  # replica -> id of the last batch taken from its manager
        self._dropped: dict[str, int] = {}  # replica -> values its manager says the group dropped
        self.refused = 0  # values refused here: malformed summaries, names past MAX_METRICS, a full inbox
        self._outbox: deque[tuple[str, list[pb.MetricSummaries]]] | None = None

    def take_status(self, replica: str, status: pb.ManagerStatus) -> None:
        """The metrics riding on a manager's status (from the event loop: never waits for the lock);
        a batch id taken before is skipped."""
        if status.metrics_dropped:
            self._dropped[replica] = status.metrics_dropped
        if not status.metrics or status.metrics_batch <= self._batches.get(replica, 0):
            return  # nothing, or sent again: the call that carried it succeeded after all
        self._batches[replica] = status.metrics_batch
        summaries = list(status.metrics)
        self._post(replica, summaries)
        if self._lock.acquire(blocking=False):
            try:
                self._take_inbox()
            finally:
                self._lock.release()
        outbox = self._outbox
        if outbox is not None:
            outbox.append((replica, summaries))

    def take(self, replica: str, summaries: Iterable[pb.MetricSummaries]) -> None:
        """Add one group's summaries (shared by the lighthouse its manager talks to)."""
        self._post(replica, list(summaries))
        with self._locked():
            pass

    def _post(self, replica: str, summaries: list[pb.MetricSummaries]) -> None:
        inbox = self._inbox
        if len(inbox) >= MAX_INBOX:  # nobody has taken the lock for that long: the oldest go
            _, gone = inbox.popleft()
            self.refused += sum(len(s.steps) // 8 for s in gone)
        inbox.append((replica, summaries))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock, with everything sent so far taken in."""
        with self._lock:
            self._take_inbox()
            yield

    def _take_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            replica, summaries = inbox.popleft()
            for summary in summaries:
                self._take(replica, summary.name, batch_of(summary), len(summary.steps) // 8)

    def _take(self, replica: str, name: str, batch: Columns | None, size: int) -> None:
        series = self._metrics.get(name)
        if series is None and batch is not None:
            if len(self._metrics) >= MAX_METRICS or not is_metric_name(name):
                batch = None
            else:
                series = self._metrics[name] = MetricSeries()
        if series is None or batch is None:
            self.refused += size
            return
        key = replica
        if replica not in series.trails and self._trails() >= MAX_TRAILS:
            key = OVERFLOW  # a job's (group, metric) trails are capped: the rest share one
        series.take(key, batch)

    def _trails(self) -> int:
        return sum(len(m.trails) for m in self._metrics.values())

    # ------------------------------------------------------------ sharing
    def share(self) -> None:
        """Keep what managers send for ``take_outbox`` (another lighthouse shares this job)."""
        if self._outbox is None:
            self._outbox = deque(maxlen=MAX_OUTBOX)

    def take_outbox(self) -> list[tuple[str, list[pb.MetricSummaries]]]:
        """What managers sent since the previous call, oldest first."""
        outbox = self._outbox
        out = []
        while outbox:
            out.append(outbox.popleft())
        return out

    # ------------------------------------------------------------ reads
    def names(self) -> list[str]:
        with self._locked():
            return sorted(self._metrics)

    def query(
        self,
        names: Sequence[str] | None = None,
        first: int = 0,
        last: int = FOREVER,
        max_points: int | None = None,
        groups: bool = False,
    ) -> dict[str, Any]:
        """GET /api/jobs/{job}/metrics: per metric its points from ``first`` to ``last``."""
        out: dict[str, Any] = {"job": self.job, "metrics": {}}
        per_group: dict[str, dict[str, list[dict[str, Any]]]] = {}
        resolution: dict[str, dict[str, int]] = {}
        newest: dict[str, dict[str, Any]] = {}
        with self._locked():
            for name in sorted(self._metrics):
                if names is not None and name not in names:
                    continue
                series = self._metrics[name]
                points = series.points(first, last)
                if max_points is not None:
                    points = thin(points, max_points)
                out["metrics"][name] = [point_json(p) for p in points]
                settled = series.last_point()
                if settled is not None:  # the newest step, whatever the range asked for
                    newest[name] = point_json(settled)
                resolution[name] = {"recent_from": series.horizon, "bucket_steps": series.coarse.width}
                if groups:
                    per_group[name] = {
                        replica: [point_json(p) for p in rows]
                        for replica, rows in series.group_points(first, last).items()
                    }
            dropped = sum(self._dropped.values()) + self.refused
        out["last"] = newest
        out["resolution"] = resolution
        out["dropped"] = dropped
        if groups:
            out["groups"] = per_group
        return out

    def window(self, name: str, first: int, last: int) -> list[Point]:
        """The points of ``name`` from ``first`` to ``last`` (empty when never reported)."""
        with self._locked():
            series = self._metrics.get(name)
            return series.points(first, last) if series is not None else []

    def settled(self, name: str) -> int:
        """The newest step of ``name`` every recently reporting group has reported (-1: none)."""
        with self._locked():
            series = self._metrics.get(name)
            return series.settled() if series is not None else -1

    def nonfinite_groups(self, name: str, first: int, last: int) -> list[tuple[str, int]]:
        """(group, step) of every non-finite value of ``name`` in the recent steps ``first``..``last``."""
        with self._locked():
            series = self._metrics.get(name)
            rows = series.group_points(first, last) if series is not None else {}
        return [(replica, p[0]) for replica, points in rows.items() for p in points if p[3]]

    def last_values(self) -> dict[str, LastValue]:
        """Per metric, the summary across groups of its newest settled step (see ``settled``)."""
        out = {}
        with self._locked():
            for name, series in self._metrics.items():
                point = series.last_point()
                if point is not None:
                    row = point_json(point)
                    out[name] = LastValue(row["step"], row["mean"], row["nonfinite"])
        return out

    def entries(self) -> dict[str, dict[str, int]]:
        """What the job holds per metric (tests and benchmarks check the bound with it)."""
        with self._locked():
            return {name: series.entries() for name, series in sorted(self._metrics.items())}
