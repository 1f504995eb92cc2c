"""A test worker that reports a loss: ``get_config(step=...)`` each step, then ``report(step, loss=...)``.

The loss is known in advance: ``1 + 0.5 * group + 0.25 * rank + step / 1000``,
NaN at the ``--nan-at`` steps, and three times as much while the config's ``lr``
is above ``--hot-lr`` (so a change of ``lr`` shows in the loss, the way a bad
learning rate does). Prints ``ready``, one JSON record per step (``group``,
``rank``, ``step``, ``version``, ``lr``, ``loss``), then ``done`` once its client
is closed (which sends the reports still waiting).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from worker_client import ManagerClient


def known_loss(group: int, rank: int, step: int) -> float:
    return 1 + 0.5 * group + 0.25 * rank + step / 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--addr", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.0)
    parser.add_argument("--prefetch", action="store_true")
    parser.add_argument("--nan-at", type=int, action="append", default=[])
    parser.add_argument("--hot-lr", type=float, default=None, help="loss x3 while lr is above this")
    args = parser.parse_args()
    client = ManagerClient(args.addr, timeout=5.0, group_rank=args.rank, prefetch=args.prefetch)
    print("ready", flush=True)
    for step in range(args.steps):
        cfg = client.get_config(step=step)
        lr = cfg.get_float("lr", 0.0)
        loss = math.nan if step in args.nan_at else known_loss(args.group, args.rank, step)
        if args.hot_lr is not None and lr > args.hot_lr:
            loss *= 3
        client.report(step, loss=loss, tokens=100.0 * (args.rank + 1))
        record = {"group": args.group, "rank": args.rank, "step": step, "version": cfg.version}
        record.update({"lr": lr, "loss": loss, "source": cfg.source})
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
        if args.interval:
            time.sleep(args.interval)
    client.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
