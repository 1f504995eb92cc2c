"""Keeps the benchmark working: a --quick run (seconds, tiny counts) must finish and report every section.

No speed is asserted here: figures on a shared CI machine are noise; the
benchmark itself reports ratios measured side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.procs import ROOT


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
    assert "etcd / SQLite" in out.stdout


def test_many_jobs_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("many_jobs", tmp_path)
    assert {w["case"] for w in results["windows"]} == {"jobs", "one_job", "jobs_edited"}
    for window in results["windows"]:
        assert window["client_calls"] > 0 and window["p99"] is not None
    assert results["summary"]["jobs_edited"]["edits"] > 0
    assert "p99 goal" in out.stdout


def test_etcd_fleet_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("etcd_fleet", tmp_path)
    assert results["fleet"]["client_calls"] > 0 and results["fleet"]["p99"] is not None
    (gap,) = results["gap"]["rounds"]
    assert gap["steps"] > 0 and gap["max_gap_after_kill_ms"] is not None
    assert gap["survivor_calls_after_kill"] > 0  # the manager moved to the other lighthouse
    assert "longest gap after a kill" in out.stdout


def test_leases_benchmark_runs(tmp_path: Path) -> None:
    out, results = run_quick("leases", tmp_path, timeout=180)
    cases = results["first_use"]
    assert [(c["ttl_s"], c["step_s"]) for c in cases] == [(0.25, 0.01), (0.25, 0.1)]
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
    assert [g["case"] for g in results["goals"]] == ["TTL 0.25 s, 10 ms steps", "TTL 0.25 s, 100 ms steps"]
    assert "Goals (issue 16)" in out.stdout


def run_quick(
    name: str, out_dir: Path, timeout: float = 120
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``python -m benchmarks.NAME --quick``: it must exit 0; its stdout and JSON results."""
    out = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads((out_dir / f"{name}.json").read_text())
