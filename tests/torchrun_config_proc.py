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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=2.0, help="deadline of each call")
    parser.add_argument("--connect-timeout", type=float, default=20.0, help="room for rank 0 to start it")
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
    print("done", flush=True)


if __name__ == "__main__":
    main()
