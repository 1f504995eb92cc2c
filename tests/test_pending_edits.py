"""Issue 36: a version names one config in the admin API, and ``If-Match`` compares against what
the client read, so an edit of what ``GET /api/config`` shows never drops a pending change.

``GET /api/config`` answers the latest ``version`` with that version's ``config`` (every change up
to it applied, pending ones too: the history's config of that version, ``at-step/N`` from
``from_step`` on), and the live pair apart (``live_version``/``live``: what the groups get at the
job's step). The tests run a real lighthouse, manager and stepping worker; the worker is stopped
(SIGSTOP) while a change made now is pending, so it stays pending however slow the machine is.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lighthouse.config.values import encode_config
from lighthouse.jobs.guards import GuardSpec, JobGuards
from lighthouse.jobs.leases import LeaseBook, LeasePolicy
from lighthouse.jobs.state import LighthouseState
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.sqlite import SqliteBackend
from protos.limits import FOREVER
from tests.helpers_lighthouse import LighthouseProc, start_lighthouse
from tests.http_util import call, get_json, history, live, wait_healthy
from tests.procs import Proc, ProcessPool, last_record, manager_cli, poll, records_so_far

FAR = 1_000_000  # a step the job does not reach during a test: a change scheduled there stays pending
# The managers' cache TTL: a run ends 2 x TTL + 0.5 s after its last step, so the stopped worker
# keeps the run (and its leases, which keep the change made now pending) for 10.5 s at least.
TTL = 5.0


def at_step(url: str, step: int, prefix: str = "api/config") -> dict[str, Any]:
    result: dict[str, Any] = get_json(url, f"{prefix}/at-step/{step}")
    return result


def stepping_job(procs: ProcessPool, config: dict[str, Any]) -> tuple[LighthouseProc, str, Proc]:
    """A lighthouse, one group's manager and a rank stepping until its groups hold a lease ahead
    of the job's step (a change made now is then pending until the job passes the lease)."""
    lh = procs.lighthouse(config)
    wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=TTL)
    worker = procs.worker(m.address, group="g0", rank=0, steps=100_000, step_interval=0.01)

    def leased() -> bool:
        view = live(lh.url)
        return bool(view["lease_horizon"] > view["current_step"] >= 0)

    poll(leased, 20, what="a step lease ahead of the job's step")
    return lh, m.address, worker


def change(url: str, method: str, body: dict[str, Any], path: str = "api/config", **headers: str) -> Any:
    res = call(url, method, path, body, headers=headers)
    assert res.status == 200, res.body
    return res.json


@pytest.mark.slow
def test_an_edit_of_what_get_shows_keeps_a_pending_change_made_now(procs: ProcessPool) -> None:
    lh, _, worker = stepping_job(procs, {"lr": 0.1, "bs": 32})
    worker.signal(signal.SIGSTOP)  # the job's step holds still: the change made now stays pending
    try:
        made = change(lh.url, "PATCH", {"wd": 0.01})
        at = made["effective_step"]
        view = live(lh.url)
        run = view["run"]
        assert isinstance(at, int) and at > view["current_step"] and run is not None, (made, view)
        # What the client reads: version 2 and its config, the pending change's key in it.
        assert (view["version"], view["from_step"]) == (made["version"], at), view
        assert view["config"] == {"lr": 0.1, "bs": 32, "wd": 0.01}, view
        assert (view["live_version"], view["live"]) == (1, {"lr": 0.1, "bs": 32}), view

        # It edits that config and puts it back, If-Match the version it read: accepted, the
        # change made now kept (the put takes effect at or after its step, on top of it).
        edited = {**view["config"], "bs": 64}
        put = change(lh.url, "PUT", edited, **{"If-Match": str(view["version"])})
        put_at = put["effective_step"]
        assert isinstance(put_at, int) and put_at >= at, (put, at)
        assert (put["version"], put["config"], put["from_step"]) == (view["version"] + 1, edited, put_at)
        assert (put["live_version"], put["live"]) == (1, {"lr": 0.1, "bs": 32}), put
        # Stale now: the same edit If-Match the version before is refused and stores nothing.
        stale = call(lh.url, "PUT", "api/config", edited, headers={"If-Match": str(view["version"])})
        assert stale.status == 409 and stale.json["version"] == put["version"], stale.body

        assert at_step(lh.url, at - 1)["config"] == {"lr": 0.1, "bs": 32}
        assert at_step(lh.url, at)["config"]["wd"] == 0.01
        assert at_step(lh.url, put_at)["config"] == edited
        assert at_step(lh.url, FAR)["config"] == edited
        view = live(lh.url)
        assert (view["version"], view["config"], view["from_step"]) == (put["version"], edited, put_at)
        assert view["current_step"] < at and view["run"] == run, "all of the above was read while pending"
    finally:
        worker.signal(signal.SIGCONT)

    # What the rank trained: the pending change from its step on, the edit from the put's.
    poll(lambda: last_record(worker)["step"] > put_at + 3, 30, what=f"the rank past step {put_at}")
    worker.stop()
    records = records_so_far(worker)
    assert {r["config"].get("wd") for r in records if r["step"] < at} == {None}
    assert {r["config"].get("wd") for r in records if r["step"] >= at} == {"0.01"}
    assert {r["config"]["bs"] for r in records if r["step"] >= put_at} == {"64"}
    assert {r["config"]["bs"] for r in records if r["step"] < put_at} == {"32"}


