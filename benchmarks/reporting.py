"""What reported metrics cost (issue 19): ``python -m benchmarks.reporting [--quick] [--out DIR]``.

Each figure against a baseline measured in the same run:

* ``critical_path``: a training loop with ``prefetch=True`` (1 ms of work a step)
  calling ``get_config(step=N)`` and then ``report(N, ...)`` of 4 metrics; the p50
  of the two together against the plain grpcio floor (``benchmarks.floor``), and
  against the same loop without ``report`` and a dict read after the same sleep
  (what any in-memory work costs right after 1 ms idle here). Interleaved batches.
  Goal: <= 0.01x.
* ``lighthouse_cpu``: one ``lighthouse serve`` and 1,000 simulated managers at a
  1 s TTL whose groups step 10 steps a call: reporting 4 metrics of every step
  (the summaries a manager forwards) against the same calls without metrics, in
  interleaved rounds; and reporting with a dashboard open on the job (its charts
  polling ``/api/metrics`` every 2 s). Compared per call served (the lighthouse's CPU
  over the calls it answered in the window). Goal: reporting <= 1.3x.
* ``memory``: a job's series after 1,000,000 steps of 4 metrics from 100 groups,
  fed in this process through the lighthouse's own intake (``JobSeries.take_status``,
  what its gRPC handler calls): the series' size (its objects and arrays, walked)
  and how much the process grew, with the time the intake took.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import latency
from benchmarks.agent import reported_metrics
from benchmarks.load import SimFleet, measure_window
from benchmarks.procs import Children
from benchmarks.report import machine_line, machine_load, run_standalone, standalone_parser, summarize
from benchmarks.stack import CONFIG, start_lighthouse, start_manager
from lighthouse.admin import AdminClient
from lighthouse.jobs.series import JobSeries
from protos import lighthouse_config_pb2 as pb

PARTS = ("critical_path", "lighthouse_cpu", "memory")
METRICS = {"loss": 2.31, "grad_norm": 0.87, "tokens_per_s": 51234.0, "lr_applied": 3e-4}
CPU_GOAL, PATH_GOAL = 1.3, 0.01
CHART_READS = ("/metrics?max_points=450", "/config/timeline?limit=200", "/config/guards")


# ----------------------------------------------------------------- critical path
def critical_path(children: Children, work: Path, rounds: int, batch: int) -> dict[str, Any]:
    _, lh_addr, _ = start_lighthouse(children, work, "lighthouse-path")
    manager = start_manager(children, lh_addr, "path-manager")
    floor = children.python("floor", "-m", "benchmarks.floor")
    manager_addr, floor_addr = manager.readline(), floor.readline()
    steps = latency.StepCounter()
    plain = latency.FloorClient(floor_addr)
    cases = [
        latency.Case("floor", "plain grpcio unary call (the floor)", latency.timed(plain.get), plain.close),
        latency.Case(
            "prefetch",
            "prefetch=True: get_config(step=N)",
            latency.PrefetchBatch(manager_addr, steps, 1e-3).run,
        ),
        latency.Case(
            "prefetch_report",
            "prefetch=True: get_config(step=N) + report(N, 4 metrics)",
            latency.PrefetchBatch(manager_addr, steps, 1e-3, METRICS).run,
        ),
        latency.Case(
            "memory_read",
            "a dict read after the same 1 ms sleep (floor of any in-memory work)",
            latency.MemoryReadBatch(1e-3).run,
        ),
    ]
    try:
        samples = latency.run_interleaved(cases, rounds, batch, warmup=batch // 4)
    finally:
        for case in cases:
            case.close()
    out = {c.name: {"label": c.label, **summarize(samples[c.name])} for c in cases}
    out["ratio_to_floor"] = out["prefetch_report"]["p50"] / out["floor"]["p50"]
    out["report_adds_us"] = out["prefetch_report"]["p50"] - out["prefetch"]["p50"]
    return out


# ---------------------------------------------------------------- lighthouse CPU
def dashboard(url: str, period: float = 2.0) -> Any:
    """A function for ``measure_window``: what an open dashboard's charts fetch (``url`` is a job's
    API: ``.../api/jobs/JOB``), every ``period``."""

    def run(end: float) -> dict[str, Any]:
        reads = 0
        while time.monotonic() < end:
            for path in CHART_READS:
                with urllib.request.urlopen(url + path, timeout=10) as answer:
                    answer.read()
            reads += 1
            time.sleep(max(0.0, min(period, end - time.monotonic())))
        return {"chart_refreshes": reads}

    return run


def lighthouse_cpu(
    children: Children, work: Path, managers: int, processes: int, ttl: float, duration: float, rounds: int
) -> dict[str, Any]:
    lh, addr, url = start_lighthouse(children, work, "lighthouse-cpu")
    windows: list[dict[str, Any]] = []
    cases = [("silent", 0), ("reporting", 4), ("reporting_dashboard", 4)]
    for r in range(rounds):
        for case, metrics in cases if r % 2 == 0 else cases[::-1]:
            job = f"{case}-{r}"  # a fresh job per window: a job's series starts with its first report
            AdminClient(url, job=job).put(CONFIG)
            with SimFleet(children, job, addr, managers, processes, ttl, [job], 10, metrics) as fleet:
                during = dashboard(f"{url}/api/jobs/{job}") if case == "reporting_dashboard" else None
                window = measure_window(fleet, [(lh, url)], ttl, duration, during=during)
            windows.append({"case": case, "round": r, **window, "cpu_us_per_call": cpu_per_call(window)})
    children.stop(lh)

    def median(key: str, case: str) -> float:
        return statistics.median(w[key] for w in windows if w["case"] == case and w[key] is not None)

    per_call = {case: median("cpu_us_per_call", case) for case, _ in cases}
    return {
        "managers": managers,
        "ttl_s": ttl,
        "steps_per_call": 10,
        "metrics": 4,
        "windows": windows,
        "cpu_pct": {case: median("lighthouse_cpu_pct", case) for case, _ in cases},
        "cpu_us_per_call": per_call,
        "ratio": per_call["reporting"] / per_call["silent"],
        "ratio_with_dashboard": per_call["reporting_dashboard"] / per_call["silent"],
    }


def cpu_per_call(window: dict[str, Any]) -> float | None:
    """Lighthouse CPU (us) per call it served in ``window``: a lighthouse slowed by reporting serves
    fewer calls in a window, so its CPU share alone understates what reporting costs. ``None`` for
    a window in which it served none (a short window on a loaded machine): no figure, not a zero."""
    if window["lighthouse_calls_per_s"] <= 0:
        return None
    return float(window["lighthouse_cpu_pct"]) / 100 / window["lighthouse_calls_per_s"] * 1e6


# ----------------------------------------------------------------------- memory
def deep_size(root: object) -> int:
    """Bytes held by ``root`` and everything it references (not classes, modules or functions)."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type) or callable(obj):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def memory(steps: int, groups: int, chunk: int) -> dict[str, Any]:
    """A job fed ``steps`` steps of 4 metrics from ``groups`` groups, ``chunk`` steps a batch."""
    summaries = reported_metrics(len(METRICS), chunk)
    series = JobSeries("bench")
    rss0, t0 = _rss(), time.perf_counter()
    checkpoints = []
    for batch, first in enumerate(range(0, steps, chunk), start=1):
        status = pb.ManagerStatus(metrics=summaries(first), metrics_batch=batch)
        for g in range(groups):
            series.take_status(f"group{g}", status)
        done = first + chunk
        if done in (steps // 10, steps):
            checkpoints.append({"steps": done, "series_bytes": deep_size(series), "rss_bytes": _rss() - rss0})
    elapsed = time.perf_counter() - t0
    entries = series.entries()
    return {
        "steps": steps,
        "groups": groups,
        "metrics": len(METRICS),
        "values": steps * groups * len(METRICS),
        "intake_s": elapsed,
        "intake_ns_per_value": elapsed / (steps * groups * len(METRICS)) * 1e9,
        "checkpoints": checkpoints,
        "entries": entries,
        "points_per_metric": len(series.query(["loss"])["metrics"]["loss"]),
    }


# ----------------------------------------------------------------------- report
def render(results: dict[str, Any]) -> str:
    lines = []
    path = results.get("critical_path")
    if path:
        lines += [
            "report() on the critical path (prefetch=True, 1 ms of work a step), interleaved:",
            *(
                f"  {path[c]['label']:58} p50 {path[c]['p50']:9.2f} us  p99 {path[c]['p99']:9.2f} us"
                for c in ("floor", "prefetch", "prefetch_report", "memory_read")
            ),
            f"  get_config + report p50 / floor p50: {path['ratio_to_floor']:.4f}x (goal <= {PATH_GOAL}x); "
            f"report() adds {path['report_adds_us']:.2f} us",
        ]
    cpu = results.get("lighthouse_cpu")
    if cpu:
        lines.append(
            f"lighthouse CPU, {cpu['managers']} managers at TTL {cpu['ttl_s']:g}s, "
            f"{cpu['steps_per_call']} steps a call, {cpu['metrics']} metrics a step "
            "(median of rounds):"
        )
        for case, pct in cpu["cpu_pct"].items():
            lines.append(
                f"  {case:20} {pct:6.1f}% of a core, {cpu['cpu_us_per_call'][case]:6.0f} us a call served"
            )
        lines.append(
            f"  reporting / silent, CPU per call served: {cpu['ratio']:.2f}x (goal <= {CPU_GOAL}x); "
            f"with a dashboard open: {cpu['ratio_with_dashboard']:.2f}x"
        )
    mem = results.get("memory")
    if mem:
        lines.append(
            f"a job's series after {mem['steps']:,} steps x {mem['metrics']} metrics x "
            f"{mem['groups']} groups ({mem['values']:,} values, intake {mem['intake_ns_per_value']:.0f} ns "
            "a value):"
        )
        for c in mem["checkpoints"]:
            lines.append(
                f"  after {c['steps']:>9,} steps: series {c['series_bytes'] / 2**20:6.2f} MiB, "
                f"process grew {c['rss_bytes'] / 2**20:6.1f} MiB"
            )
        lines.append(f"  points per metric: {mem['points_per_metric']}; held: {mem['entries']['loss']}")
    lines.append(machine_line(results["machine_before"], results["machine_after"]))
    return "\n".join(lines)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    parts = [p for p in args.parts.split(",") if p]
    results: dict[str, Any] = {"machine_before": machine_load()}
    with Children(work / "logs") as children:
        if "critical_path" in parts:
            results["critical_path"] = critical_path(children, work, args.rounds, args.batch)
        if "lighthouse_cpu" in parts:
            results["lighthouse_cpu"] = lighthouse_cpu(
                children, work, args.managers, args.processes, args.ttl, args.duration, args.cpu_rounds
            )
    if "memory" in parts:
        results["memory"] = memory(args.steps, args.groups, args.chunk)
    results["machine_after"] = machine_load()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("reporting", __doc__, fleet=True)
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument("--rounds", type=int, default=20, help="critical path: interleaved rounds")
    parser.add_argument("--batch", type=int, default=200, help="critical path: steps a batch")
    parser.add_argument("--managers", type=int, default=1000)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per CPU window")
    parser.add_argument("--cpu-rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1_000_000, help="memory: steps reported")
    parser.add_argument("--groups", type=int, default=100, help="memory: replica groups")
    parser.add_argument("--chunk", type=int, default=1000, help="memory: steps a manager's batch")
    quick = {"rounds": 3, "batch": 40, "managers": 20, "processes": 2, "ttl": 0.5, "duration": 1.0,
             "cpu_rounds": 1, "steps": 20_000, "groups": 4}  # fmt: skip
    return run_standalone("reporting", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
