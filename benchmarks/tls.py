"""What TLS costs per call: relay cache hit and lighthouse fetch, TLS against plaintext, in one run.

Two stacks side by side (lighthouse + manager each, in their own processes):
one plaintext, one with TLS on both hops (the lighthouse also with mutual TLS).
The cases run interleaved (``latency.run_interleaved``), so the ratios hold
even when the machine's noise moves the absolute numbers. Established
connections are measured: the handshake happens once per channel, not per call.

    python -m benchmarks.tls [--rounds 20] [--batch 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.latency import Case, run_interleaved, timed
from benchmarks.procs import Children
from benchmarks.report import publish, run_meta, summarize, table
from benchmarks.stack import start_lighthouse, start_manager
from lighthouse.client import LighthouseClient
from protos.tls import TLSConfig
from tests.certs import CA, Pair
from tests.procs import Proc
from worker_client import ManagerClient


def _lighthouse(children: Children, work: Path, name: str, tls: list[str]) -> str:
    return start_lighthouse(children, work, name, *tls, dashboard=False)[1]


def _manager(children: Children, lighthouse: str, name: str, tls: list[str]) -> Proc:
    return start_manager(children, lighthouse, name, ttl=3600, flags=tls)


def _pair_args(prefix: str, pair: Pair) -> list[str]:
    return [f"--{prefix}cert", str(pair.cert), f"--{prefix}key", str(pair.key)]


def run(rounds: int, batch: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp, Children(Path(tmp) / "logs") as children:
        work = Path(tmp)
        ca = CA(work / "pki")
        server, client = ca.issue("server"), ca.issue("client", client=True)
        plain_lh = _lighthouse(children, work, "lh-plain", [])
        tls_lh = _lighthouse(children, work, "lh-tls", [*_pair_args("tls-", server)])
        mtls_lh = _lighthouse(
            children, work, "lh-mtls", [*_pair_args("tls-", server), "--tls-client-ca", str(ca.cert)]
        )
        plain_mgr = _manager(children, plain_lh, "m-plain", []).readline()
        tls_mgr = _manager(
            children,
            mtls_lh,
            "m-tls",
            [
                "--lighthouse-ca",
                str(ca.cert),
                *_pair_args("lighthouse-", client),
                *_pair_args("tls-", server),
            ],
        ).readline()
        trust = TLSConfig(ca=ca.cert)
        mutual = TLSConfig(ca=ca.cert, cert=client.cert, key=client.key)
        clients: list[ManagerClient | LighthouseClient] = []

        def case(name: str, label: str, c: ManagerClient | LighthouseClient) -> Case:
            clients.append(c)
            return Case(name, label, timed(c.get_config))

        cases = [
            case(
                "relay_hit_plain",
                "ManagerClient.get_config(), cache hit, plaintext",
                ManagerClient(plain_mgr),
            ),
            case("relay_hit_tls", "the same over TLS", ManagerClient(tls_mgr, tls=trust)),
            case("lighthouse_plain", "LighthouseClient.get_config(), plaintext", LighthouseClient(plain_lh)),
            case("lighthouse_tls", "the same over TLS", LighthouseClient(tls_lh, tls=trust)),
            case("lighthouse_mtls", "the same over mutual TLS", LighthouseClient(mtls_lh, tls=mutual)),
        ]
        try:
            samples = run_interleaved(cases, rounds, batch, warmup)
        finally:
            for c in clients:
                c.close()
    stats = {name: summarize(values) for name, values in samples.items()}
    labels = {c.name: c.label for c in cases}
    return {"cases": stats, "labels": labels}


def render(results: dict[str, Any]) -> str:
    stats, labels = results["cases"], results["labels"]
    base = {"relay": stats["relay_hit_plain"], "lighthouse": stats["lighthouse_plain"]}
    rows = []
    for name, s in stats.items():
        ref = base[name.split("_")[0]]
        rows.append(
            [
                name,
                *(f"{s[q]:.1f}" for q in ("p50", "p90", "p99")),
                f"{s['p50'] / ref['p50']:.3f}",
                f"{s['p99'] / ref['p99']:.3f}",
                labels[name],
            ]
        )
    headers = ["case", "p50", "p90", "p99", "p50/plain", "p99/plain", "what"]
    return "Per-call latency with and without TLS, one client, interleaved, us\n" + table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None, help="also write tls.json here")
    args = parser.parse_args(argv)
    meta = run_meta(benchmark="tls", rounds=args.rounds, batch=args.batch)
    results = run(args.rounds, args.batch, args.warmup)
    results["meta"] = meta
    publish(render(results), results, args.out, "tls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
