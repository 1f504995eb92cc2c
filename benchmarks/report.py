"""Turns raw results into the printed tables, the goal verdicts of issue 6, JSON and a PNG chart."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    index = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def summarize(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    s = sorted(samples)
    return {
        "n": len(s),
        "p50": percentile(s, 50),
        "p90": percentile(s, 90),
        "p99": percentile(s, 99),
        "mean": sum(s) / len(s),
        "max": s[-1],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True))
    )
    out = [line, "-" * len(line)]
    for row in rows:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(out)


# ------------------------------------------------------------------ goals
def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of issue 6 with the measured value and whether it is met (None: not measured)."""
    out: list[dict[str, Any]] = []

    def goal(name: str, target: str, value: str, met: bool | None) -> None:
        out.append({"goal": name, "target": target, "measured": value, "met": met})

    lat = results.get("latency", {}).get("cases", {})
    floor = lat.get("floor", {})
    hit = lat.get("relay_hit", {})
    r50, r99 = _ratio(hit.get("p50"), floor.get("p50")), _ratio(hit.get("p99"), floor.get("p99"))
    goal(
        "relay cache hit vs floor",
        "p50 <= 1.05x, p99 <= 1.2x",
        f"p50 {_fmt(r50, 2)}x, p99 {_fmt(r99, 2)}x",
        None if r50 is None or r99 is None else r50 <= 1.05 and r99 <= 1.2,
    )
    pre = lat.get("relay_prefetch", {})
    rp = _ratio(pre.get("p50"), floor.get("p50"))
    mem = lat.get("memory_read", {}).get("p50")
    goal(
        "prefetch critical path p50 vs floor p50",
        "<= 0.01x",
        f"{_fmt(rp, 4)}x ({_fmt(pre.get('p50'), 2)} us; dict read after same work {_fmt(mem, 2)} us)",
        None if rp is None else rp <= 0.01,
    )
    tp = results.get("throughput", {})
    m32, f32 = tp.get("manager", {}).get("32", {}), tp.get("floor", {}).get("32", {})
    rt = _ratio(m32.get("calls_per_s"), f32.get("calls_per_s"))
    goal(
        "manager calls/s vs floor, 32 workers",
        ">= 0.9x",
        f"{_fmt(rt, 2)}x ({_fmt(m32.get('calls_per_s'), 0)} vs {_fmt(f32.get('calls_per_s'), 0)}/s)",
        None if rt is None else rt >= 0.9,
    )
    fan = [p for p in results.get("fan_in", {}).get("workers_sweep", [])]
    if fan:
        rates = [p["lighthouse_calls_per_s"] for p in fan]
        spread = (max(rates) - min(rates)) / min(rates) if min(rates) > 0 else math.inf
        goal(
            "lighthouse calls independent of workers",
            f"within 5% from {fan[0]['workers']} to {fan[-1]['workers']} workers",
            f"{spread * 100:.1f}% spread ({min(rates):.2f}..{max(rates):.2f}/s)",
            spread <= 0.05,
        )
    else:
        goal("lighthouse calls independent of workers", "within 5%", "not measured", None)
    for prop in results.get("propagation", []):
        bound = (prop["ttl_s"] + 2 * prop["step_s"]) * 1e6
        p99 = prop.get("p99")
        goal(
            f"propagation p99 at TTL {prop['ttl_s']:g}s",
            f"<= TTL + 2 steps = {bound / 1e3:.0f} ms",
            f"{_fmt(p99 and p99 / 1e3, 0)} ms (p50 {_fmt(prop.get('p50') and prop['p50'] / 1e3, 0)} ms)",
            None if p99 is None else p99 <= bound and prop["missed"] == 0,
        )
    if not results.get("propagation"):
        goal("propagation p99", "<= TTL + 2 steps", "not measured", None)
    out_ = results.get("outage")
    if out_:
        ratio = out_.get("p99_ratio")
        goal(
            "outage p99 vs healthy p99",
            "<= 1.5x",
            f"{_fmt(ratio, 2)}x ({_fmt(out_['outage']['p99'], 0)} vs {_fmt(out_['healthy']['p99'], 0)} us)",
            None if ratio is None else ratio <= 1.5,
        )
    else:
        goal("outage p99 vs healthy p99", "<= 1.5x", "not measured", None)
    sc = results.get("scale", [])
    if sc:
        top = sc[-1]
        p99 = top.get("p99")
        goal(
            f"lighthouse with {top['managers']} managers at {top['ttl_s']:g}s TTL",
            "1,000 managers, p99 < 50 ms",
            f"p99 {_fmt(p99 and p99 / 1e3, 1)} ms, {top['lighthouse_calls_per_s']:.0f} calls/s, "
            f"CPU {top['lighthouse_cpu_pct']:.0f}%, {top['errors']} errors",
            None if p99 is None or top["managers"] < 1000 else p99 < 50_000 and top["errors"] == 0,
        )
    else:
        goal("lighthouse with 1,000 managers", "p99 < 50 ms", "not measured", None)
    return out


