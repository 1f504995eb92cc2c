"""One chaos run: the plan of a seed played against a real cluster, then its history checked.

The run's folder keeps everything the checker reads (``plan.json``, ``records/*.jsonl``,
``ops.jsonl``, ``faults.jsonl``, ``histories/*.json``, ``final.json``) and the processes' logs;
a run without violations deletes it unless asked to keep it.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos import checker
from tests.chaos.cluster import Cluster
from tests.chaos.nemesis import Nemesis
from tests.chaos.operator import Operator
from tests.chaos.schedule import Plan, plan

INITIAL = {"lr": 0.01, "sync_every": 50, "mark": "init"}
FINAL_MARK = "final"
GUARD_AUTHOR = "guard"  # the author of a guard's rollback
LIVENESS_BOUND = 15.0  # seconds from the final change's acknowledgement to every rank training it


@dataclass
class Result:
    seed: int
    store: str
    seconds: float
    workdir: Path
    faults: dict[str, int] = field(default_factory=dict)
    operations: dict[str, int] = field(default_factory=dict)
    records: int = 0
    guard_rollbacks: int = 0  # versions the guards made (the operator's guarded changes that regressed)
    violations: list[checker.Violation] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "store": self.store,
            "seconds": self.seconds,
            "faults": self.faults,
            "operations": self.operations,
            "records": self.records,
            "guard_rollbacks": self.guard_rollbacks,
            "violations": [str(v) for v in self.violations],
            "kept": str(self.workdir) if self.workdir.exists() else None,
        }


def _follow(events: list[Any], t0: float, act: Callable[[Any], None], errors: list[BaseException]) -> None:
    """Do each event at its time (late ones at once, in order); an exception ends the thread, kept."""
    try:
        for event in events:
            time.sleep(max(0.0, t0 + event.at - time.monotonic()))
            act(event)
    except BaseException as exc:  # reported by the caller, never lost in the thread
        errors.append(exc)


def play(the_plan: Plan, workdir: Path) -> None:
    """Run the plan against a fresh cluster and write every file the checker reads into ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "plan.json").write_text(json.dumps(the_plan.to_json()))
    with Cluster(the_plan, workdir) as cluster:
        cluster.start(INITIAL)
        operator = Operator(cluster, workdir / "ops.jsonl")
        nemesis = Nemesis(cluster, workdir / "faults.jsonl")
        t0 = time.monotonic()
        stop_at = t0 + the_plan.seconds
        errors: list[BaseException] = []
        ops = [e for e in the_plan.events if e.actor == "operator"]
        faults = [e for e in the_plan.events if e.actor == "nemesis"]
        threads = [
            threading.Thread(target=_follow, args=(ops, t0, operator.do, errors)),
            threading.Thread(target=_follow, args=(faults, t0, lambda e: nemesis.inject(e, stop_at), errors)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        cluster.heal()
        final = {"quiet": time.time()}
        final.update(_final_change(cluster))
        operator.close()
        nemesis.close()
        (workdir / "final.json").write_text(json.dumps(final))
        histories = workdir / "histories"
        histories.mkdir(exist_ok=True)
        for index in range(len(cluster.lighthouses)):
            (histories / f"lighthouse{index}.json").write_text(json.dumps(cluster.history(index)))


def _final_change(cluster: Cluster) -> dict[str, Any]:
    """After the faults: one change made now, and when each rank first trained it (liveness)."""
    from tests.http_util import call

    deadline = time.monotonic() + 30
    while True:
        try:
            res = call(cluster.url(0), "PATCH", "api/config", {"mark": FINAL_MARK}, timeout=5)
            if res.status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError("no lighthouse acknowledged the final change within 30 s of the faults' end")
        time.sleep(0.2)
    acked = time.time()
    answer = res.json
    ranks = [(g, r) for g in cluster.groups for r in range(cluster.plan.ranks)]
    reached: dict[str, float | None] = {f"{g.name}-{r}": None for g, r in ranks}
    until = time.monotonic() + LIVENESS_BOUND + 5
    while time.monotonic() < until and any(v is None for v in reached.values()):
        for g, r in ranks:
            key = f"{g.name}-{r}"
            if reached[key] is None:
                records = checker.load_jsonl(cluster.records / f"{key}.jsonl")
                reached[key] = checker.first_time_live(records, answer["version"], acked)
        time.sleep(0.2)
    return {"acked": acked, "answer": answer, "reached": reached, "bound": LIVENESS_BOUND}


def run_seed(
    seed: int, seconds: float, workdir: Path, store: str | None = None, keep: bool = False
) -> Result:
    """Play seed ``seed`` and check its history; the folder is deleted when it passed (unless ``keep``)."""
    the_plan = plan(seed, seconds, store)
    play(the_plan, workdir)
    history = checker.load(workdir)
    result = Result(seed, the_plan.store, seconds, workdir)
    result.violations = checker.check(history)
    result.records = len(history.records)
    rows = next(iter(history.lighthouses.values()), {}).get("versions", [])
    result.guard_rollbacks = sum(row.get("author") == GUARD_AUTHOR for row in rows)
    for fault in history.faults:
        result.faults[fault["kind"]] = result.faults.get(fault["kind"], 0) + 1
    for op in history.ops:
        result.operations[op["kind"]] = result.operations.get(op["kind"], 0) + 1
    if not result.violations and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return result
