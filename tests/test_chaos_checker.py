"""The chaos checker on small planted histories: a clean one passes, each planted violation is caught.

The histories are written by hand from the rules the checker states (docs/invariants.md): a job
at config v1 ``{"lr": 0.1, "mark": "init"}``; v2 a change made now at step 10 (``lr`` 0.2); v3
scheduled at step 20 (``mark`` "s"); two groups of one rank stepping 0..29 once a second from
t=100. Each test plants one fault and asserts the checker names the invariant, and only it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.chaos import checker
from tests.chaos.checker import History, Model

T0 = 100.0


def row(
    version: int,
    op: str,
    change: dict[str, Any],
    effective: int | None,
    order: int,
    made_now: bool,
    at: float,
) -> dict[str, Any]:
    return {
        "version": version,
        "op": op,
        "change": change,
        "effective_step": effective,
        "order_step": order,
        "made_now": made_now,
        "created_at": at,
    }


ROWS = [
    row(1, "put", {"lr": 0.1, "mark": "init"}, None, -1, False, 50.0),
    row(2, "patch", {"lr": 0.2}, 10, 10, True, T0 + 5.5),
    row(3, "patch", {"mark": "s"}, 20, 20, False, T0 + 6.5),
]
RUN1 = {
    "number": 1,
    "start_step": 0,
    "started_at": T0 - 0.5,
    "base_version": 1,
    "run_id": "inc1",
    "ended_at": None,
    "end_version": 0,
    "live": True,
}


def served(config: dict[str, Any]) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}


def expected_at(step: int) -> dict[str, Any]:
    config: dict[str, Any] = {"lr": 0.1, "mark": "init"}
    if step >= 10:
        config["lr"] = 0.2
    if step >= 20:
        config["mark"] = "s"
    return config


def version_at(step: int) -> int:
    return 3 if step >= 20 else 2 if step >= 10 else 1


def clean() -> History:
    h = History(seed=7)
    for group in ("g0", "g1"):
        for step in range(30):
            h.records.append(
                {
                    "inc": 1,
                    "group": group,
                    "rank": 0,
                    "step": step,
                    "version": version_at(step),
                    "source": "cache",
                    "config": served(expected_at(step)),
                    "t": T0 + step + 0.1,
                }
            )
    ack2 = {"version": 2, "op": "patch", "effective_step": 10, "scheduled": False}
    ack3 = {"version": 3, "op": "patch", "effective_step": 20, "scheduled": True}
    h.ops = [
        {
            "n": 1,
            "kind": "patch",
            "status": 200,
            "sent": T0 + 5.4,
            "answered": T0 + 5.6,
            "answer": ack2,
            "request": {"method": "PATCH", "body": {"lr": 0.2}},
        },
        {
            "n": 2,
            "kind": "scheduled",
            "status": 200,
            "sent": T0 + 6.4,
            "answered": T0 + 6.6,
            "answer": ack3,
            "request": {"method": "PATCH", "body": {"mark": "s"}, "effective_step": 20},
        },
    ]
    h.lighthouses = {
        "lighthouse0": {"versions": copy.deepcopy(ROWS), "runs": [dict(RUN1)]},
        "lighthouse1": {"versions": copy.deepcopy(ROWS), "runs": [dict(RUN1)]},
    }
    # The final change: v3 (acknowledged at T0 + 6.6, in effect from step 20), as the checker
    # reads it from T0 + 25 on: every rank trains it (or a later one) at once.
    h.final = {
        "acked": T0 + 25,
        "bound": 15.0,
        "answer": {"version": 3},
        "reached": {"g0-0": None, "g1-0": None},
    }
    return h


def invariants(h: History) -> list[str]:
    return [v.invariant for v in checker.check(h)]


def record(h: History, group: str, step: int) -> dict[str, Any]:
    return next(r for r in h.records if r["group"] == group and r["step"] == step)


def test_the_clean_history_passes() -> None:
    assert checker.check(clean()) == []


def test_a_split_step_is_caught() -> None:
    h = clean()
    r = record(h, "g1", 12)
    r["config"] = served({"lr": 0.1, "mark": "init"})  # g1 still on v1 at step 12, g0 on v2
    r["version"] = 1
    found = checker.check(h)
    assert {v.invariant for v in found} >= {"split", "effective"}
    split = next(v for v in found if v.invariant == "split")
    assert (split.inc, split.step, split.seed) == (1, 12, 7)
    assert "seed 7: split: incarnation 1 step 12" in str(split)


def test_a_fallback_is_not_a_split_while_a_fault_explains_it() -> None:
    h = clean()
    r = record(h, "g1", 12)
    r.update({"config": {}, "version": 0, "source": "fallback"})
    assert invariants(h) == ["fallback"]  # no fault explains it
    h.faults = [{"kind": "manager_kill", "target": "manager-g1", "start": T0 + 11, "end": T0 + 11.5}]
    assert invariants(h) == []
    h.faults[0].update({"start": T0 + 1, "end": T0 + 2})  # healed 10 s before: no longer explains it
    assert invariants(h) == ["fallback"]
    h.faults = [{"kind": "manager_kill", "target": "manager-g0", "start": T0 + 11, "end": T0 + 11.5}]
    assert invariants(h) == ["fallback"]  # another group's manager: no excuse
    h.faults = [{"kind": "etcd_leader_kill", "target": "etcd-m0", "start": T0 + 11, "end": T0 + 11.5}]
    assert invariants(h) == ["fallback"]  # the lighthouses serve through an election
    h.faults = [{"kind": "lighthouse_stop", "target": "lighthouse0", "start": T0 + 11, "end": T0 + 11.5}]
    assert invariants(h) == []
    # A job restart explains its new incarnation's first steps for a moment only.
    r["inc"] = 2
    run2 = {"number": 2, "start_step": 12, "started_at": T0 + 11.6, "base_version": 3, "run_id": "inc2"}
    for lh in h.lighthouses.values():
        lh["runs"] = [dict(RUN1, ended_at=T0 + 11.55, end_version=3, live=False), dict(run2, live=True)]
    h.faults = [{"kind": "job_resume", "start": T0 + 10, "end": T0 + 11.5, "incarnation": 2}]
    assert invariants(h) == []
    h.faults[0]["incarnation"] = 3  # another incarnation's restart
    assert "fallback" in invariants(h)
    h.faults[0].update({"incarnation": 2, "start": T0 + 9, "end": T0 + 10})  # 2.1 s after it: too late
    assert invariants(h) == ["fallback"]
    # An operator's run end, answered a moment before: the next run's first lease waits for its record.
    h.ops.append(
        {
            "n": 9,
            "kind": "run_end",
            "status": 200,
            "sent": T0 + 11.4,
            "answered": T0 + 11.5,
            "answer": {"ended": {}},
            "request": {},
        }
    )
    assert "fallback" not in invariants(h)
    h.ops[-1]["status"] = 409  # refused: no run ended, nothing explains it
    assert "fallback" in invariants(h)


def test_a_change_served_before_its_effective_step_is_caught() -> None:
    h = clean()
    for group in ("g0", "g1"):  # both groups alike: not a split, but early
        r = record(h, group, 9)
        r["config"] = served(expected_at(10))
        r["version"] = 2
    found = checker.check(h)
    assert [v.invariant for v in found] == ["effective", "effective"]
    assert {v.group for v in found} == {"g0", "g1"} and {v.step for v in found} == {9}


def test_a_change_missing_from_its_effective_step_on_is_caught() -> None:
    h = clean()
    for r in h.records:
        if r["group"] == "g0" and r["step"] >= 20:
            r["config"] = served(expected_at(19))
            r["version"] = 2
    found = checker.check(h)
    assert "effective" in {v.invariant for v in found}
    assert min(v.step for v in found if v.invariant == "effective") == 20


def test_a_cancelled_change_must_not_be_served() -> None:
    h = clean()
    cancel = row(4, "cancel", {"version": 3}, None, 7, False, T0 + 7.5)
    for lh in h.lighthouses.values():
        lh["versions"].append(dict(cancel))
    assert "effective" in invariants(h)  # records still show v3's mark from step 20
    for r in h.records:
        if r["step"] >= 20:
            r["config"] = served(expected_at(19))
    assert invariants(h) == []


def test_an_acknowledged_change_missing_from_a_lighthouse_is_caught() -> None:
    h = clean()
    h.lighthouses["lighthouse1"]["versions"] = h.lighthouses["lighthouse1"]["versions"][:2]
    found = checker.check(h)
    assert {v.invariant for v in found} == {"lost"}
    assert any("missing on lighthouse1" in v.detail for v in found)


def test_an_acknowledgement_that_differs_from_the_stored_change_is_caught() -> None:
    h = clean()
    h.ops[1]["answer"] = dict(h.ops[1]["answer"], effective_step=25)
    found = checker.check(h)
    assert {v.invariant for v in found} == {"lost"} and "effective_step 20 != 25" in found[0].detail


def test_a_refused_change_that_was_stored_anyway_is_caught() -> None:
    h = clean()
    h.ops.append(
        {
            "n": 3,
            "kind": "patch_if_match",
            "status": 412,
            "sent": T0 + 8,
            "answered": T0 + 8.1,
            "answer": {"error": "x"},
            "request": {"method": "PATCH", "body": {"mark": "op3"}, "if_match": 2},
        }
    )
    assert invariants(h) == []
    for lh in h.lighthouses.values():
        lh["versions"].append(row(4, "patch", {"mark": "op3"}, 40, 40, True, T0 + 8.05))
    assert set(invariants(h)) == {"lost"}


def test_a_version_naming_two_configs_is_caught() -> None:
    h = clean()
    for group in ("g0", "g1"):
        h.records.append(
            {
                "inc": 2,
                "group": group,
                "rank": 0,
                "step": 25,
                "version": 3,
                "source": "cache",
                "config": served({"lr": 0.3}),
                "t": T0 + 40,
            }
        )
    assert "version" in invariants(h)


def test_acknowledged_order_that_is_not_effective_order_is_caught() -> None:
    h = clean()
    later = {"version": 4, "op": "patch", "effective_step": 8, "scheduled": False}
    h.ops.append(
        {
            "n": 3,
            "kind": "patch",
            "status": 200,
            "sent": T0 + 7,
            "answered": T0 + 7.1,
            "answer": later,
            "request": {"method": "PATCH", "body": {"sync_every": 3}},
        }
    )
    for lh in h.lighthouses.values():
        lh["versions"].append(row(4, "patch", {"sync_every": 3}, 8, 8, True, T0 + 7.05))
    found = checker.check(h)
    order = [v for v in found if v.invariant == "order"]
    assert len(order) == 1 and "before op1" in order[0].detail


def test_a_resumed_job_whose_run_misses_an_acknowledged_change_is_caught() -> None:
    h = clean()
    h.faults = [{"kind": "job_resume", "start": T0 + 30, "end": T0 + 31, "incarnation": 2, "resumed_at": 5}]
    run2 = {
        "number": 2,
        "start_step": 5,
        "started_at": T0 + 31,
        "base_version": 3,
        "run_id": "inc2",
        "ended_at": None,
        "end_version": 0,
        "live": True,
    }
    ended = dict(RUN1, ended_at=T0 + 30.5, end_version=3, live=False)
    for lh in h.lighthouses.values():
        lh["runs"] = [ended, run2]
    assert invariants(h) == []
    run2["base_version"] = 2  # the new run began before v3 was part of it
    assert invariants(h) == ["resume"]
    for lh in h.lighthouses.values():
        lh["runs"] = [ended]  # no run at all for the resumed job
    assert invariants(h) == ["resume"]


def test_a_resumed_run_trains_changes_made_now_from_its_first_step() -> None:
    """v2 and v4, made now and promised to run 1 at steps 10 and 40, hold at every step of run 2
    (rebased); v3, scheduled at step 20, keeps its step."""
    h = clean()
    v4 = row(4, "patch", {"sync_every": 9}, 40, 40, True, T0 + 29.5)
    end = row(5, "patch", {}, None, -1, False, T0 + 30.6)  # the run's end commits a version
    ended = dict(RUN1, ended_at=T0 + 30.5, end_version=4, live=False)
    run2 = {
        "number": 2,
        "start_step": 5,
        "started_at": T0 + 31,
        "base_version": 5,
        "run_id": "inc2",
        "ended_at": None,
        "end_version": 0,
        "live": True,
    }
    for lh in h.lighthouses.values():
        lh["versions"] += [dict(v4), dict(end)]
        lh["runs"] = [ended, run2]
    resumed = [
        {
            "inc": 2,
            "group": g,
            "rank": 0,
            "step": s,
            "version": 5,
            "source": "cache",
            "config": served({"lr": 0.2, "mark": "init", "sync_every": 9}),
            "t": T0 + 31 + s,
        }
        for g in ("g0", "g1")
        for s in range(5, 8)
    ]
    h.records += resumed
    assert invariants(h) == []
    for r in resumed:
        r["config"] = served(expected_at(r["step"]))  # trained without the change the operator made
    assert set(invariants(h)) == {"effective"}


def test_liveness_is_caught() -> None:
    h = clean()
    h.final["acked"] = T0 + 29.5  # after every record: no rank trained it
    assert invariants(h) == ["liveness", "liveness"]
    for group in ("g0", "g1"):  # trained, but 16 s after its acknowledgement
        h.records.append(dict(record(h, group, 29), step=45, t=T0 + 29.5 + 16))
    assert invariants(h) == ["liveness", "liveness"]
    for group in ("g0", "g1"):  # within the bound
        h.records.append(dict(record(h, group, 29), step=31, t=T0 + 31))
    assert invariants(h) == []


def test_served_values_compare_as_json() -> None:
    assert checker.served_equal({"a": "1", "b": "x", "c": "[1,2]"}, {"a": 1, "b": "x", "c": [1, 2]})
    assert not checker.served_equal({"a": "1.0"}, {"a": 1})  # a float is not the int
    assert not checker.served_equal({"a": "1"}, {"a": "1", "b": 2})
    assert not checker.served_equal({"b": '"x"'}, {"b": "x"})


def test_the_model_replays_scheduled_changes_over_later_ones_by_order_step() -> None:
    """A change scheduled at 20 lands on what is live there; one made now at step 25 overrides it."""
    rows = [*ROWS, row(4, "patch", {"mark": "late"}, 30, 25, True, T0 + 26)]
    model = Model(rows, [RUN1])
    assert model.config(3, 29) == {"lr": 0.2, "mark": "s"}
    assert model.config(4, 29) == {"lr": 0.2, "mark": "s"}
    assert model.config(4, 30) == {"lr": 0.2, "mark": "late"}
    early = [*ROWS, row(4, "patch", {"mark": "early"}, 30, 15, True, T0 + 26)]  # made before step 20
    assert Model(early, [RUN1]).config(4, 30) == {"lr": 0.2, "mark": "s"}


def test_load_reads_a_run_folder(tmp_path: Path) -> None:
    h = clean()
    (tmp_path / "plan.json").write_text(json.dumps({"seed": 7}))
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "g0-0.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in h.records) + '{"inc": 1, "gro'  # killed mid-line
    )
    (tmp_path / "ops.jsonl").write_text("".join(json.dumps(o) + "\n" for o in h.ops))
    (tmp_path / "histories").mkdir()
    for name, body in h.lighthouses.items():
        (tmp_path / "histories" / f"{name}.json").write_text(json.dumps(body))
    (tmp_path / "final.json").write_text(json.dumps(h.final))
    loaded = checker.load(tmp_path)
    assert len(loaded.records) == len(h.records) and loaded.seed == 7
    assert checker.check(loaded) == []
    (tmp_path / "final.json").unlink()
    assert invariants(checker.load(tmp_path)) == ["liveness"]


@pytest.mark.parametrize("invariant", [f.__name__ for f in checker.INVARIANTS])
def test_every_invariant_has_a_planted_case(invariant: str) -> None:
    """A new invariant in the checker gets its planted history here."""
    covered = {
        "split_steps": test_a_split_step_is_caught,
        "effective_steps": test_a_change_served_before_its_effective_step_is_caught,
        "acknowledged_in_history": test_an_acknowledged_change_missing_from_a_lighthouse_is_caught,
        "versions_name_one_config": test_a_version_naming_two_configs_is_caught,
        "acknowledged_order": test_acknowledged_order_that_is_not_effective_order_is_caught,
        "resumed_runs": test_a_resumed_job_whose_run_misses_an_acknowledged_change_is_caught,
        "unexplained_fallbacks": test_a_fallback_is_not_a_split_while_a_fault_explains_it,
        "liveness": test_liveness_is_caught,
    }
    assert invariant in covered


def test_a_split_across_an_operators_run_end_is_not_promised() -> None:
    """Ending a live run ends its leases: a group behind the others may then train the config as
    the operator left it at steps the others trained before (docs/invariants.md says so)."""
    h = clean()
    for r in h.records:
        if r["group"] == "g1" and r["step"] == 12:
            r["t"] = T0 + 14
            r["config"] = served({"lr": 0.3})
    assert "split" in invariants(h)
    h.ops.append(
        {
            "n": 3,
            "kind": "run_end",
            "status": 200,
            "sent": T0 + 13,
            "answered": T0 + 13.1,
            "answer": {"ended": {"end_version": 2}},
            "request": {"method": "POST"},
        }
    )
    record(h, "g1", 12)["version"] = 4  # served after the run's end and its version
    assert "split" not in invariants(h)
    # The next run's head may be a version up to the ended run's last (a change made now, pending
    # at the end, applies at once): seed 23194112, a stopped group's steps 298-389 on v5, end v6.
    h.ops[-1]["answer"]["ended"]["end_version"] = 5
    assert "split" not in invariants(h)
    # Past the steps the job reached while the ended run's leases could last: still a split.
    late = record(h, "g1", 25)
    late["config"], late["version"] = served({"lr": 0.3}), 4
    assert [(v.invariant, v.step) for v in checker.check(h) if v.invariant == "split"] == [("split", 25)]
    h.ops[-1]["status"] = 409  # refused: no run ended
    assert [v.step for v in checker.check(h) if v.invariant == "split"] == [12, 25]


def test_steps_served_between_runs_may_have_the_ended_run_s_config_or_the_latest() -> None:
    """Once a run ended and before the next begins, a step promised to the ended run keeps its
    config and any other gets the latest (no run is live: a change applies at once); a config that
    is neither is still caught."""
    h = clean()
    ended = dict(RUN1, ended_at=T0 + 29.5, end_version=3, live=False)
    now = row(4, "patch", {"lr": 0.5}, None, -1, False, T0 + 29.6)  # made at once between runs
    for lh in h.lighthouses.values():
        lh["versions"].append(dict(now))
        lh["runs"] = [ended]
    late = [
        {
            "inc": 1,
            "group": "g0",
            "rank": 0,
            "step": 30,
            "version": 3,
            "source": "cache",
            "config": served(expected_at(30)),
            "t": T0 + 30.1,
        },
        {
            "inc": 1,
            "group": "g1",
            "rank": 0,
            "step": 31,
            "version": 4,
            "source": "cache",
            "config": served(expected_at(31) | {"lr": 0.5}),
            "t": T0 + 31.1,
        },
    ]
    h.records += late
    assert invariants(h) == []
    late[1]["config"] = served({"lr": 0.7})
    assert invariants(h) == ["effective"]


def test_while_an_old_release_is_on_the_prefix_groups_may_lag_a_ttl_but_ranks_agree() -> None:
    """A lighthouse of the release before step leases on the prefix: no lease is granted, and each
    group serves by its TTL, so groups may differ at a step and serve a state up to ``MIXED_STALE``
    old (since the old release came); an older state is still caught, the ranks of a group still
    agree, and the window ends once the old one can no longer be seen."""
    h = clean()
    for lh in h.lighthouses.values():  # v2 and v3 committed 2 s before step 10 was served
        lh["versions"][1]["created_at"] = T0 + 8.0
        lh["versions"][2]["created_at"] = T0 + 8.5
    lag = record(h, "g1", 10)  # g1 still on v1 at step 10, g0 on v2
    lag["config"], lag["version"] = served({"lr": 0.1, "mark": "init"}), 1
    fallback = record(h, "g0", 11)
    fallback.update({"config": {}, "version": 0, "source": "fallback"})
    assert sorted(set(invariants(h))) == ["effective", "fallback", "split"]
    h.faults = [
        {"kind": checker.MIXED, "target": "lighthouse0-old-release-g1", "start": T0 + 7.9, "end": T0 + 9.5}
    ]
    assert invariants(h) == []
    # v1's config at step 14, 6 s after v2 came (seeds 1910554750 and 7622960 before the fix): caught.
    stale = record(h, "g1", 14)
    stale["config"], stale["version"] = served({"lr": 0.1, "mark": "init"}), 1
    assert invariants(h) == ["effective"]
    # The old one came after v3: v1 was no state of the job since, caught at step 10 too.
    stale["config"], stale["version"] = served(expected_at(14)), version_at(14)
    h.faults[0]["start"] = T0 + 8.6
    assert sorted(set(invariants(h))) == ["effective"]
    h.faults[0]["start"] = T0 + 7.9
    # Two ranks of one group apart at a step: caught, old release or not.
    h.records.append(dict(record(h, "g0", 10), group="g1", rank=1))
    h.final["reached"]["g1-1"] = None
    assert [(v.invariant, v.step) for v in checker.check(h) if v.invariant != "liveness"] == [("split", 10)]
    h.records.pop()
    del h.final["reached"]["g1-1"]
    # Served after the old one could still be seen (its etcd lease and the TTLs after): caught.
    h.faults[0].update({"start": T0 - 20, "end": T0 - 19})
    assert sorted(set(invariants(h))) == ["effective", "fallback", "split"]


def test_an_etcd_leader_elected_while_the_old_release_s_record_lives_keeps_it_seen() -> None:
    """Seed 2101312727: two etcd leaders killed after the old release died; each new leader gave its
    record's lease the TTL afresh, and the lighthouses suspended leases 12 s after its death (the
    checker allowed 8). A leader fault while the record lives moves the window's end to that fault
    + an election + the TTL (+ the managers' TTLs); one after the record is gone does not."""
    h = clean()
    for lh in h.lighthouses.values():
        lh["versions"][1]["created_at"] = T0 + 8.0
        lh["versions"][2]["created_at"] = T0 + 19.0
    lag = record(h, "g1", 20)  # g1 still on v2 at step 20 (served at T0 + 20.1), g0 on v3
    lag["config"], lag["version"] = served(expected_at(10)), 2
    old = {"kind": checker.MIXED, "target": "lighthouse0-old-release-g1", "start": T0 + 2.0, "end": T0 + 9.0}
    h.faults = [old]  # seen until T0 + 14 (lease), the window ends at T0 + 17
    assert sorted(set(invariants(h))) == ["effective", "split"]
    kill = {"kind": "etcd_leader_kill", "target": "etcd-m0", "start": T0 + 10.0, "end": T0 + 12.0}
    h.faults = [old, kill]  # the record's lease lives to T0 + 18, the window to T0 + 21
    assert invariants(h) == []
    kill.update({"start": T0 + 14.5, "end": T0 + 16.0})  # its record was gone already: no matter
    assert sorted(set(invariants(h))) == ["effective", "split"]


def test_a_rank_behind_its_group_replays_an_answer_pinned_while_an_old_release_was_on_the_prefix() -> None:
    """Seed 1931634541: a rank SIGSTOPped while the old release was on the prefix woke after its
    window and trained the steps its group-mate had trained in it: its manager's pinned answers,
    judged by when the group's first rank got them; an answer its group first got after the
    window is still judged by the strict rules."""
    h = clean()
    for lh in h.lighthouses.values():
        lh["versions"][1]["created_at"] = T0 + 8.0
        lh["versions"][2]["created_at"] = T0 + 8.5
    h.faults = [
        {"kind": checker.MIXED, "target": "lighthouse0-old-release-g1", "start": T0 + 7.9, "end": T0 + 9.5}
    ]
    lag = record(h, "g1", 10)  # g1 on v1 at step 10 in the window, g0 on v2
    lag["config"], lag["version"] = served({"lr": 0.1, "mark": "init"}), 1
    woken = dict(lag, rank=1, t=T0 + 30.0)  # past the window (it ends 8 s after the old one)
    h.records.append(woken)
    h.final["reached"]["g1-1"] = None
    assert [v.invariant for v in checker.check(h) if v.invariant != "liveness"] == []
    lag["t"] = T0 + 30.5  # the group first got it after the window: no lease missing explains it
    assert sorted({v.invariant for v in checker.check(h) if v.invariant != "liveness"}) == [
        "effective",
        "split",
    ]
