"""The nemesis: injects one fault of the plan, waits its duration, heals it, and logs both moments.

Targets are picked when the fault happens (``target`` modulo the candidates then), so a seed
replays the same kinds and timing even though which member leads etcd varies.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.chaos.cluster import Cluster, Group
from tests.chaos.schedule import Event
from tests.procs import ManagerProc, Proc

# A fault: what it hits, how it begins, and how it heals (given what ``begin`` returned).
Fault = tuple[str, Callable[[], Any], Callable[[Any], Any]]


def _manager(group: Group) -> ManagerProc:
    assert group.manager is not None
    return group.manager


def _stopping(c: Cluster, target: str, proc: Callable[[], Proc]) -> Fault:
    """SIGSTOP of ``proc()`` (looked up as the fault begins), healed by SIGCONT of that process."""

    def begin() -> Proc:
        stopped = proc()
        c.pause(stopped)
        return stopped

    return (target, begin, c.resume)


class Nemesis:
    def __init__(self, cluster: Cluster, log: Path) -> None:
        self.cluster = cluster
        self.log = log.open("a", buffering=1)

    def inject(self, event: Event, stop_at: float) -> dict[str, Any]:
        """Inject ``event``'s fault and heal it after its duration (no later than ``stop_at``)."""
        c = self.cluster
        p = event.params
        entry: dict[str, Any] = {"kind": event.kind, "start": time.time()}
        duration = max(0.0, min(p["duration"], stop_at - time.monotonic()))
        group = c.groups[p["target"] % len(c.groups)]
        lighthouse = p["target"] % len(c.lighthouses)
        link = (p["target"] // len(c.groups)) % len(group.links)
        rank = (p["target"] // len(c.groups)) % c.plan.ranks
        # Each fault, healed after ``duration``.
        faults: dict[str, Fault] = {
            "lighthouse_kill": (
                f"lighthouse{lighthouse}",
                lambda: c.kill_lighthouse(lighthouse),
                lambda _: c.restart_lighthouse(lighthouse),
            ),
            # A host rolled back to the release before step leases, then upgraded again; one group's
            # manager cut off from the other lighthouses meanwhile, so that it talks to the old one
            # (an old release no manager talks to is not seen: docs/stores-and-ha.md).
            "old_release": (
                f"lighthouse{lighthouse}-old-release-{group.name}",
                lambda: c.roll_back_lighthouse(lighthouse, group),
                lambda _: c.upgrade_lighthouse(lighthouse, group),
            ),
            "lighthouse_stop": _stopping(c, f"lighthouse{lighthouse}", lambda: c.lighthouses[lighthouse]),
            "manager_kill": (
                f"manager-{group.name}",
                lambda: c.kill_manager(group),
                lambda _: c.restart_manager(group),
            ),
            "manager_stop": _stopping(c, f"manager-{group.name}", lambda: _manager(group)),
            "rank_kill": (
                f"rank-{group.name}-{rank}",
                lambda: c.kill_rank(group, rank),
                lambda resume_at: c.restart_rank(group, rank, resume_at),
            ),
            # A rank that hangs, then catches up with its group at full speed.
            "rank_stop": _stopping(c, f"rank-{group.name}-{rank}", lambda: group.ranks[rank]),
            "lighthouse_etcd_cut": (
                f"lighthouse{lighthouse}-etcd",
                lambda: c.cut(c.store_links[lighthouse]),
                lambda _: c.heal_links(c.store_links[lighthouse]),
            ),
            "manager_cut": (
                f"manager-{group.name}-lighthouse{link}",
                lambda: c.cut([group.links[link]]),
                lambda _: c.heal_links([group.links[link]]),
            ),
            "disk_full": ("lighthouse0-disk", c.fill_disk, lambda filler: filler.unlink()),
        }
        if event.kind in faults:
            entry["target"], begin, heal = faults[event.kind]
            began = begin()
            time.sleep(duration)
            heal(began)
            if event.kind == "rank_kill":
                entry["resumed_at"] = began
        elif event.kind in ("etcd_member_kill", "etcd_leader_kill", "etcd_member_stop"):
            members = c.etcd_members()
            member = (
                c.etcd_leader() if event.kind == "etcd_leader_kill" else members[p["target"] % len(members)]
            )
            entry["target"] = f"etcd-{member.name}"
            if event.kind == "etcd_member_stop":
                c.pause(member)
                time.sleep(duration)
                c.resume(member)
            else:
                c.kill_member(member)
                time.sleep(duration)
                c.restart_member(member)
        elif event.kind == "job_resume":
            reached = c.kill_job()
            step = max(0, reached - p["back"])
            entry.update({"target": "job", "reached": reached, "resumed_at": step})
            time.sleep(duration)
            c.resume_job(step)
            entry["incarnation"] = c.incarnation
        else:
            raise ValueError(f"unknown fault {event.kind}")
        entry["end"] = time.time()
        self.log.write(json.dumps(entry, sort_keys=True) + "\n")
        return entry

    def close(self) -> None:
        self.log.close()
