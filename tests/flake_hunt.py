"""The flake hunt: run the suite N times and print every test that failed, with its count.

    python -m tests.flake_hunt --runs 5                      # the whole suite, 5 times, here
    python -m tests.flake_hunt --runs 5 --clean-clone        # each: bash .ci/run, a clone of HEAD, a new venv
    python -m tests.flake_hunt --runs 10 --load 2 -- -m slow # the slow set beside 2 busy processes

A test that fails once in N runs is a race to find (docs/install.md keeps the figures). Each run
writes a JUnit XML report; the hunt reads the failures from it, and samples the load average every
10 s so a figure says what the machine was doing.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """One run of the suite: its verdicts and what the machine was doing."""

    exit_code: int
    seconds: float
    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: int = 0
    loads: list[float] = field(default_factory=list)

    def line(self, index: int, runs: int) -> str:
        low, high, middle = min(self.loads), max(self.loads), statistics.median(self.loads)
        load = f"load average {low:.1f}-{high:.1f}, median {middle:.1f}"
        minutes, seconds = divmod(round(self.seconds), 60)
        return (
            f"run {index}/{runs}: exit {self.exit_code}, {self.passed} passed, {len(self.failed)} failed, "
            f"{self.skipped} skipped in {minutes} min {seconds} s ({load})"
        )


def read_report(path: Path) -> tuple[int, list[str], int]:
    """Passed count, failed test ids (failures and errors) and skipped count of a JUnit XML report."""
    if not path.exists():
        return 0, ["(no report: the run ended before pytest wrote one)"], 0
    passed, failed, skipped = 0, [], 0
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def cpu_by_module(path: Path) -> dict[str, float]:
    """CPU seconds per test module of a JUnit XML report: the ``cpu_s`` and ``children_cpu_s``
    properties tests/conftest.py records (none: an empty answer)."""
    if not path.exists():
        return {}
    spent: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") in ("cpu_s", "children_cpu_s"):
                spent[case.get("classname", "").replace(".", "/") + ".py"] += float(prop.get("value", 0))
    return dict(spent)


def print_cpu(reports: list[Path], top: int = 12) -> None:
    """The modules that cost the machine most, as a mean over the runs (what to make cheaper when
    the suite is over its time: it is CPU-bound)."""
    runs = [spent for spent in map(cpu_by_module, reports) if spent]
    if not runs:
        return
    mean = {m: sum(r.get(m, 0.0) for r in runs) / len(runs) for m in set().union(*runs)}
    print(f"\nCPU seconds per run, all tests: {sum(mean.values()):.0f}; the most costly modules:")
    for module, seconds in sorted(mean.items(), key=lambda item: -item[1])[:top]:
        print(f"{seconds:8.1f}  {module}")


def sample_load(stop: threading.Event, into: list[float]) -> None:
    while True:
        into.append(os.getloadavg()[0])
        if stop.wait(10):
            return


# Spins until its parent is gone: a hunt ended by SIGTERM (its ``finally`` never runs) leaves no
# busy process behind to load the machine for whatever runs next.
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"


def busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    """CPU load beside the suite: ``count`` processes spinning at normal priority."""
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]


def at_a_terminal() -> None:
    """SIGINT as at a terminal in the suite's processes: a hunt started as a background job has it
    ignored, every process it starts inherits that, and the tests that send Ctrl-C would fail."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_once(args: argparse.Namespace, work: Path, index: int) -> Run:
    report = work / f"run-{index}.xml"
    report.unlink(missing_ok=True)  # an earlier hunt's, in a --keep folder: never read as this run's
    env = {**os.environ, "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} --junitxml={report}"}
    if args.clean_clone:
        checkout = work / f"clone-{index}"
        # A --keep folder used before holds an earlier hunt's clone: a fresh clone it must be.
        shutil.rmtree(checkout, ignore_errors=True)
        subprocess.run(["git", "clone", "-q", str(ROOT), str(checkout)], check=True)
        if args.venv:  # one environment for every clone; by default each clone makes its own, as CI does
            env["VENV"] = str(args.venv)
        command = ["bash", ".ci/run"]
        if args.pytest_args:
            sys.exit("--clean-clone runs .ci/run as CI does: it takes no pytest arguments")
    else:
        checkout = ROOT
        command = [sys.executable, "-m", "pytest", "-q", *args.pytest_args]
    log = work / f"run-{index}.log"
    loads: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_load, args=(stop, loads), daemon=True)
    sampler.start()
    began = time.monotonic()
    with log.open("wb") as out:
        code = subprocess.run(
            command,
            cwd=checkout,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,  # as CI runs it: no standard input
            preexec_fn=at_a_terminal,  # no threads yet but the load sampler's: safe before exec
        ).returncode
    stop.set()
    sampler.join()
    passed, failed, skipped = read_report(report)
    return Run(code, time.monotonic() - began, passed, failed, skipped, loads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="how many times to run the suite")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside every run")
    parser.add_argument(
        "--clean-clone", action="store_true", help="each run: bash .ci/run on a clone of HEAD"
    )
    parser.add_argument(
        "--venv", type=Path, default=None, help="an environment the clones share (default: new)"
    )
    parser.add_argument(
        "--keep", type=Path, default=None, help="folder for the logs and reports (default: temp)"
    )
    parser.add_argument(
        "pytest_args", nargs="*", help="after --: arguments for pytest (not with --clean-clone)"
    )
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="flake-hunt-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    load = busy_loops(args.load)
    try:
        for index in range(1, args.runs + 1):
            runs.append(run_once(args, work, index))
            print(runs[-1].line(index, args.runs), flush=True)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    counts = collections.Counter(name for run in runs for name in run.failed)
    print(f"\n{len(runs)} runs, {args.load} busy processes beside them; logs and reports in {work}")
    if not counts:
        print("no test failed")
    for name, count in counts.most_common():
        print(f"{count}/{len(runs)} failed: {name}")
    print_cpu([work / f"run-{index}.xml" for index in range(1, len(runs) + 1)])
    return 0 if not counts and all(run.exit_code == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
