"""A month of a job, compressed (issue 37).

``python -m benchmarks.month [--quick] [--store etcd] [--out DIR]``.

The history is seeded with ``--versions`` versions (40,000: a controller's change a minute for a
month), one every 100 steps of a job that stepped past them, under the default retention, and
each group's step switches to the versions kept. Then
``lighthouse serve`` (defaults) opens it, ``--groups`` ``manager serve --push`` processes serve the
job, and one worker process per group calls ``get_config(step=N)`` for N = 1, 2, ... past the
seeded step as fast as it is answered, for ``--minutes`` minutes, the groups coupled by a step
barrier as torchft's all-reduce couples them (no group starts step N+1 before every group finished
step N). A controller (this process)
makes a change at once (PATCH ``sync_every``) every ``--change-every`` steps of the first group;
every ``--guard-every``-th of them guarded (``loss:1.5`` over ``GUARD_STEPS`` steps: the workers
report a flat loss every step, so each guard passes), and every ``--withdraw-every``-th change is
followed by one scheduled far ahead and cancelled at once (a controller withdrawing a plan). Both
once left a trace per change that the retention never removed (the guards; the history itself,
held back by the cancelled changes): counted in every sample (``store_counts``, ``guards``).

Sampled every ``--sample-seconds``: the job's step, the lighthouse's RSS and CPU, the store's bytes
(the SQLite file and its log; etcd's database in use: ``--store etcd`` is a 3-member cluster with
``--quota-backend-bytes`` 256 MiB, compacted every 10 s by etcd itself). Counted: workers' answers
from the fallback, PATCHes answered 507 (store full) or failing otherwise. Each worker records the
steps at which its config's version changed; the groups must agree on every one of them over the
steps both trained. Goals: no fallback, no 507, no disagreement, and the lighthouse's RSS and the
store's bytes at the end within ``FLAT`` of the first sample after ``--settle-minutes`` (5).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.history import ETCD_QUOTA, HistoryStore, write_history
from benchmarks.leases import StepBarrier
from benchmarks.procs import Children, cpu_seconds, rss_bytes
from benchmarks.report import machine_line, machine_load, percentile, run_standalone, standalone_parser
from benchmarks.stack import serve_lighthouse, start_manager
from lighthouse.admin.client import AdminClient, AdminError
from lighthouse.jobs.versions import DEFAULT_HISTORY_LIMIT, DEFAULT_KEEP_STEPS
from protos.job_ids import DEFAULT_JOB
from tests.etcd_cluster import EtcdCluster

FLAT = 1.1  # memory and store bytes at the end within this factor of the settled sample
SEED_EVERY = 100  # steps between two seeded versions (a controller's change)
REPORT_EVERY = 250  # a worker prints its progress every this many steps
GUARD_STEPS = 200  # steps a guarded change is watched for
WITHDRAWN_AHEAD = 10**6  # steps ahead a withdrawn change was scheduled at


# ------------------------------------------------------------------ the worker process
def worker(manager: str, first_step: int, barrier: str) -> None:
    """Steps from ``first_step`` as fast as the manager answers and the other groups follow (the step
    barrier at ``barrier`` says when to stop); prints a progress line every REPORT_EVERY steps and,
    at the end, the steps at which the version changed."""
    import socket

    from worker_client import ManagerClient

    host, port = barrier.rsplit(":", 1)
    switches: list[tuple[int, int]] = []
    fallbacks = 0
    unpinned: list[tuple[int, int, str]] = []  # steps answered without a pin (not the same in every group)
    version = -1
    step = first_step
    with ManagerClient(manager, timeout=5.0) as client, socket.create_connection((host, int(port))) as link:
        link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            config = client.get_config(step=step)
            client.report(step, loss=1.0)  # flat: every guard passes
            if config.source == "fallback":
                fallbacks += 1
            elif not config.pinned:
                unpinned.append((step, config.version, config.source))
            if config.source != "fallback" and config.version != version:
                version = config.version
                switches.append((step, version))
            if step % REPORT_EVERY == 0:
                print(json.dumps({"step": step, "fallbacks": fallbacks, "version": version}), flush=True)
            link.sendall(b"s")  # this step is done: wait for every group's
            if link.recv(1) != b"g":
                break
            step += 1
    print(
        json.dumps({"done": step, "fallbacks": fallbacks, "switches": switches, "unpinned": unpinned}),
        flush=True,
    )


# ------------------------------------------------------------------ the run
class Controller:
    """Reads the first worker's progress and makes a change at once every ``every`` of its steps."""

    def __init__(self, url: str, every: int, first_step: int, guard_every: int, withdraw_every: int) -> None:
        self._admin = AdminClient(url, timeout=30.0)
        self._every = every
        self._guard_every = guard_every
        self._withdraw_every = withdraw_every
        self.guarded = 0
        self.withdrawn = 0
        self._next = first_step + every
        self.step = first_step
        self.changes = 0
        self.full = 0  # 507: the store is full
        self.errors: list[str] = []
        self.latencies: list[float] = []
        self.effective: dict[int, int | None] = {}  # version -> the step it takes effect at

    def progress(self, line: dict[str, Any]) -> None:
        self.step = line["step"]
        while self.step >= self._next:
            self._next += self._every
            self._change()

    def _change(self) -> None:
        guarded = self._guard_every > 0 and self.changes % self._guard_every == 0
        guard = {"guard": "loss:1.5", "guard_steps": GUARD_STEPS} if guarded else {}
        started = time.perf_counter()
        # A new value each time (the seeded config has 100): a guard refuses a change of nothing.
        answer = self._call(lambda: self._admin.patch({"sync_every": 101 + self.changes % 50}, **guard))
        if answer is None:
            return
        self.latencies.append(time.perf_counter() - started)
        self.changes += 1
        self.guarded += guarded
        self.effective[answer["version"]] = answer.get("effective_step")
        if self._withdraw_every > 0 and self.changes % self._withdraw_every == 0:
            ahead = self.step + WITHDRAWN_AHEAD
            plan = self._call(lambda: self._admin.patch({"warmup": self.changes}, effective_step=ahead))
            if plan is not None and self._call(lambda: self._admin.cancel(plan["version"])) is not None:
                self.withdrawn += 1

    def _call(self, call: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``call()``'s answer; None when refused (counted: 507, or another error)."""
        try:
            return call()
        except AdminError as exc:
            if exc.status == 507:
                self.full += 1
            else:
                self.errors.append(str(exc)[:200])
            return None


def follow(child: Any, controller: Controller | None, out: dict[str, Any]) -> None:
    """Read a worker's lines until its last one (into ``out``); the first worker's drive ``controller``."""
    try:
        while True:
            line = json.loads(child.readline())
            if "done" in line:
                out.update(line)
                return
            if controller is not None:
                controller.progress(line)
            out["step"] = line["step"]
    except BaseException as exc:  # reported by the run
        out["error"] = repr(exc)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"machine_before": machine_load(), "store": args.store}
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="bench-month-", dir=shm if shm.is_dir() else work))
    try:
        with Children(work / "logs") as children, contextlib.ExitStack() as stack:
            etcd = None
            if args.store == "etcd":
                compaction = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=10s")
                quota = f"--quota-backend-bytes={ETCD_QUOTA}"
                etcd = stack.enter_context(
                    EtcdCluster(base / "etcd", size=3, extra_args=[*compaction, quota])
                )
            where = HistoryStore("month", base, etcd)
            started = time.monotonic()
            seeded_step = write_history(where, args.versions, SEED_EVERY)
            results["switches_seeded"], results["guards_seeded"] = seed_switches(
                where, args.versions, args.groups, args.guard_every
            )
            results["seconds_to_seed"] = time.monotonic() - started
            results["seeded_step"] = seeded_step
            lighthouse, address, url = serve_lighthouse(children, "lighthouse", *where.flags())
            managers = [start_manager(children, address, f"month-g{g}") for g in range(args.groups)]
            addrs = [m.readline() for m in managers]
            barrier = StepBarrier(len(addrs), time.monotonic() + args.minutes * 60)
            stack.callback(barrier.close)
            workers = [
                children.python(
                    f"worker-{g}",
                    "-m",
                    "benchmarks.month",
                    "worker",
                    addr,
                    str(seeded_step + 1),
                    barrier.address,
                )
                for g, addr in enumerate(addrs)
            ]
            controller = Controller(
                url, args.change_every, seeded_step, args.guard_every, args.withdraw_every
            )
            sampler = AdminClient(url, timeout=30.0)  # the controller's is in use on its thread
            outs: list[dict[str, Any]] = [{} for _ in workers]
            readers = [
                threading.Thread(
                    target=follow, args=(w, controller if g == 0 else None, outs[g]), daemon=True
                )
                for g, w in enumerate(workers)
            ]
            for reader in readers:
                reader.start()
            samples = []
            began = time.monotonic()
            while any(r.is_alive() for r in readers):
                now = time.monotonic()
                samples.append(
                    {
                        "minutes": (now - began) / 60,
                        "step": controller.step - seeded_step,
                        "rss_mb": rss_bytes(lighthouse.popen.pid) / 2**20,
                        "cpu_s": cpu_seconds(lighthouse.popen.pid),
                        "store_kb": where.bytes() / 1024,
                        "store_file_kb": where.file_bytes() / 1024,
                        "store_counts": store_counts(where),
                        "guards": len(sampler.guards()["guards"]),
                        "changes": controller.changes,
                    }
                )
                for reader in readers:
                    reader.join(timeout=max(0.0, now + args.sample_seconds - time.monotonic()))
            results["samples"] = samples
            kept_apart = ("switches", "unpinned")
            results["workers"] = [{k: v for k, v in o.items() if k not in kept_apart} for o in outs]
            errors = [o["error"] for o in outs if "error" in o]
            if errors:
                raise RuntimeError(f"a worker failed: {errors}")
            differing = disagreements(outs)
            results["disagreements"] = len(differing)
            results["disagreeing"] = differing[:10]
            results["effective_steps"] = {  # of the versions the groups disagree on (those named)
                v: controller.effective.get(v) for d in differing[:10] for view in d for _, v in view
            }
            results["switches"] = len(outs[0]["switches"])
            results["unpinned"] = sum(len(o["unpinned"]) for o in outs)
            results["unpinned_first"] = [o["unpinned"][:5] for o in outs]
            if etcd is not None:
                results["etcd_defrag"] = defrag_probe(etcd)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    results.update(
        {
            "minutes": args.minutes,
            "versions_seeded": args.versions,
            "change_every": args.change_every,
            "changes": controller.changes,
            "guarded": controller.guarded,
            "withdrawn": controller.withdrawn,
            "patch_507": controller.full,
            "patch_errors": controller.errors[:10],
            "patch_ms_p50": percentile(sorted(controller.latencies), 50) * 1e3
            if controller.latencies
            else None,
            "patch_ms_p99": percentile(sorted(controller.latencies), 99) * 1e3
            if controller.latencies
            else None,
            "fallbacks": sum(o["fallbacks"] for o in outs),
            "steps": [o["done"] - seeded_step for o in outs],
            "retention": {"history_limit": DEFAULT_HISTORY_LIMIT, "keep_steps": DEFAULT_KEEP_STEPS},
            "machine_after": machine_load(),
        }
    )
    results["flat"] = flatness(samples, args.settle_minutes)
    results["goals_met"] = (
        results["fallbacks"] == 0
        and results["patch_507"] == 0
        and not results["patch_errors"]
        and results["disagreements"] == 0
        and all(f["ratio"] is not None and f["ratio"] <= FLAT for f in results["flat"].values())
    )
    return results


