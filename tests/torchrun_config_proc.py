"""A torchrun rank that only asks for its config (no collectives): for the test that kills group rank 0.

Calls ``connect()`` and prints ``{"event": "start", "rank", "torch_before",
"torch_after"}`` (whether torch was loaded before and after the call: only
``connect()`` may import it), then ``get_config(step=...)`` every ``--interval``
seconds with one JSON record per step: ``{"rank", "pid", "step", "source", "job",
"lr", "elapsed"}``; ``done`` at the end. Without collectives a rank outlives the death
of rank 0, so the test sees what its config calls do then.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from worker_client import connect


def everyone_done(rank: int) -> None:
    """Count this rank done in torchrun's store; rank 0 waits until every rank is."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    store.add("config_proc_done", 1)
    if rank == 0:
        world = int(os.environ["WORLD_SIZE"])
        deadline = time.monotonic() + 60
        while store.add("config_proc_done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=2.0, help="deadline of each call")
    # Room for rank 0 to import torch and start the manager: under a load of 17 that took over 20 s.
    parser.add_argument("--connect-timeout", type=float, default=60.0, help="room for rank 0 to start it")
    parser.add_argument(
        "--hold-manager",
        action="store_true",
        help="rank 0 (and its manager) stays until every rank is done (else a rank may outlive it)",
    )
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch_before = "torch" in sys.modules
    client = connect(timeout=args.connect_timeout)
    torch_after = "torch" in sys.modules
    start = {"event": "start", "rank": rank, "torch_before": torch_before, "torch_after": torch_after}
    sys.stdout.write(json.dumps(start) + "\n")
    sys.stdout.flush()
    for step in range(args.steps):
        start = time.monotonic()
        cfg = client.get_config(step=step, timeout=args.timeout)
        elapsed = time.monotonic() - start
        record = {"rank": rank, "pid": os.getpid(), "step": step, "source": cfg.source, "job": cfg.job}
        # One write per line: the ranks share torchrun's stdout.
        sys.stdout.write(json.dumps({**record, "lr": cfg.get("lr"), "elapsed": elapsed}) + "\n")
        sys.stdout.flush()
        time.sleep(args.interval)
    if args.hold_manager:
        everyone_done(rank)
    print("done", flush=True)


if __name__ == "__main__":
    main()
