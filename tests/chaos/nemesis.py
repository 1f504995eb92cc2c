"""The nemesis: injects one fault of the plan, waits its duration, heals it, and logs both moments.

Targets are picked when the fault happens (``target`` modulo the candidates then), so a seed
replays the same kinds and timing even though which member leads etcd varies.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.chaos.cluster import Cluster
from tests.chaos.schedule import Event


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
        if event.kind == "lighthouse_kill":
            index = p["target"] % len(c.lighthouses)
            entry["target"] = f"lighthouse{index}"
            c.kill_lighthouse(index)
            time.sleep(duration)
            c.restart_lighthouse(index)
        elif event.kind == "lighthouse_stop":
            index = p["target"] % len(c.lighthouses)
            entry["target"] = f"lighthouse{index}"
            c.pause(c.lighthouses[index])
            time.sleep(duration)
            c.resume(c.lighthouses[index])
        elif event.kind == "manager_kill":
            entry["target"] = f"manager-{group.name}"
            c.kill_manager(group)
            time.sleep(duration)
            c.restart_manager(group)
        elif event.kind == "manager_stop":
            entry["target"] = f"manager-{group.name}"
            assert group.manager is not None
            c.pause(group.manager)
            time.sleep(duration)
            c.resume(group.manager)
        elif event.kind == "rank_kill":
            rank = (p["target"] // len(c.groups)) % c.plan.ranks
            entry["target"] = f"rank-{group.name}-{rank}"
            resume_at = c.kill_rank(group, rank)
            time.sleep(duration)
            c.restart_rank(group, rank, resume_at)
            entry["resumed_at"] = resume_at
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
        elif event.kind == "lighthouse_etcd_cut":
            index = p["target"] % len(c.lighthouses)
            entry["target"] = f"lighthouse{index}-etcd"
            c.cut(c.store_links[index])
            time.sleep(duration)
            c.heal_links(c.store_links[index])
        elif event.kind == "manager_cut":
            index = (p["target"] // len(c.groups)) % len(group.links)
            entry["target"] = f"manager-{group.name}-lighthouse{index}"
            c.cut([group.links[index]])
            time.sleep(duration)
            c.heal_links([group.links[index]])
        elif event.kind == "disk_full":
            entry["target"] = "lighthouse0-disk"
            filler = c.fill_disk()
            time.sleep(duration)
            filler.unlink()
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
