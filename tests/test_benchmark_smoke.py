"""Keeps the benchmark working: a --quick run (seconds, tiny counts) must finish and report every section.

No speed is asserted here: figures on a shared CI machine are noise; the
benchmark itself reports ratios measured side by side.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.push import GOAL_FANOUT_P99_MS, GOAL_RSS_PER_STREAM_KIB, GOAL_WORKERS_P99_MS
from tests.etcd_cluster import require_etcd
from tests.procs import ROOT


def cpu_pct_ok(pct: float) -> bool:
    """A CPU figure in % of one core: finite, not negative, and no more than every core of the machine
    (5% over for the 10 ms ticks CPU time comes in)."""
    return math.isfinite(pct) and 0 <= pct <= 105 * (os.cpu_count() or 1)


@pytest.mark.slow
def test_quick_benchmark_run_reports_every_section(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for section in ("latency", "throughput", "fan_in", "propagation", "outage", "scale", "goals"):
        assert results.get(section), f"section {section} missing or empty"
    assert "floor" in results["latency"]["cases"] and "relay_hit" in results["latency"]["cases"]
    assert "Goals" in out.stdout


@pytest.mark.slow
def test_etcd_store_benchmark_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.etcd_store", "--edits", "5", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "etcd_store.json").read_text())
    assert results["propagation_to_other_lighthouse"]["n"] == 5
    assert_run_meta(results)
    assert "etcd / SQLite" in out.stdout


@pytest.mark.slow
def test_many_jobs_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("many_jobs", tmp_path)
    assert {w["case"] for w in results["windows"]} == {"jobs", "one_job", "jobs_edited"}
    for window in results["windows"]:
        assert window["client_calls"] > 0 and window["p99"] is not None
    assert results["summary"]["jobs_edited"]["edits"] > 0
    assert "p99 goal" in out.stdout


@pytest.mark.slow
def test_etcd_fleet_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("etcd_fleet", tmp_path)
    assert results["fleet"]["client_calls"] > 0 and results["fleet"]["p99"] is not None
    (gap,) = results["gap"]["rounds"]
    assert gap["steps"] > 0 and gap["max_gap_after_kill_ms"] is not None
    assert gap["survivor_calls_after_kill"] > 0  # the manager moved to the other lighthouse
    assert "longest gap after a kill" in out.stdout


@pytest.mark.slow
def test_push_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("push", tmp_path)
    workers = results["workers"]
    for kind in ("push", "poll"):  # every edit reached every worker, pushed and polled
        k = workers[kind]
        assert k["missed"] == 0 and k["n"] == workers["edits"] > 0
        assert 0 <= k["p50"] <= k["p90"] <= k["p99"] <= k["max"]
    polling = results["idle"]["polling"]
    assert polling["calls_per_s"] > 0 and polling["errors"] == 0 and polling["rss_mib"] > 0
    pushed = results["idle"]["pushed"]
    assert [p["streams"] for p in pushed] == [20, 60]
    for level in pushed:  # one connection per simulated manager unless told otherwise
        assert level["connections"] == level["streams"] and level["rss_mib"] > 0
        assert cpu_pct_ok(level["lighthouse_cpu_pct"]) and cpu_pct_ok(level["load_cpu_pct"]), level
    for key, streams, lighthouses in (("fanout", 60, 1), ("etcd", 30, 3)):
        fan = results[key]
        assert fan["streams"] == streams and fan["missed"] == 0 and len(fan["edits"]) == 2
        assert len(fan["acks"]) == 2  # the messages counted: 2 edits to every stream
        each = fan["lighthouse_cpu_pct_each"]
        assert len(each) == lighthouses and all(cpu_pct_ok(c) for c in each), each
        # CPU time comes in ticks of 10 ms: the quick run's 2 edits can fit in none of them (0), but
        # the figure per message is finite, and not 0 when a lighthouse was seen using CPU.
        per_message = fan["lighthouse_cpu_us_per_message"]
        assert math.isfinite(per_message) and per_message >= 0, per_message
        assert per_message > 0 or not any(c > 0 for c in each), (per_message, each)
        for edit in fan["edits"]:  # every stream had every edit; the slowest stream bounds the others
            assert edit["have"] == streams
            assert edit["first_ms"] <= edit["p50_ms"] <= edit["p99_ms"] <= edit["last_ms"] + 1
    assert sum(p["streams"] for p in results["etcd"]["per_lighthouse"]) == 30
    # Four goals have a target: each flag is a bool saying what its figures say. The etcd fan-out
    # has none (reported only): None.
    met = [g["met"] for g in results["goals"]]
    assert [type(m) for m in met] == [bool, bool, bool, bool, type(None)], met
    push, fanout = workers["push"], results["fanout"]
    assert met[0] == (push["p99"] <= GOAL_WORKERS_P99_MS and push["missed"] == 0)
    assert met[1] == (pushed[-1]["lighthouse_cpu_pct"] < polling["lighthouse_cpu_pct"])
    assert met[2] == (max(p["rss_per_stream_kib"] for p in pushed) <= GOAL_RSS_PER_STREAM_KIB)
    assert met[3] == (fanout["last_p99_ms"] <= GOAL_FANOUT_P99_MS and fanout["missed"] == 0)
    assert "Goals (issue 17)" in out.stdout


@pytest.mark.slow
def test_leases_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("leases", tmp_path, timeout=180)
    cases = results["first_use"]
    assert [(c["mode"], c["ttl_s"], c["step_s"]) for c in cases] == [
        (mode, 0.25, step) for mode in ("push", "poll") for step in (0.01, 0.1)
    ]
    for case in cases:
        assert case["changes"] == len(case["rows"]) == 4 and case["not_used"] == 0
        # Every rank first used each change at its E (or, on a machine too busy for the lighthouse
        # to renew a lease in time, got the documented fallback from E until it did): never another.
        assert case["wrong"] == 0 and case["exact"] + case["after_fallback"] == 4, case["rows"]
        assert case["went_back"] == 0
        for row in case["rows"]:
            assert row["effective_step"] > row["job_step"] >= 0  # above the step the job was at
            assert row["steps_to_every"] >= row["steps_to_e"] and row["s_to_every"] >= row["s_to_e"] > 0
        assert 0 < case["ttls_to_e"]["p50"] <= case["ttls_to_every"]["p99"]
        fallbacks = case["sources"].get("fallback", 0)
        assert case["lease_ahead_max"] > 0 and case["unleased_steps"] == fallbacks  # the rest were promised
    sqlite, etcd = results["writes"]
    assert (sqlite["store"], etcd["store"]) == ("sqlite", "etcd")
    for writes in (sqlite, etcd):
        assert writes["window_s"] > 0 and writes["fallbacks"] == 0
        assert writes["horizon_steps_per_s"] > 0 and writes["job_step_writes_per_min"] > 0
        assert 0 <= writes["ceiling_writes_per_min"] <= writes["all_writes_per_min"]
    # etcd's own history and the lighthouse's counter agree (read a moment apart: one write may straddle)
    assert abs(etcd["etcd_ceiling_puts"] - etcd["ceiling_writes"]) <= 1
    assert [g["case"] for g in results["goals"]] == [
        f"{mode}, TTL 0.25 s, {step} ms steps" for mode in ("push", "poll") for step in (10, 100)
    ]
    # The bound of a push case is 100 ms + 3 steps, of a polled one a TTL + 3 steps.
    for case in cases:
        wait = 0.1 if case["mode"] == "push" else case["ttl_s"]
        assert case["bound_s"] == pytest.approx(wait + 3 * case["step_period_s"])
    assert "Goals (issue 16; push: issue 37)" in out.stdout


def assert_run_meta(results: dict[str, Any]) -> None:
    """What the shared writer records of a run: the commit it measured, when, and the load around it."""
    meta = results["meta"]
    assert re.fullmatch(r"[0-9a-f]{7,40}", meta["commit"]), meta
    assert isinstance(meta["dirty"], bool)
    assert len(meta["loadavg_before"]) == len(meta["loadavg_after"]) == 3
    assert meta["started_utc"] <= meta["finished_utc"]


def run_quick(
    name: str, out_dir: Path, timeout: float = 120, extra: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``python -m benchmarks.NAME --quick [extra]``: it must exit 0; its stdout and JSON results."""
    out = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", *extra, "--out", str(out_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads((out_dir / f"{name}.json").read_text())


