"""RowIndex: the facts a commit reads of a job's history, kept per commit, equal a scan of it."""

from __future__ import annotations

import random

import pytest

from lighthouse.jobs.row_index import RowIndex
from lighthouse.jobs.runs import Runs
from lighthouse.store.backend import Change


def random_rows(rnd: random.Random, count: int) -> list[Change]:
    rows, step = [], 0
    for version in range(1, count + 1):
        step += rnd.randint(0, 5)
        op = rnd.choice(["put", "patch", "patch", "cancel"])
        scheduled = op != "cancel" and rnd.random() < 0.5
        at = step + rnd.randint(-3, 10) if scheduled else None
        order = max(step, at) if at is not None else step - rnd.randint(0, 2)
        change = {"version": rnd.randint(1, version)} if op == "cancel" else {"x": version}
        made_now = scheduled and rnd.random() < 0.5
        rows.append(Change(version, op, change, {}, at, order, 0.0, "t", "-", "", made_now))
    return rows


@pytest.mark.parametrize("seed", range(20))
def test_the_index_answers_what_a_scan_of_the_rows_does(seed: int) -> None:
    rnd = random.Random(seed)
    rows = random_rows(rnd, 200)
    runs = Runs().begin(0, 0).end(50, rnd.randint(1, 200), "t").begin(10, 200)
    step = 0
    index = RowIndex(rows[:50], runs, step)
    for end in range(50, 201, 10):
        step += rnd.randint(0, 40)
        index.add(rows[:end], step)  # rows already added are skipped
        held = rows[:end]
        for epoch in range(3):
            scan = [r.order_step for r in held if r.effective_step is None and runs.epoch(r.version) == epoch]
            assert index.at_once_top(epoch) == max(scan, default=None)
        pending = [
            r for r in held if r.op != "cancel" and r.effective_step is not None and r.effective_step > step
        ]
        assert index.pending(step) == pending
