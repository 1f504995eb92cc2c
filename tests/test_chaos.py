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
from tests.chaos.schedule import FAULTS, plan
from tests.etcd_cluster import require_etcd

SECONDS = 40.0

# (seed, store): the fixed seeds, chosen so that between them every fault kind happens: 2394 kills
# the etcd leader and a member, stops a member, cuts a lighthouse from etcd, kills and stops a
# lighthouse and resumes the job; 2501 fills the disk, kills and stops a manager, cuts one off,
# kills a rank and the lighthouse, and resumes the job (tests/test_chaos.py checks the plans).
SEEDS = [
    pytest.param(2394, "etcd", id="etcd-2394"),
    pytest.param(2501, "sqlite", id="sqlite-2501"),
]


def test_the_fixed_seeds_exercise_every_fault_kind() -> None:
    kinds = {
        e.kind for p in SEEDS for e in plan(p.values[0], SECONDS, p.values[1]).events if e.actor == "nemesis"
    }
    assert kinds == set(FAULTS["etcd"]) | set(FAULTS["sqlite"])


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
