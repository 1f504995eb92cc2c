"""A job's costs against the length of its history (issue 25 item 7, issue 37 item 1).

``python -m benchmarks.history [--quick] [--every STEPS] [--out DIR]``.

For each history length (10, 1,000, 10,000 and 100,000 versions): a job's state directory is
written with that many versions, each a one-key change taking effect at a step of a job that
stepped past it, one every ``--every`` steps (10: a change every few seconds; 100: a controller's),
under the retention a lighthouse applies by default; then ``lighthouse serve`` (defaults) opens it.
Measured: the bytes of the lighthouse's reply to a manager at the job's step and to one without
a step yet; the lighthouse's CPU per reply over ``--replies`` GetConfig calls (each carrying a
manager's status, as a renewal does); its CPU and latency per edit over ``--edits`` PATCHes
applying at once (with a schedule of 5 changes pending far ahead) and as many scheduled ahead of
the job; the p99 of a group's calls (GetConfig at the job's step, as a manager renews) made back to
back while as many edits applying at once are made; and its memory (RSS) and the store's bytes
after them. Goal: each figure within 1.2x of the
10-version one.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from benchmarks.procs import Children, cpu_seconds, rss_bytes
from benchmarks.report import machine_line, machine_load, percentile, run_standalone, standalone_parser
from benchmarks.stack import CONFIG, read_metrics, serve_lighthouse
from lighthouse.jobs.versions import DEFAULT_HISTORY_LIMIT, DEFAULT_KEEP_STEPS, ConfigStore, Edit
from lighthouse.store.backend import StoreBackend
from lighthouse.store.etcd import EtcdBackend
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb
from protos.rpc import LIGHTHOUSE_GET_CONFIG
from tests.etcd_cluster import EtcdCluster

GOAL = 1.2  # each figure within this factor of the 10-version one
ETCD_QUOTA = 256 * 2**20  # the etcd cluster's --quota-backend-bytes (issue 37's month-long run)
PENDING_AHEAD = 5  # changes scheduled far ahead while the edits applying at once are made
FIGURES = (  # compared with the 10-version run's
    "reply_bytes_at_step",
    "reply_bytes_stepless",
    "cpu_us_per_reply",
    "cpu_ms_per_scheduled_edit",
    "cpu_ms_per_edit",
    "wall_ms_p50_scheduled_edit",
    "wall_ms_p50_edit",
    "rss_mb",
    "store_kb",
    "call_ms_p99_during_edits",
)


@dataclass(frozen=True)
class HistoryStore:
    """Where one history length is written and served from: a SQLite state directory, or a prefix
    of the run's 3-member etcd (``--store etcd``)."""

    name: str
    state_dir: Path | None = None
    etcd: EtcdCluster | None = None

    def backend(self) -> StoreBackend:
        if self.etcd is not None:
            return EtcdBackend(self.etcd.endpoints, prefix=f"/{self.name}")
        assert self.state_dir is not None
        return SqliteBackend(self.state_dir / "lighthouse.db")

    def flags(self) -> tuple[str, ...]:
        if self.etcd is not None:
            return ("--store", f"etcd://{self.etcd.endpoints}/{self.name}")
        return ("--state-dir", str(self.state_dir))

    def bytes(self) -> int:
        """The SQLite file and its write-ahead log; etcd's database in use (a member's: compacted
        revisions leave pages free in the file, reused, not returned)."""
        if self.etcd is not None:
            samples = read_metrics(f"http://{self.etcd.members[0].endpoint}")
            return int(samples["etcd_mvcc_db_total_size_in_use_in_bytes"])
        assert self.state_dir is not None
        return sum(p.stat().st_size for p in self.state_dir.iterdir() if p.name.startswith("lighthouse.db"))

    def file_bytes(self) -> int:
        """What the store takes on disk: the SQLite files; etcd's database file (a member's: what
        its quota counts, and what only a defragmentation shrinks)."""
        if self.etcd is not None:
            samples = read_metrics(f"http://{self.etcd.members[0].endpoint}")
            return int(samples["etcd_mvcc_db_total_size_in_bytes"])
        return self.bytes()


def write_history(where: HistoryStore, versions: int, every: int) -> int:
    """``versions`` versions, one every ``every`` steps, as a lighthouse with the default retention
    leaves them; returns the job's step."""
    store = ConfigStore(where.backend(), history_limit=DEFAULT_HISTORY_LIMIT, keep_steps=DEFAULT_KEEP_STEPS)
    try:
        store.apply([Edit("put", CONFIG, "bench")])
        for i in range(1, versions):
            store.advance_step(every * i)
            store.apply([Edit("patch", {"lr": i * 1e-6}, "bench", effective_step=every * i + 2)])
        step = every * versions
        store.advance_step(step)
        return step
    finally:
        store.close()
        store.backend.close()


