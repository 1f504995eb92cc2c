"""What the forward costs: torchft's quorum and heartbeat calls through ``lighthouse serve --torchft``'s
port against the same calls made to torchft's lighthouse directly, in one run.

One ``lighthouse serve --torchft --min-replicas 1`` process; its in-process torchft lighthouse's own
address comes from ``GET /api/torchft``. One client in the benchmark process sends the raw request
bytes torchft's Manager sends (a ``LighthouseHeartbeatRequest``, a ``LighthouseQuorumRequest`` of one
replica group, which torchft answers at once with ``min_replicas`` 1) on one channel per target. The
four cases run interleaved (``latency.run_interleaved``): the ratios of p50 and p99 hold while the
machine's noise moves the absolute numbers.

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
        payloads = requests()
        channels = {"ours": grpc.insecure_channel(ours), "direct": grpc.insecure_channel(direct)}
        try:
            cases = []
            for method, short in ((HEARTBEAT, "heartbeat"), (QUORUM, "quorum")):
                for target, channel in channels.items():
                    stub = channel.unary_unary(method)
                    request = payloads[method]
                    label = f"{short} {'through our port' if target == 'ours' else 'to torchft directly'}"
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
    ratios = {
        method: {q: stats[f"{method}_ours"][q] / stats[f"{method}_direct"][q] for q in ("p50", "p90", "p99")}
        for method in ("heartbeat", "quorum")
    }
    return {"cases": stats, "labels": {c.name: c.label for c in cases}, "ratios": ratios}


def render(results: dict[str, Any]) -> str:
    stats, labels, ratios = results["cases"], results["labels"], results["ratios"]
    rows = []
    for name, s in stats.items():
        method, target = name.rsplit("_", 1)
        ratio = ratios[method] if target == "ours" else {"p50": 1.0, "p99": 1.0}
        rows.append(
            [
                name,
                *(f"{s[q]:.1f}" for q in ("p50", "p90", "p99")),
                f"{ratio['p50']:.2f}",
                f"{ratio['p99']:.2f}",
                labels[name],
            ]
        )
    headers = ["case", "p50", "p90", "p99", "p50/direct", "p99/direct", "what"]
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
