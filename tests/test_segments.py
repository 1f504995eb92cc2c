"""The segments a store serves (its config per step range, computed incrementally) agree with the
definition: resolving one step from every committed row, for random histories of changes made
now, scheduled and cancelled ones, puts, deletes, and runs that end and resume at earlier steps."""

from __future__ import annotations

import bisect
import contextlib
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lighthouse.config.values import ConfigError
from lighthouse.jobs.versions import ConfigStore, Segment
from lighthouse.store.sqlite import SqliteBackend
from tests.store_edits import commit

KEYS = ("a", "b", "c")
values = st.one_of(st.none(), st.integers(0, 9))
patches = st.dictionaries(st.sampled_from(KEYS), values, min_size=1, max_size=2)
ops = st.one_of(
    st.tuples(st.just("step"), st.integers(1, 30)),
    st.tuples(st.just("now"), patches),
    st.tuples(st.just("put"), st.dictionaries(st.sampled_from(KEYS), st.integers(0, 9), max_size=3)),
    st.tuples(st.just("at"), st.tuples(st.integers(1, 40), patches)),
    st.tuples(st.just("cancel"), st.integers(0, 5)),
    st.tuples(st.just("end_run"), st.none()),
    st.tuples(st.just("begin_run"), st.integers(0, 60)),
)


def served(segments: list[Segment], step: int) -> dict[str, Any]:
    starts = [seg.from_step for seg in segments]
    return segments[max(0, bisect.bisect_right(starts, step) - 1)].config


def play(store: ConfigStore, history: list[tuple[str, Any]]) -> None:
    step = 0
    for op, arg in history:
        if op == "step":
            step += arg
            store.advance_step(step)
        elif op in ("now", "put"):
            commit(store, "patch" if op == "now" else "put", arg, source="t")
        elif op == "at":
            commit(store, "patch", arg[1], source="t", effective_step=step + arg[0])
        elif op == "cancel":
            scheduled = [r for r in store.scheduled() if r["status"] == "pending"]
            if scheduled:
                target = scheduled[arg % len(scheduled)]["version"]
                # in effect meanwhile, or promised: refused, nothing stored
                with contextlib.suppress(ConfigError):
                    commit(store, "cancel", {"version": target}, source="t")
        elif op == "end_run":
            store.end_run("test")
        elif store.begin_run(arg) is not None:
            step = arg


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=25))
def test_served_segments_are_the_config_resolved_at_every_step(history: list[tuple[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        backend = SqliteBackend(Path(tmp) / "lighthouse.db")
        store = ConfigStore(backend)
        try:
            play(store, history)
            if store.head == 0:
                return
            steps = {0, store.current_step, 10_000}
            for row in store.held_changes():
                if row.effective_step is not None:
                    steps |= {row.effective_step - 1, row.effective_step, row.effective_step + 1}
            for version in range(max(1, store.head - 5), store.head + 1):
                segments = store.segments(version)
                steps |= {seg.from_step for seg in segments}
                with store.lock:
                    expected = {s: store._resolve_rows(store._rows, version, s) for s in steps if s >= 0}
                got = {s: served(segments, s) for s in expected}
                assert got == expected, (version, segments)
        finally:
            store.close()
            backend.close()