def defrag_probe(etcd: EtcdCluster) -> list[dict[str, int]]:
    """Each member's database size and size in use before and after a defragmentation: what the
    in-use figure counted that was not live data (pages bbolt freed but had not reused yet)."""
    import grpc

    from protos.etcd import rpc_pb2, rpc_pb2_grpc

    out = []
    for member in etcd.members:
        with grpc.insecure_channel(member.endpoint) as channel:
            stub = rpc_pb2_grpc.MaintenanceStub(channel)
            before = stub.Status(rpc_pb2.StatusRequest(), timeout=10)
            stub.Defragment(rpc_pb2.DefragmentRequest(), timeout=60)
            after = stub.Status(rpc_pb2.StatusRequest(), timeout=10)
        out.append(
            {
                "db_bytes_before": before.dbSize,
                "in_use_before": before.dbSizeInUse,
                "db_bytes_after": after.dbSize,
                "in_use_after": after.dbSizeInUse,
            }
        )
    return out


def seed_switches(where: HistoryStore, versions: int, groups: int, guard_every: int) -> tuple[int, int]:
    """Each group's step switches to the last DEFAULT_HISTORY_LIMIT seeded versions, and a passed
    guard of every ``guard_every``-th of them, as a month of the job left them (the retention keeps
    those of kept versions: without them the store would grow through the run's first thousand
    changes, to the same bound); how many of each."""
    backend = where.backend()
    try:
        kept = range(max(2, versions - DEFAULT_HISTORY_LIMIT + 1), versions + 1)
        switches = [
            (f"month-g{g}", v, SEED_EVERY * (v - 1) + 2, SEED_EVERY * (v - 1) + 1)
            for v in kept
            for g in range(groups)
        ]
        backend.add_switches(DEFAULT_JOB, switches)
        guarded = [v for v in kept if guard_every > 0 and v % guard_every == 0]
        for v in guarded:
            backend.save_guard(DEFAULT_JOB, passed_guard(v, SEED_EVERY * (v - 1) + 2))
    finally:
        backend.close()
    return len(switches), len(guarded)


