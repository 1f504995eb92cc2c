"""The flake hunt (tests/flake_hunt.py) counts each failing test over its runs and fails when any did."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT, child_env


def hunt(runs: int, work: Path, *pytest_args: str) -> subprocess.CompletedProcess[str]:
    """``python -m tests.flake_hunt`` over ``runs`` runs kept in ``work``, pytest given ``pytest_args``."""
    command = [sys.executable, "-m", "tests.flake_hunt", "--runs", str(runs), "--keep", str(work)]
    return subprocess.run(
        [*command, "--", "-p", "no:cacheprovider", *pytest_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=child_env(None),
        timeout=120,
    )


def test_the_hunt_counts_each_failure_and_exits_1(tmp_path: Path) -> None:
    sample = tmp_path / "sample" / "test_sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "def test_ok(record_property):\n    record_property('cpu_s', 1.5)\n"
        "    record_property('children_cpu_s', 2.0)\n\n\ndef test_bad():\n    assert False\n"
    )
    # --rootdir: test ids relative to the sample's folder, wherever the clone and the temporary
    # folder lie (a clone under /tmp once named it pytest-of-root/.../test_sample.py).
    done = hunt(2, tmp_path / "work", "--rootdir", str(sample.parent), str(sample))
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert sum(", 1 passed, 1 failed, 0 skipped in " in line for line in lines) == 2, lines
    assert [line for line in lines if "failed: " in line and line.startswith("2/2")] == [
        "2/2 failed: test_sample.py::test_bad"
    ], lines
    assert len(list((tmp_path / "work").glob("run-*.xml"))) == 2
    # The CPU the tests recorded (tests/conftest.py does for the suite), per module, over the runs.
    assert lines[lines.index("CPU seconds per run, all tests: 4; the most costly modules:") + 1] == (
        "     3.5  test_sample.py"
    ), lines


def test_a_run_that_writes_no_report_is_never_read_from_an_earlier_hunts_report(tmp_path: Path) -> None:
    """A --keep folder used before holds the earlier hunt's run-1.xml: a run whose pytest ends before
    writing its own (here: an option pytest does not know) is counted as such, not as the old report."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "run-1.xml").write_text(
        '<testsuites><testsuite><testcase classname="test_old" name="test_stale">'
        "<failure/></testcase></testsuite></testsuites>"
    )
    done = hunt(1, work, "--no-such-pytest-option")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_stale" not in done.stdout, done.stdout
    assert "1/1 failed: (no report: the run ended before pytest wrote one)" in done.stdout, done.stdout