@pytest.mark.slow
def test_reporting_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("reporting", tmp_path)
    path = results["critical_path"]
    assert all(path[case]["n"] > 0 for case in ("floor", "prefetch", "prefetch_report", "memory_read"))
    assert set(results["lighthouse_cpu"]["cpu_pct"]) == {"silent", "reporting", "reporting_dashboard"}
    assert all(w["errors"] == 0 and w["client_calls"] > 0 for w in results["lighthouse_cpu"]["windows"])
    cpu = results["lighthouse_cpu"]  # the ratio is of CPU per call served, not of CPU shares
    for case, us in cpu["cpu_us_per_call"].items():
        windows = [w for w in cpu["windows"] if w["case"] == case and w["lighthouse_calls_per_s"] > 0]
        assert windows, case  # a window without calls served has no figure; every case needs one
        expected = [w["lighthouse_cpu_pct"] / 100 / w["lighthouse_calls_per_s"] * 1e6 for w in windows]
        assert us == pytest.approx(statistics.median(expected))
    per_call = cpu["cpu_us_per_call"]
    assert cpu["ratio"] == pytest.approx(per_call["reporting"] / per_call["silent"])
    assert_run_meta(results)
    memory = results["memory"]
    assert memory["entries"]["loss"]["trail_steps"] > 0 and len(memory["checkpoints"]) == 2
    assert "report() on the critical path" in out.stdout


