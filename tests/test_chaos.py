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

SECONDS = 40.0

# (seed, store): the fixed seeds, chosen so that between them every fault kind and every kind of
# change happens: 128 cuts a lighthouse from etcd, stops a rank and an etcd member, kills a
# member, the leader and a rank, and makes four guarded changes; 2251 resumes the job, kills and
# stops a manager, stops and kills the lighthouse, fills the disk and cuts a manager off
# (test_the_fixed_seeds_exercise_every_kind checks the plans).
SEEDS = [
    pytest.param(128, "etcd", id="etcd-128"),
    pytest.param(2251, "sqlite", id="sqlite-2251"),
]


def test_the_fixed_seeds_exercise_every_kind() -> None:
    events = [e for p in SEEDS for e in plan(p.values[0], SECONDS, p.values[1]).events]
    assert {e.kind for e in events if e.actor == "nemesis"} == set(FAULTS["etcd"]) | set(FAULTS["sqlite"])
    assert {e.kind for e in events if e.actor == "operator"} == set(CHANGES)


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "store"), SEEDS)
def test_a_chaos_seed_keeps_every_invariant(seed: int, store: str, tmp_path: Path) -> None:
    if store == "etcd":
        require_etcd()
    result = run_seed(seed, SECONDS, tmp_path / f"seed-{seed}", store, keep=True)
    assert sum(result.faults.values()) >= 4, result.faults  # the nemesis did its part
    assert result.records > 3000, result.records  # and the job trained through it
    assert sum(n for kind, n in result.operations.items() if kind != "run_end") >= 40, result.operations
    assert not result.violations, "\n".join(str(v) for v in result.violations[:30]) + f"\nkept in {tmp_path}"
