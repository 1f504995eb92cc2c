"""What the forward costs: torchft's quorum and heartbeat calls through ``lighthouse serve --torchft``'s
port against the same calls made to torchft's lighthouse directly, in one run.

One ``lighthouse serve --torchft --min-replicas 1`` process; its in-process torchft lighthouse's own
address comes from ``GET /api/torchft``. One client in the benchmark process sends the raw request
bytes torchft's Manager sends (a ``LighthouseHeartbeatRequest``, a ``LighthouseQuorumRequest`` of one
replica group, which torchft answers at once with ``min_replicas`` 1) on one channel per target: our
port, ``benchmarks.passthrough`` (a minimal Python forward in a process of its own: what any Python
hop costs) and torchft's lighthouse directly. The six cases run interleaved
(``latency.run_interleaved``): what each hop adds to the direct call holds while the machine's noise
moves the absolute numbers.

    python -m benchmarks.torchft_forward [--rounds 20] [--batch 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc

from benchmarks.latency import Case, run_interleaved, timed
from benchmarks.procs import Children
from benchmarks.report import run_standalone, standalone_parser, summarize, table
from benchmarks.stack import start_lighthouse
from tests.seed_proto import seed_modules

HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
QUORUM = "/torchft.LighthouseService/Quorum"
TIMEOUT = 10.0  # seconds, every call's deadline
LABELS = {
    "ours": "through our port",
    "passthrough": "through a minimal Python pass-through (the floor of a Python hop)",
    "direct": "to torchft directly",
}


def requests() -> dict[str, bytes]:
    """The request bytes of each method, built from the seed's torchft.proto (torchft's own)."""
    pb2, _ = seed_modules()
    member = pb2.QuorumMember(
        replica_id="bench", address="127.0.0.1:1", store_address="127.0.0.1:2", step=1, world_size=1
    )
    return {
        HEARTBEAT: pb2.LighthouseHeartbeatRequest(replica_id="bench").SerializeToString(),
        QUORUM: pb2.LighthouseQuorumRequest(requester=member).SerializeToString(),
    }


def torchft_target(url: str) -> str:
    """torchft's own lighthouse, as the lighthouse's dashboard names it."""
    with urllib.request.urlopen(f"{url}/api/torchft", timeout=TIMEOUT) as answer:
        page = json.loads(answer.read())["torchft"]["page"]
    return f"127.0.0.1:{urlsplit(page).port}"


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rounds, batch, warmup = args.rounds, args.batch, args.warmup
    with Children(work / "logs") as children:
        flags = ("--torchft", "--min-replicas", "1", "--join-timeout-ms", "100")
        _, ours, url = start_lighthouse(children, work, "lh-torchft", *flags)
        direct = torchft_target(url)
        passthrough = children.python("passthrough", "-m", "benchmarks.passthrough", direct).readline()
        payloads = requests()
        channels = {
            "ours": grpc.insecure_channel(ours),
            "passthrough": grpc.insecure_channel(passthrough),
            "direct": grpc.insecure_channel(direct),
        }
        try:
            cases = []
            for method, short in ((HEARTBEAT, "heartbeat"), (QUORUM, "quorum")):
                for target, channel in channels.items():
                    stub = channel.unary_unary(method)
                    request = payloads[method]
                    label = f"{short} {LABELS[target]}"
                    cases.append(
                        Case(
                            f"{short}_{target}", label, timed(lambda s=stub, r=request: s(r, timeout=TIMEOUT))
                        )
                    )
            samples = run_interleaved(cases, rounds, batch, warmup)
        finally:
            for channel in channels.values():
                channel.close()
    stats = {name: summarize(values) for name, values in samples.items()}
    quantiles = ("p50", "p90", "p99")
    ratios = {
        method: {q: stats[f"{method}_ours"][q] / stats[f"{method}_direct"][q] for q in quantiles}
        for method in ("heartbeat", "quorum")
    }
    added_us = {  # what each hop adds to the direct call, in microseconds
        f"{method}_{hop}": {q: stats[f"{method}_{hop}"][q] - stats[f"{method}_direct"][q] for q in quantiles}
        for method in ("heartbeat", "quorum")
        for hop in ("ours", "passthrough")
    }
    labels = {c.name: c.label for c in cases}
    return {"cases": stats, "labels": labels, "ratios": ratios, "added_us": added_us}


def render(results: dict[str, Any]) -> str:
    stats, labels = results["cases"], results["labels"]
    rows = []
    for name, s in stats.items():
        method = name.rsplit("_", 1)[0]
        direct = stats[f"{method}_direct"]
        rows.append(
            [
                name,
                *(f"{s[q]:.1f}" for q in ("p50", "p90", "p99")),
                f"{s['p50'] - direct['p50']:+.1f}",
                f"{s['p99'] - direct['p99']:+.1f}",
                labels[name],
            ]
        )
    headers = ["case", "p50", "p90", "p99", "p50 added", "p99 added", "what"]
    return "torchft's calls through the forward and directly, one client, interleaved, us\n" + table(
        headers, rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = standalone_parser("torchft_forward", __doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=200)
    quick = {"rounds": 2, "batch": 20, "warmup": 10}  # a smoke run: 2 rounds of 20 calls
    return run_standalone("torchft_forward", parser, argv, quick, run, render)


if __name__ == "__main__":
    raise SystemExit(main())
