"""Load-generating child processes, driven by one-line commands on stdin, answering one JSON line each.

Roles (``python -m benchmarks.agent ROLE ...``):

* ``workers``: simulated worker ranks. ``run`` hammers an address with N threads
  (throughput), ``loop`` steps N workers at a fixed step time across managers
  (fan-in), ``watch`` steps N workers and records when each config version is
  first seen (propagation), ``lockstep`` steps one replica group's ranks,
  coupled to the other groups by a step barrier, and records which change each
  step used (step leases). Clients are ``ManagerClient``s made in this process.
* ``managers``: hosts several ``ManagerServer``s in one process (fan-in with up to
  64 managers without 64 interpreter start-ups); prints their addresses.
* ``sims``: many lightweight simulated managers, each a loop calling
  ``LighthouseClient.fetch(request(status=..., known_version=...))`` once per TTL, as a
  real manager's refresh loop does (scale). ``--jobs A,B,...`` spreads them over
  jobs in turn (``--offset``: this process's first global index), and
  ``--lighthouse A,B,C`` over lighthouses by replica id, as managers do.
  ``--steps-per-call K`` moves each sim's step K steps a call (its group steps);
  ``--metrics N`` adds to each status the group's summaries of N metrics for
  those K steps, as a manager forwards its ranks' reports.
* ``streams``: many simulated pushed managers on one ``grpc.aio`` event loop, each
  a ``WatchConfig`` stream opened with a first request carrying its replica id, as
  ``manager serve`` opens it; ``--per-connection`` of them share one HTTP/2
  connection. ``open`` adds streams, ``report`` says when each stream first had
  each edited version.

Times cross processes as ``time.monotonic()`` (CLOCK_MONOTONIC is system-wide).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.report import summarize

MAX_LATENCIES = 4000  # per command: enough for a p99, small enough for one stdout line


def _reply(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _threads(n: int, target: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        results[i] = target(i)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ---------------------------------------------------------------- workers
class Workers:
    def __init__(self) -> None:
        from worker_client import ManagerClient

        self._make = ManagerClient
        self._clients: dict[tuple[str, int], Any] = {}

    def client(self, addr: str, i: int) -> Any:
        """One client per (address, thread), kept across commands (a worker keeps its channel)."""
        key = (addr, i)
        if key not in self._clients:
            self._clients[key] = self._make(addr, timeout=5.0)
            self._clients[key].get_config()
        return self._clients[key]

    def prepare(self, addrs: list[str], threads: int) -> str:
        """Connect the clients a following ``run``/``loop`` uses, so the timed window has no set-up."""
        for i in range(threads):
            self.client(addrs[i % len(addrs)], i)
        return "ok"

    def run(self, addr: str, threads: int, start: float, duration: float) -> dict[str, Any]:
        """Closed loop: every thread calls get_config() back to back during [start, start + duration)."""
        clients = [self.client(addr, i) for i in range(threads)]
        end = start + duration
        keep_every = max(1, threads // 8)

        def loop(i: int) -> tuple[int, list[float]]:
            client, calls, lat = clients[i], 0, []
            _sleep_until(start)
            while True:
                t0 = time.monotonic()
                if t0 >= end:
                    return calls, lat
                client.get_config()
                calls += 1
                if i % keep_every == 0 and len(lat) < MAX_LATENCIES // 8:
                    lat.append((time.monotonic() - t0) * 1e6)

        results = _threads(threads, loop)
        return {"calls": sum(r[0] for r in results), "lat": [x for r in results for x in r[1]]}

    def loop(
        self, addrs: list[str], threads: int, start: float, duration: float, step_s: float
    ) -> dict[str, Any]:
        """Workers stepping every ``step_s`` (fixed rate), each on manager ``i % len(addrs)``."""
        clients = [self.client(addrs[i % len(addrs)], i) for i in range(threads)]
        end = start + duration

        def loop(i: int) -> int:
            client, calls = clients[i], 0
            t = start + step_s * random.random()
            while t < end:
                _sleep_until(t)
                client.get_config()
                calls += 1
                t += step_s
            return calls

        return {"calls": sum(_threads(threads, loop))}

    def watch(
        self, addrs: list[str], threads: int, duration: float, step_s: float, no_step: bool = False
    ) -> dict[str, Any]:
        """Training loops with prefetch: step every ``step_s``; first time each version was seen.
        ``no_step``: ``get_config()`` without a step and without prefetch (the seed's workers)."""
        end = time.monotonic() + duration

        def loop(i: int) -> dict[str, float]:
            client = self._make(addrs[i % len(addrs)], timeout=5.0, prefetch=not no_step)
            seen: dict[str, float] = {}
            step, last = 0, -1
            try:
                t = time.monotonic()
                while t < end:
                    step += 1
                    cfg = client.get_config() if no_step else client.get_config(step=step)
                    if cfg.version > last:
                        last = cfg.version
                        seen[str(cfg.version)] = time.monotonic()
                    t += step_s
                    _sleep_until(t)
            finally:
                client.close()
            return seen

        return {"seen": _threads(threads, loop)}

    def lockstep(
        self, addr: str, ranks: int, barrier: str, start: float, step_s: float, key: str
    ) -> list[dict[str, Any]]:
        """The ranks of one replica group, coupled to the other groups as torchft's all-reduce
        couples them: a step is its ``get_config(step=N)``, work until ``step_s`` has passed, then
        the step barrier at ``barrier`` (``host:port``), which every rank of every group must reach
        before any starts the next step; it says when to stop. Step 0 starts at ``start``.
        Per rank: when each step started (seconds after ``start``), the steps at which the integer
        value of ``key`` changed (-1: missing, as in a fallback), the answers' sources, how far
        ahead of its step each answer was promised, and the per-call latency."""
        host, _, port = barrier.rpartition(":")
        clients = [self._make(addr, timeout=5.0) for _ in range(ranks)]
        links = [socket.create_connection((host, int(port))) for _ in range(ranks)]
        for client in clients:
            client.get_config()  # connected before the first step (no step: nothing pinned)

        def rank(i: int) -> dict[str, Any]:
            client, link = clients[i], links[i]
            started: list[float] = []
            switches: list[list[int]] = []
            sources: dict[str, int] = {}
            unleased, ahead_max = 0, -1  # answers not promised through their step; the longest promise
            lat: list[float] = []
            marker = None
            _sleep_until(start)
            for step in itertools.count():
                t0 = time.monotonic()
                cfg = client.get_config(step=step)
                lat.append((time.monotonic() - t0) * 1e6)
                started.append(round(t0 - start, 5))
                value = int(cfg.get(key, "-1"))
                if value != marker:
                    switches.append([step, value])
                    marker = value
                sources[cfg.source] = sources.get(cfg.source, 0) + 1
                through = cfg.stable_through_step
                if through is None or through < step:
                    unleased += 1
                else:
                    ahead_max = max(ahead_max, through - step)
                _sleep_until(t0 + step_s)  # the step's work
                link.sendall(b"s")
                if link.recv(1) != b"g":  # the barrier says stop (or is gone)
                    break
            client.close()
            link.close()
            lat_summary = summarize(lat)
            return {
                "started": started,
                "switches": switches,
                "sources": sources,
                "unleased": unleased,
                "lease_ahead_max": ahead_max,
                "lat_us": {q: lat_summary[q] for q in ("p50", "p99", "max")},
            }

        return _threads(ranks, rank)


def serve_workers() -> None:
    workers = Workers()
    _reply("ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            return
        _reply(getattr(workers, op)(**cmd))


# --------------------------------------------------------------- managers
def serve_managers(lighthouse: str, count: int, ttl: float, prefix: str) -> None:
    from manager.server import ManagerServer
    from worker_client import ManagerClient

    servers = [ManagerServer(lighthouse, "127.0.0.1:0", f"{prefix}-{i}", cache_ttl=ttl) for i in range(count)]
    try:
        for server in servers:  # each has fetched once before the window opens
            with ManagerClient(server.address(), timeout=10.0, strict=True) as client:
                client.get_config()
        _reply([s.address() for s in servers])
        for line in sys.stdin:
            if json.loads(line).get("op") == "quit":
                break
    finally:
        for server in servers:
            server.shutdown(grace=0)


# ------------------------------------------------------------------- sims
def reported_metrics(names: int, steps: int) -> Callable[[int], list[Any]]:
    """``summaries(first_step)``: a group's summaries of ``names`` metrics over ``steps`` steps from
    ``first_step`` (two ranks a step), packed as a manager packs them."""
    from array import array

    from protos import lighthouse_config_pb2 as pb
    from protos.metrics import pack

    values = array("d", (1.0 + 0.001 * i for i in range(steps)))
    columns = {
        "count": pack(array("I", [2]) * steps),
        "nonfinite": pack(array("I", [0]) * steps),
        "sum": pack(array("d", (2 * v for v in values))),
        "min": pack(values),
        "max": pack(values),
    }
    names_ = ["loss", "grad_norm", "tokens_per_s", "lr_applied", *(f"metric_{i}" for i in range(4, names))]

    def summaries(first: int) -> list[Any]:
        steps_ = pack(array("q", range(first, first + steps)))
        return [pb.MetricSummaries(name=name, steps=steps_, **columns) for name in names_[:names]]

    return summaries


def serve_sims(
    lighthouse: str,
    count: int,
    ttl: float,
    prefix: str,
    jobs: list[str],
    offset: int,
    steps_per_call: int = 0,
    metrics: int = 0,
) -> None:
    from lighthouse.client import LighthouseClient
    from protos import lighthouse_config_pb2 as pb
    from protos.job_ids import DEFAULT_JOB

    summaries = reported_metrics(metrics, steps_per_call) if metrics and steps_per_call else None

    stop = threading.Event()
    records: list[list[tuple[float, float, bool]]] = [[] for _ in range(count)]
    in_flight: list[float | None] = [None] * count  # start of the call each sim is waiting on
    updates: list[list[float]] = [[] for _ in range(count)]  # calls that brought a new version
    job_of = [jobs[(offset + i) % len(jobs)] if jobs else DEFAULT_JOB for i in range(count)]

    def sim(i: int) -> None:
        client = LighthouseClient(lighthouse, job=job_of[i], spread_key=f"{prefix}-{i}")
        version, state_id, requests, step, batch = 0, "", 0, 0, 0
        t = time.monotonic() + ttl * random.random()
        try:
            while not stop.wait(max(0.0, t - time.monotonic())):
                requests += 100
                status = pb.ManagerStatus(
                    replica_id=f"{prefix}-{i}",
                    address=f"127.0.0.1:{20000 + i}",
                    version=version,
                    requests=requests,
                    cache_hits=requests - 1,
                    step=step + steps_per_call - 1,
                )
                if summaries is not None:
                    batch += 1
                    status.metrics.extend(summaries(step))
                    status.metrics_batch = batch
                step += steps_per_call
                t0 = in_flight[i] = time.monotonic()
                try:
                    request = client.request(known_version=version, known_state_id=state_id, status=status)
                    reply = client.fetch(request, timeout=5.0)
                    if version and reply.version != version:
                        updates[i].append(t0)
                    version, state_id, ok = reply.version, reply.state_id, True
                except Exception:
                    ok = False
                records[i].append((t0, (time.monotonic() - t0) * 1e6, ok))
                in_flight[i] = None
                t += ttl
                if t < time.monotonic():  # fell behind: skip the missed beats, like a late refresh
                    t = time.monotonic() + ttl
        finally:
            client.close()

    threads = [threading.Thread(target=sim, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    _reply("ready")
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            start, end = cmd["start"], cmd["start"] + cmd["duration"]
            exclude = cmd.get("exclude_job")
            _sleep_until(end + 1.0)
            now = time.monotonic()
            window = [
                (r, job_of[i]) for i, rec in enumerate(records) for r in list(rec) if start <= r[0] < end
            ]
            # A call still waiting counts with the time it has waited so far (a lower bound).
            window += [
                ((t0, (now - t0) * 1e6, True), job_of[i])
                for i, t0 in enumerate(list(in_flight))
                if t0 and start <= t0 < end
            ]
            answer = {
                "calls": len(window),
                "errors": sum(not ok for (*_, ok), _ in window),
                "lat": [lat for (_, lat, ok), _ in window if ok],
            }
            if exclude is not None:  # the calls of every other job (an edited job's neighbours)
                answer["lat_others"] = [lat for (_, lat, ok), job in window if ok and job != exclude]
                answer["updates_others"] = sum(
                    start <= t < end for i, ups in enumerate(updates) if job_of[i] != exclude for t in ups
                )
            answer["updates"] = sum(start <= t < end for ups in updates for t in ups)
            _reply(answer)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=6)


# ---------------------------------------------------------------- streams
STREAM_OPEN_TIMEOUT = 120.0  # seconds for every stream of one ``open`` to get its first message
OPENING_AT_ONCE = 100  # streams waiting for their first message at a time: a storm of thousands of
# new connections at once makes handshakes time out (real managers spread out and retry)


class Streams:
    """Simulated pushed managers: one coroutine per ``WatchConfig`` stream, all on one event loop.

    Each sends one request (``known_version`` 0, a ``ManagerStatus`` with its replica id, no
    step: an idle group) and then only reads, as an idle manager does; it records when it
    first had each version (keep-alives repeat the version and are only counted).
    """

    def __init__(self, lighthouse: str, prefix: str, per_connection: int) -> None:
        self.lighthouse = lighthouse
        self.prefix = prefix
        self.per_connection = per_connection
        self.channels: list[Any] = []
        self.stubs: list[Any] = []
        self.arrivals: list[dict[int, float]] = []  # per stream: version -> first time held
        self.messages = 0
        self.errors: dict[str, int] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def _stub(self, i: int) -> Any:
        """Stream ``i``'s stub: a new connection every ``per_connection`` streams (a local
        subchannel pool, or grpcio would share one connection among equal channels)."""
        import grpc

        from protos import lighthouse_config_pb2_grpc as pb_grpc
        from protos.rpc import CHANNEL_OPTIONS, grpc_target

        if i % self.per_connection == 0:
            options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
            channel = grpc.aio.insecure_channel(grpc_target(self.lighthouse), options=options)
            self.channels.append(channel)
            self.stubs.append(pb_grpc.LighthouseServiceStub(channel))
        return self.stubs[-1]

    async def open(self, count: int) -> dict[str, Any]:
        """``count`` more streams; answers once each has its first message."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        firsts: list[asyncio.Future[None]] = []
        opening = asyncio.Semaphore(OPENING_AT_ONCE)
        deadline = started + STREAM_OPEN_TIMEOUT
        for _ in range(count):
            await asyncio.wait_for(opening.acquire(), max(0.0, deadline - time.monotonic()))
            i = len(self.arrivals)
            self.arrivals.append({})
            first: asyncio.Future[None] = loop.create_future()
            first.add_done_callback(lambda _: opening.release())
            firsts.append(first)
            self.tasks.append(asyncio.create_task(self._stream(self._stub(i), i, first)))
        await asyncio.wait(firsts, timeout=max(0.0, deadline - time.monotonic()))
        return {
            "open": len(self.arrivals),
            "answered": sum(1 for f in firsts if f.done() and f.exception() is None),  # of these
            "seconds": time.monotonic() - started,
            "connections": len(self.channels),
            "errors": self.errors,
        }

    async def _stream(self, stub: Any, i: int, first: asyncio.Future[None]) -> None:
        import grpc

        from protos import lighthouse_config_pb2 as pb

        replica = f"{self.prefix}-{i}"
        status = pb.ManagerStatus(replica_id=replica, address=f"127.0.0.1:{20000 + i % 40000}", step=-1)
        arrivals = self.arrivals[i]
        call = stub.WatchConfig(wait_for_ready=True)  # connects as a retrying manager would
        try:
            await call.write(pb.LighthouseConfigRequest(replica_id=replica, status=status, lease_seconds=1.0))
            async for reply in call:
                self.messages += 1
                arrivals.setdefault(reply.version, time.monotonic())
                if not first.done():
                    first.set_result(None)
        except grpc.aio.AioRpcError as exc:
            key = f"{exc.code().name}: {exc.details()}"
            self.errors[key] = self.errors.get(key, 0) + 1
            if not first.done():
                first.set_exception(exc)
        except asyncio.CancelledError:
            call.cancel()
            raise

    def report(self, acks: list[tuple[int, float]]) -> dict[str, Any]:
        """For each acknowledged edit (version, time): how many streams had it (that version or a
        newer one: sends coalesce), the slowest, and a 1 ms histogram of the delays (mergeable)."""
        edits = []
        for version, acked in acks:
            delays = []
            for arrivals in self.arrivals:
                times = [t for v, t in arrivals.items() if v >= version]
                if times:
                    delays.append(max(0.0, min(times) - acked))
            histogram: dict[str, int] = {}
            for delay in delays:
                key = str(int(delay * 1e3))
                histogram[key] = histogram.get(key, 0) + 1
            edits.append(
                {"version": version, "have": len(delays), "max_s": max(delays, default=None), "ms": histogram}
            )
        streams = len(self.arrivals)
        return {"streams": streams, "messages": self.messages, "errors": self.errors, "edits": edits}

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for channel in self.channels:
            await channel.close()


async def serve_streams(lighthouse: str, prefix: str, per_connection: int) -> None:
    # A stream per connection at the most: a process may hold thousands of sockets.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    streams = Streams(lighthouse, prefix, per_connection)
    loop = asyncio.get_running_loop()
    _reply("ready")
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "open":
                _reply(await streams.open(cmd["count"]))
            else:
                _reply(streams.report([(v, t) for v, t in cmd["acks"]]))
    finally:
        await streams.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent")
    parser.add_argument("role", choices=["workers", "managers", "sims", "streams"])
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--prefix", default="bench")
    parser.add_argument("--jobs", default="", help="sims: comma-separated jobs, taken in turn")
    parser.add_argument("--offset", type=int, default=0, help="sims: global index of this process's first")
    parser.add_argument("--per-connection", type=int, default=1, help="streams: per HTTP/2 connection")
    parser.add_argument("--steps-per-call", type=int, default=0, help="sims: steps a group makes per call")
    parser.add_argument(
        "--metrics", type=int, default=0, help="sims: metrics reported for each of those steps"
    )
    args = parser.parse_args()
    if args.role == "workers":
        serve_workers()
    elif args.role == "managers":
        serve_managers(args.lighthouse, args.count, args.ttl, args.prefix)
    elif args.role == "streams":
        asyncio.run(serve_streams(args.lighthouse, args.prefix, args.per_connection))
    else:
        jobs = [j for j in args.jobs.split(",") if j]
        serve_sims(
            args.lighthouse,
            args.count,
            args.ttl,
            args.prefix,
            jobs,
            args.offset,
            args.steps_per_call,
            args.metrics,
        )


if __name__ == "__main__":
    main()