# ------------------------------------------------------------------ print
def render(results: dict[str, Any]) -> str:
    parts: list[str] = []
    lat = results.get("latency")
    if lat:
        cases = lat["cases"]
        floor = cases.get("floor", {})
        rows = []
        for name, c in cases.items():
            rows.append(
                [
                    name,
                    _fmt(c["p50"]),
                    _fmt(c["p90"]),
                    _fmt(c["p99"]),
                    _fmt(_ratio(c["p50"], floor.get("p50")), 3),
                    _fmt(_ratio(c["p99"], floor.get("p99")), 3),
                    c["label"],
                ]
            )
        parts.append(
            f"Per-call latency, one client, interleaved "
            f"({lat['rounds']} rounds x {lat['batch']} calls per case), us"
        )
        parts.append(table(["case", "p50", "p90", "p99", "p50/floor", "p99/floor", "what"], rows))
        for name, why in lat.get("skipped", {}).items():
            parts.append(f"  skipped {name}: {why}")
        pre = lat.get("prefetch_stats")
        if pre:
            parts.append(
                f"  prefetch: {pre['from_memory']}/{pre['calls']} steps answered from memory, "
                f"{pre['wrong_step']} of another step, {pre['not_pinned']} not pinned"
            )
        mgr = lat.get("manager")
        if mgr:
            parts.append(
                f"  manager: {mgr['waited']:,} of {mgr['calls']:,} calls waited for the lighthouse; "
                f"step lease through step {mgr['lease_through_step']:,} at step {mgr['last_step']:,}"
            )
    tp = results.get("throughput")
    if tp:
        rows = []
        for n in next(iter(tp.values())):
            m, f = tp["manager"][n], tp["floor"][n]
            rows.append(
                [
                    n,
                    _fmt(m["calls_per_s"], 0),
                    _fmt(f["calls_per_s"], 0),
                    _fmt(_ratio(m["calls_per_s"], f["calls_per_s"]), 2),
                    _fmt(m["p99"], 0),
                    _fmt(f["p99"], 0),
                ]
            )
        parts.append(
            "\nThroughput of one manager vs the floor server (ManagerClient workers, threads over processes)"
        )
        parts.append(table(["workers", "manager/s", "floor/s", "ratio", "mgr p99 us", "floor p99 us"], rows))
    fan = results.get("fan_in")
    if fan:
        rows = [
            [
                sweep.split("_")[0],
                str(p["managers"]),
                str(p["workers"]),
                _fmt(p["lighthouse_calls_per_s"], 2),
                _fmt(p["expected_per_s"], 1),
                _fmt(p["worker_calls_per_s"], 0),
            ]
            for sweep in ("workers_sweep", "managers_sweep")
            for p in fan.get(sweep, [])
        ]
        parts.append(f"\nFan-in: lighthouse calls/s at TTL {fan['ttl_s']:g}s (expected = managers / TTL)")
        parts.append(
            table(["sweep", "managers", "workers", "lighthouse/s", "expected/s", "worker calls/s"], rows)
        )
    prop = results.get("propagation")
    if prop:
        rows = [
            [
                f"{p['ttl_s']:g}",
                str(p["changes"]),
                str(p["workers"]),
                _fmt(p["p50"] and p["p50"] / 1e3, 0),
                _fmt(p["p99"] and p["p99"] / 1e3, 0),
                f"{(p['ttl_s'] + 2 * p['step_s']) * 1e3:.0f}",
                str(p["missed"]),
            ]
            for p in prop
        ]
        parts.append("\nPropagation: acknowledged PATCH -> every worker (prefetch on) has seen it")
        parts.append(table(["TTL s", "changes", "workers", "p50 ms", "p99 ms", "bound ms", "missed"], rows))
    out_ = results.get("outage")
    if out_:
        waited = out_["first_deadline_max_us"]
        parts.append(
            f"\nOutage (lighthouse SIGSTOPped, deadline {out_['deadline_s']:g}s): per-call p50/p99 "
            f"healthy {_fmt(out_['healthy']['p50'], 0)}/{_fmt(out_['healthy']['p99'], 0)} us, "
            f"during {_fmt(out_['outage']['p50'], 0)}/{_fmt(out_['outage']['p99'], 0)} us; "
            f"slowest call around the first deadline: {_fmt(waited and waited / 1e3, 0)} ms; "
            f"fallback share {out_['outage_fallback_share']:.0%}; "
            f"serving the lighthouse again {_fmt(out_['recovered_after_s'], 2)} s after SIGCONT"
        )
    sc = results.get("scale")
    if sc:
        rows = [
            [
                str(s["managers"]),
                _fmt(s["lighthouse_calls_per_s"], 0),
                _fmt(s["lighthouse_cpu_pct"], 0),
                _fmt(s["p50"] and s["p50"] / 1e3, 2),
                _fmt(s["p99"] and s["p99"] / 1e3, 2),
                str(s["errors"]),
            ]
            for s in sc
        ]
        parts.append(f"\nScale: one lighthouse process, simulated managers at TTL {sc[0]['ttl_s']:g}s")
        parts.append(table(["managers", "calls/s", "CPU % core", "p50 ms", "p99 ms", "errors"], rows))
    parts.append("\nGoals (issue 6)")
    for g in results.get("goals", []):
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[g["met"]]
        parts.append(f"  [{verdict:>7}] {g['goal']}: {g['measured']}  (target {g['target']})")
    return "\n".join(parts)


