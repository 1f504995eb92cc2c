"""A test worker: calls ``ManagerClient.get_config`` once per step and prints one JSON record per step.

Prints ``ready`` once the client exists, then ``{"group", "rank", "step",
"version", "source", "pinned", "stable_through_step", "config", "elapsed", "t"}`` per
step, then ``done``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from protos.tls import TLSConfig
from worker_client import Config, ConfigUnavailable, ManagerClient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--addr", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--interval", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--prefetch", action="store_true")
    parser.add_argument("--no-step", action="store_true", help="call get_config() without a step")
    parser.add_argument("--tls-ca", default=None, help="dial the manager over TLS, trusting this CA")
    parser.add_argument("--strict", action="store_true", help="strict client: ConfigUnavailable is recorded")
    args = parser.parse_args()
    tls = TLSConfig(ca=args.tls_ca) if args.tls_ca else None
    client = ManagerClient(
        args.addr,
        timeout=args.timeout,
        group_rank=args.rank,
        prefetch=args.prefetch,
        tls=tls,
        strict=args.strict,
    )
    print("ready", flush=True)
    for step in range(args.first_step, args.first_step + args.steps):
        started = time.monotonic()
        try:
            cfg = client.get_config(step=None if args.no_step else step)
        except ConfigUnavailable as exc:  # strict: the step has no confirmed config (source "error")
            cfg = exc.answer or Config()
            cfg.source = "error"
        elapsed = time.monotonic() - started
        record = {
            "group": args.group,
            "rank": args.rank,
            "step": step,
            "version": cfg.version,
            "source": cfg.source,
            "pinned": cfg.pinned,
            "stable_through_step": cfg.stable_through_step,
            "config": dict(cfg),
            "elapsed": elapsed,
            "t": time.time(),
        }
        sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
        sys.stdout.flush()
        if args.interval:
            time.sleep(args.interval)
    client.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
