"""Real torchrun jobs for the tests: one ``torchrun --standalone`` per replica group, as with torchft.

Each rank of ``examples/train_ddp.py`` prints one JSON record per event (``"event": "step"``
and so on); these helpers start groups, read their records, and kill a group as a lost machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from tests.procs import ROOT, Proc, ProcessPool, poll

EXAMPLE = ROOT / "examples" / "train_ddp.py"
RUN_TIMEOUT = 120.0


def torchrun(
    procs: ProcessPool,
    group: int,
    script: Path,
    args: list[str],
    env: dict[str, str],
    monitor_interval: float = 0.2,
) -> Proc:
    """One replica group: ``torchrun --standalone`` (a free port for its store) with 2 ranks.

    ``monitor_interval``: how often torchrun checks its ranks (and stops them all when one failed).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [f"--monitor-interval={monitor_interval}", str(script), *args]
    proc: Proc = procs.spawn(cmd, f"group{group}", env={"REPLICA_GROUP_ID": str(group), **env})
    return proc


def records(proc: Proc, event: str = "step") -> list[dict[str, Any]]:
    out = []
    for line in proc.lines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event", "step") == event:
                out.append(record)
    return out


def max_step(proc: Proc) -> int:
    return max((r["step"] for r in records(proc)), default=-1)


def finish(proc: Proc, timeout: float = RUN_TIMEOUT) -> list[dict[str, Any]]:
    """Wait for a torchrun to exit 0 and return its step records."""
    try:
        code = proc.wait(timeout)
    except Exception:
        raise AssertionError(f"{proc.name} still running after {timeout}s\n{proc.stderr()}") from None
    assert code == 0, f"{proc.name} exited {code}\n{proc.stderr()}"
    poll(lambda: len(records(proc, "done")) == 2, 10, what=f"{proc.name}'s ranks done")
    return records(proc)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_group(proc: Proc) -> list[dict[str, Any]]:
    """SIGKILL a whole replica group at once, as a lost machine: torchrun, its ranks, their manager.

    Returns every step record it printed.
    """
    pids = [proc.pid, *descendants(proc.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)  # nothing reacts (restarts, cleans up) while the others die
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    proc.wait(10)
    # Once every writer is gone the pipe ends: then every line it printed has been read.
    poll(proc.output_ended, 10, what="the end of its output")
    return records(proc)


def torchft_lighthouse(procs: ProcessPool, min_replicas: int = 1) -> str:
    """torchft's own (Rust) lighthouse, which forms the quorum across groups: its URL."""
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    args = ["--min_replicas", str(min_replicas), "--bind", "127.0.0.1:0", "--join_timeout_ms", "500"]
    ft = procs.spawn([binary, *args, "--heartbeat_timeout_ms", "1000"], "torchft-lighthouse")
    found = poll(
        # Its start imports torch: a minute on a loaded machine.
        lambda: re.search(r"listening on: http://[^:\s]+:(\d+)", ft.stderr()),
        90,
        what="torchft lighthouse",
    )
    return f"http://127.0.0.1:{found.group(1)}"
