"""The chaos suite's fixed seeds: real clusters under random faults, every history checked.

Each seed plays its schedule (tests/chaos/schedule.py) against real processes (lighthouses on
SQLite or on a 3-member etcd, managers, ranks, the operator, the nemesis) and the checker
(tests/chaos/checker.py, its own tests in test_chaos_checker.py) finds no violation. The
regression seeds each found a bug once, named beside it; ``python -m tests.chaos --seed N``
replays one with its folder kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import run_seed
from tests.chaos.schedule import CHANGES, FAULTS, plan
from tests.etcd_cluster import require_etcd

# (seed, store, seconds): the fixed seeds, chosen so that between them every fault kind and every
# kind of change happens: 1897 (etcd, 40 s) cuts a lighthouse from etcd, stops a rank and an etcd
# member, kills a member and the leader, and rolls a lighthouse back to the release before step
# leases; 4987 (SQLite, 45 s) kills a rank, kills and stops the lighthouse, fills the disk twice,
# stops, cuts and kills a manager and resumes the job; both make guarded changes and end a run
# (test_the_fixed_seeds_exercise_every_kind checks the plans).
SEEDS = [
    pytest.param(1897, "etcd", 40.0, id="etcd-1897"),
    pytest.param(4987, "sqlite", 45.0, id="sqlite-4987"),
]


def test_the_fixed_seeds_exercise_every_kind() -> None:
    events = [e for p in SEEDS for e in plan(p.values[0], p.values[2], p.values[1]).events]
    assert {e.kind for e in events if e.actor == "nemesis"} == set(FAULTS["etcd"]) | set(FAULTS["sqlite"])
    assert {e.kind for e in events if e.actor == "operator"} == set(CHANGES)


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "store", "seconds"), SEEDS)
def test_a_chaos_seed_keeps_every_invariant(seed: int, store: str, seconds: float, tmp_path: Path) -> None:
    if store == "etcd":
        require_etcd()
    result = run_seed(seed, seconds, tmp_path / f"seed-{seed}", store, keep=True)
    assert sum(result.faults.values()) >= 4, result.faults  # the nemesis did its part
    assert result.records > 3000, result.records  # and the job trained through it
    assert sum(n for kind, n in result.operations.items() if kind != "run_end") >= 40, result.operations
    assert not result.violations, "\n".join(str(v) for v in result.violations[:30]) + f"\nkept in {tmp_path}"