# ------------------------------------------------------------------ files
def run_meta(**extra: Any) -> dict[str, Any]:
    """Taken when a run starts, so its figures can be checked against the code they measured (the
    commit; ``dirty``: with uncommitted changes) and the machine they shared (the load average)."""
    import grpc

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except OSError:
            return ""

    return {
        **extra,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "loadavg_before": list(os.getloadavg()),
    }


def write_json(results: dict[str, Any], path: Path) -> None:
    """Every result file goes through here: the raw figures under the run's ``meta`` (from
    ``run_meta``), completed with when the run ended and the load average then."""
    meta = results["meta"]
    meta["finished_utc"] = datetime.now(UTC).isoformat(timespec="seconds")
    meta["loadavg_after"] = list(os.getloadavg())
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")


def standalone_parser(name: str, doc: str, *, fleet: bool = False) -> argparse.ArgumentParser:
    """The options every standalone benchmark shares; ``fleet``: it simulates managers in
    several processes, and ``--processes`` says how many."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny counts: a smoke run of seconds")
    if fleet:
        parser.add_argument("--processes", type=int, default=4, help="processes simulating managers")
    parser.add_argument("--out", type=Path, default=None, help=f"also write {name}.json here")
    return parser


def machine_load() -> dict[str, Any]:
    """The 1-minute load average and CPU count, to record beside figures from a shared machine."""
    return {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}


def machine_line(before: dict[str, Any], after: dict[str, Any]) -> str:
    load = f"{before['loadavg_1m']:.2f}/{after['loadavg_1m']:.2f}"
    return f"load average before/after: {load} on {before['cpus']} CPUs"


def run_standalone(
    name: str,
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    quick: dict[str, Any],
    run: Callable[[argparse.Namespace, Path], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """``main`` of a standalone benchmark: parse (``--quick`` overrides with ``quick``), run in a
    throwaway folder, print the table, write the JSON."""
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(quick)
    meta = run_meta(benchmark=name, argv=sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        results = run(args, Path(tmp))
    results["meta"] = meta
    publish(render(results), results, args.out, name)
    return 0


def publish(text: str, results: dict[str, Any], out: Path | None, name: str) -> None:
    """End of a standalone benchmark: print its table; with ``--out``, write ``out/name.json``."""
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(results, out / f"{name}.json")


def write_chart(results: dict[str, Any], path: Path) -> None:
    """One PNG: latency per case, throughput, fan-in, propagation and scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(18, 10))
    fig.suptitle(f"lighthouse-config benchmark ({results['meta']['mode']}, {results['meta']['started']})")

    ax = axes[0][0]
    lat = results.get("latency", {}).get("cases", {})
    if lat:
        names = list(lat)
        ys = range(len(names))
        ax.barh([y + 0.2 for y in ys], [lat[n]["p50"] for n in names], height=0.4, label="p50")
        ax.barh([y - 0.2 for y in ys], [lat[n]["p99"] for n in names], height=0.4, label="p99")
        ax.set_yticks(list(ys), names, fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("µs per call (log)")
        ax.invert_yaxis()
        floor = lat.get("floor", {}).get("p50")
        if floor:
            ax.axvline(floor, color="k", linestyle=":", linewidth=1, label="floor p50")
        ax.set_xlim(right=ax.get_xlim()[1] * 20)  # room for the legend
        ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Per-call latency, one client")

    ax = axes[0][1]
    tp = results.get("throughput", {})
    for name, points in tp.items():
        xs = [int(n) for n in points]
        ax.plot(xs, [points[n]["calls_per_s"] for n in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent workers")
    ax.set_ylabel("calls/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput: one manager vs plain grpcio server")
    if tp:
        ax.legend()

    ax = axes[0][2]
    fan = results.get("fan_in", {})
    for sweep, key, style in (("workers_sweep", "workers", "o-"), ("managers_sweep", "managers", "s-")):
        pts = fan.get(sweep, [])
        if pts:
            ax.plot(
                [p[key] for p in pts], [p["lighthouse_calls_per_s"] for p in pts], style, label=f"vs {key}"
            )
            ax.plot([p[key] for p in pts], [p["expected_per_s"] for p in pts], "k:", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers (1 manager) / managers")
    ax.set_ylabel("lighthouse calls/s")
    ax.set_title(f"Fan-in at TTL {fan.get('ttl_s', '?')} s (dotted: managers/TTL)")
    if fan:
        ax.legend()

    ax = axes[1][0]
    prop = results.get("propagation", [])
    if prop:
        xs = [p["ttl_s"] for p in prop]
        ax.plot(xs, [p["p50"] / 1e3 for p in prop], "o-", label="p50")
        ax.plot(xs, [p["p99"] / 1e3 for p in prop], "s-", label="p99")
        ax.plot(xs, [(p["ttl_s"] + 2 * p["step_s"]) * 1e3 for p in prop], "k:", label="TTL + 2 steps")
        ax.legend()
    ax.set_xlabel("cache TTL (s)")
    ax.set_ylabel("ms")
    ax.set_title("Propagation: acknowledged change -> all workers")

    ax = axes[1][1]
    out_ = results.get("outage")
    if out_:
        labels = ["healthy", "lighthouse stopped"]
        ax.bar([0, 1], [out_["healthy"]["p50"], out_["outage"]["p50"]], width=0.35, label="p50")
        ax.bar([0.35, 1.35], [out_["healthy"]["p99"], out_["outage"]["p99"]], width=0.35, label="p99")
        ax.set_xticks([0.175, 1.175], labels)
        ax.set_ylabel("µs per call")
        ax.legend()
    ax.set_title("Outage: per-call latency after the first deadline")

    ax = axes[1][2]
    sc = results.get("scale", [])
    if sc:
        xs = [s["managers"] for s in sc]
        ax.plot(xs, [s["p99"] / 1e3 for s in sc], "o-", label="p99 ms")
        ax.plot(xs, [s["lighthouse_cpu_pct"] for s in sc], "s-", label="lighthouse CPU % of a core")
        ax.axhline(50, color="k", linestyle=":", linewidth=1, label="50 ms goal")
        ax.set_xlabel("simulated managers")
        ax.legend()
    ax.set_title("Scale: one lighthouse, fetch per manager per TTL")

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
