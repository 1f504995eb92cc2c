"""Multi-process measurements: throughput, fan-in, propagation, outage and scale.

Load comes from ``benchmarks.agent`` children (threads across several processes,
started fresh, never forked), so the client side is not one GIL-bound process.
Each function returns plain JSON-able results; ``report`` turns them into
tables, goals and the chart.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from benchmarks.procs import Children, CpuMeter
from benchmarks.report import summarize
from benchmarks.stack import lighthouse_calls, patch_config, start_lighthouse, start_manager
from tests.procs import Proc
from worker_client import ManagerClient


class WorkerPool:
    """Several ``agent workers`` processes; a command goes to all of them and their answers come back."""

    def __init__(self, children: Children, processes: int) -> None:
        self.agents = [
            children.python(f"workers-{i}", "-m", "benchmarks.agent", "workers") for i in range(processes)
        ]
        for agent in self.agents:
            if json.loads(agent.readline()) != "ready":
                raise RuntimeError(f"{agent.name} did not start")

    def each(self, commands: list[dict[str, Any]], timeout: float = 120.0) -> list[Any]:
        for agent, cmd in zip(self.agents, commands, strict=True):
            agent.send(json.dumps(cmd))
        return [json.loads(agent.readline(timeout)) for agent in self.agents]

    def split(self, total: int) -> list[int]:
        """``total`` threads spread over the processes as evenly as possible."""
        n = len(self.agents)
        return [total // n + (i < total % n) for i in range(n)]


# ------------------------------------------------------------- throughput
def throughput(
    pool: WorkerPool, targets: dict[str, str], concurrency: list[int], rounds: int, duration: float
) -> dict[str, Any]:
    """Calls/s of each target under N closed-loop workers; targets alternate within a round."""
    calls: dict[str, dict[int, list[float]]] = {name: {n: [] for n in concurrency} for name in targets}
    lat: dict[str, dict[int, list[float]]] = {name: {n: [] for n in concurrency} for name in targets}
    for n in concurrency:
        split = pool.split(n)
        for addr in targets.values():
            pool.each([{"op": "prepare", "addrs": [addr], "threads": t} for t in split])
    for r in range(rounds):
        for n in concurrency:
            names = list(targets) if r % 2 == 0 else list(reversed(targets))
            split = pool.split(n)
            for name in names:
                start = time.monotonic() + 0.2
                cmds = [
                    {"op": "run", "addr": targets[name], "threads": t, "start": start, "duration": duration}
                    for t in split
                ]
                answers = pool.each(cmds)
                calls[name][n].append(sum(a["calls"] for a in answers) / duration)
                lat[name][n].extend(x for a in answers for x in a["lat"])
    return {
        name: {
            str(n): {
                "calls_per_s": sorted(calls[name][n])[len(calls[name][n]) // 2],
                "rounds": calls[name][n],
                **summarize(lat[name][n]),
            }
            for n in concurrency
        }
        for name in targets
    }


# ----------------------------------------------------------------- fan-in
def fan_in(
    children: Children,
    pool: WorkerPool,
    lighthouse_addr: str,
    url: str,
    points: list[tuple[int, int]],
    ttl: float,
    duration: float,
    step_s: float,
) -> list[dict[str, Any]]:
    """Lighthouse calls/s for each (managers, workers) point, managers hosted in up to 4 processes."""
    out = []
    for managers, workers in points:
        hosts: list[Proc] = []
        try:
            per_host = [managers // 4 + (i < managers % 4) for i in range(min(4, managers))]
            for i, count in enumerate(per_host):
                hosts.append(
                    children.python(
                        f"managers-{managers}x{workers}-{i}",
                        "-m",
                        "benchmarks.agent",
                        "managers",
                        "--lighthouse",
                        lighthouse_addr,
                        "--count",
                        str(count),
                        "--ttl",
                        str(ttl),
                        "--prefix",
                        f"fanin-{managers}x{workers}-{i}",
                    )
                )
            addrs = [a for host in hosts for a in json.loads(host.readline())]
            split = pool.split(workers)
            # Worker j of the job uses manager j % managers: spread the addresses over the processes.
            offsets = [sum(split[:i]) for i in range(len(split))]
            per_agent = [
                [addrs[(o + k) % managers] for k in range(max(t, 1))]
                for o, t in zip(offsets, split, strict=True)
            ]
            pool.each(
                [{"op": "prepare", "addrs": a, "threads": t} for a, t in zip(per_agent, split, strict=True)]
            )
            start = time.monotonic() + 2 * ttl + 0.2
            cmds = [
                {
                    "op": "loop",
                    "addrs": a,
                    "threads": t,
                    "start": start,
                    "duration": duration,
                    "step_s": step_s,
                }
                for a, t in zip(per_agent, split, strict=True)
            ]
            for agent, cmd in zip(pool.agents, cmds, strict=True):
                agent.send(json.dumps(cmd))
            time.sleep(max(0.0, start - time.monotonic()))
            before = lighthouse_calls(url)
            t0 = time.monotonic()
            time.sleep(duration)
            after = lighthouse_calls(url)
            elapsed = time.monotonic() - t0
            worker_calls = sum(json.loads(agent.readline(60))["calls"] for agent in pool.agents)
            out.append(
                {
                    "managers": managers,
                    "workers": workers,
                    "ttl_s": ttl,
                    "lighthouse_calls_per_s": (after - before) / elapsed,
                    "expected_per_s": managers / ttl,
                    "worker_calls_per_s": worker_calls / duration,
                }
            )
        finally:
            for host in hosts:
                with contextlib.suppress(OSError):
                    host.send(json.dumps({"op": "quit"}))
                children.stop(host)
    return out


# ------------------------------------------------------------ propagation
def propagation(
    children: Children,
    pool: WorkerPool,
    work_dir: Path,
    ttls: list[float],
    changes: int,
    managers: int,
    workers_per_manager: int,
    step_s: float,
) -> list[dict[str, Any]]:
    """Time from an acknowledged PATCH to the last worker seeing its version (workers use prefetch)."""
    results = []
    for ttl in ttls:
        tag = f"prop-{ttl:g}"
        lh, addr, url = start_lighthouse(children, work_dir, f"lighthouse-{tag}")
        mgrs = [start_manager(children, addr, f"{tag}-m{i}", ttl=ttl) for i in range(managers)]
        try:
            maddrs = [m.readline() for m in mgrs]
            workers = managers * workers_per_manager
            split = pool.split(workers)
            warmup = 2 * ttl + 0.5
            spacing = [ttl * random.uniform(1.2, 1.8) for _ in range(changes)]
            duration = warmup + sum(spacing) + ttl + 1.0
            for agent, t, i in zip(pool.agents, split, range(len(split)), strict=True):
                addrs = [maddrs[(sum(split[:i]) + k) % managers] for k in range(max(t, 1))]
                agent.send(
                    json.dumps(
                        {"op": "watch", "addrs": addrs, "threads": t, "duration": duration, "step_s": step_s}
                    )
                )
            time.sleep(warmup)
            acks: list[tuple[int, float]] = []
            for i, gap in enumerate(spacing):
                version = patch_config(url, {"bench_marker": i})
                acks.append((version, time.monotonic()))
                time.sleep(gap)
            seen = [
                s
                for agent in pool.agents
                for s in json.loads(agent.readline(duration + 60))["seen"]
                if s is not None
            ]
            delays, missed = last_worker_delays(seen, acks)
            results.append(
                {
                    "ttl_s": ttl,
                    "step_s": step_s,
                    "changes": len(acks),
                    "missed": missed,
                    "workers": workers,
                    "managers": managers,
                    **summarize(delays),
                }
            )
        finally:
            for m in mgrs:
                children.stop(m)
            children.stop(lh)
    return results


def last_worker_delays(
    seen: list[dict[str, float]], acks: list[tuple[int, float]]
) -> tuple[list[float], int]:
    """Per acknowledged edit (version, time), the µs until the last worker of ``seen`` (each: version
    -> when first seen) had it or a newer version; and how many edits some worker never had."""
    delays = []
    missed = 0
    for version, acked in acks:
        firsts = []
        for worker in seen:
            times = [t for v, t in worker.items() if int(v) >= version]
            if times:
                firsts.append(min(times))
        if len(firsts) < len(seen):
            missed += 1
            continue
        delays.append(max(0.0, max(firsts) - acked) * 1e6)
    return delays, missed


# ----------------------------------------------------------------- outage
def outage(
    children: Children, work_dir: Path, ttl: float, deadline: float, phase_s: float, step_s: float
) -> dict[str, Any]:
    """Per-call latency of a stepping worker before and while the lighthouse is SIGSTOPped."""
    lh, addr, _url = start_lighthouse(children, work_dir, "lighthouse-outage")
    mgr = start_manager(children, addr, "outage-m", ttl=ttl, lighthouse_timeout=deadline, backoff=deadline)
    client = None
    try:
        client = ManagerClient(mgr.readline(), timeout=5.0)
        step = 0

        def steps(until: float, stop_on_fallback: bool = False) -> tuple[list[float], list[str]]:
            nonlocal step
            lat, sources = [], []
            clock = time.perf_counter_ns
            while time.monotonic() < until:
                step += 1
                t0 = clock()
                cfg = client.get_config(step=step)  # type: ignore[union-attr]
                lat.append((clock() - t0) / 1000)
                sources.append(cfg.source)
                if stop_on_fallback and cfg.source in ("fallback", "stale"):
                    break
                time.sleep(step_s)
            return lat, sources

        steps(time.monotonic() + min(1.0, phase_s))  # warm-up
        healthy, _ = steps(time.monotonic() + phase_s)
        lh.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        first, _ = steps(stopped_at + ttl + 5 * deadline + 5, stop_on_fallback=True)
        first_fallback_after = time.monotonic() - stopped_at
        during, sources = steps(time.monotonic() + phase_s)
        lh.signal(signal.SIGCONT)
        resumed = time.monotonic()
        recovered = None
        while recovered is None and time.monotonic() < resumed + 3 * (ttl + deadline) + 2:
            _, after = steps(time.monotonic() + step_s)
            if any(s not in ("fallback", "stale") for s in after):
                recovered = time.monotonic() - resumed
        return {
            "ttl_s": ttl,
            "deadline_s": deadline,
            "healthy": summarize(healthy),
            "outage": summarize(during),
            "outage_fallback_share": sum(s in ("fallback", "stale") for s in sources) / max(1, len(sources)),
            "first_deadline_max_us": max(first) if first else None,
            "first_fallback_after_s": first_fallback_after,
            "recovered_after_s": recovered,
            "p99_ratio": summarize(during)["p99"] / max(1e-9, summarize(healthy)["p99"]),
        }
    finally:
        if client is not None:
            client.close()
        children.stop(mgr)
        children.stop(lh)


# ------------------------------------------------------------------ scale
class AgentGroup:
    """Load-generating ``benchmarks.agent`` processes, told to quit and stopped on exit."""

    def __init__(self, children: Children) -> None:
        self.children = children
        self.agents: list[Proc] = []

    @property
    def pids(self) -> list[int]:
        return [agent.pid for agent in self.agents]

    def stop(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(OSError):
                agent.send(json.dumps({"op": "quit"}))
            self.children.stop(agent)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SimFleet(AgentGroup):
    """``count`` simulated managers (``agent sims``) over ``processes`` processes; stopped on exit.

    ``lighthouse`` may list several (``A,B,C``): each sim starts on one picked by its
    replica id, as a manager does. ``jobs`` are taken in turn over all the sims. With
    ``steps_per_call`` each group steps that many steps a call; with ``metrics`` too, its
    status carries that many metrics' summaries for those steps.
    """

    def __init__(
        self,
        children: Children,
        name: str,
        lighthouse: str,
        count: int,
        processes: int,
        ttl: float,
        jobs: list[str] | None = None,
        steps_per_call: int = 0,
        metrics: int = 0,
    ) -> None:
        super().__init__(children)
        offset = 0
        try:
            for i in range(processes):
                n = count // processes + (i < count % processes)
                args = [
                    "-m", "benchmarks.agent", "sims", "--lighthouse", lighthouse, "--count", str(n),
                    "--ttl", str(ttl), "--prefix", f"{name}-{i}", "--jobs", ",".join(jobs or []),
                    "--offset", str(offset), "--steps-per-call", str(steps_per_call),
                    "--metrics", str(metrics),
                ]  # fmt: skip
                self.agents.append(children.python(f"{name}-{i}", *args))
                offset += n
            for sim in self.agents:
                sim.readline()
        except BaseException:
            self.stop()
            raise


class StreamFleet(AgentGroup):
    """Simulated pushed managers (``agent streams``): ``processes`` processes, each holding its share
    of the ``WatchConfig`` streams on one ``grpc.aio`` event loop, ``per_connection`` streams to an
    HTTP/2 connection (1: each its own, as real managers); stopped on exit."""

    def __init__(
        self, children: Children, name: str, lighthouse: str, processes: int, per_connection: int
    ) -> None:
        super().__init__(children)
        self.count = 0
        try:
            for i in range(processes):
                args = [
                    "-m", "benchmarks.agent", "streams", "--lighthouse", lighthouse,
                    "--prefix", f"{name}-{i}", "--per-connection", str(per_connection),
                ]  # fmt: skip
                self.agents.append(children.python(f"{name}-{i}", *args))
            for agent in self.agents:
                agent.readline()
        except BaseException:
            self.stop()
            raise

    def open(self, count: int) -> dict[str, Any]:
        """``count`` more streams, spread over the processes; returns once each has its first
        message (raises when one failed: a figure over fewer streams than claimed is wrong)."""
        n = len(self.agents)
        for i, agent in enumerate(self.agents):
            agent.send(json.dumps({"op": "open", "count": count // n + (i < count % n)}))
        answers = [json.loads(agent.readline(300)) for agent in self.agents]
        self.count += count
        answered = sum(a["answered"] for a in answers)
        if answered != count:
            raise RuntimeError(f"{answered} of {count} new streams answered: {answers}")
        return {
            "streams": sum(a["open"] for a in answers),
            "connections": sum(a["connections"] for a in answers),
            "seconds": max(a["seconds"] for a in answers),
        }


def deliveries(fleets: list[StreamFleet], acks: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """For each acknowledged edit (version, time): how many streams of ``fleets`` had it, and
    after how long the first, the median, the p99 and the last stream had it (ms; 1 ms bins but
    the last, which is exact)."""
    agents = [agent for fleet in fleets for agent in fleet.agents]
    for agent in agents:
        agent.send(json.dumps({"op": "report", "acks": acks}))
    reports = [json.loads(agent.readline(120)) for agent in agents]
    out = []
    for k, (version, _) in enumerate(acks):
        edits = [r["edits"][k] for r in reports]
        bins: dict[int, int] = {}
        for edit in edits:
            for ms, n in edit["ms"].items():
                bins[int(ms)] = bins.get(int(ms), 0) + n
        have = sum(e["have"] for e in edits)
        last = [e["max_s"] for e in edits if e["max_s"] is not None]

        def quantile(q: float, bins: dict[int, int] = bins, have: int = have) -> float | None:
            rank, seen = max(1, math.ceil(q * have)), 0
            for ms in sorted(bins):
                seen += bins[ms]
                if seen >= rank:
                    return ms + 0.5
            return None

        out.append(
            {
                "version": version,
                "streams": sum(r["streams"] for r in reports),
                "have": have,
                "first_ms": quantile(0.0),
                "p50_ms": quantile(0.5),
                "p99_ms": quantile(0.99),
                "last_ms": max(last) * 1e3 if last else None,
            }
        )
    return out


def measure_window(
    fleet: SimFleet,
    lighthouses: list[tuple[Proc, str]],
    ttl: float,
    duration: float,
    exclude_job: str | None = None,
    during: Callable[[float], Any] | None = None,
    other_pids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """One timed window once every sim has called: lighthouse CPU and calls/s (summed over
    ``lighthouses``, (child, dashboard URL) pairs), the sims' client-side latency and errors.
    ``during(end)`` runs in this thread through the window (e.g. edits); its result is ``during``.
    ``other_pids`` (e.g. etcd members) and the sims' processes get their CPU measured too."""
    start = time.monotonic() + 2 * ttl  # every loop has made its first call
    cmd: dict[str, Any] = {"op": "measure", "start": start, "duration": duration}
    if exclude_job is not None:
        cmd["exclude_job"] = exclude_job
    for sim in fleet.agents:
        sim.send(json.dumps(cmd))
    time.sleep(max(0.0, start - time.monotonic()))
    pids = [lh.pid for lh, _ in lighthouses] + list(other_pids) + fleet.pids
    meter = CpuMeter(pids)
    calls0, t0 = sum(lighthouse_calls(url) for _, url in lighthouses), time.monotonic()
    extra = during(t0 + duration) if during is not None else None
    time.sleep(max(0.0, t0 + duration - time.monotonic()))
    cpu = meter.percent()
    calls1, t1 = sum(lighthouse_calls(url) for _, url in lighthouses), time.monotonic()
    answers = [json.loads(sim.readline(duration + 60)) for sim in fleet.agents]
    result = {
        "ttl_s": ttl,
        "lighthouse_cpu_pct": sum(cpu[: len(lighthouses)]),
        "lighthouse_cpu_pct_each": cpu[: len(lighthouses)],
        "other_cpu_pct_each": cpu[len(lighthouses) : len(lighthouses) + len(other_pids)],
        "sims_cpu_pct": sum(cpu[len(lighthouses) + len(other_pids) :]),  # the load generator's share
        "lighthouse_calls_per_s": (calls1 - calls0) / (t1 - t0),
        "client_calls": sum(a["calls"] for a in answers),
        "errors": sum(a["errors"] for a in answers),
        "new_versions": sum(a["updates"] for a in answers),  # calls that brought a new config
        **summarize([x for a in answers for x in a["lat"]]),
    }
    if exclude_job is not None:
        result["others"] = summarize([x for a in answers for x in a["lat_others"]])
        result["others"]["new_versions"] = sum(a["updates_others"] for a in answers)
    if during is not None:
        result["during"] = extra
    return result


def scale(
    children: Children, work_dir: Path, levels: list[int], processes: int, ttl: float, duration: float
) -> list[dict[str, Any]]:
    """One lighthouse process against N simulated managers: its CPU, the fetch p99, calls/s."""
    lh, addr, url = start_lighthouse(children, work_dir, "lighthouse-scale")
    results = []
    try:
        for level in levels:
            with SimFleet(children, f"sim{level}", addr, level, processes, ttl) as fleet:
                results.append({"managers": level, **measure_window(fleet, [(lh, url)], ttl, duration)})
    finally:
        children.stop(lh)
    return results
