"""Per-step pinning: every rank of a group asking for step N gets the group's first answer for N.

Without it, a cache refresh between two ranks' calls for the same step would
give them different configs and silently diverge their replicas. Memory is
bounded by a window of recent steps; older steps are answered unpinned.

A leap far ahead (more than a window) is taken only once the group goes on
from there (a second request in the new range): one stray request, say a rank
with a wrong counter, must not move the group's window and unpin its steps.
"""

from __future__ import annotations

import threading
from collections import deque

from manager.snapshot import Snapshot
from protos.limits import STEP_WINDOW, SWITCHES_HELD


class StepPins:
    def __init__(self, window: int = STEP_WINDOW) -> None:
        if window < 1:
            raise ValueError("the step window must be at least 1")
        self.window = window
        self._pins: dict[int, bytes] = {}
        self._order: deque[int] = deque()
        self._lock = threading.Lock()
        self.max_step = -1
        self._max_version = -1  # version pinned at max_step
        self._leap: int | None = None  # a step far ahead, seen once, not yet followed
        self._switches: list[tuple[int, int, int]] = []
        self._ended_run: dict[int, bytes] = {}  # the pins a run's end set aside (``run_changed``)

    def get(self, step: int) -> bytes | None:
        """The pinned reply for ``step`` (lock-free: a dict read)."""
        return self._pins.get(step)

    def outside_window(self, step: int) -> bool:
        return step < self.max_step - self.window

    def pin(self, step: int, snapshot: Snapshot, reply: bytes, version: int | None = None) -> bytes | None:
        """Pin ``reply`` for ``step`` unless another rank won the race; return the pinned reply.

        ``version``: the version whose config ``reply`` holds (its segment's; default the
        snapshot's), recorded as a switch when it differs from the previous step's.
        None: the step is a leap not yet confirmed, answer it unpinned.
        """
        if version is None:
            version = snapshot.version
        with self._lock:
            pinned = self._pins.get(step)
            if pinned is not None:
                return pinned
            if self.max_step >= 0 and step > self.max_step + self.window:
                leap = self._leap
                if leap is None or not leap <= step <= leap + self.window:
                    self._leap = step
                    return None
            self._leap = None
            self._pins[step] = reply
            self._order.append(step)
            if step > self.max_step:
                if version != self._max_version:
                    self._switches.append((version, step, self.max_step))
                    del self._switches[:-SWITCHES_HELD]  # bounded while the lighthouse is away
                self.max_step = step
                self._max_version = version
                self._evict(step - self.window)
            return reply

    def run_changed(self, run_start: int | None, served_between: bool) -> None:
        """A run of the job ended (``run_start`` None, or a lighthouse that does not name where a run
        began) or began at ``run_start``: forget the steps pinned that are the new run's.

        A run's end sets every pin aside: a resume from a checkpoint may follow, and asks for those
        steps again in the next run. A run's begin at step R forgets the pins from R on (the new
        run's steps), from R + 1 on when the steps before were ``served_between`` the runs (no run
        live, leases suspended: the run began at the step the manager reported, served already).
        The steps below stay pinned: a rank behind its group replays them as the group trained
        them (chaos seed 216499858: a rank restarted 200 steps behind its group, after a run had
        begun, got the new run's config for steps its group-mate had trained with another). So do
        the pins a run's end set aside, below R and below every step asked since the end: an
        operator ended the run and the group's next step began another (chaos seed 788386760: a
        rank restarted 14 steps behind got the fallback where its group-mate had trained the ended
        run's config); the steps asked since are a resume's, which the pins set aside must not
        answer."""
        with self._lock:
            if run_start is None:
                ended = self._pins
                self._clear()
                self._ended_run = ended
                return
            self._drop_from(run_start + 1 if served_between else run_start)
            below = min(run_start, min(self._pins, default=run_start))
            self._pins.update((s, reply) for s, reply in self._ended_run.items() if s < below)
            self._order = deque(sorted(self._pins))
            self.max_step = max(self._pins, default=-1)
            self._ended_run = {}

    def drop_from(self, step: int) -> None:
        """Forget the pins of ``step`` and later (a run of the job began there: those steps are its
        own, a resume from a checkpoint asks for them again); the ones below stay, what the group
        trained them with (a rank behind its group replays them so). The switches not reported
        yet stay."""
        with self._lock:
            self._drop_from(step)

    def _drop_from(self, step: int) -> None:
        for pinned in [s for s in self._pins if s >= step]:
            del self._pins[pinned]
        self._order = deque(s for s in self._order if s < step)
        self.max_step = max(self._pins, default=-1)
        self._max_version = -1  # not known below: the next step pinned records its version
        self._leap = None

    def _clear(self) -> None:
        """Forget every pin; the switches not reported yet stay."""
        self._pins = {}
        self._order.clear()
        self._ended_run = {}
        self.max_step = -1
        self._max_version = -1
        self._leap = None

    def _evict(self, below: int) -> None:
        order, pins = self._order, self._pins
        while order and (order[0] < below or len(order) > 2 * self.window):
            pins.pop(order.popleft(), None)

    def __len__(self) -> int:
        return len(self._pins)

    def lowest(self) -> int:
        """The oldest step still pinned; -1 when none is."""
        with self._lock:
            return min(self._pins, default=-1)

    def take_switches(self) -> list[tuple[int, int, int]]:
        """(version, first step, highest step before) not yet reported to the lighthouse."""
        with self._lock:
            return list(self._switches)

    def ack_switches(self, sent: list[tuple[int, int, int]]) -> None:
        """Forget switches the lighthouse received (a fetch and a heartbeat may both have sent them)."""
        if not sent:
            return
        done = set(sent)
        with self._lock:
            self._switches = [s for s in self._switches if s not in done]
