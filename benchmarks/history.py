"""Replies independent of history length (issue 25 item 7).

``python -m benchmarks.history [--quick] [--out DIR]``.

For each history length (10, 1,000 and 10,000 versions): a job's state directory is written
with that many versions, each a one-key change taking effect at a step of a job that stepped
past it (what a controller editing a stepping job leaves), then ``lighthouse serve`` opens it.
Measured: the bytes of the lighthouse's reply to a manager at the job's step and to one without
a step yet, the lighthouse's CPU per reply over ``--replies`` GetConfig calls (each carrying a
manager's status, as a renewal does), and its CPU per edit over ``--edits`` PATCHes scheduled ahead
of the job and as many applying at once. Goal: each
figure within 1.2x of the 10-version one.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.procs import Children, cpu_seconds
from benchmarks.report import machine_line, machine_load, run_standalone, standalone_parser
from benchmarks.stack import CONFIG, serve_lighthouse
from lighthouse.jobs.versions import ConfigStore, Edit
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb
from protos.rpc import LIGHTHOUSE_GET_CONFIG

GOAL = 1.2  # each figure within this factor of the 10-version one
STEPS_PER_VERSION = 10


def write_history(state_dir: Path, versions: int) -> int:
    """A state directory holding ``versions`` versions; returns the job's step."""
    store = ConfigStore(SqliteBackend(state_dir / "lighthouse.db"))
    try:
        store.apply([Edit("put", CONFIG, "bench")])
        for i in range(1, versions):
            store.advance_step(STEPS_PER_VERSION * i)
            store.apply([Edit("patch", {"lr": i * 1e-6}, "bench", effective_step=STEPS_PER_VERSION * i + 2)])
        step = STEPS_PER_VERSION * versions
        store.advance_step(step)
        return step
    finally:
        store.close()
        store.backend.close()


def measure(children: Children, state_dir: Path, step: int, replies: int, edits: int) -> dict[str, Any]:
    name = f"lighthouse-{state_dir.name}"
    child, address, url = serve_lighthouse(children, name, "--state-dir", str(state_dir))
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

        def patch(i: int, path: str) -> None:
            body = json.dumps({"beta1": 0.9 + i * 1e-6})
            conn.request("PATCH", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = response.read()
            if response.status != 200:
                raise RuntimeError(f"PATCH answered {response.status}: {answer[:200]!r}")

        # Scheduled at steps ahead of the job (as changes made while it steps land): only the
        # segments from there on change.
        cpu = cpu_seconds(child.popen.pid)
        for i in range(edits):
            patch(i, f"/api/config?effective_step={step + replies + 1000 + i}")  # past every lease
        scheduled_cpu = cpu_seconds(child.popen.pid) - cpu
        # Applying at once (no group holds a lease): the config of every step changes.
        cpu, started = cpu_seconds(child.popen.pid), time.monotonic()
        for i in range(edits):
            patch(i, "/api/config")
        edit_cpu, edit_wall = cpu_seconds(child.popen.pid) - cpu, time.monotonic() - started
        conn.close()
    finally:
        children.stop(child)
    return {
        "reply_bytes_at_step": at_step,
        "reply_bytes_stepless": stepless,
        "cpu_us_per_reply": reply_cpu / replies * 1e6,
        "cpu_ms_per_scheduled_edit": scheduled_cpu / edits * 1e3 if edits else None,
        "cpu_ms_per_edit": edit_cpu / edits * 1e3 if edits else None,
        "wall_ms_per_edit": edit_wall / edits * 1e3 if edits else None,
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
                started = time.monotonic()
                step = write_history(state_dir, versions)
                figures = measure(children, state_dir, step, args.replies, args.edits)
                figures["seconds_to_write_history"] = time.monotonic() - started
                results["lengths"][str(versions)] = figures
    finally:
        shutil.rmtree(base, ignore_errors=True)
    first = results["lengths"][str(args.versions[0])]
    results["ratios"] = {
        str(v): {
            key: (figures[key] / first[key] if first[key] else None)
            for key in (
                "reply_bytes_at_step",
                "reply_bytes_stepless",
                "cpu_us_per_reply",
                "cpu_ms_per_scheduled_edit",
                "cpu_ms_per_edit",
            )
            if figures[key] is not None
        }
        for v, figures in results["lengths"].items()
    }
    results["goal"] = GOAL
    results["machine_after"] = machine_load()
    return results


def _ratio_text(ratios: dict[str, Any], key: str) -> str:
    """A ratio for the table; None where the 10-version figure is 0 (a CPU clock tick is 10 ms:
    a --quick run of 5 edits may measure none)."""
    value = ratios.get(key)
    return f"{value:.2f}x" if value is not None else "no baseline"


def render(results: dict[str, Any]) -> str:
    lines = [machine_line(results["machine_before"], results["machine_after"])]
    for versions, f in results["lengths"].items():
        ratios = results["ratios"][versions]
        ratio = functools.partial(_ratio_text, ratios)
        lines.append(
            f"{versions:>6} versions: reply {f['reply_bytes_at_step']} B at the job's step "
            f"({ratio('reply_bytes_at_step')}), {f['reply_bytes_stepless']} B without a step "
            f"({ratio('reply_bytes_stepless')}); {f['cpu_us_per_reply']:.0f} us CPU a reply "
            f"({ratio('cpu_us_per_reply')}); an edit scheduled ahead "
            f"{f['cpu_ms_per_scheduled_edit']:.2f} ms CPU ({ratio('cpu_ms_per_scheduled_edit')}), "
            f"one applying at once {f['cpu_ms_per_edit']:.2f} ms ({ratio('cpu_ms_per_edit')}) "
            f"(goal <= {results['goal']}x)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("history", __doc__)
    parser.add_argument("--versions", type=int, nargs="+", default=[10, 1000, 10_000])
    parser.add_argument("--replies", type=int, default=2000, help="GetConfig calls measured per length")
    parser.add_argument("--edits", type=int, default=50, help="PATCHes measured per length")
    quick = {"versions": [10, 100], "replies": 50, "edits": 5}
    return run_standalone("history", parser, argv, quick, run, render)


if __name__ == "__main__":
    sys.exit(main())
