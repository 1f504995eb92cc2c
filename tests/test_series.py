"""The pieces of reporting, one at a time: a rank's buffer, a manager's per-step summaries, and the
lighthouse's bounded series (exact merges, late values, malformed input, bounds)."""

from __future__ import annotations

import math
from array import array

import pytest

from lighthouse.jobs.series import COARSE_BUCKETS, MAX_TRAILS, OVERFLOW, RECENT_STEPS, JobSeries, MetricSeries
from manager.metrics import MAX_BATCH_ENTRIES, MAX_STEPS, GroupMetrics
from protos import lighthouse_config_pb2 as pb
from protos.limits import FOREVER
from protos.metrics import MAX_METRICS, pack, unpack
from worker_client.reports import MAX_CALL_BYTES, ReportBuffer


def summaries(name: str, steps: list[int], values: list[float], count: int = 1) -> pb.MetricSummaries:
    """One group's summaries of ``name``: ``count`` equal values per step."""
    n = len(steps)
    return pb.MetricSummaries(
        name=name,
        steps=pack(array("q", steps)),
        count=pack(array("I", [count] * n)),
        nonfinite=pack(array("I", [0] * n)),
        sum=pack(array("d", [v * count for v in values])),
        min=pack(array("d", values)),
        max=pack(array("d", values)),
    )


def rows(series: JobSeries, name: str = "loss", first: int = 0, last: int = FOREVER) -> list[tuple[int, ...]]:
    return [
        (p["step"], p.get("to_step", p["step"]), p["count"])
        for p in series.query([name], first, last)["metrics"][name]
    ]


# ------------------------------------------------------------------ the rank's buffer
def test_a_full_buffer_drops_the_oldest_and_counts_them() -> None:
    buffer = ReportBuffer(capacity=3)
    for step in range(5):
        buffer.add(step, {"loss": float(step)})
    request = pb.ManagerConfigRequest()
    assert buffer.drain_into(request) == 3
    assert [m.step for m in request.metrics] == [2, 3, 4]
    assert request.metrics_dropped == 2 and buffer.dropped == 2
    buffer.failed(request)  # the call failed: its 3 reports are lost, the 2 drops told again
    again = pb.ManagerConfigRequest()
    buffer.drain_into(again)
    assert again.metrics_dropped == 5 and buffer.dropped == 5


def test_a_call_carries_a_bounded_number_of_reports() -> None:
    buffer = ReportBuffer()
    values = {f"metric_{i:02d}": 1.0 for i in range(MAX_METRICS)}
    for step in range(1000):
        buffer.add(step, values)
    request = pb.ManagerConfigRequest()
    taken = buffer.drain_into(request)
    assert 0 < taken < 1000 and len(buffer) == 1000 - taken
    assert request.ByteSize() < 2 * MAX_CALL_BYTES


def test_a_bad_report_is_dropped_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    buffer = ReportBuffer()
    too_many = {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}
    bad = [(-1, {"loss": 1.0}), (1.5, {"loss": 1.0}), (True, {"loss": 1.0}), (1, {"1loss": 1.0})]
    bad += [(1, {"loss": "x"}), (1, too_many), (1, {"loss": 1.0, "1loss": 2.0})]  # the last: as the 4th
    for step, metrics in [*bad, (2, {"loss": 3, "tokens": 2.5}), (3, {"loss": "nan"})]:
        buffer.add(step, metrics)  # never raises: a training loop must not die of a metric
    request = pb.ManagerConfigRequest()
    assert buffer.drain_into(request) == 2
    first, second = request.metrics
    assert (first.step, dict(first.values)) == (2, {"loss": 3.0, "tokens": 2.5})
    assert math.isnan(second.values["loss"])
    assert request.metrics_dropped == len(bad) and buffer.dropped == len(bad)
    logged = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(logged) == len(bad) - 1, logged  # once per kind of mistake


# ------------------------------------------------------------------ the manager's summaries
def report(step: int, **values: float) -> pb.StepMetrics:
    return pb.StepMetrics(step=step, values=values)


def unpacked(batch: list[pb.MetricSummaries]) -> dict[str, list[tuple[float, ...]]]:
    out = {}
    for m in batch:
        columns = [
            unpack(code, data)
            for code, data in zip("qIIddd", (m.steps, m.count, m.nonfinite, m.sum, m.min, m.max), strict=True)
        ]
        out[m.name] = list(zip(*columns, strict=True))  # type: ignore[arg-type]
    return out


def test_a_step_waits_one_status_then_is_resent_until_acknowledged() -> None:
    group = GroupMetrics()
    group.add([report(1, loss=1.0), report(1, loss=3.0), report(1, loss=math.nan)])
    assert group.take() == ([], 0)  # step 1 was first seen since the previous status: it waits
    group.add([report(2, loss=5.0)])
    batch, batch_id = group.take()
    assert unpacked(batch) == {"loss": [(1, 3, 1, 4.0, 1.0, 3.0)]}
    group.add([report(3, loss=7.0)])
    assert group.take() == (batch, batch_id)  # not acknowledged: the same batch, the same id
    group.ack(batch_id)
    batch, second = group.take()
    assert second > batch_id and unpacked(batch) == {
        "loss": [(2, 1, 0, 5.0, 5.0, 5.0), (3, 1, 0, 7.0, 7.0, 7.0)]
    }
    group.ack(second)
    group.add([report(4, loss=9.0)])
    last, _ = group.take(everything=True)  # shutdown: the settling step goes too
    assert unpacked(last) == {"loss": [(4, 1, 0, 9.0, 9.0, 9.0)]}