class GroupCalls:
    """A group's manager renewing back to back (GetConfig with its status at the job's step) in a
    thread, timing each call, while the benchmark edits the job."""

    def __init__(self, address: str, step: int) -> None:
        self._channel = grpc.insecure_channel(address)
        self._call = self._channel.unary_unary(
            LIGHTHOUSE_GET_CONFIG, request_serializer=None, response_deserializer=None
        )
        self._request = pb.LighthouseConfigRequest(
            status=pb.ManagerStatus(replica_id="group", step=step)
        ).SerializeToString()
        self._stop = threading.Event()
        self.seconds: list[float] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="group-calls", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.perf_counter()
                self._call(self._request, timeout=30)
                self.seconds.append(time.perf_counter() - started)
                time.sleep(0.001)  # a manager renews on a timer, not in a busy loop
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(60)
        self._channel.close()
        if self.error is not None:
            raise RuntimeError(f"a group call failed: {self.error!r}") from self.error
        return self.seconds


def measure(children: Children, where: HistoryStore, step: int, replies: int, edits: int) -> dict[str, Any]:
    child, address, url = serve_lighthouse(children, f"lighthouse-{where.name}", *where.flags())
    try:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_unary(
                LIGHTHOUSE_GET_CONFIG, request_serializer=None, response_deserializer=None
            )
            stepless = len(call(pb.LighthouseConfigRequest().SerializeToString(), timeout=30))
            at_step = 0
            cpu = cpu_seconds(child.popen.pid)
            for i in range(replies):
                status = pb.ManagerStatus(replica_id="bench", step=step + i // 10, requests=i)
                at_step = len(call(pb.LighthouseConfigRequest(status=status).SerializeToString(), timeout=30))
            reply_cpu = cpu_seconds(child.popen.pid) - cpu
        host, port = url.split("://", 1)[1].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)

        def patch(i: int, path: str) -> float:
            body = json.dumps({"beta1": 0.9 + i * 1e-6})
            started = time.perf_counter()
            conn.request("PATCH", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = response.read()
            if response.status != 200:
                raise RuntimeError(f"PATCH answered {response.status}: {answer[:200]!r}")
            return time.perf_counter() - started

        ahead = step + replies + 1000  # past every lease
        # A schedule pending ahead of the job, as a warm-up or a decay is (a few changes).
        for i in range(PENDING_AHEAD):
            patch(i, f"/api/config?effective_step={ahead + 100_000 + i}")
        # Applying at once (no group holds a lease): the config of every step up to the schedule
        # changes.
        cpu = cpu_seconds(child.popen.pid)
        walls = sorted(patch(i, "/api/config") for i in range(edits))
        edit_cpu = cpu_seconds(child.popen.pid) - cpu
        # As many again while a group calls back to back: does it wait for the edits?
        group = GroupCalls(address, step + replies // 10)
        for i in range(edits):
            patch(edits + i, "/api/config")
        calls = sorted(group.stop())
        # Scheduled at steps ahead of the job (as changes made while it steps land): only the
        # segments from there on change (each adds one to every reply: the last ones cost more).
        cpu = cpu_seconds(child.popen.pid)
        scheduled_walls = sorted(patch(i, f"/api/config?effective_step={ahead + i}") for i in range(edits))
        scheduled_cpu = cpu_seconds(child.popen.pid) - cpu
        conn.close()
        rss = rss_bytes(child.popen.pid)
    finally:
        children.stop(child)
    return {
        "reply_bytes_at_step": at_step,
        "reply_bytes_stepless": stepless,
        "cpu_us_per_reply": reply_cpu / replies * 1e6,
        "cpu_ms_per_scheduled_edit": scheduled_cpu / edits * 1e3 if edits else None,
        "cpu_ms_per_edit": edit_cpu / edits * 1e3 if edits else None,
        "wall_ms_p50_scheduled_edit": percentile(scheduled_walls, 50) * 1e3 if edits else None,
        "wall_ms_p50_edit": percentile(walls, 50) * 1e3 if edits else None,
        "rss_mb": rss / 2**20,
        "store_kb": where.bytes() / 1024,
        "group_calls_during_edits": len(calls),
        "call_ms_p99_during_edits": percentile(calls, 99) * 1e3 if calls else None,
    }


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"machine_before": machine_load(), "lengths": {}}
    shm = Path("/dev/shm")  # the histories are written on tmpfs when there is one: no fsyncs measured
    base = Path(tempfile.mkdtemp(prefix="bench-history-", dir=shm if shm.is_dir() else work))
    try:
        with Children(work / "logs") as children:
            for versions in args.versions:
                state_dir = base / f"v{versions}"
                state_dir.mkdir()
                with contextlib.ExitStack() as stack:
                    etcd = None
                    if args.store == "etcd":  # a cluster of its own per length: its bytes are that length's
                        # Compacted every few seconds here (a run writes in minutes what a month of a
                        # job does in weeks; deploy/kubernetes compacts hourly), with the month-long
                        # run's quota.
                        compaction = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=10s")
                        quota = f"--quota-backend-bytes={ETCD_QUOTA}"
                        etcd = stack.enter_context(
                            EtcdCluster(base / f"etcd-{versions}", size=3, extra_args=[*compaction, quota])
                        )
                    where = HistoryStore(f"v{versions}", state_dir, etcd)
                    started = time.monotonic()
                    step = write_history(where, versions, args.every)
                    written = time.monotonic() - started
                    figures = measure(children, where, step, args.replies, args.edits)
                figures["seconds_to_write_history"] = written
                results["lengths"][str(versions)] = figures
    finally:
        shutil.rmtree(base, ignore_errors=True)
    first = results["lengths"][str(args.versions[0])]
    results["ratios"] = {
        str(v): {
            key: (figures[key] / first[key] if first[key] else None)
            for key in FIGURES
            if figures.get(key) is not None
        }
        for v, figures in results["lengths"].items()
    }
    results["goal"] = GOAL
    results["every"] = args.every
    results["store"] = args.store
    results["retention"] = {"history_limit": DEFAULT_HISTORY_LIMIT, "keep_steps": DEFAULT_KEEP_STEPS}
    results["machine_after"] = machine_load()
    return results


def _ratio_text(ratios: dict[str, Any], key: str) -> str:
    """A ratio for the table; None where the 10-version figure is 0 (a CPU clock tick is 10 ms:
    a --quick run of 5 edits may measure none)."""
    value = ratios.get(key)
    return f"{value:.2f}x" if value is not None else "no baseline"


def render(results: dict[str, Any]) -> str:
    lines = [machine_line(results["machine_before"], results["machine_after"])]
    every = results.get("every")
    if every is not None:
        retention = results["retention"]
        lines.append(
            f"a change every {every} steps; retention: {retention['history_limit']} versions, "
            f"{retention['keep_steps']} steps kept (goal: every figure <= {results['goal']}x the first)"
        )
    for versions, f in results["lengths"].items():
        ratios = results["ratios"][versions]
        ratio = functools.partial(_ratio_text, ratios)
        line = (
            f"{versions:>6} versions: reply {f['reply_bytes_at_step']} B at the job's step "
            f"({ratio('reply_bytes_at_step')}), {f['reply_bytes_stepless']} B without a step "
            f"({ratio('reply_bytes_stepless')}); {f['cpu_us_per_reply']:.0f} us CPU a reply "
            f"({ratio('cpu_us_per_reply')}); an edit scheduled ahead "
            f"{f['cpu_ms_per_scheduled_edit']:.2f} ms CPU ({ratio('cpu_ms_per_scheduled_edit')}), "
            f"one applying at once {f['cpu_ms_per_edit']:.2f} ms ({ratio('cpu_ms_per_edit')})"
        )
        if "rss_mb" in f:
            line += (
                f"; p50 {f['wall_ms_p50_scheduled_edit']:.1f} ms ({ratio('wall_ms_p50_scheduled_edit')}) and "
                f"{f['wall_ms_p50_edit']:.1f} ms ({ratio('wall_ms_p50_edit')}); RSS {f['rss_mb']:.1f} MB "
                f"({ratio('rss_mb')}); store {f['store_kb']:.0f} KB ({ratio('store_kb')}); a group's "
                f"call p99 during the edits {f['call_ms_p99_during_edits']:.2f} ms "
                f"({ratio('call_ms_p99_during_edits')}, {f['group_calls_during_edits']} calls)"
            )
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("history", __doc__)
    parser.add_argument("--versions", type=int, nargs="+", default=[10, 1000, 10_000, 100_000])
    parser.add_argument("--every", type=int, default=10, help="steps between two changes of the history")
    parser.add_argument(
        "--store", choices=("sqlite", "etcd"), default="sqlite", help="etcd: a 3-member cluster"
    )
    parser.add_argument("--replies", type=int, default=2000, help="GetConfig calls measured per length")
    parser.add_argument("--edits", type=int, default=200, help="PATCHes measured per length and kind")
    quick = {"versions": [10, 100], "replies": 50, "edits": 5}
    return run_standalone("history", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