@pytest.mark.slow
def test_prefetch_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("prefetch", tmp_path)
    assert results["floor"]["n"] > 0
    for case in ("plain_loop", "paused_loop", "run_start"):
        r = results[case]
        assert r["n"] > 0 and r["client_asks"] > 0, (case, r)
        assert r["share_from_memory"] == pytest.approx(r["client_from_memory"] / r["client_asks"])
        assert r["ratio_to_floor"] == pytest.approx(r["p50"] / results["floor"]["p50"])
        assert r["wrong_step"] == 0 and r["not_pinned"] == 0, (case, r)
    assert_run_meta(results)
    start = results["run_start"]
    assert start["runs"] == 2 and start["client_asks"] == 20  # warm-up and one round: 10 steps a job
    assert start["misses_per_run"] == (start["client_asks"] - start["client_from_memory"]) / 2
    assert results["memory_read"]["n"] > 0
    assert "paused_loop:" in out.stdout and "run_start:" in out.stdout


@pytest.mark.slow
def test_torchft_forward_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("torchft_forward", tmp_path)
    cases = results["cases"]
    hops = ("ours", "passthrough", "direct")
    assert set(cases) == {f"{method}_{hop}" for method in ("heartbeat", "quorum") for hop in hops}
    assert all(c["n"] == 2 * 20 for c in cases.values()), cases  # every call answered (none raised)
    for method, ratio in results["ratios"].items():
        for q in ("p50", "p99"):
            assert ratio[q] == pytest.approx(cases[f"{method}_ours"][q] / cases[f"{method}_direct"][q])
            for hop in ("ours", "passthrough"):
                added = results["added_us"][f"{method}_{hop}"][q]
                assert added == pytest.approx(cases[f"{method}_{hop}"][q] - cases[f"{method}_direct"][q])
    assert_run_meta(results)
    assert "quorum through our port" in out.stdout and "quorum through a minimal Python" in out.stdout


@pytest.mark.slow
def test_history_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("history", tmp_path)
    lengths = results["lengths"]
    assert set(lengths) == {"10", "100"}
    for versions, figures in lengths.items():
        assert figures["reply_bytes_at_step"] > 0 and figures["reply_bytes_stepless"] > 0, figures
        assert figures["cpu_ms_per_edit"] is not None
        assert figures["rss_mb"] > 10 and figures["store_kb"] > 0, figures
        assert figures["group_calls_during_edits"] > 0 and figures["call_ms_p99_during_edits"] > 0, figures
        ratios = results["ratios"][versions]
        assert ratios["rss_mb"] == pytest.approx(figures["rss_mb"] / lengths["10"]["rss_mb"])
        assert ratios["reply_bytes_at_step"] == pytest.approx(
            figures["reply_bytes_at_step"] / lengths["10"]["reply_bytes_at_step"]
        )
    assert_run_meta(results)
    assert "100 versions: reply" in out.stdout