def test_the_manager_bounds_steps_names_and_batches() -> None:
    group = GroupMetrics()
    group.add([report(s, loss=1.0) for s in range(MAX_STEPS + 10)], dropped=3)
    assert group.dropped >= 3 + 10
    group.add([report(0, **{f"m{i}": 1.0 for i in range(MAX_METRICS + 5)})])
    group.take()
    batch, _ = group.take()
    assert sum(len(m.steps) // 8 for m in batch) <= MAX_BATCH_ENTRIES
    assert len({m.name for m in batch}) <= MAX_METRICS


# ------------------------------------------------------------------ the lighthouse's series
def test_summaries_merge_exactly_wherever_they_arrive() -> None:
    series = JobSeries("j")
    series.take("g0", [summaries("loss", [0, 1, 2], [1.0, 2.0, 3.0], count=2)])
    series.take("g1", [summaries("loss", [1, 2], [5.0, math.inf])])  # an inf max: kept as a max
    series.take("g0", [summaries("loss", [1], [9.0])])  # a late value for a step taken: merged
    answer = series.query(["loss"], groups=True)
    one = answer["metrics"]["loss"][1]
    assert one == {
        "step": 1,
        "mean": (4.0 + 5.0 + 9.0) / 4,
        "min": 2.0,
        "max": 9.0,
        "count": 4,
        "nonfinite": 0,
    }
    assert answer["metrics"]["loss"][2]["max"] is None  # JSON has no infinity
    assert [p["count"] for p in answer["groups"]["loss"]["g0"]] == [2, 3, 2]


def test_old_steps_fold_into_buckets_and_late_ones_join_them() -> None:
    series = JobSeries("j")
    for first in range(0, 4000, 500):
        series.take("g0", [summaries("loss", list(range(first, first + 500)), [1.0] * 500)])
    series.take("g1", [summaries("loss", [10], [1.0])])  # long folded: joins its bucket
    points = series.query(["loss"])["metrics"]["loss"]
    assert sum(p["count"] for p in points) == 4001
    coarse = [p for p in points if "to_step" in p]
    recent = [p for p in points if "to_step" not in p]
    assert coarse and RECENT_STEPS <= len(recent) <= 2 * RECENT_STEPS
    assert [p["step"] for p in recent] == list(range(4000 - len(recent), 4000))
    assert series.entries()["loss"]["trail_steps"] <= 2 * RECENT_STEPS


def test_a_series_stays_bounded_whatever_the_run_length() -> None:
    series = MetricSeries()
    from lighthouse.jobs.series import batch_of

    for first in range(0, 3_000_000, 3_000):
        batch = batch_of(summaries("loss", list(range(first, first + 3_000)), [2.0] * 3_000))
        assert batch is not None
        series.take("g0", batch)
    held = series.entries()
    assert held["trail_steps"] <= 2 * RECENT_STEPS and held["coarse_buckets"] <= COARSE_BUCKETS
    assert held["bucket_steps"] == 4096
    points = series.points(0, FOREVER)
    assert sum(p[2] for p in points) == 3_000_000 and sum(p[4] for p in points) == 6_000_000


def test_out_of_order_and_malformed_batches() -> None:
    series = JobSeries("j")
    series.take("g0", [summaries("loss", [5, 3, 4], [5.0, 3.0, 4.0])])  # unsorted: merged in order
    assert rows(series) == [(3, 3, 1), (4, 4, 1), (5, 5, 1)]
    broken = summaries("loss", [6, 7], [1.0, 1.0])
    broken.min = broken.min[:8]  # one column short
    series.take("g0", [broken, summaries("1bad", [6], [1.0])])
    assert rows(series) == [(3, 3, 1), (4, 4, 1), (5, 5, 1)] and series.refused == 3
    series.take_status("g0", pb.ManagerStatus(metrics=[summaries("loss", [8], [1.0])], metrics_batch=7))
    series.take_status("g0", pb.ManagerStatus(metrics=[summaries("loss", [8], [1.0])], metrics_batch=7))
    assert rows(series, first=8) == [(8, 8, 1)]  # the same batch twice is taken once


def test_metrics_and_groups_are_capped() -> None:
    series = JobSeries("j")
    series.take("g0", [summaries(f"m{i}", [0], [1.0]) for i in range(MAX_METRICS + 2)])
    assert len(series.names()) == MAX_METRICS and series.refused == 2
    groups = MAX_TRAILS + 10  # beyond the cap, groups share one trail per metric
    for g in range(groups):
        series.take(f"group{g}", [summaries("m0", [1], [1.0])])
    trails = sum(e["trails"] for e in series.entries().values())
    assert trails == MAX_TRAILS + 1
    answer = series.query(["m0"], first=1, last=1, groups=True)
    assert answer["metrics"]["m0"][0]["count"] == groups  # every group counted
    assert answer["groups"]["m0"][OVERFLOW][0]["count"] == groups - (MAX_TRAILS - MAX_METRICS)
