"""The job timeline (which version held from which step) in the store and over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lighthouse import LighthouseClient
from lighthouse.jobs.timeline import timeline
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb
from tests.helpers_lighthouse import start_lighthouse
from tests.store_edits import commit


def spans(line: dict[str, Any]) -> list[tuple[int, int, int | None, bool]]:
    return [(s["version"], s["from_step"], s["to_step"], s["pending"]) for s in line["segments"]]


def test_segments_follow_apply_order() -> None:
    store = ConfigStore(SqliteBackend())
    commit(store, "put", {"lr": 1}, source="file")  # v1, before any step: holds from 0
    commit(store, "patch", {"lr": 2}, source="api", author="alice")  # v2, same step: v1 held no step
    store.advance_step(100)
    commit(store, "patch", {"lr": 3}, source="api")  # v3 from 100
    commit(store, "patch", {"lr": 4}, source="api", effective_step=500)  # v4 ahead
    commit(store, "patch", {"lr": 5}, source="api", effective_step=900)  # v5 ahead, then cancelled
    commit(store, "cancel", {"version": 5}, source="api")  # v6: not a segment
    store.advance_step(200)
    commit(store, "patch", {"bs": 8}, source="api")  # v7 from 200, before v4 in apply order
    line = timeline(store)
    assert spans(line) == [
        (1, 0, 0, False),
        (2, 0, 100, False),
        (3, 100, 200, False),
        (7, 200, 500, False),
        (4, 500, None, True),
    ]
    assert (line["version"], line["current_step"], line["earlier"]) == (7, 200, 0)
    assert line["segments"][1]["author"] == "alice" and line["segments"][4]["scheduled"]
    store.advance_step(600)
    assert spans(timeline(store))[-1] == (4, 500, None, False)
    short = timeline(store, limit=2)
    assert [s["version"] for s in short["segments"]] == [7, 4] and short["earlier"] == 3


def test_late_groups_and_job_alias_over_http(tmp_path: Path) -> None:
    with start_lighthouse(tmp_path, config={"lr": 1}) as lh:
        assert lh.http("PUT", "/api/jobs/alpha/config", {"lr": 10}).status == 200
        due = lh.http("PATCH", "/api/jobs/alpha/config?effective_step=50", {"lr": 20}).json["version"]
        with LighthouseClient(lh.grpc_addr, job="alpha") as client:
            for replica, step, previous in (("g0", 50, 49), ("g1", 53, 52)):
                switch = pb.StepSwitch(version=due, step=step, previous_step=previous)
                status = pb.ManagerStatus(
                    replica_id=replica, address="x:1", version=due, step=step, switches=[switch], job="alpha"
                )
                client.heartbeat(status, timeout=5)
        line = lh.http("GET", "/api/jobs/alpha/config/timeline").json
        assert spans(line) == [(1, 0, 50, False), (2, 50, None, False)]
        assert line["late_groups"] == [
            {
                "version": 2,
                "effective_step": 50,
                "replica_id": "g1",
                "switched_at_step": 53,
                "late_by_steps": 3,
            }
        ]
        default = lh.http("GET", "/api/config/timeline").json
        assert spans(default) == [(1, 0, None, False)] and default["late_groups"] == []
        assert lh.http("GET", "/api/jobs/nope/config/timeline").status == 404
        assert lh.http("GET", "/api/config/timeline?limit=0").status == 400
        # With several jobs / lists them, and /jobs/default is the dashboard the timeline is drawn on.
        assert b"jobs.js" in lh.http("GET", "/").body
        assert b"dashboard.js" in lh.http("GET", "/jobs/default").body
        assert lh.http("POST", "/jobs/default", {}).status == 405
