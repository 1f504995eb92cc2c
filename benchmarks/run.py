"""One command for the whole benchmark: ``python -m benchmarks.run [--quick] [--out bench-results]``.

Starts every server it needs on loopback (the product through its CLIs, the
floor server, the peers), runs the sections in order, prints the tables and the
issue-6 goal verdicts, and writes ``results.json``, ``results.txt`` and
``chart.png`` to the output folder. Every process it starts is stopped, also on
Ctrl-C or an error (``Children``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import latency, load, report
from benchmarks.peers import connect_peers, launch_peers
from benchmarks.procs import Children
from benchmarks.stack import start_lighthouse, start_manager
from manager.status_client import manager_info

SECTIONS = ("latency", "throughput", "fanin", "propagation", "outage", "scale")


@dataclass
class Profile:
    """How much of each section to run; ``quick`` is a CI smoke run of a few seconds per section."""

    rounds: int = 20
    batch: int = 300
    warmup: int = 100
    tp_workers: list[int] = field(default_factory=lambda: [8, 32, 128])
    tp_rounds: int = 3
    tp_duration: float = 2.0
    fan_ttl: float = 0.1
    fan_duration: float = 6.0
    fan_step: float = 0.2
    fan_workers: list[tuple[int, int]] = field(
        default_factory=lambda: [(1, 1), (1, 4), (1, 16), (1, 64), (1, 256)]
    )
    fan_managers: list[tuple[int, int]] = field(default_factory=lambda: [(1, 2), (4, 8), (16, 32), (64, 128)])
    prop_ttls: list[float] = field(default_factory=lambda: [0.25, 1.0])
    prop_changes: int = 20
    prop_managers: int = 2
    prop_workers_per_manager: int = 4
    step_s: float = 0.01
    outage_ttl: float = 1.0
    outage_deadline: float = 1.0
    outage_phase: float = 5.0
    scale_levels: list[int] = field(default_factory=lambda: [100, 250, 500, 1000])
    scale_processes: int = 4
    scale_ttl: float = 1.0
    scale_duration: float = 5.0
    worker_processes: int = 4


QUICK = Profile(
    rounds=3,
    batch=40,
    warmup=20,
    tp_workers=[8, 32],
    tp_rounds=1,
    tp_duration=0.3,
    fan_duration=1.0,
    fan_workers=[(1, 1), (1, 8)],
    fan_managers=[(4, 8)],
    prop_ttls=[0.2],
    prop_changes=3,
    prop_workers_per_manager=1,
    outage_ttl=0.3,
    outage_deadline=0.3,
    outage_phase=0.6,
    scale_levels=[20],
    scale_processes=2,
    scale_ttl=0.5,
    scale_duration=1.0,
    worker_processes=2,
)


def run(profile: Profile, sections: list[str], out_dir: Path, work_ms: float, mode: str) -> dict[str, Any]:
    results: dict[str, Any] = {"meta": report.run_meta(mode=mode)}
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lhc-bench-") as tmp, Children(out_dir / "logs") as children:
        work = Path(tmp)
        needs_pool = {"throughput", "fanin", "propagation"} & set(sections)
        needs_stack = {"latency", "throughput"} & set(sections)
        # Start what the sections share in parallel, then read each one's address.
        pool_started = time.monotonic()
        if needs_stack:
            lh, lh_addr, _ = start_lighthouse(children, work)
            mgr = start_manager(children, lh_addr, "bench-manager", ttl=1.0)
            floor_child = children.python("floor", "-m", "benchmarks.floor")
        skipped: dict[str, str] = {}
        launched = launch_peers(children, skipped) if "latency" in sections else {}
        fan_lh = start_lighthouse(children, work, "lighthouse-fanin") if "fanin" in sections else None
        pool = load.WorkerPool(children, profile.worker_processes) if needs_pool else None
        if needs_stack:
            mgr_addr, floor_addr = mgr.readline(), floor_child.readline()
        print(f"started servers in {time.monotonic() - pool_started:.1f}s", file=sys.stderr)

        if "latency" in sections:
            _log("latency (interleaved)")
            peers = connect_peers(launched, skipped)
            cases = latency.relay_cases(mgr_addr, floor_addr, work_ms / 1e3)
            cases.append(latency.lighthouse_case(lh_addr))
            cases += [latency.Case(p.name, p.label, latency.timed(p.call), p.close) for p in peers]
            before = manager_info(mgr_addr, timeout=5.0)
            try:
                samples = latency.run_interleaved(cases, profile.rounds, profile.batch, profile.warmup)
            finally:
                for case in cases:
                    case.close()
            after = manager_info(mgr_addr, timeout=5.0)
            prefetch_stats = next(c.extra for c in cases if c.name == "relay_prefetch")
            results["latency"] = {
                "rounds": profile.rounds,
                "batch": profile.batch,
                "work_ms": work_ms,
                "cases": {c.name: {"label": c.label, **report.summarize(samples[c.name])} for c in cases},
                "skipped": skipped,
                "prefetch_stats": prefetch_stats,
                # Step leases: the manager renews in the background; a call that waited for the
                # lighthouse (a renewal or refresh on its path) is not a cache hit.
                "manager": {
                    "calls": after.requests - before.requests,
                    "waited": (after.requests - after.cache_hits) - (before.requests - before.cache_hits),
                    "lease_through_step": after.lease_through_step,
                    "last_step": after.last_pinned_step,
                },
            }
            for name in ("tcpstore", "redis", "torchft"):
                for child in list(children._started):
                    if child.name == name:
                        children.stop(child)

        if "throughput" in sections:
            _log("throughput")
            assert pool is not None
            results["throughput"] = load.throughput(
                pool,
                {"manager": mgr_addr, "floor": floor_addr},
                profile.tp_workers,
                profile.tp_rounds,
                profile.tp_duration,
            )
        if needs_stack:
            for child in (mgr, floor_child, lh):
                children.stop(child)

        if fan_lh is not None:
            _log("fan-in")
            assert pool is not None
            _, fan_addr, fan_url = fan_lh
            common = dict(ttl=profile.fan_ttl, duration=profile.fan_duration, step_s=profile.fan_step)
            results["fan_in"] = {
                "ttl_s": profile.fan_ttl,
                "step_s": profile.fan_step,
                "workers_sweep": load.fan_in(
                    children, pool, fan_addr, fan_url, profile.fan_workers, **common
                ),
                "managers_sweep": load.fan_in(
                    children, pool, fan_addr, fan_url, profile.fan_managers, **common
                ),
            }
            children.stop(fan_lh[0])

        if "propagation" in sections:
            _log("propagation")
            assert pool is not None
            results["propagation"] = load.propagation(
                children,
                pool,
                work,
                profile.prop_ttls,
                profile.prop_changes,
                profile.prop_managers,
                profile.prop_workers_per_manager,
                profile.step_s,
            )
        if pool is not None:
            for agent in pool.agents:
                children.stop(agent)

        if "outage" in sections:
            _log("outage")
            results["outage"] = load.outage(
                children,
                work,
                profile.outage_ttl,
                profile.outage_deadline,
                profile.outage_phase,
                profile.step_s / 2,
            )

        if "scale" in sections:
            _log("scale")
            results["scale"] = load.scale(
                children,
                work,
                profile.scale_levels,
                profile.scale_processes,
                profile.scale_ttl,
                profile.scale_duration,
            )
    results["goals"] = report.goals(results)
    return results


def _log(section: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {section} ...", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run well under a minute")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for JSON, text and PNG"
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    parser.add_argument("--work-ms", type=float, default=1.0, help="work per step in the prefetch loop")
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib needed)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    started = time.monotonic()
    mode = "quick" if args.quick else "full"
    results = run(QUICK if args.quick else Profile(), sections, args.out, args.work_ms, mode)
    results["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
    text = report.render(results)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(results, args.out / "results.json")
    (args.out / "results.txt").write_text(text + "\n")
    if not args.no_chart:
        report.write_chart(results, args.out / "chart.png")
    print(
        f"\nwrote {args.out}/results.json, results.txt{'' if args.no_chart else ', chart.png'} "
        f"in {results['meta']['elapsed_s']:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
