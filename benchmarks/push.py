"""Push streams (issue 17): ``python -m benchmarks.push [--quick] [--out DIR]``.

* ``workers``: one ``lighthouse serve``, ``--managers`` ``manager serve --push`` and as many
  ``--poll`` processes (TTL 1 s), each with ``--workers-per-manager`` worker threads (in
  ``benchmarks.agent workers`` processes) calling ``get_config()`` without a step every
  ``--step-ms``. Edits (PATCH) at random moments; for each, the time from the acknowledged PATCH
  until the last worker of each kind had that version. Both kinds see the same edits at once.
* ``idle``: lighthouse CPU and RSS (``/proc/<pid>``) with ``--poll-managers`` simulated polling
  managers at TTL 1 s (``agent sims``), then, on a fresh lighthouse, with each level of
  ``--streams`` idle pushed managers (``agent streams``: ``WatchConfig`` streams on ``grpc.aio``,
  several processes). RSS per stream is (RSS with N streams - RSS before any) / N.
* ``fanout``: on that lighthouse with the largest level open, ``--fanout-edits`` edits; for each,
  the time until the last stream had it.
* ``etcd``: 3 lighthouses on a 3-member etcd, ``--etcd-streams`` pushed managers spread evenly
  over them; edits through the first: the time until the last stream (on any of them) had it.

The load generators share the machine's cores with the lighthouse: their CPU is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.etcd_store import start_etcd_fleet
from benchmarks.load import SimFleet, StreamFleet, deliveries, last_worker_delays, measure_window
from benchmarks.procs import Children, CpuMeter, rss_bytes
from benchmarks.report import (
    machine_line,
    machine_load,
    percentile,
    run_standalone,
    standalone_parser,
    summarize,
)
from benchmarks.stack import patch_config, start_lighthouse, start_manager
from lighthouse.client import LighthouseClient
from tests.etcd_cluster import EtcdCluster
from tests.procs import Proc, poll

GOAL_WORKERS_P99_MS = 50.0  # change -> every worker, pushed (0.05x the 1 s TTL)
GOAL_RSS_PER_STREAM_KIB = 50.0
GOAL_FANOUT_P99_MS = 500.0


def open_streams(url: str, timeout: float = 10.0) -> int:
    """Push streams open at a lighthouse, all jobs summed, from ``/metrics``."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
        lines = response.read().decode().splitlines()
    return sum(int(float(line.split()[-1])) for line in lines if line.startswith("lighthouse_watch_streams{"))


def edit_at_random(url: str, edits: int, gap: tuple[float, float]) -> list[tuple[int, float]]:
    """``edits`` PATCHes, each after a random pause in ``gap`` seconds: (version, acknowledged at)."""
    acks = []
    for i in range(edits):
        time.sleep(random.uniform(*gap))
        version = patch_config(url, {"bench_push": i})
        acks.append((version, time.monotonic()))
    return acks


