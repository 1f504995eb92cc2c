"""Several lighthouses on one etcd under load (issue 10): ``python -m benchmarks.etcd_fleet [--quick]``.

* ``fleet``: 3 ``lighthouse serve --store etcd://`` processes on one 3-member etcd
  (loopback, data on disk) serving 3,000 simulated managers at a 3 s TTL, 1,000
  calls/s in all; each simulated manager is given ``A,B,C`` and starts on the one
  its replica id picks, as ``manager serve`` does. Client-side p50/p99, errors,
  each lighthouse's and each etcd member's CPU.
* ``gap``: a real ``manager serve --lighthouse A,B`` and a ``ManagerClient``
  worker stepping every 10 ms (``get_config(step=N)``); the lighthouse the manager
  uses is SIGKILLed. The longest time between two successful configs that are not
  the fallback, before and after the kill, and how many fallbacks were served
  (the goal: none). Repeated ``--gap-rounds`` times with a fresh pair, so the kill
  falls at different points of the manager's TTL.
* ``hang``: the same with SIGSTOP instead of SIGKILL (a frozen host: the
  connection stays open and nothing answers), so the manager's calls are hedged
  to the other lighthouse after a fraction of their deadline.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.etcd_store import start_etcd_fleet, start_etcd_lighthouse
from benchmarks.load import SimFleet, measure_window
from benchmarks.procs import Children
from benchmarks.report import machine_line, machine_load, run_standalone, standalone_parser
from benchmarks.stack import CONFIG, lighthouse_calls, start_manager
from lighthouse.admin import AdminClient
from lighthouse.client import LighthouseClient
from tests.etcd_cluster import EtcdCluster
from worker_client import ManagerClient

FALLBACK_SOURCES = ("fallback", "stale")


def fleet(
    children: Children, cluster: EtcdCluster, managers: int, ttl: float, duration: float, processes: int
) -> dict[str, Any]:
    store = f"etcd://{cluster.endpoints}/fleet"
    lighthouses = start_etcd_fleet(children, "lighthouse-fleet", store, 3)
    addrs = ",".join(addr for _, addr, _ in lighthouses)
    etcd_pids = tuple(m.popen.pid for m in cluster.members if m.popen is not None)
    with SimFleet(children, "fleet", addrs, managers, processes, ttl) as sims:
        window = measure_window(
            sims, [(lh, url) for lh, _, url in lighthouses], ttl, duration, other_pids=etcd_pids
        )
    for lh, _, _ in lighthouses:
        children.stop(lh)
    return {"managers": managers, "lighthouses": 3, "etcd_members": len(cluster.members), **window}


def gap_round(
    children: Children,
    store: str,
    r: int,
    ttl: float,
    healthy_s: float,
    after_s: float,
    sig: signal.Signals = signal.SIGKILL,
) -> dict[str, Any]:
    """One manager on a fresh pair of lighthouses; its lighthouse sent ``sig`` mid-run (the keys
    say "kill" for either signal)."""
    pair = [start_etcd_lighthouse(children, f"lighthouse-gap{r}-{k}", store) for k in range(2)]
    addrs = ",".join(addr for _, addr, _ in pair)
    replica = f"gap-{r}"
    with LighthouseClient(addrs, spread_key=replica) as picker:  # the manager's own pick (no call made)
        used = picker.current
    victim = next(lh for lh, addr, _ in pair if addr == used)
    survivor_url = next(url for _, addr, url in pair if addr != used)
    manager = start_manager(children, addrs, replica, ttl=ttl)
    client = ManagerClient(manager.readline(), timeout=5.0)
    records: list[tuple[float, str, float]] = []  # (answered at, source, call seconds)
    try:
        step = 0
        due = time.monotonic()
        killed_at = None
        end = due + healthy_s + after_s
        while due < end:
            time.sleep(max(0.0, due - time.monotonic()))
            if killed_at is None and due >= end - after_s:
                survivor_calls = lighthouse_calls(survivor_url)
                victim.signal(sig)
                killed_at = time.monotonic()
            step += 1
            started = time.monotonic()
            cfg = client.get_config(step=step)
            records.append((time.monotonic(), cfg.source, time.monotonic() - started))
            due += 0.01
        survivor_calls = lighthouse_calls(survivor_url) - survivor_calls
    finally:
        client.close()
        children.stop(manager)
        for lh, _, _ in pair:
            children.stop(lh)
    assert killed_at is not None
    good = [t for t, source, _ in records if source not in FALLBACK_SOURCES]
    gaps = [(b - a, b) for a, b in itertools.pairwise(good)]
    before = [g for g, t in gaps if t < killed_at]
    after = [g for g, t in gaps if t >= killed_at]
    return {
        "round": r,
        "signal": sig.name,
        "killed": used,
        "steps": len(records),
        "survivor_calls_after_kill": survivor_calls,  # > 0: the manager did move to the other one
        "fallbacks": sum(source in FALLBACK_SOURCES for _, source, _ in records),
        "max_gap_before_ms": max(before) * 1e3 if before else None,
        "max_gap_after_kill_ms": max(after) * 1e3 if after else None,
        "slowest_call_after_kill_ms": max((c for t, _, c in records if t >= killed_at), default=0.0) * 1e3,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    load_before = machine_load()
    with EtcdCluster(work / "etcd", size=3) as cluster, Children(work / "logs") as children:
        fleet_result = fleet(children, cluster, args.managers, args.ttl, args.duration, args.processes)
        store = f"etcd://{cluster.endpoints}/gap"
        first = start_etcd_lighthouse(children, "lighthouse-gap-setup", store)
        AdminClient(first[2]).put(CONFIG)
        children.stop(first[0])
        timing = (args.gap_ttl, args.gap_healthy, args.gap_after)
        gaps = [gap_round(children, store, r, *timing) for r in range(args.gap_rounds)]
        hangs = [gap_round(children, store, r, *timing, signal.SIGSTOP) for r in range(args.gap_rounds)]
    return {
        "machine_before": load_before,
        "machine_after": machine_load(),
        "fleet": fleet_result,
        "gap": {"ttl_s": args.gap_ttl, "step_s": 0.01, "rounds": gaps},
        "hang": {"ttl_s": args.gap_ttl, "step_s": 0.01, "rounds": hangs},
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(results: dict[str, Any]) -> str:
    f = results["fleet"]
    us = {k: f[k] / 1e3 if f[k] is not None else None for k in ("p50", "p99", "max")}
    met = us["p99"] is not None and us["p99"] < 50 and not f["errors"]
    lines = [
        f"Fleet: {f['lighthouses']} lighthouses on one {f['etcd_members']}-member etcd, "
        f"{f['managers']} simulated managers at TTL {f['ttl_s']:g}s",
        f"{'calls/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'errors':>6}  "
        "lighthouse CPU % each  etcd CPU % each  sims CPU %",
        f"{f['lighthouse_calls_per_s']:8.0f} {_ms(us['p50']):>7} {_ms(us['p99']):>7} {_ms(us['max']):>7} "
        f"{f['errors']:6d}  {' / '.join(f'{c:.0f}' for c in f['lighthouse_cpu_pct_each']):21}  "
        f"{' / '.join(f'{c:.0f}' for c in f['other_cpu_pct_each']):15}  {f['sims_cpu_pct']:.0f}",
        f"p99 goal < 50 ms and no errors: {'MET' if met else 'NOT MET'}",
    ]
    for key, what, event in (("gap", "SIGKILLed", "kill"), ("hang", "SIGSTOPped (a hang)", "hang")):
        lines += ["", *_gap_table(results[key], what, event)]
    lines.append(machine_line(results["machine_before"], results["machine_after"]))
    return "\n".join(lines)


def _gap_table(gap: dict[str, Any], what: str, event: str) -> list[str]:
    lines = [
        f"Gap: manager serve --lighthouse A,B (TTL {gap['ttl_s']:g}s), a worker stepping "
        f"every 10 ms; the manager's lighthouse {what}",
        f"{'round':>5} {'steps':>6} {'max gap before ms':>18} {'max gap after it ms':>20} "
        f"{'slowest call ms':>16} {'fallbacks':>9} {'calls to the other':>18}",
    ]
    for g in gap["rounds"]:
        lines.append(
            f"{g['round']:5d} {g['steps']:6d} {_ms(g['max_gap_before_ms']):>18} "
            f"{_ms(g['max_gap_after_kill_ms']):>20} {_ms(g['slowest_call_after_kill_ms']):>16} "
            f"{g['fallbacks']:9d} {g['survivor_calls_after_kill']:18d}"
        )
    rounds = gap["rounds"]
    worst = max((g["max_gap_after_kill_ms"] or 0 for g in rounds), default=0)
    healthy = max((g["max_gap_before_ms"] or 0 for g in rounds), default=0)
    ratio = f" ({worst / healthy:.1f}x the longest healthy gap)" if healthy else ""
    fallbacks = sum(g["fallbacks"] for g in rounds)
    lines.append(f"longest gap after a {event}: {worst:.1f} ms{ratio}; fallbacks served: {fallbacks}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("etcd_fleet", __doc__, fleet=True)
    parser.add_argument(
        "--managers", type=int, default=3000, help="simulated managers over the 3 lighthouses"
    )
    parser.add_argument("--ttl", type=float, default=3.0, help="their TTL (seconds)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of the timed window")
    parser.add_argument("--gap-rounds", type=int, default=5)
    parser.add_argument("--gap-ttl", type=float, default=1.0, help="the real manager's --cache-ttl")
    parser.add_argument("--gap-healthy", type=float, default=2.0, help="seconds of stepping before the kill")
    parser.add_argument("--gap-after", type=float, default=4.0, help="seconds of stepping after the kill")
    quick = {"managers": 30, "ttl": 1.0, "duration": 1.0, "processes": 2}
    quick |= {"gap_rounds": 1, "gap_ttl": 0.5, "gap_healthy": 0.5, "gap_after": 1.5}
    return run_standalone("etcd_fleet", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
