"""A test worker: calls ``ManagerClient.get_config`` once per step and prints one JSON record per step.

Prints ``ready`` once the client exists, then ``{"group", "rank", "step",
"version", "source", "pinned", "stable_through_step", "pending_version", "pending_step",
"config", "elapsed", "t"}`` per
step, then ``done``.

With ``--report`` it also reports a loss known in advance after each step
(``known_loss``: NaN at the ``--nan-at`` steps, three times as much while the
config's ``lr`` is above ``--hot-lr``, as a bad learning rate makes it) and adds
``lr`` and ``loss`` to its records; ``done`` comes once ``close()`` sent them all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time

from protos.tls import TLSConfig
from worker_client import Config, ConfigUnavailable, ManagerClient


def known_loss(group: str, rank: int, step: int) -> float:
    """The loss a reporting worker reports: ``group`` is ``g<N>``."""
    return 1 + 0.5 * int(group.lstrip("g")) + 0.25 * rank + step / 1000


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
    parser.add_argument("--report", action="store_true", help="report known_loss() every step")
    parser.add_argument("--nan-at", type=int, action="append", default=[], help="report NaN at this step")
    parser.add_argument("--hot-lr", type=float, default=None, help="loss x3 while lr is above this")
    parser.add_argument(
        "--digest", action="store_true", help="record the config's size, lr and sha256, not the config"
    )
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
            "pending_version": cfg.pending_version,
            "pending_step": cfg.pending_step,
            "config": dict(cfg),
            "elapsed": elapsed,
            "t": time.time(),
        }
        if args.digest:  # a big config: one line per step must stay small
            text = json.dumps(dict(cfg), sort_keys=True)
            del record["config"]
            record.update(
                {"lr": cfg.get("lr"), "keys": len(cfg), "sha": hashlib.sha256(text.encode()).hexdigest()}
            )
        if args.report:
            lr = cfg.get_float("lr", 0.0)
            loss = math.nan if step in args.nan_at else known_loss(args.group, args.rank, step)
            loss *= 3 if args.hot_lr is not None and lr > args.hot_lr else 1
            client.report(step, loss=loss, tokens=100.0 * (args.rank + 1))
            record.update({"lr": lr, "loss": loss})
        sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
        sys.stdout.flush()
        if args.interval:
            time.sleep(args.interval)
    client.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