# ---------------------------------------------------------------- workers
def change_to_workers(children: Children, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Pushed and polling managers side by side on one lighthouse, the same edits for both."""
    lh, addr, url = start_lighthouse(children, work, "lighthouse-workers")
    kinds = {"push": True, "poll": False}
    managers = {
        kind: [
            start_manager(children, addr, f"{kind}-m{i}", ttl=args.ttl, push=push)
            for i in range(args.managers)
        ]
        for kind, push in kinds.items()
    }
    addrs = {kind: [m.readline() for m in ms] for kind, ms in managers.items()}
    poll(lambda: open_streams(url) == args.managers, 30, 0.1, "the pushed managers' streams")
    agents = {
        kind: [
            children.python(f"workers-{kind}-{i}", "-m", "benchmarks.agent", "workers")
            for i in range(args.worker_processes)
        ]
        for kind in kinds
    }
    workers = args.managers * args.workers_per_manager
    step_s = args.step_ms / 1e3
    gap = (0.5 * args.ttl, 1.5 * args.ttl)  # random moments against the polling managers' TTL
    warmup = 2 * args.ttl + 0.5
    duration = warmup + args.edits * gap[1] + 2 * args.ttl + 1.0
    for kind, procs in agents.items():
        for i, agent in enumerate(procs):
            if json.loads(agent.readline()) != "ready":
                raise RuntimeError(f"{agent.name} did not start")
            threads = [j for j in range(workers) if j % len(procs) == i]  # worker j: manager j % managers
            cmd = {
                "op": "watch",
                "addrs": [addrs[kind][j % args.managers] for j in threads],
                "threads": len(threads),
                "duration": duration,
                "step_s": step_s,
                "no_step": True,
            }
            agent.send(json.dumps(cmd))
    time.sleep(warmup)  # every worker has its first config, every polling manager has fetched twice
    acks = edit_at_random(url, args.edits, gap)
    result: dict[str, Any] = {
        "ttl_s": args.ttl,
        "step_ms": args.step_ms,
        "edits": len(acks),
        "managers_each": args.managers,
        "workers_each": workers,
    }
    for kind, procs in agents.items():
        seen = [s for agent in procs for s in json.loads(agent.readline(duration + 60))["seen"]]
        delays, missed = last_worker_delays(seen, acks)
        result[kind] = {"missed": missed, **_ms_summary(delays)}
    for agent in [a for procs in agents.values() for a in procs]:
        agent.send(json.dumps({"op": "quit"}))
        children.stop(agent)
    for m in [m for ms in managers.values() for m in ms]:
        children.stop(m)
    children.stop(lh)
    return result


def _ms_summary(delays_us: list[float]) -> dict[str, Any]:
    s = summarize(delays_us)
    return {"n": s["n"], **{k: None if s[k] is None else s[k] / 1e3 for k in ("p50", "p90", "p99", "max")}}


# ------------------------------------------------------------------- idle
def polling_cost(children: Children, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A lighthouse with ``--poll-managers`` simulated polling managers at the TTL: CPU, RSS, calls."""
    lh, addr, url = start_lighthouse(children, work, "lighthouse-poll")
    rss_before = rss_bytes(lh.pid)
    try:
        with SimFleet(children, "poll", addr, args.poll_managers, args.processes, args.ttl) as fleet:
            w = measure_window(fleet, [(lh, url)], args.ttl, args.poll_window)
            rss = rss_bytes(lh.pid)
    finally:
        children.stop(lh)
    return {
        "managers": args.poll_managers,
        "ttl_s": args.ttl,
        "window_s": args.poll_window,
        "lighthouse_cpu_pct": w["lighthouse_cpu_pct"],
        "load_cpu_pct": w["sims_cpu_pct"],
        "calls_per_s": w["lighthouse_calls_per_s"],
        "p99_ms": None if w["p99"] is None else w["p99"] / 1e3,
        "errors": w["errors"],
        "rss_before_mib": rss_before / 2**20,
        "rss_mib": rss / 2**20,
        "rss_per_manager_kib": (rss - rss_before) / args.poll_managers / 1024,
    }


def pushed_cost(lh: Proc, url: str, fleet: StreamFleet, args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each level of ``--streams``: open streams up to it, then the lighthouse's RSS and its and
    the load's CPU over ``--idle-window`` seconds of nothing but keep-alives."""
    rss_before = rss_bytes(lh.pid)
    levels = []
    for level in args.streams:
        opened = fleet.open(level - fleet.count)
        poll(lambda: open_streams(url) == fleet.count, 30, 0.2, f"{fleet.count} streams at the lighthouse")
        meter = CpuMeter([lh.pid, *fleet.pids])
        time.sleep(args.idle_window)
        cpu = meter.percent()
        rss = rss_bytes(lh.pid)
        levels.append(
            {
                "streams": fleet.count,
                "connections": opened["connections"],
                "open_s": opened["seconds"],
                "window_s": args.idle_window,
                "lighthouse_cpu_pct": cpu[0],
                "load_cpu_pct": sum(cpu[1:]),
                "rss_before_mib": rss_before / 2**20,
                "rss_mib": rss / 2**20,
                "rss_per_stream_kib": (rss - rss_before) / fleet.count / 1024,
            }
        )
    return levels


# ----------------------------------------------------------------- fan-out
def fan_out(
    lighthouses: list[Proc], url: str, fleets: list[StreamFleet], edits: int, gap: float
) -> dict[str, Any]:
    """``edits`` edits through ``url``, ``gap`` to ``1.5 gap`` seconds apart; per edit, when the
    streams of ``fleets`` had it. Lighthouse CPU over the edits."""
    meter = CpuMeter([lh.pid for lh in lighthouses])
    acks = edit_at_random(url, edits, (gap, 1.5 * gap))
    streams = sum(f.count for f in fleets)
    poll(
        lambda: deliveries(fleets, acks[-1:])[0]["have"] == streams, 60, 0.5, "the last edit at every stream"
    )
    cpu, cpu_s = meter.percent(), meter.seconds()
    per_edit = deliveries(fleets, acks)
    return {
        "streams": streams,
        # CPU of the lighthouses over the edits per message delivered: an upper bound (the window
        # also holds the keep-alives and the edits' HTTP requests), machine noise mostly left out.
        "lighthouse_cpu_us_per_message": 1e6 * sum(cpu_s) / (streams * len(acks)),
        "acks": acks,  # (version, acknowledged at): monotonic, as the agents' times
        "edits": per_edit,
        "lighthouse_cpu_pct_each": cpu,
        **_over_edits(per_edit),
    }


def _over_edits(per_edit: list[dict[str, Any]]) -> dict[str, Any]:
    """The time to the last stream, over edits: p50, p99 (nearest rank), max; and edits some stream missed."""
    lasts = sorted(e["last_ms"] for e in per_edit if e["have"] == e["streams"])
    return {
        "last_p50_ms": percentile(lasts, 50) if lasts else None,
        "last_p99_ms": percentile(lasts, 99) if lasts else None,
        "last_max_ms": lasts[-1] if lasts else None,
        "stream_p50_ms": statistics.median(e["p50_ms"] for e in per_edit) if per_edit else None,
        "missed": sum(e["have"] < e["streams"] for e in per_edit),
    }


def etcd_fan_out(children: Children, cluster: EtcdCluster, args: argparse.Namespace) -> dict[str, Any]:
    """3 lighthouses on one etcd, the streams spread evenly; edits through the first."""
    lighthouses = start_etcd_fleet(children, "lighthouse-etcd", f"etcd://{cluster.endpoints}/push", 3)
    fleets = []
    try:
        for i, (_, addr, _) in enumerate(lighthouses):
            fleets.append(
                StreamFleet(children, f"etcd-streams-{i}", addr, args.etcd_processes, args.per_connection)
            )
            fleets[-1].open(args.etcd_streams // 3 + (i < args.etcd_streams % 3))
        result = fan_out(
            [lh for lh, _, _ in lighthouses], lighthouses[0][2], fleets, args.etcd_edits, args.gap
        )
        result["per_lighthouse"] = [  # the same edits, each lighthouse's streams alone
            {"streams": fleet.count, **_over_edits(deliveries([fleet], result["acks"]))} for fleet in fleets
        ]
    finally:
        for fleet in fleets:
            fleet.stop()
        for lh, _, _ in lighthouses:
            children.stop(lh)
    return {"lighthouses": 3, "etcd_members": len(cluster.members), **result}


# -------------------------------------------------------------------- run
def raise_fd_limit() -> int:
    """Soft file-descriptor limit up to the hard one (children inherit it: a lighthouse holding a
    connection per simulated manager needs one descriptor each); the limit now."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    fd_limit = raise_fd_limit()
    load_before = machine_load()
    with Children(work / "logs") as children:
        workers = change_to_workers(children, work, args)
        polling = polling_cost(children, work, args)
        lh, addr, url = start_lighthouse(children, work, "lighthouse-push")
        with LighthouseClient(addr) as client:
            client.fetch(timeout=10)  # the gRPC side has served a call before RSS is first read
        with StreamFleet(children, "streams", addr, args.processes, args.per_connection) as fleet:
            pushed = pushed_cost(lh, url, fleet, args)
            fanout = fan_out([lh], url, [fleet], args.fanout_edits, args.gap)
        children.stop(lh)
        with EtcdCluster(work / "etcd", size=3) as cluster:
            etcd = etcd_fan_out(children, cluster, args)
    results = {
        "machine_before": load_before,
        "machine_after": machine_load(),
        "fd_limit": fd_limit,
        "processes": args.processes,
        "per_connection": args.per_connection,
        "workers": workers,
        "idle": {"polling": polling, "pushed": pushed},
        "fanout": fanout,
        "etcd": etcd,
    }
    results["goals"] = goals(results)
    return results


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []

    def goal(name: str, target: str, measured: str, met: bool | None) -> None:
        out.append({"goal": name, "target": target, "measured": measured, "met": met})

    w = results["workers"]
    push, poll = w["push"], w["poll"]
    goal(
        f"change -> every worker, pushed, TTL {w['ttl_s']:g} s",
        f"p99 <= {GOAL_WORKERS_P99_MS:g} ms",
        f"p50 {_ms(push['p50'])} ms, p99 {_ms(push['p99'])} ms (polling: p50 {_ms(poll['p50'])}, "
        f"p99 {_ms(poll['p99'])} ms; push/poll p99 {_ratio(push['p99'], poll['p99'])}x)",
        None if push["p99"] is None else push["p99"] <= GOAL_WORKERS_P99_MS and push["missed"] == 0,
    )
    polling, top = results["idle"]["polling"], results["idle"]["pushed"][-1]
    goal(
        f"lighthouse CPU, {top['streams']:,} idle pushed vs {polling['managers']:,} polling",
        "less",
        f"{top['lighthouse_cpu_pct']:.1f}% vs {polling['lighthouse_cpu_pct']:.1f}% of a core "
        f"({_ratio(top['lighthouse_cpu_pct'], polling['lighthouse_cpu_pct'])}x)",
        top["lighthouse_cpu_pct"] < polling["lighthouse_cpu_pct"],
    )
    worst = max(results["idle"]["pushed"], key=lambda p: p["rss_per_stream_kib"])
    goal(
        "lighthouse RSS per idle stream",
        f"<= {GOAL_RSS_PER_STREAM_KIB:g} KiB",
        ", ".join(
            f"{p['rss_per_stream_kib']:.1f} KiB at {p['streams']:,}" for p in results["idle"]["pushed"]
        ),
        worst["rss_per_stream_kib"] <= GOAL_RSS_PER_STREAM_KIB,
    )
    for key, name in (("fanout", "one lighthouse"), ("etcd", "3 lighthouses on etcd")):
        f = results[key]
        goal(
            f"one edit -> {f['streams']:,} streams, {name}",
            f"p99 <= {GOAL_FANOUT_P99_MS:g} ms" if key == "fanout" else "(no goal; reported)",
            f"last stream p50 {_ms(f['last_p50_ms'])} ms, p99 {_ms(f['last_p99_ms'])} ms over "
            f"{len(f['edits'])} edits, {f['missed']} missed",
            (f["last_p99_ms"] is not None and f["last_p99_ms"] <= GOAL_FANOUT_P99_MS and not f["missed"])
            if key == "fanout"
            else None,
        )
    return out


# ----------------------------------------------------------------- render
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def render(results: dict[str, Any]) -> str:
    w = results["workers"]
    lines = [
        f"Change -> every worker: {w['managers_each']} pushed and {w['managers_each']} polling managers "
        f"(TTL {w['ttl_s']:g} s), {w['workers_each']} workers each calling get_config() every "
        f"{w['step_ms']:g} ms, {w['edits']} edits at random moments",
        f"{'kind':5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'missed':>6}",
    ]
    for kind in ("push", "poll"):
        k = w[kind]
        lines.append(
            f"{kind:5} {_ms(k['p50']):>8} {_ms(k['p90']):>8} {_ms(k['p99']):>8} {_ms(k['max']):>8} "
            f"{k['missed']:6d}"
        )
    lines.append(
        f"push / poll: p50 {_ratio(w['push']['p50'], w['poll']['p50'])}x, "
        f"p99 {_ratio(w['push']['p99'], w['poll']['p99'])}x"
    )
    polling = results["idle"]["polling"]
    lines += [
        "",
        f"Idle cost: lighthouse CPU and RSS; load processes {results['processes']}, "
        f"{results['per_connection']} stream(s) per connection",
        f"{'case':22} {'CPU % core':>10} {'load CPU %':>10} {'RSS MiB':>8} {'KiB each':>8}",
        f"{'polling ' + format(polling['managers'], ','):22} {polling['lighthouse_cpu_pct']:10.1f} "
        f"{polling['load_cpu_pct']:10.1f} {polling['rss_mib']:8.1f} {polling['rss_per_manager_kib']:8.1f}"
        f"   ({polling['calls_per_s']:.0f} calls/s, p99 {_ms(polling['p99_ms'])} ms, "
        f"{polling['errors']} errors)",
    ]
    for p in results["idle"]["pushed"]:
        lines.append(
            f"{'pushed ' + format(p['streams'], ','):22} {p['lighthouse_cpu_pct']:10.1f} "
            f"{p['load_cpu_pct']:10.1f} {p['rss_mib']:8.1f} {p['rss_per_stream_kib']:8.1f}   "
            f"(RSS before {p['rss_before_mib']:.1f} MiB, "
            f"{p['connections']:,} connections)"
        )
    for key, title in (
        ("fanout", "One edit fanned out, one lighthouse"),
        ("etcd", "One edit through A, 3 lighthouses on a 3-member etcd"),
    ):
        f = results[key]
        lines += [
            "",
            f"{title}: {f['streams']:,} streams, time from the acknowledged PATCH (ms)",
            f"{'edit':>4} {'version':>7} {'first':>7} {'p50':>7} {'p99':>7} {'last':>7} {'have':>7}",
        ]
        for i, e in enumerate(f["edits"]):
            lines.append(
                f"{i:4d} {e['version']:7d} {_ms(e['first_ms']):>7} {_ms(e['p50_ms']):>7} "
                f"{_ms(e['p99_ms']):>7} {_ms(e['last_ms']):>7} {e['have']:7d}"
            )
        lines.append(
            f"last stream over edits: p50 {_ms(f['last_p50_ms'])}, p99 {_ms(f['last_p99_ms'])}, "
            f"max {_ms(f['last_max_ms'])} ms; lighthouse CPU during the edits "
            + " / ".join(f"{c:.0f}%" for c in f["lighthouse_cpu_pct_each"])
            + f", {f['lighthouse_cpu_us_per_message']:.0f} us of lighthouse CPU per message sent"
        )
        for i, per in enumerate(f.get("per_lighthouse", [])):
            lines.append(
                f"  lighthouse {'ABC'[i]}: {per['streams']:,} streams, last p50 {_ms(per['last_p50_ms'])}, "
                f"p99 {_ms(per['last_p99_ms'])} ms"
            )
    lines += ["", "Goals (issue 17)"]
    for g in results["goals"]:
        verdict = {True: "MET", False: "NOT MET", None: "-"}[g["met"]]
        lines.append(f"  [{verdict:>7}] {g['goal']}: {g['measured']}  (target {g['target']})")
    lines.append(machine_line(results["machine_before"], results["machine_after"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("push", __doc__, fleet=True)
    parser.add_argument("--ttl", type=float, default=1.0, help="managers' cache TTL (seconds)")
    parser.add_argument(
        "--managers", type=int, default=3, help="workers: pushed managers, and as many polling"
    )
    parser.add_argument("--workers-per-manager", type=int, default=2)
    parser.add_argument("--worker-processes", type=int, default=2, help="workers: processes per kind")
    parser.add_argument("--step-ms", type=float, default=10.0, help="workers: ms between get_config() calls")
    parser.add_argument("--edits", type=int, default=30, help="workers: edits")
    parser.add_argument("--poll-managers", type=int, default=1000, help="idle: simulated polling managers")
    parser.add_argument("--poll-window", type=float, default=10.0, help="idle: seconds of the polling window")
    parser.add_argument(
        "--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 10000], help="idle: levels"
    )
    parser.add_argument(
        "--idle-window", type=float, default=30.0, help="idle: seconds per level (two keep-alive periods)"
    )
    parser.add_argument("--per-connection", type=int, default=1, help="streams per HTTP/2 connection")
    parser.add_argument("--fanout-edits", type=int, default=20)
    parser.add_argument("--gap", type=float, default=2.0, help="fan-out: seconds between edits (to 1.5x)")
    parser.add_argument("--etcd-streams", type=int, default=10000)
    parser.add_argument("--etcd-processes", type=int, default=2, help="etcd: stream processes per lighthouse")
    parser.add_argument("--etcd-edits", type=int, default=20)
    quick = {"managers": 1, "workers_per_manager": 1, "worker_processes": 1, "edits": 3, "ttl": 0.5}
    quick |= {"poll_managers": 20, "poll_window": 1.0, "streams": [20, 60], "idle_window": 1.0}
    quick |= {"fanout_edits": 2, "gap": 0.3, "etcd_streams": 30, "etcd_processes": 1, "etcd_edits": 2}
    quick |= {"processes": 2}
    return run_standalone("push", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
