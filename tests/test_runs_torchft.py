"""The rewind (issue 25) with real torchft jobs: the whole job crashes, the operator lowers lr,
the job resumes from a checkpoint at an earlier step and gets the new lr from there.

Two replica groups (one ``torchrun`` each, 2 ranks, gloo, torchft's lighthouse for the quorum)
train ``examples/train_ddp.py --torchft``, each saving its state at step 100. Near step 300
both are SIGKILLed with their managers. Once the lighthouse has ended the run (no manager
stepped for its lease), lr is lowered (a change made now: live at once) and momentum is
scheduled at step 150 (accepted: no live run holds a promise). Both groups restart from their
checkpoints: they use the new lr from step 100 on, the new momentum from exactly 150, and end
with equal parameters. (One group killed and restarted alone while the other trains, healed by
torchft at the config of its step, is ``test_torchrun.py``'s
``test_torchft_trains_across_a_kill_and_restart_of_one_group``.)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.http_steps import call
from tests.http_util import wait_healthy
from tests.procs import ProcessPool, poll
from tests.torchrun_jobs import EXAMPLE, finish, kill_group, max_step, records, torchft_lighthouse, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SAVE_AT, CRASH_NEAR, SCHEDULED_AT, END = 100, 300, 150, 200


def test_a_job_resumed_from_a_checkpoint_gets_the_config_as_the_operator_left_it(
    procs: ProcessPool, tmp_path: Path
) -> None:
    assert importlib.util.find_spec("torchft"), "torchft is not installed: pip install -e '.[torchft]'"
    lh = procs.lighthouse(
        {"lr": 0.01, "momentum": 0.0}, state_dir=tmp_path / "state", extra=["--run-end-after", "0"]
    )
    wait_healthy(lh.url)
    # Two replicas for a quorum: both groups train every step from 0 (none heals past step 100).
    env = {"TORCHFT_LIGHTHOUSE": torchft_lighthouse(procs, min_replicas=2)}
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()

    def start(steps: int, cache_ttl: float) -> list[Any]:
        args = ["--torchft", "--lighthouse", lh.address, "--steps", str(steps), "--cache-ttl", str(cache_ttl)]
        args += ["--step-time", "0.01", "--gloo-timeout", "10", "--timeout", "10"]
        args += ["--checkpoint-dir", str(checkpoints), "--save-at", str(SAVE_AT)]
        return [torchrun(procs, g, EXAMPLE, args, env) for g in (0, 1)]

    first = start(10 * CRASH_NEAR, cache_ttl=0.5)  # its run ends 1.5 s after the crash
    poll(lambda: min(map(max_step, first)) >= CRASH_NEAR, 240, what=f"both groups past step {CRASH_NEAR}")
    crashed = [kill_group(p) for p in first]  # the whole job: torchruns, ranks, managers
    assert all((checkpoints / f"group-{g}.pt").exists() for g in (0, 1))
    assert all(r["lr"] == 0.01 for recs in crashed for r in recs)

    # The run ends once no manager has stepped for its lease (2 x TTL + 0.5 s).
    def ended() -> list[dict[str, Any]] | None:
        runs: list[dict[str, Any]] = call(lh.url, "GET", "/api/config/runs")["runs"]
        return runs if runs and not runs[-1]["live"] else None

    runs = poll(ended, 30, what="the run ended")
    # The last step a manager heard of: past the checkpoint, so the resume below goes back to an
    # earlier step. A rank asks a step's config before it trains the step and prints its record
    # after, so a rank killed in between made its manager hear of one step past every record.
    trained = max(r["step"] for recs in crashed for r in recs)
    assert SAVE_AT < runs[-1]["end_step"] <= trained + 1 and runs[-1]["end_reason"] == "managers gone", runs
    lowered = call(lh.url, "PATCH", "/api/config", {"lr": 0.002})
    assert lowered["effective_step"] is None  # no live run: live at once
    assert call(lh.url, "GET", "/api/config")["config"]["lr"] == 0.002  # also for stepless readers
    scheduled = call(lh.url, "PATCH", f"/api/config?effective_step={SCHEDULED_AT}", {"momentum": 0.5})
    assert scheduled["effective_step"] == SCHEDULED_AT  # below the dead run's promises: accepted

    # The resumed run must not end before the groups do: with its managers' lease at 1.5 s, a
    # machine under a load of 17 stalled them longer, and the run ended three times on the way
    # (runs began at 116 and 152). A TTL of 5 s: the run outlives a stall of 10 s.
    again = start(END, cache_ttl=5.0)
    done = [finish(p, timeout=240) for p in again]
    for g, recs in enumerate(done):
        starts = records(again[g], "start")
        assert {r["first_step"] for r in starts} == {SAVE_AT}, starts
        steps = {r["step"] for r in recs}
        assert min(steps) == SAVE_AT and max(steps) == END - 1, (g, min(steps), max(steps))
        wrong = [
            r
            for r in recs
            if r["lr"] != 0.002 or r["momentum"] != (0.5 if r["step"] >= SCHEDULED_AT else 0.0)
        ]
        assert not wrong, (g, wrong[:3])
    hashes = {r["sha"] for p in again for r in records(p, "params")}
    assert len(hashes) == 1, f"the groups ended with different parameters: {hashes}"
    runs = call(lh.url, "GET", "/api/config/runs")["runs"]
    assert runs[-1]["start_step"] == SAVE_AT and runs[-1]["number"] == len(runs) >= 2, runs
    timeline = call(lh.url, "GET", "/api/config/timeline")
    assert timeline["runs"][-1]["start_step"] == SAVE_AT
