"""Cost does not grow with jobs (issue 9): ``python -m benchmarks.many_jobs [--quick] [--out DIR]``.

One ``lighthouse serve`` process, the same call rate two ways, interleaved round
by round so machine noise hits both alike:

* ``jobs``: 100 jobs x 10 simulated managers at a 1 s TTL (1,000 calls/s);
* ``one_job``: 1 job x 1,000 simulated managers at a 1 s TTL (1,000 calls/s);
* ``jobs_edited``: the ``jobs`` fleet again while job 0 is PATCHed ``--edit-rate``
  times a second; ``others`` is the latency of every other job's calls, to
  compare with the same in ``jobs`` (an edit rebuilds only its own job's snapshot).

Every job gets a config through ``PUT /api/jobs/{job}/config`` first, so calls
get real configs. The simulated managers are ``benchmarks.agent sims`` (threads
in several processes calling ``LighthouseClient.fetch`` once per TTL), and their
groups step (``--steps-per-call``, 100 by default: 100 steps a second at a 1 s TTL):
every call reports a new job step and gets a step lease, so the lighthouse does
what training makes it do (job steps queued for the store's writer, lease grants,
lease ceilings stored).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.load import SimFleet, measure_window
from benchmarks.procs import Children
from benchmarks.report import machine_line, machine_load, run_standalone, standalone_parser
from benchmarks.stack import CONFIG, start_lighthouse
from lighthouse.admin import AdminClient

P99_GOAL_MS = 50.0


def edits(url: str, job: str, rate: float) -> Any:
    """A function for ``measure_window``: PATCH ``job`` ``rate`` times a second until the window ends."""

    def run(end: float) -> dict[str, Any]:
        admin = AdminClient(url, job=job)
        latencies: list[float] = []
        due = time.monotonic()
        while due < end:
            time.sleep(max(0.0, due - time.monotonic()))
            started = time.monotonic()
            admin.patch({"bench_edit": len(latencies)})
            latencies.append((time.monotonic() - started) * 1e3)
            due += 1 / rate
        return {"edits": len(latencies), "edit_p50_ms": statistics.median(latencies) if latencies else None}

    return run


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    jobs = [f"job-{k:03d}" for k in range(args.jobs)]
    managers = args.jobs * args.managers_per_job
    windows: list[dict[str, Any]] = []
    load_before = machine_load()
    with Children(work / "logs") as children:
        lh, addr, url = start_lighthouse(children, work, "lighthouse-jobs")
        for job in [*jobs, "single"]:
            AdminClient(url, job=job).put(CONFIG)
        lighthouse = [(lh, url)]

        def jobs_fleet(r: int) -> None:
            with SimFleet(
                children, "jobs", addr, managers, args.processes, args.ttl, jobs, args.steps_per_call
            ) as fleet:
                cases = ["jobs", "jobs_edited"] if r % 2 == 0 else ["jobs_edited", "jobs"]
                for case in cases:
                    during = edits(url, jobs[0], args.edit_rate) if case == "jobs_edited" else None
                    w = measure_window(fleet, lighthouse, args.ttl, args.duration, jobs[0], during)
                    windows.append({"case": case, "round": r, **w})

        def one_job_fleet(r: int) -> None:
            with SimFleet(
                children, "one", addr, managers, args.processes, args.ttl, ["single"], args.steps_per_call
            ) as fleet:
                w = measure_window(fleet, lighthouse, args.ttl, args.duration)
                windows.append({"case": "one_job", "round": r, **w})

        for r in range(args.rounds):
            for step in (jobs_fleet, one_job_fleet) if r % 2 == 0 else (one_job_fleet, jobs_fleet):
                step(r)
    return {
        "jobs": args.jobs,
        "managers_per_job": args.managers_per_job,
        "managers": managers,
        "ttl_s": args.ttl,
        "steps_per_call": args.steps_per_call,
        "edit_rate_per_s": args.edit_rate,
        "machine_before": load_before,
        "machine_after": machine_load(),
        "windows": windows,
        "summary": summarize_cases(windows),
    }


def summarize_cases(windows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case, the median over rounds of each figure (one noisy window moves no verdict)."""
    out: dict[str, dict[str, Any]] = {}
    for case in ("jobs", "one_job", "jobs_edited"):
        rows = [w for w in windows if w["case"] == case]

        def med(get: Any, rows: list[dict[str, Any]] = rows) -> float | None:
            values = [v for v in (get(w) for w in rows) if v is not None]
            return statistics.median(values) if values else None

        out[case] = {
            "calls_per_s": med(lambda w: w["lighthouse_calls_per_s"]),
            "cpu_pct": med(lambda w: w["lighthouse_cpu_pct"]),
            "p50_ms": med(lambda w: _ms_of(w["p50"])),
            "p99_ms": med(lambda w: _ms_of(w["p99"])),
            "others_p99_ms": med(lambda w: _ms_of(w.get("others", {}).get("p99"))),
            "errors": sum(w["errors"] for w in rows),
            "edits": sum((w.get("during") or {}).get("edits", 0) for w in rows),
            "new_versions": sum(w["new_versions"] for w in rows),
            "others_new_versions": sum(w.get("others", {}).get("new_versions", 0) for w in rows),
        }
    return out