def passed_guard(version: int, step: int) -> dict[str, Any]:
    """The record of a guard of ``version`` (taking effect at ``step``) that passed."""
    return {
        "version": version,
        "metric": "loss",
        "factor": 1.5,
        "steps": GUARD_STEPS,
        "window": GUARD_STEPS,
        "effective_step": step,
        "changes": {"lr": {"before": 0.0, "after": 1e-6}},
        "author": "bench",
        "created_at": time.time(),
        "status": "passed",
        "baseline": 1.0,
        "baseline_steps": [step - GUARD_STEPS, step - 1],
        "rollback_version": None,
        "rollback_step": None,
        "reason": None,
        "decided_at": time.time(),
    }


def store_counts(where: HistoryStore) -> dict[str, int]:
    """What the store holds: SQLite rows per table, or etcd keys under the job's prefix per kind
    (the path's part after ``jobs/{job}/``, or its first part)."""
    counts: dict[str, int] = {}
    if where.etcd is not None:
        from lighthouse.etcd.client import EtcdClient

        client = EtcdClient(where.etcd.endpoints)
        try:
            for kv in client.get(f"/{where.name}/", prefix=True, keys_only=True).kvs:
                parts = kv.key.decode().split("/")[2:]
                kind = parts[2] if parts[:1] == ["jobs"] and len(parts) > 2 else parts[0]
                counts[kind] = counts.get(kind, 0) + 1
        finally:
            client.close()
        return counts
    import sqlite3

    assert where.state_dir is not None
    db = sqlite3.connect(where.state_dir / "lighthouse.db")
    try:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            counts[table] = db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    finally:
        db.close()
    return counts


