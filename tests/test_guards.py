"""Guarded changes with real processes: a lighthouse, two managers and two groups x two ranks of
workers (``tests/worker_proc.py --report``) whose loss triples while ``lr`` is above 0.015, as a bad learning
rate would make it. The scenarios share one running job, each from the calm ``lr`` it sets itself:

1. a guarded change whose loss triples is rolled back (history: the ``guard`` version, its reason);
   every group switches back at the same step (this needs issue 16's step leases);
2. a guarded change whose loss stays flat passes;
3. a cancelled guard does nothing (its change stays, though the loss triples);
4. a guard survives a lighthouse restart, clean or SIGKILL (it was stored before its change took
   effect; the restarted lighthouse rolls the change back).

A job of its own shows a reported NaN rolling a guarded change back.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers_lighthouse import run_cli, start_lighthouse
from tests.http_util import call, get_json, history, live, wait_healthy
from tests.procs import (
    LighthouseProc,
    ManagerProc,
    Proc,
    ProcessPool,
    metric,
    poll,
    records_so_far,
    wait_ready,
)
from tests.worker_proc import known_loss

GROUPS, RANKS = 2, 2
CALM_LR, HOT_LR = 0.01, 0.02  # the workers' loss triples while lr > 0.015
GUARD_STEPS = 60
DECIDED = 60.0  # seconds a guard may take to be decided on this shared, noisy machine


@dataclass
class Job:
    procs: ProcessPool
    tmp: Path
    lighthouse: LighthouseProc
    managers: list[ManagerProc]
    workers: list[Proc]

    def cli(self, *args: str) -> str:
        done = run_cli("config", *args, "--url", self.lighthouse.url)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def set(self, *args: str) -> int:
        """``config set ...``; the version it made."""
        first = self.cli("set", *args).splitlines()[0]
        assert first.startswith("version "), first
        return int(first.split()[1])

    def guard(self, version: int) -> dict[str, Any]:
        guards = get_json(self.lighthouse.url, "/api/config/guards")["guards"]
        return next(g for g in guards if g["version"] == version)

    def decided(self, version: int) -> dict[str, Any]:
        return poll(
            lambda: (g := self.guard(version))["status"] != "active" and g,
            DECIDED,
            0.2,
            f"the guard of v{version} decided",
        )

    def step(self) -> int:
        return int(live(self.lighthouse.url)["current_step"])

    def ahead(self, steps: int) -> int:
        """A step ``steps`` past the job's step and past every step already promised (a change
        cannot be scheduled at a step a step lease covers)."""
        view = live(self.lighthouse.url)
        return max(int(view["current_step"]), int(view.get("lease_horizon", -1))) + steps

    def records(self) -> list[dict[str, Any]]:
        return [r for w in self.workers for r in records_so_far(w)]

    def calm(self, steps: int = 0) -> None:
        """Make the calm lr the live one, and wait until the job has used it for ``steps`` steps (the
        baseline a guard measures): a scenario starts from it whatever ran before."""
        self.set(f"lr={CALM_LR}")
        since = history(self.lighthouse.url)[0]["effective_step"]
        since = self.step() if since is None else int(since)
        if steps:
            poll(lambda: self.step() >= since + steps, 60, 0.2, f"{steps} steps on the calm lr")

    def hot_change_rolled_back(self) -> tuple[int, dict[str, Any]]:
        """A guarded change to the hot lr, from a calm baseline; once every rank trained with it and
        then with its rollback: its version and its (triggered) guard."""
        self.calm(GUARD_STEPS)
        version = self.set(f"lr={HOT_LR}", "--guard", "loss:1.5", "--guard-steps", str(GUARD_STEPS))
        guard = self.decided(version)
        assert guard["status"] == "triggered", guard

        def back(lrs: dict[int, float]) -> bool:
            return HOT_LR in lrs.values() and lrs[max(lrs)] == CALM_LR

        def every_rank_back() -> bool:
            records = self.records()
            return all(back(_lr_at(records, g, r, version)) for g in range(GROUPS) for r in range(RANKS))

        poll(every_rank_back, 30, 0.2, "every rank trained with the hot lr, then the calm one again")
        return version, guard

    def restart(self, how: str) -> None:
        """Stop (``how="stop"``) or SIGKILL (``"kill"``) the lighthouse and start it again on its
        state and ports (managers find it again)."""
        old = self.lighthouse
        if how == "stop":
            assert old.stop() == 0
        else:
            old.signal(signal.SIGKILL)
            assert old.wait(10) == -signal.SIGKILL
        port = old.address.rpartition(":")[2]
        http_port = old.url.rstrip("/").rpartition(":")[2]

        def start() -> LighthouseProc | None:
            try:
                return self.procs.lighthouse(
                    config_path=self.tmp / "config.json",
                    state_dir=self.tmp / "state",
                    bind=f"127.0.0.1:{port}",
                    http_bind=f"127.0.0.1:{http_port}",
                )
            except AssertionError as exc:
                if "exited" in str(exc):
                    return None  # the port is not free yet
                raise

        self.lighthouse = poll(start, 30, 0.2, "the lighthouse on its ports again")
        wait_healthy(self.lighthouse.url)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    tmp = tmp_path_factory.mktemp("guards")
    procs = ProcessPool(tmp)
    try:
        lh = procs.lighthouse({"lr": CALM_LR}, state_dir=tmp / "state")
        managers = [procs.manager(lh.address, f"g{g}", cache_ttl=0.2) for g in range(GROUPS)]
        workers = [
            procs.worker(
                managers[g].address,
                group=f"g{g}",
                rank=r,
                steps=1_000_000,
                step_interval=0.02,
                wait=False,
                extra=["--report", "--hot-lr", "0.015"],
            )
            for g in range(GROUPS)
            for r in range(RANKS)
        ]
        wait_ready(workers)
        job = Job(procs, tmp, lh, managers, workers)
        poll(lambda: job.step() >= GUARD_STEPS, 60, 0.2, "a baseline's worth of steps")
        yield job
    finally:
        procs.stop_all()


def _lr_at(records: list[dict[str, Any]], group: int, rank: int, since: int) -> dict[int, float]:
    """The lr of each step of one rank, from the first step it got version ``since`` or newer."""
    mine = [r for r in records if (r["group"], r["rank"]) == (f"g{group}", rank)]
    first = min((r["step"] for r in mine if r["version"] >= since), default=None)
    return {} if first is None else {r["step"]: r["lr"] for r in mine if r["step"] >= first}


@pytest.mark.slow
def test_a_guarded_change_whose_loss_triples_is_rolled_back(job: Job) -> None:
    rollbacks = metric(job.lighthouse.url, "lighthouse_guard_rollbacks_total")
    version, guard = job.hot_change_rolled_back()
    assert metric(job.lighthouse.url, "lighthouse_guard_rollbacks_total") == rollbacks + 1  # the alert's
    rollback = guard["rollback_version"]
    newest = history(job.lighthouse.url)[0]
    assert newest["version"] == rollback and newest["author"] == "guard" and newest["source"] == "guard"
    comment = newest["comment"]
    assert comment.startswith(f"guard of v{version}: loss ") and "> 1.5 x " in comment, comment
    assert " at step " in comment and comment.endswith("rolled back lr"), comment
    assert newest["config"]["lr"] == CALM_LR
    first, last = guard["baseline_steps"]  # the calm loss over them (it rises with the step)
    calm = [
        known_loss(f"g{g}", r, s) for g in range(GROUPS) for r in range(RANKS) for s in range(first, last + 1)
    ]
    assert guard["baseline"] == pytest.approx(sum(calm) / len(calm), rel=0.01)


@pytest.mark.slow
def test_every_group_switches_back_at_the_same_step(job: Job) -> None:
    """The rollback is a change made now; with issue 16's step leases it takes effect at one step
    (``rollback_step``) in every group. Without them each group switches within its cache TTL, at
    whatever step it is then, and this fails."""
    version, guard = job.hot_change_rolled_back()
    assert isinstance(guard["rollback_step"], int), guard  # steps were promised: a step of its own
    records = job.records()
    back_at = set()
    for g in range(GROUPS):
        for r in range(RANKS):
            lrs = _lr_at(records, g, r, version)
            hot = [s for s, lr in lrs.items() if lr == HOT_LR]
            back_at.add(min(s for s, lr in lrs.items() if lr == CALM_LR and s > max(hot)))
    assert back_at == {guard["rollback_step"]}, f"the groups switched back at steps {sorted(back_at)}"


def test_a_guarded_change_whose_loss_stays_flat_passes(job: Job) -> None:
    job.calm(40)
    rollbacks = metric(job.lighthouse.url, "lighthouse_guard_rollbacks_total")
    version = job.set("batch_size=64", "--guard", "loss:1.5", "--guard-steps", "40")
    guard = job.decided(version)
    assert guard["status"] == "passed", guard
    assert metric(job.lighthouse.url, "lighthouse_guard_rollbacks_total") == rollbacks
    assert history(job.lighthouse.url)[0]["version"] == version  # nothing rolled back
    assert live(job.lighthouse.url)["config"]["batch_size"] == 64


@pytest.mark.slow
def test_a_cancelled_guard_does_nothing(job: Job) -> None:
    job.calm()
    at = job.ahead(100)
    version = job.set(f"lr={HOT_LR}", "--at-step", str(at), "--guard", "loss:1.5", "--guard-steps", "40")
    # A witness: a guard that cannot regress (loss x1000), from the next step through 20 steps past
    # the cancelled guard's. Once it passed, the lighthouse has judged those steps of tripled loss.
    # Made right after the change (before the cancel and the listing), so that a loaded machine's
    # slow CLI calls cannot let the job's leases run past step at + 1 first.
    witness = job.set("probe=1", "--at-step", str(at + 1), "--guard", "loss:1000", "--guard-steps", "60")
    assert job.cli("guards", "--cancel", str(version)) == f"the guard of v{version} is cancelled\n"
    listed = job.cli("guards")
    assert any(line.split()[:2] == [f"v{version}", "cancelled"] for line in listed.splitlines()), listed
    assert job.decided(witness)["status"] == "passed"
    assert job.guard(version)["status"] == "cancelled"
    assert [v["version"] for v in history(job.lighthouse.url)][:2] == [witness, version]  # no rollback
    assert live(job.lighthouse.url)["config"]["lr"] == HOT_LR
    refused = run_cli("config", "guards", "--cancel", str(version), "--url", job.lighthouse.url)
    assert refused.returncode == 1 and "cancelled already" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_guard_survives_a_lighthouse_restart(job: Job, how: str) -> None:
    job.calm()
    at = job.ahead(150)  # stored now, takes effect after the restart
    version = job.set(f"lr={HOT_LR}", "--at-step", str(at), "--guard", "loss:1.5", "--guard-steps", "60")
    job.restart(how)
    assert job.guard(version)["status"] == "active"
    guard = job.decided(version)
    assert guard["status"] == "triggered", guard
    newest = history(job.lighthouse.url)[0]
    assert newest["version"] == guard["rollback_version"] and newest["author"] == "guard"
    # A change made now: with step leases it takes effect at its step, above every step promised
    # (after a restart, above the ceiling stored for promises: possibly far ahead).
    assert newest["config"]["lr"] == CALM_LR and newest["effective_step"] == guard["rollback_step"]


def test_a_guard_is_checked_before_its_change_and_cancelled_with_a_token(tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": CALM_LR}, token="s3cret") as lh:
        auth = lh.auth()
        for query, error in (
            ("guard=loss", "METRIC:FACTOR"),
            ("guard=loss:0.5", "above 1"),
            ("guard=1loss:2", "not a metric name"),
            ("guard_steps=10", "go with guard"),
            ("guard=loss:2&guard_steps=0", "guard_steps must be >= 1"),
            ("guard=loss:2&guard_steps=5&guard_window=6", "window must be 1 to"),
        ):
            answer = lh.http("PATCH", f"/api/config?{query}", {"lr": HOT_LR}, headers=auth)
            assert answer.status == 400 and error in answer.error, (query, answer.body)
        unchanged = lh.http("PATCH", "/api/config?guard=loss:2", {"lr": CALM_LR}, headers=auth)
        assert unchanged.status == 400 and "nothing to guard" in unchanged.error
        dry = lh.http(
            "PATCH", "/api/config?guard=loss:2&guard_steps=50&dry_run=1", {"lr": HOT_LR}, headers=auth
        )
        assert dry.status == 200 and dry.json["dry_run"] and dry.json["guard"]["steps"] == 50
        assert len(history(lh.url)) == 1 and get_json(lh.url, "/api/config/guards") == {"guards": []}

        made = lh.http("PUT", "/api/config?guard=loss:1.5", {"lr": HOT_LR}, headers=auth).json
        version = made["version"]
        assert made["guard"]["changes"] == {"lr": {"before": CALM_LR, "after": HOT_LR}}
        (guard,) = get_json(lh.url, "/api/config/guards")["guards"]
        assert (guard["version"], guard["status"], guard["steps"], guard["window"]) == (
            version,
            "active",
            200,
            10,
        )
        assert lh.http("DELETE", f"/api/config/guards/{version}").status == 401
        cancelled = lh.http("DELETE", f"/api/config/guards/{version}", headers=auth)
        assert cancelled.status == 200 and cancelled.json["guard"]["status"] == "cancelled"
        assert lh.http("DELETE", f"/api/config/guards/{version}", headers=auth).status == 409
        assert lh.http("DELETE", "/api/config/guards/999", headers=auth).status == 404
        assert live(lh.url)["config"]["lr"] == HOT_LR  # cancelling a guard leaves its change


NAN_STEP = 600


@pytest.mark.slow
def test_a_nan_in_the_guarded_steps_rolls_the_change_back(procs: ProcessPool) -> None:
    """A loss that stays below any factor (x10) but is NaN at one step of one group: rolled back."""
    lh = procs.lighthouse({"lr": CALM_LR})
    managers = [procs.manager(lh.address, f"g{g}", cache_ttl=0.2) for g in range(GROUPS)]
    for g, manager in enumerate(managers):
        nan = ["--nan-at", str(NAN_STEP)] if g == 1 else []
        procs.worker(
            manager.address,
            group=f"g{g}",
            rank=0,
            steps=1_000_000,
            step_interval=0.01,
            extra=["--report", *nan],
        )
    poll(lambda: live(lh.url)["current_step"] >= 50, 60, 0.2, "a baseline's worth of steps")
    made = run_cli(
        "config", "set", "batch_size=64", "--guard", "loss:10", "--guard-steps", "1000", "--url", lh.url
    )
    assert made.returncode == 0, made.stderr
    version = int(made.stdout.split()[1])
    active = next(g for g in get_json(lh.url, "/api/config/guards")["guards"] if g["version"] == version)
    assert active["effective_step"] < NAN_STEP, active  # the NaN falls in the guarded steps
    guard = poll(
        lambda: (g := get_json(lh.url, "/api/config/guards")["guards"][0])["status"] != "active" and g,
        DECIDED,
        0.2,
        "the guard decided",
    )
    assert (guard["version"], guard["status"]) == (version, "triggered"), guard
    assert guard["reason"] == f"loss was not finite (NaN or inf) in group g1 at step {NAN_STEP}", guard
    newest = history(lh.url)[0]
    assert (newest["version"], newest["author"]) == (guard["rollback_version"], "guard")
    assert newest["config"] == {"lr": CALM_LR}  # batch_size, which it added, is gone again


LAPSE_SECONDS = 3.0


def test_a_guard_on_a_metric_nobody_reports_lapses_and_its_change_stays(procs: ProcessPool) -> None:
    """A guard on ``val_loss`` (the workers report only ``loss``) cannot be judged: once the job has
    stood past its last step for ``--guard-lapse-seconds`` it is decided ``lapsed`` (no longer active,
    so dropped with its version like any decided guard) and its change stays; a guard on ``loss``
    beside it passes as before."""
    lh = procs.lighthouse({"lr": CALM_LR}, extra=["--guard-lapse-seconds", str(LAPSE_SECONDS)])
    manager = procs.manager(lh.address, "g0", cache_ttl=0.2)
    procs.worker(manager.address, group="g0", rank=0, steps=1_000_000, step_interval=0.01, extra=["--report"])
    poll(lambda: live(lh.url)["current_step"] >= 30, 60, 0.2, "a baseline's worth of steps")

    def guarded(key_value: str, guard: str) -> int:
        made = run_cli("config", "set", key_value, "--guard", guard, "--guard-steps", "20", "--url", lh.url)
        assert made.returncode == 0, made.stderr
        return int(made.stdout.split()[1])

    unjudged = guarded(f"lr={HOT_LR}", "val_loss:1.5")
    judged = guarded("batch_size=64", "loss:10")

    def decided(version: int) -> dict[str, Any]:
        guards = get_json(lh.url, "/api/config/guards")["guards"]
        return next(g for g in guards if g["version"] == version and g["status"] != "active")

    lapsed = poll(lambda: _or_none(lambda: decided(unjudged)), DECIDED, 0.2, "the val_loss guard decided")
    last = lapsed["effective_step"] + lapsed["steps"]
    assert lapsed["status"] == "lapsed", lapsed
    assert lapsed["reason"].startswith(f"not judged: val_loss never reported, not through step {last}"), (
        lapsed
    )
    assert lapsed["rollback_version"] is None
    # It waited the lapse after the job passed its last step (which took 20+ steps after it was made).
    assert lapsed["decided_at"] - lapsed["created_at"] >= LAPSE_SECONDS, lapsed
    assert live(lh.url)["config"]["lr"] == HOT_LR  # not rolled back
    assert all(row["author"] != "guard" for row in history(lh.url))
    assert decided(judged)["status"] == "passed"
    refused = call(lh.url, "DELETE", f"/api/config/guards/{unjudged}")
    assert refused.status == 409 and "lapsed already" in refused.error  # decided: nothing to cancel
    listed = run_cli("config", "guards", "--url", lh.url)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(f"v{unjudged} "))
    assert "lapsed" in row and "val_loss never reported" in row, listed.stdout


def _or_none(read: Any) -> Any:
    """``read()``, or None while it raises StopIteration (not there yet)."""
    try:
        return read()
    except StopIteration:
        return None
