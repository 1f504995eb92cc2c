"""Runs with the real lighthouse, managers and workers (issue 25).

One scenario on one lighthouse, each phase building on the last:

* a paused job: the workers of both groups stop stepping while their managers live; the run ends
  after its lease (2 x TTL + 0.5 s), a change made then is live at once for stepless readers, and
  when stepping resumes every group gets the new config from the resume step, in a new run;
* managers started with run ids (``manager serve --run-id``, what ``connect(run_id=)`` starts): a
  new id ends the live run and begins one at the resumed, lower step;
* an operator ends that run with ``lighthouse runs end``; a second end is 409, also per job.

A run ends on its own once no manager stepped for its lease: whatever must find a run live happens
while a group steps (the groups step on until it did), or within a run's life after its last step
long enough to be a deadline (60.5 s), not a race.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.helpers_lighthouse import run_cli
from tests.http_steps import call, wait_for_end
from tests.http_util import call as http_call
from tests.http_util import wait_healthy
from tests.procs import ManagerProc, Proc, ProcessPool, poll, records_so_far, worker_records

pytestmark = pytest.mark.slow

TTL = 0.3  # the managers' cache TTL: a run ends 2 x 0.3 + 0.5 s after the last step (--run-end-after 0)
# The TTL of the managers with run ids: a run then lives 2 x 30 + 0.5 s after its last step (the
# longest TTL of the job's managers sets it), a deadline for what must find it live after its group
# stopped (the restarted job's manager start, the operator's CLI), not a race. (A group stepping on
# to keep it live would pass the effective step of the change promised to the run, which the restart
# below must find still pending.)
LONG_TTL = 30.0
FOREVER = 1_000_000  # steps of a worker that steps until the test stops it


def runs(url: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = call(url, "GET", "/api/config/runs")["runs"]
    return found


def run_state(url: str) -> tuple[list[str], dict[str, int]]:
    """The job and its RUN column in ``lighthouse jobs``, and the run gauges of ``/metrics``."""
    out = run_cli("jobs", "--url", url)
    assert out.returncode == 0, out.stderr
    header, row = (re.split(r" {2,}", line.strip()) for line in out.stdout.splitlines()[:2])
    cells = dict(zip(header, row, strict=True))
    text = http_call(url, "GET", "/metrics").body.decode()
    gauges = {
        name: int(float(value))
        for line in text.splitlines()
        if line.startswith(("lighthouse_run{", "lighthouse_run_live{"))
        for name, value in [(line.split("{")[0], line.split()[-1])]
    }
    return [cells["JOB"], cells["RUN"]], gauges


def step_all(procs: ProcessPool, managers: dict[str, Any], first: int, steps: int) -> dict[str, list[Any]]:
    """One worker per group steps ``first`` .. ``first + steps - 1``; their records by group."""
    workers = {
        g: procs.worker(
            m.address, group=g, rank=0, steps=steps, first_step=first, step_interval=0.01, wait=False
        )
        for g, m in managers.items()
    }
    return {g: worker_records(w) for g, w in workers.items()}


def stepping(procs: ProcessPool, manager: ManagerProc, group: str, first: int) -> Proc:
    """A worker of ``group`` stepping from ``first`` until the test stops it: its run stays live."""
    return procs.worker(
        manager.address, group=group, rank=0, steps=FOREVER, first_step=first, step_interval=0.02, wait=False
    )


def first_records(worker: Proc, count: int) -> list[dict[str, Any]]:
    """The first ``count`` records of a worker that is still stepping."""
    records: list[dict[str, Any]] = poll(
        lambda: (r := records_so_far(worker))[count - 1 :] and r, 60, what=f"{count} steps of {worker.name}"
    )
    return records[:count]


def test_pause_operator_end_and_run_ids_begin_and_end_runs(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=["--run-end-after", "0"])
    wait_healthy(lh.url)
    managers = {g: procs.manager(lh.address, g, cache_ttl=TTL) for g in ("g0", "g1")}

    # Run 1: both groups step 0..29, then pause (their managers stay up).
    first = step_all(procs, managers, 0, 30)
    assert all(r["config"]["lr"] == "0.1" for recs in first.values() for r in recs)
    assert runs(lh.url)[0]["start_step"] == 0
    ended, heard = wait_for_end(lh.url)
    # It ended at the job's step: the highest step a manager reported. A manager reports its step
    # with each lease renewal and within a second of a change, and the run ends 1.1 s after the last
    # report that moved it, so the last steps may be heard only after the end: the end step is at
    # least what the lighthouse had heard while the run was live (the last step, mostly) and at most
    # the last step trained (a rank asks a step's config before it trains it: no manager reports a
    # step its workers did not ask for).
    trained = max(r["step"] for recs in first.values() for r in recs)
    assert ended[-1]["end_reason"] == "managers gone", ended
    assert heard <= ended[-1]["end_step"] <= trained, (heard, ended[-1], trained)
    assert run_state(lh.url) == (["default", "1 ended"], {"lighthouse_run": 1, "lighthouse_run_live": 0})
    # No run is live: a change made now is live at once, for stepless readers too.
    made = call(lh.url, "PATCH", "/api/config", {"lr": 0.2})
    assert made["effective_step"] is None
    assert call(lh.url, "GET", "/api/config")["config"]["lr"] == 0.2
    stepless = procs.worker(managers["g0"].address, group="g0", rank=1, steps=1, no_step=True)
    record = worker_records(stepless)[0]
    assert record["config"].get("lr") == "0.2", record
    # Stepping resumes: the new config from the resume step, in every group, in run 2 (live while
    # the groups step: they step on until the checks are done).
    resuming = {g: stepping(procs, m, g, 30) for g, m in managers.items()}
    for g, w in resuming.items():
        recs = first_records(w, 10)
        assert [r["step"] for r in recs] == list(range(30, 40))
        assert all(r["config"]["lr"] == "0.2" for r in recs), (g, recs[:2])
    live = runs(lh.url)[-1]
    assert live["live"] and live["number"] == 2 and live["start_step"] == 30
    assert run_state(lh.url) == (["default", "2 from 30"], {"lighthouse_run": 2, "lighthouse_run_live": 1})
    for proc in [*resuming.values(), *managers.values()]:  # run 2's groups leave (their last reports go)
        proc.stop()

    # The training script names its runs (connect(run_id=...) starts its manager with --run-id).
    a = procs.manager(lh.address, "g2", cache_ttl=LONG_TTL, extra=["--run-id", "a"])
    step_all(procs, {"g2": a}, 50, 5)
    began = runs(lh.url)[-1]
    assert (began["run_id"], began["start_step"], began["live"]) == ("a", 50, True)
    changed = call(lh.url, "PATCH", "/api/config", {"lr": 0.3})  # promised to run "a": pending
    assert changed["effective_step"] is not None and changed["effective_step"] > 54
    # It restarts from a checkpoint at step 10 with a new run id: a new run begins there at once
    # (no wait for the old one's lease), and the change promised to run "a" applies from step 10.
    b = procs.manager(lh.address, "g3", cache_ttl=LONG_TTL, extra=["--run-id", "b"])
    restarted = step_all(procs, {"g3": b}, 10, 5)["g3"]
    assert [r["step"] for r in restarted] == list(range(10, 15))
    assert all(r["config"]["lr"] == "0.3" for r in restarted), restarted[:2]
    last_two = runs(lh.url)[-2:]
    assert last_two[0]["number"] == began["number"] and last_two[0]["end_reason"] == "run id 'b'", last_two
    assert (last_two[1]["run_id"], last_two[1]["start_step"], last_two[1]["live"]) == ("b", 10, True)
    # The job's step is the new run's (it went down to 10 and moves on from there).
    poll(lambda: call(lh.url, "GET", "/api/config")["current_step"] == 14, 10, what="the job at step 14")

    # The operator ends that run (the CLI), then nothing is live: 409, also on the per-job route.
    out = run_cli("runs", "end", "--comment", "eval", "--url", lh.url)
    assert out.returncode == 0, out.stderr
    assert f"run {last_two[1]['number']} ended at step 14" in out.stdout
    assert runs(lh.url)[-1]["end_reason"].startswith("ended by") and "eval" in runs(lh.url)[-1]["end_reason"]
    assert http_call(lh.url, "POST", "/api/config/runs/end").status == 409
    assert http_call(lh.url, "POST", "/api/jobs/default/runs/end").status == 409
    listed = run_cli("runs", "--url", lh.url)
    assert listed.returncode == 0 and "RUN" in listed.stdout and "managers gone" in listed.stdout


def test_a_change_in_effect_in_the_ended_run_holds_from_the_next_runs_first_step(procs: ProcessPool) -> None:
    """Issue 35's finding with real processes: lr changed now takes effect in run "a" (its group
    trains past the step); run "b" resumes below that step and trains the operator's lr from its
    first step (before the fix: the old lr, with the change pending at its old step again)."""
    lh = procs.lighthouse({"lr": 0.1})
    a = procs.manager(lh.address, "g2", cache_ttl=0.3, extra=["--run-id", "a"])
    old = procs.worker(
        a.address, group="g2", rank=0, steps=1_000_000, first_step=50, step_interval=0.02, wait=False
    )
    poll(lambda: records_so_far(old), 30, what="run a stepping")
    changed = call(lh.url, "PATCH", "/api/config", {"lr": 0.3})
    assert changed["effective_step"] is not None and changed["effective_step"] > 10
    poll(lambda: any(r["config"].get("lr") == "0.3" for r in records_so_far(old)), 30, what="lr 0.3 in run a")
    b = procs.manager(lh.address, "g3", cache_ttl=30.0, extra=["--run-id", "b"])

    def ended_by_b() -> bool:
        return any(r["end_reason"] == "run id 'b'" for r in call(lh.url, "GET", "/api/config/runs")["runs"])

    poll(ended_by_b, 30, what="run a ended by run id b")
    old.stop()
    a.stop()
    resumed = worker_records(procs.worker(b.address, group="g3", rank=0, steps=5, first_step=10))
    assert [r["step"] for r in resumed] == [10, 11, 12, 13, 14]
    assert [r["config"]["lr"] for r in resumed] == ["0.3"] * 5, resumed
