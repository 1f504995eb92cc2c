"""The etcd store side by side with SQLite: ``python -m benchmarks.etcd_store [--edits N] [--out DIR]``.

* acknowledged-edit latency: a ``PATCH /api/config`` on a lighthouse with its
  SQLite state directory, and on one with ``--store etcd://`` (a 3-member etcd on
  loopback, data on disk, as deployed), alternating so noise hits both alike;
* propagation: after each edit acknowledged by lighthouse A, the time until
  lighthouse B (same etcd prefix) serves that version on GetConfig, polled every
  millisecond (the goal: 100 ms p99).

etcd is Debian's ``etcd-server``, started and stopped by the run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.procs import Children
from benchmarks.report import publish, run_meta
from benchmarks.stack import CONFIG, patch_config, serve_lighthouse, start_lighthouse
from lighthouse.admin import AdminClient
from lighthouse.client import LighthouseClient
from tests.etcd_cluster import EtcdCluster
from tests.procs import Proc, poll


def start_etcd_lighthouse(children: Children, name: str, store: str) -> tuple[Proc, str, str]:
    return serve_lighthouse(children, name, "--store", store)


def start_etcd_fleet(children: Children, name: str, store: str, count: int) -> list[tuple[Proc, str, str]]:
    """``count`` lighthouses on ``store``, the job given ``CONFIG`` through the first; returns once
    every one serves it (each as ``start_etcd_lighthouse`` returns it)."""
    lighthouses = [start_etcd_lighthouse(children, f"{name}-{i}", store) for i in range(count)]
    version = int(AdminClient(lighthouses[0][2]).put(CONFIG)["version"])
    for _, addr, _ in lighthouses:
        with LighthouseClient(addr) as client:
            poll(lambda c=client: c.fetch(timeout=5).version >= version, 30, what=f"{addr} to catch up")
    return lighthouses


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 2),
        "p99_ms": round(ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1e3, 2),
        "max_ms": round(ordered[-1] * 1e3, 2),
        "n": len(ordered),
    }


def run(edits: int, work: Path) -> dict[str, Any]:
    sqlite_s: list[float] = []
    etcd_s: list[float] = []
    propagation_s: list[float] = []
    with EtcdCluster(work / "etcd", size=3) as cluster, Children(work / "logs") as children:
        _, _, sqlite_url = start_lighthouse(children, work, "lighthouse-sqlite")
        store = f"etcd://{cluster.endpoints}/bench"
        _, _, a_url = start_etcd_lighthouse(children, "lighthouse-a", store)
        _, b_addr, _ = start_etcd_lighthouse(children, "lighthouse-b", store)
        patch_config(a_url, CONFIG)
        with LighthouseClient(b_addr) as b:
            for i in range(edits):
                started = time.monotonic()
                patch_config(sqlite_url, {"edit": i})
                sqlite_s.append(time.monotonic() - started)

                started = time.monotonic()
                version = patch_config(a_url, {"edit": i})
                acked = time.monotonic()
                etcd_s.append(acked - started)
                while b.fetch(timeout=5).version < version:
                    time.sleep(0.001)
                propagation_s.append(time.monotonic() - acked)
    return {
        "edit_sqlite": percentiles(sqlite_s),
        "edit_etcd": percentiles(etcd_s),
        "propagation_to_other_lighthouse": percentiles(propagation_s),
        "edit_p50_ratio_etcd_to_sqlite": round(statistics.median(etcd_s) / statistics.median(sqlite_s), 2),
    }


def render(results: dict[str, Any]) -> str:
    lines = [f"{'case':34} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'n':>5}", "-" * 67]
    for case in ("edit_sqlite", "edit_etcd", "propagation_to_other_lighthouse"):
        r = results[case]
        lines.append(f"{case:34} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f} {r['n']:5d}")
    lines.append(f"acknowledged edit p50, etcd / SQLite: {results['edit_p50_ratio_etcd_to_sqlite']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.etcd_store", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--edits", type=int, default=200, help="edits per store")
    parser.add_argument("--out", type=Path, default=None, help="also write etcd_store.json here")
    args = parser.parse_args(argv)
    meta = run_meta(benchmark="etcd_store", edits=args.edits)
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as tmp:
        results = run(args.edits, Path(tmp))
    results["meta"] = meta
    publish(render(results), results, args.out, "etcd_store")
    return 0


if __name__ == "__main__":
    sys.exit(main())
