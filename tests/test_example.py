"""The worked example ``examples/train_diloco.py`` trains and switches every rank at the scheduled step.

The checks read the per-step lines the example prints, not only its own verdict.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.http_steps import call
from tests.http_util import wait_healthy
from tests.procs import ROOT, ProcessPool, child_env

EXAMPLE = ROOT / "examples" / "train_diloco.py"
STEP_LINE = re.compile(
    r"^group(\d)/r(\d) step\s+(\d+) v(\d+) lr (\S+)\s+loss (\S+)( sync)?( <- lr changed)?$"
)


def run_example(*args: str, timeout: float = 160, script: Path = EXAMPLE) -> str:
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=ROOT,
        env=child_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def step_lines(out: str) -> dict[tuple[int, int], dict[int, tuple[float, float, bool]]]:
    """(group, rank) -> step -> (lr, loss, synced)."""
    ranks: dict[tuple[int, int], dict[int, tuple[float, float, bool]]] = {}
    for line in out.splitlines():
        m = STEP_LINE.match(line)
        if m:
            g, r, step = int(m[1]), int(m[2]), int(m[3])
            ranks.setdefault((g, r), {})[step] = (float(m[5]), float(m[6]), bool(m[7]))
    return ranks


def check_drop(out: str, steps: int, drop_at: int, old: float, new: float, verdict: bool = True) -> None:
    ranks = step_lines(out)
    assert sorted(ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for key, seen in ranks.items():
        assert sorted(seen) == list(range(steps)), key
        assert all(seen[s][0] == (old if s < drop_at else new) for s in seen), (key, seen)
        # sync_every=10: the group averages after steps 9, 19, ...
        assert [s for s in seen if seen[s][2]] == list(range(9, steps, 10)), key
        # It trains: the loss fell by far from the first step to the last.
        assert seen[steps - 1][1] < seen[0][1] / 10, (key, seen[0], seen[steps - 1])
    # The two ranks of a group used the same lr at every step.
    for g in (0, 1):
        assert all(ranks[(g, 0)][s][0] == ranks[(g, 1)][s][0] for s in range(steps))
    # The log shows each rank's switch: four "lr changed" lines, all at the scheduled step.
    switches = [m for m in map(STEP_LINE.match, out.splitlines()) if m and m[8]]
    assert sorted((int(m[1]), int(m[2]), int(m[3])) for m in switches) == [
        (g, r, drop_at) for g in (0, 1) for r in (0, 1)
    ]
    if verdict:
        assert f"verify: all 4 ranks switched lr {old:g} -> {new:g} at step {drop_at}: OK" in out


@pytest.mark.slow
def test_example_drops_lr_at_the_scheduled_step_in_every_rank() -> None:
    out = run_example("--steps", "60", "--schedule-lr-drop-at", "30")
    backend = re.search(r"^backend: (torch|numpy) ", out, re.MULTILINE)
    assert backend is not None, out[-2000:]
    # PyTorch when it is installed, NumPy otherwise.
    assert backend[1] == ("torch" if importlib.util.find_spec("torch") is not None else "numpy")
    check_drop(out, 60, 30, 0.05, 0.005)


@pytest.mark.slow
def test_example_numpy_path_with_a_drop_scheduled_from_the_cli(procs: ProcessPool) -> None:
    """The README's flow: a running lighthouse, the drop scheduled by ``lighthouse config set --at-step``."""
    lh = procs.lighthouse({"lr": 0.05, "sync_every": 10})
    wait_healthy(lh.url)
    cli = subprocess.run(
        [sys.executable, "-m", "lighthouse", "config", "set", "lr=0.005", "--at-step", "25", "--url", lh.url],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cli.returncode == 0, cli.stderr
    out = run_example("--steps", "40", "--backend", "numpy", "--lighthouse", lh.address)
    assert re.search(r"^backend: numpy ", out, re.MULTILINE), out[-2000:]
    check_drop(out, 40, 25, 0.05, 0.005, verdict=False)
    assert "all 4 ranks changed lr at the same steps: yes" in out
    pending = [
        s for s in call(lh.url, "GET", "/api/config/scheduled")["scheduled"] if s["status"] != "in_effect"
    ]
    assert pending == []


@pytest.mark.slow
def test_adaptive_sync_tunes_sync_every_of_a_running_job(procs: ProcessPool) -> None:
    """``examples/adaptive_sync.py``, its own process, changes ``sync_every`` of a running
    ``train_diloco.py`` from the loss its ranks report; every change is guarded and says why."""
    lh = procs.lighthouse({"lr": 0.05, "sync_every": 4})
    wait_healthy(lh.url)
    train_args = [
        "--lighthouse",
        lh.address,
        "--steps",
        "600",
        "--step-interval",
        "0.01",
        "--backend",
        "numpy",
    ]
    train = procs.spawn([sys.executable, str(EXAMPLE), *train_args, "--print-every", "100"], "train_diloco")
    controller_args = ["--url", lh.url, "--window", "20", "--interval", "0.3", "--idle", "5"]
    controller = run_example(*controller_args, timeout=300, script=ROOT / "examples" / "adaptive_sync.py")
    assert train.wait(60) == 0, train.stderr()
    out = "\n".join(train.lines())
    decisions = [line for line in controller.splitlines() if "sync_every" in line]
    assert decisions, controller
    versions = call(lh.url, "GET", "/api/config/history")["versions"]
    made = [v for v in versions if v["author"] == "adaptive_sync"]
    assert len(made) == len(decisions)
    for version in made:
        assert version["comment"].startswith("adaptive_sync: loss ") and set(version["change"]) == {
            "sync_every"
        }
    guarded = {g["version"] for g in call(lh.url, "GET", "/api/config/guards")["guards"]}
    assert {v["version"] for v in made} <= guarded
    # Every rank trained with the new interval, and the ranks of a group always agreed on it.
    switched = {m[1] for m in re.finditer(r"^(group\d/r\d) step .* <- sync_every \d+$", out, re.MULTILINE)}
    assert switched == {"group0/r0", "group0/r1", "group1/r0", "group1/r1"}, out[-3000:]
    for g in (0, 1):
        assert f"group{g}: 600 steps, ranks agreed on (version, lr, sync_every) at every step: yes" in out


def test_without_numpy_it_names_the_extra_in_one_line(tmp_path: Path) -> None:
    """A numpy that cannot import (as on a plain ``pip install -e .``): one line naming the extra."""
    (tmp_path / "numpy.py").write_text("raise ImportError('no numpy here')\n")
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path}{':' + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''}"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "5", "--backend", "numpy"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == ['train_diloco needs numpy: pip install -e ".[examples]"']
    assert "OK" not in proc.stdout


def test_zero_ranks_is_a_failure_never_ok(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("train_diloco_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.summarize([], (30, 0.01, 0.001)) is False
    out = capsys.readouterr().out
    assert "no rank reported a step" in out and "OK" not in out, out
