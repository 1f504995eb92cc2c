"""One demo rank: asks its group's manager for the config every step and prints what it got."""

from __future__ import annotations

import argparse
import math
import os
import random
import time

from worker_client import ManagerClient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manager", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--step-time", type=float, default=0.5)
    args = parser.parse_args()
    parent = os.getppid()
    with ManagerClient(args.manager, timeout=2.0, group_rank=args.rank) as client:
        step = 0
        while os.getppid() == parent:  # the demo went away: stop too
            cfg = client.get_config(step=step)
            lr = cfg.get_float("lr", 1e-3)
            # A made-up loss that falls faster with a larger lr: the dashboard's charts draw it.
            client.report(step, loss=1.0 + 2.0 * math.exp(-step * lr * 20) + random.uniform(0, 0.05))
            print(
                f"{args.group}/{args.rank} step {step:4d} version {cfg.version:3d} lr {lr:g} ({cfg.source})",
                flush=True,
            )
            step += 1
            time.sleep(args.step_time)


if __name__ == "__main__":
    main()
