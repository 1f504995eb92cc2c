"""A controller, its own process, that tunes DiLoCo's sync interval from the loss curve.

It reads the job's ``loss`` from the lighthouse (what ``examples/train_diloco.py``'s
ranks report with ``client.report(step, loss=...)``) and changes ``sync_every``
through the admin API, as an operator would, with the reason in the history:

* every ``--interval`` seconds it compares the mean loss of the newest ``--window``
  settled steps (reported by every group) with the window before, against the
  noise: twice the standard error of that difference (from the steps' spread);
* the loss rose by more than ``--rise`` (5%) and more than the noise: averaging
  more often keeps the ranks together: ``sync_every`` halves (at least ``--min-sync``);
* else, it fell by less than ``--plateau`` (1%) or by no more than the noise: a
  calm stretch, the groups can average less often: ``sync_every`` doubles (at most
  ``--max-sync``);
* after a change it waits until the change took effect and a full window of steps
  has run with it, so it judges what its own change did, not what came before.

Every change it makes is guarded (``--guard loss:1.5`` by default): if the loss
rises above 1.5 times its mean before the change, the lighthouse rolls it back by
itself. It stops when the job has reported no new step for ``--idle`` seconds. The
window must fit in the steps the lighthouse keeps exactly (``--window`` at most 256).

    python -m lighthouse serve --config /tmp/train.json &         # {"lr": 0.05, "sync_every": 10}
    python examples/train_diloco.py --lighthouse 127.0.0.1:29510 --steps 2000 --step-interval 0.01 &
    python examples/adaptive_sync.py --url http://127.0.0.1:29511
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from lighthouse.admin import AdminClient, AdminError

AUTHOR = "adaptive_sync"


@dataclass(frozen=True)
class Decision:
    sync_every: int
    reason: str


def decide(points: list[dict[str, Any]], sync_every: int, args: argparse.Namespace) -> Decision | None:
    """The new ``sync_every`` (and why) from the loss of two windows of steps, or None to keep it."""
    means = [p["mean"] for p in points if p["mean"] is not None and "to_step" not in p]
    if len(means) < 2 * args.window or args.window < 2:
        return None
    older, newer = means[-2 * args.window : -args.window], means[-args.window :]
    before, recent = statistics.fmean(older), statistics.fmean(newer)
    if before <= 0:
        return None
    noise = 2 * math.sqrt((statistics.variance(older) + statistics.variance(newer)) / args.window)
    change = (recent - before) / before
    span = f"{before:.4g} -> {recent:.4g} over the last {2 * args.window} steps, noise {noise / before:.1%}"
    if recent - before > max(args.rise * before, noise):
        if sync_every > args.min_sync:
            return Decision(max(args.min_sync, sync_every // 2), f"loss rose {change:+.1%} ({span})")
        return None
    if before - recent < max(args.plateau * before, noise) and sync_every < args.max_sync:
        return Decision(min(args.max_sync, sync_every * 2), f"loss plateaued {change:+.1%} ({span})")
    return None


def run(args: argparse.Namespace) -> int:
    admin = AdminClient(args.url, token=args.token, job=args.job, author=AUTHOR)
    wait_until = -1  # no decision before this step: the last change must have run a window
    last_step, last_progress = -1, time.monotonic()
    while time.monotonic() - last_progress < (args.idle if last_step >= 0 else args.start_timeout):
        time.sleep(args.interval)
        try:
            newest = admin.metrics("loss", max_points=1)["last"].get("loss")
            if newest is None:
                continue
            step = newest["step"]
            if step > last_step:
                last_step, last_progress = step, time.monotonic()
            if step < wait_until:
                continue
            first = max(0, step - 2 * args.window + 1)
            points = admin.metrics("loss", from_step=first, to_step=step)["metrics"]["loss"]
            config = admin.show()["live"]  # what the groups train with now (the loss above)
            sync_every = int(config.get("sync_every", 10))
            decision = decide(points, sync_every, args)
            if decision is None:
                continue
            answer = admin.patch(
                {"sync_every": decision.sync_every},
                comment=f"{AUTHOR}: {decision.reason}: sync_every {sync_every} -> {decision.sync_every}",
                guard=args.guard,
            )
        except AdminError as exc:
            print(f"step {last_step}: {exc.message}", flush=True)
            continue
        effective = answer["effective_step"] if answer["effective_step"] is not None else step
        wait_until = effective + args.window
        print(
            f"step {step}: {decision.reason}: sync_every {sync_every} -> {decision.sync_every} "
            f"(version {answer['version']}, from step {effective})",
            flush=True,
        )
    print(f"no new step for {args.idle:g} s after step {last_step}: done", flush=True)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:29511", help="the lighthouse's dashboard URL")
    parser.add_argument("--job", default="default")
    parser.add_argument("--token", default=None, help="admin token, if the lighthouse has one")
    parser.add_argument("--window", type=int, default=50, help="steps per window of the loss")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two looks")
    parser.add_argument("--plateau", type=float, default=0.01, help="a smaller relative fall is a plateau")
    parser.add_argument("--rise", type=float, default=0.05, help="a larger relative rise is a rise")
    parser.add_argument("--min-sync", type=int, default=2)
    parser.add_argument("--max-sync", type=int, default=64)
    parser.add_argument("--guard", default="loss:1.5", help="guard of every change ('' for none)")
    parser.add_argument("--idle", type=float, default=10.0, help="stop after this long without a new step")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="wait this long for a first step")
    args = parser.parse_args()
    args.guard = args.guard or None
    sys.exit(run(args))


if __name__ == "__main__":
    main()
