"""The seeded plan of one chaos run: its topology, the operator's changes and the nemesis' faults.

``plan(seed, seconds)`` is a pure function: the seed and the commit replay the same schedule
(what happens in response, e.g. which step a change lands at, depends on timing). Faults come
one at a time, each healed before the next begins, so every fallback a worker records has a
fault to explain it; the operator's changes never stop.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

STORES = ("etcd", "sqlite")
GROUPS = 3
RANKS = 2

# Fault kinds by store: every kind the product claims to survive that this machine can inject.
FAULTS: dict[str, tuple[str, ...]] = {
    "etcd": (
        "lighthouse_kill",
        "lighthouse_stop",
        "manager_kill",
        "manager_stop",
        "rank_kill",
        "rank_stop",
        "etcd_member_kill",
        "etcd_leader_kill",
        "etcd_member_stop",
        "lighthouse_etcd_cut",
        "manager_cut",
        "job_resume",
        "old_release",  # a lighthouse's host rolled back to the release before step leases
    ),
    "sqlite": (
        "lighthouse_kill",
        "lighthouse_stop",
        "manager_kill",
        "manager_stop",
        "rank_kill",
        "rank_stop",
        "manager_cut",
        "disk_full",
        "job_resume",
    ),
}

# The operator's kinds of change, with their weights.
CHANGES: dict[str, int] = {
    "patch": 30,
    "put": 8,
    "patch_if_match": 12,
    "scheduled": 15,
    "cancel": 8,
    "rollback": 6,
    "file_reload": 5,  # SQLite: the config file, watched by the lighthouse
    "run_end": 2,
    "guard": 4,  # a change guarded by the ranks' loss, which it may make regress (rolled back)
}


@dataclass(frozen=True)
class Event:
    """At ``at`` seconds into the run, ``actor`` does ``kind`` with ``params``."""

    at: float
    actor: str  # "operator" or "nemesis"
    kind: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    seed: int
    seconds: float
    store: str
    lighthouses: int
    groups: int
    ranks: int
    intervals: tuple[float, ...]  # each group's seconds per step
    events: tuple[Event, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def fault_kinds(self) -> list[str]:
        return sorted({e.kind for e in self.events if e.actor == "nemesis"})


def plan(seed: int, seconds: float, store: str | None = None) -> Plan:
    """The schedule of seed ``seed`` for a run of ``seconds`` (the store: the seed's, unless given)."""
    rng = random.Random(seed)
    store = store or STORES[seed % len(STORES)]
    lighthouses = 2 if store == "etcd" else 1
    intervals = (round(rng.uniform(0.010, 0.020), 4),) * GROUPS  # one job: its groups step together
    events: list[Event] = []
    kinds = [k for k in CHANGES if store == "sqlite" or k != "file_reload"]
    weights = [CHANGES[k] for k in kinds]
    t = 1.0
    n = 0
    while t < seconds:
        kind = rng.choices(kinds, weights)[0]
        n += 1
        params: dict[str, Any] = {"n": n, "lighthouse": rng.randrange(lighthouses)}
        params["lr"] = round(rng.uniform(0.0001, 0.1), 6)
        params["sync_every"] = rng.randrange(1, 200)
        params["ahead"] = rng.randrange(30, 400)  # a scheduled change: steps past the job's
        params["pick"] = rng.random()  # which pending change / version a cancel or rollback takes
        events.append(Event(round(t, 3), "operator", kind, params))
        t += rng.uniform(0.25, 0.9)
    faults = FAULTS[store]
    t = rng.uniform(2.0, 4.0)
    while t < seconds - 4.0:
        kind = faults[rng.randrange(len(faults))]
        if kind.endswith("kill"):
            duration = rng.uniform(0.5, 3.0)
        elif kind == "old_release":  # long enough, mostly, for the others to see it and suspend leases
            duration = rng.uniform(3.0, 12.0)
        else:
            duration = rng.uniform(0.5, 7.0)
        target = rng.randrange(64)  # modulo the number of candidates when the fault happens
        params = {"target": target, "duration": round(duration, 3), "back": rng.randrange(20, 400)}
        events.append(Event(round(t, 3), "nemesis", kind, params))
        t += duration + rng.uniform(2.0, 5.0)
    events.sort(key=lambda e: e.at)
    return Plan(seed, seconds, store, lighthouses, GROUPS, RANKS, intervals, tuple(events))