def disagreements(outs: list[dict[str, Any]]) -> list[list[list[int]]]:
    """Version changes ([step, version]) that not every group made, over the steps all of them trained
    (each worker's ``switches``: the steps at which its config's version changed, and to what), as
    each group's changes from 2 steps before to 2 after each."""
    last = min(o["done"] for o in outs)
    views = [{(s, v) for s, v in o["switches"] if s <= last} for o in outs]
    differing = sorted(set.union(*views) - set.intersection(*views))
    return [[sorted([s, v] for s, v in view if abs(s - at) <= 2) for view in views] for at, _ in differing]


def flatness(samples: list[dict[str, Any]], settle_minutes: float) -> dict[str, Any]:
    """RSS, store bytes and the guards listed: the first sample after ``settle_minutes`` against
    the last."""
    settled = next((s for s in samples if s["minutes"] >= settle_minutes), None)
    last = samples[-1] if samples else None
    out = {}
    for key in ("rss_mb", "store_kb", "guards"):
        if settled is None or last is None or settled is last:
            out[key] = {"settled": None, "end": None, "ratio": None}
            continue
        out[key] = {"settled": settled[key], "end": last[key], "ratio": last[key] / max(settled[key], 1)}
    return out


def render(results: dict[str, Any]) -> str:
    lines = [machine_line(results["machine_before"], results["machine_after"])]
    steps = results["steps"]
    lines.append(
        f"{results['store']}: {results['versions_seeded']} versions seeded "
        f"({results['seconds_to_seed']:.0f} s), "
        f"{results['minutes']:g} minutes, {len(steps)} groups, {min(steps)}-{max(steps)} steps "
        f"({max(steps) / (results['minutes'] * 60):.0f}/s), {results['changes']} changes at once "
        f"(one every {results['change_every']} steps; PATCH p50 {results['patch_ms_p50'] or 0:.1f} ms, "
        f"p99 {results['patch_ms_p99'] or 0:.1f} ms), {results['guarded']} of them guarded, "
        f"{results['withdrawn']} changes scheduled and withdrawn"
    )
    lines.append(
        f"fallbacks {results['fallbacks']}, 507 {results['patch_507']}, other PATCH errors "
        f"{len(results['patch_errors'])}, steps the groups disagree at {results['disagreements']} "
        f"({results['switches']} version changes each)"
    )
    for key, f in results["flat"].items():
        if f["ratio"] is None:
            lines.append(f"{key}: not enough samples")
        else:
            lines.append(
                f"{key}: {f['settled']:.1f} settled -> {f['end']:.1f} at the end "
                f"({f['ratio']:.2f}x, goal <= {FLAT}x)"
            )
    lines.append(f"goals met: {results['goals_met']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(argv[1], int(argv[2]), argv[3])
        return 0
    parser = standalone_parser("month", __doc__)
    parser.add_argument(
        "--store", choices=("sqlite", "etcd"), default="sqlite", help="etcd: a 3-member cluster"
    )
    parser.add_argument("--versions", type=int, default=40_000, help="versions the history is seeded with")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument(
        "--settle-minutes", type=float, default=5.0, help="memory and store flat from then on"
    )
    parser.add_argument("--change-every", type=int, default=1000, help="steps between two changes at once")
    parser.add_argument("--guard-every", type=int, default=5, help="every Nth change guarded (0: none)")
    parser.add_argument(
        "--withdraw-every",
        type=int,
        default=10,
        help="a change scheduled and cancelled after every Nth (0: none)",
    )
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--sample-seconds", type=float, default=30.0)
    quick = {
        "versions": 200,
        "minutes": 0.4,
        "settle_minutes": 0.1,
        "change_every": 200,
        "guard_every": 2,
        "withdraw_every": 2,
        "sample_seconds": 3.0,
    }
    return run_standalone("month", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
