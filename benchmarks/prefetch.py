"""Prefetch across pauses (issue 25 item 6): ``python -m benchmarks.prefetch [--quick] [--out DIR]``.

A training loop with ``prefetch=True`` and ``--work-ms`` of work a step (at least two manager
round trips), in a plain loop and with a ``--pause-s`` pause every ``--pause-every`` steps (an
evaluation, a checkpoint save). For each: the share of steps answered from memory (the client's
own count, ``ManagerClient.steps_from_memory``, every step of every batch from a new client's first,
unless ``--warmup-s``), and the critical path p50 of ``get_config(step=N)`` against the plain grpcio
call (``benchmarks.floor``), in interleaved batches. And a run's first ``--pause-every`` steps: a new
job per batch, its run beginning with the loop. Goal: at least 99.5% from memory and at most 0.01x.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks import latency
from benchmarks.procs import Children
from benchmarks.report import machine_line, machine_load, run_standalone, standalone_parser, summarize
from benchmarks.stack import CONFIG, start_lighthouse, start_manager
from lighthouse.admin import AdminClient

SHARE_GOAL, PATH_GOAL = 0.995, 0.01


class RunStartBatch:
    """A run's first steps: per batch a new job (its own manager), whose first run begins with the
    loop's first step: the lighthouse learns the job's step rate and stores its first step-lease
    ceilings while these steps are asked for."""

    def __init__(self, children: Children, lighthouse: str, url: str, work_s: float, steps: int) -> None:
        self.children, self.lighthouse, self.url = children, lighthouse, url
        self.work_s, self.steps = work_s, steps
        self.stats: dict[str, Any] = {"runs": 0}

    def run(self, n: int) -> list[float]:
        job = f"run-start-{self.stats['runs'] + 1}"
        AdminClient(self.url, job=job).put(CONFIG)
        manager = start_manager(self.children, self.lighthouse, f"manager-{job}", job=job)
        batch = latency.PrefetchBatch(manager.readline(), latency.StepCounter(), self.work_s, warmup_s=0)
        try:
            out = batch.run(self.steps)
        finally:
            self.children.stop(manager)
        self.stats["runs"] += 1
        for key, value in batch.stats.items():
            self.stats[key] = self.stats.get(key, 0) + value
        return out


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"machine_before": machine_load()}
    with Children(work / "logs") as children:
        _, lh_addr, url = start_lighthouse(children, work, "lighthouse-prefetch")
        manager = start_manager(children, lh_addr, "prefetch-manager")
        floor = children.python("floor", "-m", "benchmarks.floor")
        manager_addr, floor_addr = manager.readline(), floor.readline()
        steps = latency.StepCounter()
        plain = latency.FloorClient(floor_addr)
        work_s = args.work_ms / 1e3
        warmup = args.warmup_s
        loop = latency.PrefetchBatch(manager_addr, steps, work_s, warmup_s=warmup)
        paused = latency.PrefetchBatch(
            manager_addr, steps, work_s, pause_every=args.pause_every, pause_s=args.pause_s, warmup_s=warmup
        )
        start = RunStartBatch(children, lh_addr, url, work_s, args.pause_every)
        cases = [
            latency.Case(
                "floor", "plain grpcio unary call (the floor)", latency.timed(plain.get), plain.close
            ),
            latency.Case("plain_loop", f"prefetch=True, {args.work_ms:g} ms work a step", loop.run),
            latency.Case(
                "paused_loop",
                f"the same, a {args.pause_s:g} s pause every {args.pause_every} steps",
                lambda n: paused.run(max(n, 4 * args.pause_every)),  # several pauses a batch
            ),
            latency.Case("run_start", f"a new run's first {args.pause_every} steps (a new job)", start.run),
            latency.Case(
                "memory_read",
                f"a dict read after the same {args.work_ms:g} ms sleep (any in-memory work's floor)",
                latency.MemoryReadBatch(work_s).run,
            ),
        ]
        try:
            samples = latency.run_interleaved(cases, args.rounds, args.batch, warmup=args.batch // 4)
        finally:
            for case in cases:
                case.close()
    floor_p50 = summarize(samples["floor"])["p50"]
    results["floor"] = {"label": cases[0].label, **summarize(samples["floor"])}
    for case, batch in (("plain_loop", loop), ("paused_loop", paused), ("run_start", start)):
        stats = batch.stats
        share = stats["client_from_memory"] / stats["client_asks"] if stats["client_asks"] else None
        summary = summarize(samples[case])
        results[case] = {
            "label": next(c.label for c in cases if c.name == case),
            **summary,
            **stats,
            "share_from_memory": share,
            "ratio_to_floor": summary["p50"] / floor_p50 if summary["p50"] and floor_p50 else None,
        }
    results["memory_read"] = {"label": cases[-1].label, **summarize(samples["memory_read"])}
    results["memory_read"]["ratio_to_floor"] = results["memory_read"]["p50"] / floor_p50
    starts = start.stats
    results["run_start"]["misses_per_run"] = (starts["client_asks"] - starts["client_from_memory"]) / max(
        1, starts["runs"]
    )  # the first step of each is one: nothing can know it before it is asked
    results["goals"] = {"share_from_memory": SHARE_GOAL, "ratio_to_floor": PATH_GOAL}
    results["machine_after"] = machine_load()
    return results


def render(results: dict[str, Any]) -> str:
    lines = [machine_line(results["machine_before"], results["machine_after"])]
    lines.append(f"floor p50 {results['floor']['p50']:.1f} us")
    memory = results["memory_read"]
    lines.append(f"memory_read: p50 {memory['p50']:.2f} us = {memory['ratio_to_floor']:.4f}x the floor")
    lines.append(f"run_start: {results['run_start']['misses_per_run']:.2f} steps a run not from memory")
    for case in ("plain_loop", "paused_loop", "run_start"):
        r = results[case]
        lines.append(
            f"{case}: {r['share_from_memory']:.2%} of {r['client_asks']} steps from memory "
            f"(goal >= {SHARE_GOAL:.1%}), critical path p50 {r['p50']:.2f} us = "
            f"{r['ratio_to_floor']:.4f}x the floor (goal <= {PATH_GOAL}x)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("prefetch", __doc__)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--batch", type=int, default=600, help="steps a batch")
    parser.add_argument("--work-ms", type=float, default=2.0, help="work a step (>= two round trips)")
    parser.add_argument("--pause-every", type=int, default=150)
    parser.add_argument("--pause-s", type=float, default=2.0)
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="a new client's first seconds not counted (0: from its first step)",
    )
    quick = {"rounds": 1, "batch": 40, "pause_every": 10, "pause_s": 0.2}
    return run_standalone("prefetch", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
