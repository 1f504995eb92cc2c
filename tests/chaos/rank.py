"""A chaos rank: one worker of a replica group, stepping until it is killed.

Steps on the job's clock (step N is due at ``--epoch + (N - --first-step) x --interval``), so
the groups stay in step as the replica groups of one job do. Calls
``ManagerClient.get_config(step=N)`` at the start of every step, as a training script does, and
appends one JSON line per step to ``--out`` (flushed, so a SIGKILL loses at most the step being
written): the job incarnation, group, rank, step, the version and source it was served, the
config and the wall time. The checker reads nothing else of it. Each step also reports a
``loss`` (see ``loss``) for the guards the operator sets.
"""

from __future__ import annotations

import argparse
import json
import time

from worker_client import ManagerClient


def loss(config: dict[str, str]) -> float:
    """The loss this rank reports for a step: 1 times the config's ``loss_scale`` (the operator's
    guarded changes set it: above the guard's factor, the guard must roll the change back)."""
    try:
        return float(config.get("loss_scale", "1"))
    except ValueError:
        return 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--addr", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--incarnation", type=int, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--first-step", type=int, required=True)
    parser.add_argument("--interval", type=float, required=True)
    parser.add_argument("--epoch", type=float, required=True, help="wall time at which --first-step is due")
    parser.add_argument("--timeout", type=float, default=1.0)
    args = parser.parse_args()
    client = ManagerClient(args.addr, timeout=args.timeout, group_rank=args.rank)
    print("ready", flush=True)
    step = args.first_step
    with open(args.out, "a", buffering=1) as out:
        while True:
            started = time.monotonic()
            cfg = client.get_config(step=step)
            record = {
                "inc": args.incarnation,
                "group": args.group,
                "rank": args.rank,
                "step": step,
                "version": cfg.version,
                "source": cfg.source,
                "config": dict(cfg),
                "t": time.time(),
                "elapsed": round(time.monotonic() - started, 4),
            }
            out.write(json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n")
            client.report(step, loss=loss(cfg))
            step += 1
            # The job's clock, not this rank's: every group's step N is due at the same moment, and a
            # rank that fell behind (a stall, a restart) catches up at full speed, as one healed by
            # its peers does.
            time.sleep(max(0.0, args.epoch + (step - args.first_step) * args.interval - time.time()))


if __name__ == "__main__":
    main()
