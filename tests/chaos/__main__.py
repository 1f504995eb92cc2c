"""``python -m tests.chaos``: play seeds, check each history, write a results file.

    python -m tests.chaos --seed 7 --seconds 30            # replay one seed (the store is the seed's)
    python -m tests.chaos --runs 30 --seconds 90 --results chaos.json   # soak: new seeds
    python -m tests.chaos --regressions                    # every seed that once failed

Exit 1 when any run broke an invariant; its folder (under --workdir) is kept with everything the
checker read and every process's log.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.chaos.regressions import REGRESSIONS
from tests.chaos.run import run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos")
    parser.add_argument("--seed", type=int, action="append", default=[], help="a seed to play (repeatable)")
    parser.add_argument("--runs", type=int, default=0, help="new random seeds to play")
    parser.add_argument("--seconds", type=float, default=90.0, help="each run's length")
    parser.add_argument("--store", choices=("etcd", "sqlite"), default=None, help="default: the seed's")
    parser.add_argument("--workdir", type=Path, default=Path("chaos-runs"), help="where runs' folders go")
    parser.add_argument(
        "--results", type=Path, default=None, help="JSON results file (rewritten after each run)"
    )
    parser.add_argument("--keep", action="store_true", help="keep passing runs' folders too")
    parser.add_argument(
        "--regressions",
        action="store_true",
        help="replay every seed that once failed (tests/chaos/regressions.py)",
    )
    args = parser.parse_args(argv)
    plays = [(seed, args.seconds, args.store) for seed in args.seed]
    plays += [(random.SystemRandom().randrange(1, 2**31), args.seconds, args.store) for _ in range(args.runs)]
    if args.regressions:
        plays += [(r.seed, r.seconds, r.store) for r in REGRESSIONS]
    if not plays:
        parser.error("give --seed, --runs or --regressions")
    summary: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(),
        "runs": [],
    }
    failed = 0
    for index, (seed, seconds, store) in enumerate(plays, 1):
        began = time.monotonic()
        result = run_seed(seed, seconds, args.workdir / f"seed-{seed}", store, args.keep)
        entry = result.to_json() | {"wall_seconds": round(time.monotonic() - began, 1)}
        summary["runs"].append(entry)
        failed += bool(result.violations)
        faults = sum(result.faults.values())
        ops = sum(result.operations.values())
        print(
            f"run {index}/{len(plays)}: seed {seed} ({result.store}): {len(result.violations)} violations, "
            f"{faults} faults, {ops} operations, {result.records} records, "
            f"{result.guard_rollbacks} guard rollbacks",
            flush=True,
        )
        for violation in result.violations[:20]:
            print(f"  {violation}", flush=True)
        if args.results:
            summary.update(_totals(summary["runs"]))
            args.results.write_text(json.dumps(summary, indent=1) + "\n")
    return 1 if failed else 0


def _commit() -> str | None:
    """The commit of the checkout the runs play (None: not a git checkout)."""
    root = Path(__file__).resolve().parent.parent.parent
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    faults: dict[str, int] = {}
    ops: dict[str, int] = {}
    for run in runs:
        for kind, count in run["faults"].items():
            faults[kind] = faults.get(kind, 0) + count
        for kind, count in run["operations"].items():
            ops[kind] = ops.get(kind, 0) + count
    return {
        "total_runs": len(runs),
        "failed_runs": sum(1 for r in runs if r["violations"]),
        "violations": sum(len(r["violations"]) for r in runs),
        "faults_by_kind": faults,
        "operations_by_kind": ops,
        "records": sum(r["records"] for r in runs),
        "guard_rollbacks": sum(r.get("guard_rollbacks", 0) for r in runs),
    }


if __name__ == "__main__":
    sys.exit(main())