@pytest.mark.slow
def test_history_benchmark_runs_on_etcd(tmp_path: Path) -> None:
    out, results = run_quick("history", tmp_path, extra=("--store", "etcd"))
    assert results["store"] == "etcd"
    for figures in results["lengths"].values():
        # etcd's database in use, read from its /metrics: a few pages at least, far below the quota.
        assert 16 < figures["store_kb"] < 256 * 1024, figures
        assert figures["group_calls_during_edits"] > 0, figures
    assert "100 versions: reply" in out.stdout


@pytest.mark.slow
def test_month_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("month", tmp_path)
    steps = results["steps"]
    # The step barrier couples the groups: both trained the same steps, and changes were made.
    assert len(steps) == 2 and steps[0] == steps[1] > 1000, steps
    assert results["changes"] > 0 and results["patch_507"] == 0 and not results["patch_errors"]
    assert results["disagreements"] == 0 and results["switches"] > 0
    # Every 2nd change guarded, a change scheduled and withdrawn after every 2nd (--quick).
    assert (
        results["guarded"] == (results["changes"] + 1) // 2
        and results["withdrawn"] == results["changes"] // 2
    )
    assert max(s["guards"] for s in results["samples"]) > 0
    assert results["guards_seeded"] == 100  # of every 2nd seeded version (kept: all 200)
    # The seeded switches: each group's, to every seeded version after the first (200 seeded).
    assert results["switches_seeded"] == 2 * 199
    samples = results["samples"]
    assert len(samples) >= 3 and all(s["rss_mb"] > 10 and s["store_kb"] > 0 for s in samples)
    assert samples[-1]["store_counts"]["job_versions"] > 200  # SQLite rows: the history kept
    for figure in results["flat"].values():
        assert figure["ratio"] == pytest.approx(figure["end"] / max(figure["settled"], 1))
    assert_run_meta(results)
    assert "goals met:" in out.stdout


@pytest.mark.slow
def test_month_benchmark_on_etcd_measures_what_a_defragmentation_frees(tmp_path: Path) -> None:
    require_etcd()
    _, results = run_quick("month", tmp_path, extra=("--store", "etcd"))
    assert results["store"] == "etcd" and results["disagreements"] == 0
    members = results["etcd_defrag"]
    assert len(members) == 3
    # The file holds what is in use (and the pages freed since the last defragmentation).
    assert all(s["store_file_kb"] >= s["store_kb"] > 0 for s in results["samples"])
    for m in members:  # a defragmented database is no larger, and holds what is in use
        assert 0 < m["in_use_after"] <= m["db_bytes_after"] <= m["db_bytes_before"], m


def test_history_report_renders_a_figure_without_baseline() -> None:
    """A --quick run's 5 edits may take no 10 ms CPU tick at 10 versions: its ratios are None, and
    the report says so rather than failing (a CI run did)."""
    from benchmarks.history import render

    machine = {"loadavg_1m": 0.1, "cpus": 2}
    figures = {
        "reply_bytes_at_step": 700,
        "reply_bytes_stepless": 600,
        "cpu_us_per_reply": 150.0,
        "cpu_ms_per_scheduled_edit": 0.0,
        "cpu_ms_per_edit": 2.0,
    }
    results = {
        "machine_before": machine,
        "machine_after": machine,
        "lengths": {"10": figures, "100": dict(figures, cpu_ms_per_scheduled_edit=2.0)},
        "ratios": {
            "10": {
                "reply_bytes_at_step": 1.0,
                "reply_bytes_stepless": 1.0,
                "cpu_us_per_reply": 1.0,
                "cpu_ms_per_scheduled_edit": None,
                "cpu_ms_per_edit": 1.0,
            },
            "100": {
                "reply_bytes_at_step": 1.0,
                "reply_bytes_stepless": 1.0,
                "cpu_us_per_reply": 1.0,
                "cpu_ms_per_scheduled_edit": None,
                "cpu_ms_per_edit": 1.5,
            },
        },
        "goal": 1.2,
    }
    text = render(results)
    assert "   100 versions:" in text and "2.00 ms CPU (no baseline)" in text and "(1.50x)" in text
