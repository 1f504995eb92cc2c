"""The managers table shared by several lighthouses on one etcd prefix.

A manager talks to one lighthouse, but an operator may open any lighthouse's
dashboard. So each lighthouse publishes, per job, one summary of the managers
it hears from under ``{prefix}/peers/{job}/{instance}``, attached to its own
etcd lease, and watches ``{prefix}/peers/`` for the others' summaries (see
``etcd_share``). A round writes only the jobs whose managers changed.

Ages cross hosts as wall-clock ``seen_at`` times: the monotonic clock of one
process means nothing to another (so a remote manager's ``last_seen_s`` is as
good as the hosts' clock sync, which NTP keeps well under a second).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.types import Delete, Event, Put
from lighthouse.jobs.registry import JobRegistry
from lighthouse.peers.share import LEASE_TTL, PUBLISH_INTERVAL, EtcdShare, batches, hold_job
from protos.job_ids import JobId

logger = logging.getLogger(__name__)

PEERS_DIR = "peers"
SEEN_SLACK = 0.5  # a newer seen_at alone is worth a write once it moved this much


def _without_seen(managers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "seen_at"} for m in managers]


def _changed(old: list[dict[str, Any]] | None, new: list[dict[str, Any]]) -> bool:
    """Whether ``new`` is worth a write over the published ``old``."""
    if old is None or _without_seen(old) != _without_seen(new):
        return True
    return any(n["seen_at"] - o["seen_at"] >= SEEN_SLACK for o, n in zip(old, new, strict=True))


class PeerManagers(EtcdShare):
    """Publishes this lighthouse's managers per job and merges in every other lighthouse's.

    ``start()`` hooks it into ``registry`` (every job's ``managers()`` then lists the
    managers of every lighthouse on the prefix); ``stop()`` revokes the lease, so the
    others drop this lighthouse's managers at once instead of after the TTL.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        instance_id: str,
        lighthouse_address: str,
        registry: JobRegistry,
        *,
        interval: float = PUBLISH_INTERVAL,
        ttl: float = LEASE_TTL,
    ) -> None:
        super().__init__(
            client, prefix, PEERS_DIR, instance_id, interval=interval, ttl=ttl, what="the managers table"
        )
        self.address = lighthouse_address
        self.registry = registry
        self._lock = threading.Lock()
        # job -> instance -> (its lighthouse's address, its managers as published)
        self._remote: dict[str, dict[str, tuple[str, list[dict[str, Any]]]]] = {}
        self._published: dict[JobId, list[dict[str, Any]]] = {}  # job -> what our key holds

    # ------------------------------------------------------------ reading
    def remote(self, job: str) -> list[dict[str, Any]]:
        """The job's managers that other lighthouses hear from, as ``LighthouseState.managers()`` rows."""
        wall = time.time()
        with self._lock:
            summaries = list(self._remote.get(job, {}).values())
        out = []
        for lighthouse, managers in summaries:
            for m in managers:
                row = {k: v for k, v in m.items() if k != "seen_at"}
                row["last_seen_s"] = round(max(0.0, wall - m["seen_at"]), 3)
                row["lighthouse"] = lighthouse
                out.append(row)
        return out

    def instances(self) -> dict[str, str]:
        """The other lighthouses that publish managers on the prefix: instance -> address."""
        with self._lock:
            return {instance: entry[0] for jobs in self._remote.values() for instance, entry in jobs.items()}

    def _parse_key(self, key: bytes) -> tuple[str, str] | None:
        """(job, instance) of a summary key, None for our own or a malformed one."""
        rest = key.decode(errors="replace")[len(self.root) :]
        job, _, instance = rest.partition("/")
        if not job or not instance or "/" in instance or instance == self.instance_id:
            return None
        return job, instance

    def _take(self, key: bytes, value: bytes | None) -> str | None:
        """Apply one summary (None: deleted); returns the job when it is new to this lighthouse."""
        parsed = self._parse_key(key)
        if parsed is None:
            return None
        job, instance = parsed
        if value is None:
            with self._lock:
                self._remote.get(job, {}).pop(instance, None)
            return None
        try:
            summary = json.loads(value)
            entry = (str(summary["lighthouse"]), list(summary["managers"]))
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a malformed managers summary at %r", key)
            return None
        with self._lock:
            jobs = self._remote.setdefault(job, {})
            new = not jobs
            jobs[instance] = entry
        return job if new else None

    def _hold(self, jobs: list[str]) -> None:
        """Hold a job whose managers all talk to other lighthouses, so this one lists it too."""
        for job in jobs:
            hold_job(self.registry, job)

    def _on_events(self, events: list[Event]) -> None:
        new = [self._take(e.kv.key, e.kv.value if e.type == "put" else None) for e in events]
        self._hold([job for job in new if job is not None])

    def _load(self) -> int:
        """Read every summary now (at start, and when the watch fell behind a compaction)."""
        result = self.client.get(self.root, prefix=True)
        with self._lock:
            self._remote.clear()
        new = [self._take(kv.key, kv.value) for kv in result.kvs]
        self._hold([job for job in new if job is not None])
        return result.revision

    # ------------------------------------------------------------ publishing
    def _lease_taken(self) -> None:
        self._published.clear()  # the old lease's keys are gone (or going): write everything again

    def _key(self, job: str) -> str:
        return f"{self.root}{job}/{self.instance_id}"

    def publish(self) -> None:
        """One round: write the summaries that changed, delete those of jobs without managers here."""
        lease = self._ensure_lease()
        current = {state.job: state.local_managers() for state in self.registry.states()}
        current = {job: managers for job, managers in current.items() if managers}
        ops: list[tuple[JobId, Put | Delete]] = [
            (job, Delete(self._key(job))) for job in self._published if job not in current
        ]
        for job, managers in current.items():
            if _changed(self._published.get(job), managers):
                value = json.dumps({"lighthouse": self.address, "managers": managers}, separators=(",", ":"))
                ops.append((job, Put(self._key(job), value, lease=lease)))
        for batch in batches(ops):
            if not self._txn([op for _, op in batch]):
                return
            for job, op in batch:
                if isinstance(op, Put):
                    self._published[job] = current[job]
                else:
                    self._published.pop(job, None)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Merge peers into the registry's tables now; load, watch and publish in the background."""
        self.registry.set_peers(self.remote, self.address)
        super().start()