@pytest.mark.slow
def test_the_version_config_pair_is_the_historys_and_the_live_pair_what_the_manager_serves(
    procs: ProcessPool,
) -> None:
    lh, manager, worker = stepping_job(procs, {"lr": 0.1, "name": "run-1"})
    worker.signal(signal.SIGSTOP)
    try:
        made_now = change(lh.url, "PATCH", {"name": "run-2"})
        ahead = change(lh.url, "PATCH", {"lr": 0.5}, path=f"api/config?effective_step={FAR}")
        views = [live(lh.url), get_json(lh.url, "api/jobs/default/config")]
        assert views[0]["current_step"] < made_now["effective_step"], "the change made now is pending"
    finally:
        worker.signal(signal.SIGCONT)
    pair = ("version", "config", "from_step", "live_version", "live")
    assert [views[0][k] for k in pair] == [views[1][k] for k in pair]  # both routes answer the same
    view = views[0]
    head = view["version"]
    assert (head, view["from_step"]) == (ahead["version"], FAR)
    assert view["config"] == {"lr": 0.5, "name": "run-2"}
    (entry,) = [v for v in history(lh.url) if v["version"] == head]
    assert entry["config"] == view["config"]  # the history shows that version with that config
    for step in (FAR, FAR + 1):
        shown = at_step(lh.url, step)
        assert (shown["version"], shown["config"]) == (head, view["config"]), shown
    assert at_step(lh.url, FAR - 1)["config"] == {"lr": 0.1, "name": "run-2"}  # from_step is the first
    # The answer of each change names its version and that version's config, the live pair apart.
    for answer in (made_now, ahead):
        (made,) = [v for v in history(lh.url) if v["version"] == answer["version"]]
        assert answer["config"] == made["config"], answer
        assert (answer["live_version"], answer["live"]) == (1, {"lr": 0.1, "name": "run-1"}), answer
    assert (made_now["from_step"], ahead["from_step"]) == (made_now["effective_step"], FAR)

    # The live pair is what the manager serves at the job's step.
    step = view["current_step"]
    assert (view["live_version"], view["live"]) == (1, {"lr": 0.1, "name": "run-1"})
    assert at_step(lh.url, step)["config"] == view["live"]
    done = manager_cli("get", "--addr", manager, "--step", str(step), "-o", "json")
    assert done.returncode == 0, done.stderr
    served = json.loads(done.stdout)
    assert (served["version"], served["config"]) == (view["live_version"], encode_config(view["live"]))
    # The rank asked for that step (the job's step is the highest one a manager was asked for).
    (trained,) = poll(lambda: [r for r in records_so_far(worker) if r["step"] == step], 20, what="its record")
    assert (trained["version"], trained["config"]) == (view["live_version"], encode_config(view["live"]))


@pytest.fixture
def idle(tmp_path: Path) -> Iterator[LighthouseProc]:
    """A lighthouse without managers: a change made now applies at once."""
    with start_lighthouse(tmp_path, config={"lr": 0.1, "bs": 32, "name": "run-1"}) as proc:
        yield proc
        assert "Traceback" not in proc.log()