def _ms_of(us: float | None) -> float | None:
    return None if us is None else us / 1e3


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(results: dict[str, Any]) -> str:
    lines = [
        f"One lighthouse, {results['managers']} simulated managers at TTL {results['ttl_s']:g}s: "
        f"{results['jobs']} jobs x {results['managers_per_job']} vs 1 job x {results['managers']}; "
        f"jobs_edited: job-000 PATCHed {results['edit_rate_per_s']:g}/s",
        f"{'case':12} {'round':>5} {'calls/s':>8} {'CPU %':>6} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'others p99':>10} {'errors':>6}",
        "-" * 70,
    ]
    for w in results["windows"]:
        others = _ms_of(w.get("others", {}).get("p99"))
        lines.append(
            f"{w['case']:12} {w['round']:5d} {w['lighthouse_calls_per_s']:8.0f} "
            f"{w['lighthouse_cpu_pct']:6.0f} {_ms(_ms_of(w['p50'])):>7} {_ms(_ms_of(w['p99'])):>7} "
            f"{_ms(others):>10} {w['errors']:6d}"
        )
    lines.append("median over rounds:")
    for case, s in results["summary"].items():
        lines.append(
            f"{case:12} {'':5} {s['calls_per_s'] or 0:8.0f} {s['cpu_pct'] or 0:6.0f} {_ms(s['p50_ms']):>7} "
            f"{_ms(s['p99_ms']):>7} {_ms(s['others_p99_ms']):>10} {s['errors']:6d}"
        )
    s = results["summary"]
    ratio = (
        s["jobs"]["p99_ms"] / s["one_job"]["p99_ms"]
        if s["jobs"]["p99_ms"] and s["one_job"]["p99_ms"]
        else None
    )
    worst = max(v["p99_ms"] or 0 for v in s.values())
    lines += [
        f"p99 goal < {P99_GOAL_MS:g} ms: {'MET' if worst < P99_GOAL_MS else 'NOT MET'} "
        f"(worst case median {worst:.2f} ms)",
        f"p99 {results['jobs']} jobs / 1 job: {_ms(ratio)}x; CPU {s['jobs']['cpu_pct']:.0f}% vs "
        f"{s['one_job']['cpu_pct']:.0f}% of a core",
        f"other jobs' p99 with job-000 edited / without: {_ms(s['jobs_edited']['others_p99_ms'])} vs "
        f"{_ms(s['jobs']['others_p99_ms'])} ms ({s['jobs_edited']['edits']} edits)",
        f"calls that brought a new config while job-000 was edited: {s['jobs_edited']['new_versions']} "
        f"(of those, other jobs: {s['jobs_edited']['others_new_versions']})",
        machine_line(results["machine_before"], results["machine_after"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("many_jobs", __doc__, fleet=True)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--managers-per-job", type=int, default=10)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per timed window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--edit-rate", type=float, default=10.0, help="PATCHes per second to job-000")
    parser.add_argument(
        "--steps-per-call", type=int, default=100, help="steps each group makes between two calls (0: none)"
    )
    quick = {"jobs": 5, "managers_per_job": 4, "ttl": 0.5, "duration": 1.0, "rounds": 1, "processes": 2}
    return run_standalone("many_jobs", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
