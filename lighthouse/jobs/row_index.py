"""What a commit asks of a job's history, kept up to date commit by commit instead of scanned.

Planning a change reads three facts of the rows: which versions are cancelled, the highest order
step of the changes made at once in each epoch (``ConfigStore._order_now``), and which changes may
still be pending (``_now_step``, ``_check_read``). Scanned, each costs O(n) of the history per
commit: a month of a controller's changes made every edit slower. Here each row is looked at once
when it is added, and a pending change once more when the job passes its step.

Valid for one runs record and for a job step that only goes up: ``ConfigStore`` builds it again
when either is not so (a run begins or ends, the rows are read again or pruned).
"""

from __future__ import annotations

from collections.abc import Iterable

from lighthouse.jobs.runs import Runs
from lighthouse.store.backend import Change


class RowIndex:
    def __init__(self, rows: Iterable[Change], runs: Runs, current_step: int) -> None:
        self.runs = runs  # what the epochs were counted with
        self._through = 0  # the highest version added
        # epoch -> the highest order step of a change made at once (or a cancel) in it
        self._at_once: dict[int, int] = {}
        # Changes (no cancels) that took effect above the job's step when last looked at, in version
        # order; one at or below the job's step is dropped for good (the step only goes up).
        self._pending: list[Change] = []
        self.add(rows, current_step)

    def add(self, rows: Iterable[Change], current_step: int) -> None:
        """Take committed ``rows`` (versions above the ones added before; others are skipped)."""
        for row in rows:
            if row.version <= self._through:
                continue
            self._through = row.version
            if row.effective_step is None:  # a cancel too: it sorts where it was made
                epoch = self.runs.epoch(row.version)
                self._at_once[epoch] = max(self._at_once.get(epoch, row.order_step), row.order_step)
            elif row.op != "cancel" and row.effective_step > current_step:
                self._pending.append(row)

    def at_once_top(self, epoch: int) -> int | None:
        """The highest order step of a change made at once in ``epoch`` (None: there is none)."""
        return self._at_once.get(epoch)

    def pending(self, current_step: int) -> list[Change]:
        """Every change (cancelled ones too) taking effect above ``current_step``."""
        self._pending = [
            r for r in self._pending if r.effective_step is not None and r.effective_step > current_step
        ]
        return self._pending