def test_an_edit_that_a_change_scheduled_ahead_would_undo_is_refused_and_says_how_to_make_it(
    idle: LighthouseProc,
) -> None:
    url = idle.url
    ahead = change(url, "PATCH", {"lr": 0.5}, path=f"api/config?effective_step={FAR}")
    view = live(url)
    version, read = view["version"], view["config"]
    assert (version, read, view["from_step"]) == (
        ahead["version"],
        {"lr": 0.5, "bs": 32, "name": "run-1"},
        FAR,
    )
    if_match = {"If-Match": str(version)}

    # A put of the edited config now would apply lr=0.5 before step FAR: refused, nothing stored.
    put = call(url, "PUT", "api/config", {**read, "bs": 64}, headers=if_match)
    assert put.status == 409, put.body
    assert put.json["pending"] == [{"version": version, "effective_step": FAR}], put.json
    assert put.json["earliest_step"] == FAR and f"?effective_step={FAR}" in put.error, put.json
    # A patch of a key the pending change sets too: from its step on it would override the edit.
    patch = call(url, "PATCH", "api/config", {"lr": 0.3}, headers=if_match)
    assert patch.status == 409 and "sets lr too" in patch.error, patch.body
    # The dry run says the same.
    dry = call(url, "PATCH", "api/config?dry_run=1", {"lr": 0.3}, headers=if_match)
    assert dry.status == 409 and dry.json["pending"] == patch.json["pending"], dry.body
    assert live(url)["version"] == version and len(history(url)) == 2

    # What the answer says to do is accepted: a patch of other keys now, the put at FAR.
    bs = change(url, "PATCH", {"bs": 64}, **if_match)
    assert at_step(url, FAR - 1)["config"] == {"lr": 0.1, "bs": 64, "name": "run-1"}
    assert at_step(url, FAR)["config"] == bs["config"] == {"lr": 0.5, "bs": 64, "name": "run-1"}
    later = change(
        url,
        "PUT",
        {**bs["config"], "name": "run-2"},
        f"api/config?effective_step={FAR}",
        **{"If-Match": str(bs["version"])},
    )
    assert at_step(url, FAR - 1)["config"] == {"lr": 0.1, "bs": 64, "name": "run-1"}
    assert at_step(url, FAR)["config"] == later["config"] == {"lr": 0.5, "bs": 64, "name": "run-2"}
    # Without If-Match a put is a blind write: stored as sent, the changes scheduled still land on
    # top at their step (the put at FAR replaces it there).
    blind = change(url, "PUT", {"bs": 16})
    assert blind["effective_step"] is None and blind["live"] == {"bs": 16}
    assert at_step(url, FAR)["config"] == blind["config"] == later["config"]


def test_a_guards_rollback_keeps_a_pending_change_made_now() -> None:
    """The guard's rollback is a put made now, If-Match the head: it is made from the config at the
    step it takes effect at, the pending change made now in it, not from the live config (where
    that change is not yet, and the guarded one neither: the rollback found nothing to revert)."""

    def store_ceiling(book: LeaseBook[Any]) -> None:  # at once (the lighthouse does it in a thread)
        wanted = book.wanted
        state.store.save_lease_ceiling(wanted, book.served_version)
        book.ceiling_stored(wanted)

    policy = LeasePolicy(min_steps=4, extra_steps=2)
    state = LighthouseState(ConfigStore(SqliteBackend(), request_ceiling=store_ceiling, lease_policy=policy))
    state.change("put", {"lr": 0.1, "bs": 32}, source="t")
    state.store.advance_step(10)
    assert state.store.leases.grant(10, 1.0)[1] > 10  # a group holds a lease past the job's step
    guarded = state.change("patch", {"lr": 0.5}, source="t")  # made now: pending above the lease
    guard = state.guards.add(JobGuards.draft(guarded, GuardSpec.parse("loss:1.5"), "t"))
    pending = state.change("patch", {"wd": 0.01}, source="t")
    assert state.store.live() == {"lr": 0.1, "bs": 32}  # neither is live yet
    state.guards._roll_back(guard, "loss rose")
    (decided,) = state.guards.list()
    assert (decided["status"], decided["rollback_version"]) == ("triggered", pending.version + 1), decided
    back = state.store.get(pending.version + 1)
    assert back.effective_step is not None and pending.row.effective_step is not None
    assert back.effective_step >= pending.row.effective_step
    assert state.store.resolve(back.version, FOREVER) == {"lr": 0.1, "bs": 32, "wd": 0.01}
