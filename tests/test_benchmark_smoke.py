"""Keeps the benchmark working: a --quick run (seconds, tiny counts) must finish and report every section.

No speed is asserted here: figures on a shared CI machine are noise; the
benchmark itself reports ratios measured side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
