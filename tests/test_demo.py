"""The README's first command: the demo runs every part, changes lr halfway, and leaves nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.procs import ROOT


def test_demo_runs_all_parts_and_stops_cleanly() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "examples/demo.py",
            "--duration",
            "6",
            "--dashboard",
            "127.0.0.1:0",
            "--step-time",
            "0.2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/", out, re.M), out[:500]
    lines = re.findall(r"^(group\d)/(\d) step +(\d+) version +(\d+) lr (\S+)", out, re.M)
    ranks = {(g, r) for g, r, *_ in lines}
    assert ranks == {("group0", "0"), ("group0", "1"), ("group1", "0"), ("group1", "1")}
    assert {lr for *_, lr in lines} == {"0.001", "0.0005"}, "the halfway lr change never reached the workers"
    # Every rank of a group saw the same lr at the same step.
    seen: dict[tuple[str, str], set[str]] = {}
    for group, _rank, step, _version, lr in lines:
        seen.setdefault((group, step), set()).add(lr)
    assert all(len(v) == 1 for v in seen.values())
    assert "all processes ended" in out
    started = re.search(r"^lighthouse (\S+); managers ", out, re.M)
    assert started, out[:500]
    # Workers by their script, the lighthouse by its state dir, managers by the lighthouse they dial.
    for pattern in ("examples/demo_worker.py", "lighthouse-demo-", f"--lighthouse {started.group(1)}"):
        leftovers = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True)
        assert leftovers.returncode == 1, f"a demo process is still running ({pattern}): {leftovers}"
