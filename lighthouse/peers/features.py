"""What each lighthouse on one etcd prefix honours, and whether step leases may be granted.

Each lighthouse writes one feature record, ``{prefix}/lighthouses/{instance}``, on its own etcd
lease (gone when it stops, or a TTL after it dies), before its managers summary::

    {"level": 4, "features": ["step-leases", "ceilings", "ordered-commits", "runs"],
     "lighthouse": "host:port"}

``instance`` is the one its ``peers/{job}/{instance}`` managers summaries carry. A release that
adds a rule the others must know of adds its name and raises the level; a reader goes by the
names, never by the level alone.

The rule: a lighthouse grants step leases only while every live lighthouse on the prefix
honours ``step-leases``. A lighthouse that publishes managers summaries but no feature record
is a release from before this record (9e6485e and earlier): it commits changes at once, inside
any promise, so while one is live the others suspend leases (``LeaseGate``), say so, and
resume by themselves once it is gone. One without managers writes nothing and is not seen.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.types import Event, Put
from lighthouse.jobs.leases import LeaseGate
from lighthouse.peers.share import LEASE_TTL, PUBLISH_INTERVAL, EtcdShare

logger = logging.getLogger(__name__)

FEATURES_DIR = "lighthouses"
# "runs": a job's runs record, the run number packed into its stored step and lease ceilings.
LEVEL = 4
FEATURES = ("step-leases", "ceilings", "ordered-commits", "runs")
STEP_LEASES = "step-leases"
RECORDS_KEPT = 1000  # instances' records remembered after their keys are gone
RUNS = "runs"


class FeatureRecords(EtcdShare):
    """Writes this lighthouse's feature record, reads the others', and opens or shuts ``gate``.

    ``peers()`` names the other lighthouses live on the prefix (instance -> address), from
    their managers summaries.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        instance_id: str,
        lighthouse_address: str,
        gate: LeaseGate,
        peers: Callable[[], dict[str, str]],
        *,
        interval: float = PUBLISH_INTERVAL,
        ttl: float = LEASE_TTL,
    ) -> None:
        super().__init__(
            client, prefix, FEATURES_DIR, instance_id, interval=interval, ttl=ttl, what="the feature record"
        )
        self.address = lighthouse_address
        self.gate = gate
        self.peers = peers
        self._lock = threading.Lock()
        # instance -> its record, kept once its key is gone: a lighthouse cut off from etcd for
        # longer than its lease loses the key, and publishes its managers summary again before its
        # feature record; read as "an earlier release" meanwhile, it suspended everyone's step
        # leases, and changes applied at once inside promises (the chaos suite). An instance's
        # release never changes in its life.
        self._records: dict[str, dict[str, Any]] = {}
        self._live: set[str] = set()  # the other instances whose record's key is there now
        self._written = False

    def _take(self, key: bytes, value: bytes | None) -> None:
        instance = key.decode(errors="replace")[len(self.root) :]
        if value is None:
            with self._lock:
                self._live.discard(instance)
            return  # expired or deleted: what that instance honours is still known
        try:
            record = json.loads(value)
            record["features"] = [str(f) for f in record["features"]]
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a malformed feature record at %r", key)
            return
        with self._lock:
            if instance != self.instance_id:
                self._live.add(instance)
            self._records.pop(instance, None)
            self._records[instance] = record
            while len(self._records) > RECORDS_KEPT:  # the oldest lives first
                del self._records[next(iter(self._records))]

    def _load(self) -> int:
        result = self.client.get(self.root, prefix=True)
        with self._lock:
            self._live.clear()
        for kv in result.kvs:
            self._take(kv.key, kv.value)
        self.decide()
        return result.revision

    def _on_events(self, events: list[Event]) -> None:
        for event in events:
            self._take(event.kv.key, event.kv.value if event.type == "put" else None)
        self.decide()

    def _lease_taken(self) -> None:
        self._written = False

    def publish(self) -> None:
        """Write the record once per lease, and decide again (the managers summaries move too)."""
        lease = self._ensure_lease()
        if not self._written:
            record = {"level": LEVEL, "features": list(FEATURES), "lighthouse": self.address}
            value = json.dumps(record, separators=(",", ":"))
            self._written = self._txn([Put(f"{self.root}{self.instance_id}", value, lease=lease)])
        self.decide()

    def live_peers(self) -> set[str]:
        """The other lighthouses live on the prefix (by instance): those whose feature record's key is
        there, and those of an earlier release that publish managers but no record."""
        with self._lock:
            live = set(self._live)
        return live | set(self.peers())

    def decide(self) -> None:
        """Shut the gate while a live lighthouse does not honour step leases; open it once none is."""
        with self._lock:
            records = dict(self._records)
        without = sorted(
            {
                address
                for instance, address in self.peers().items()
                if STEP_LEASES not in records.get(instance, {}).get("features", [])
            }
        )
        # A lighthouse that knows no runs reads a packed job step as a step: no run begins meanwhile.
        self.gate.runs_suspended_by = tuple(
            sorted(
                {
                    address
                    for instance, address in self.peers().items()
                    if RUNS not in records.get(instance, {}).get("features", [])
                }
            )
        )
        before, self.gate.suspended_by = self.gate.suspended_by, tuple(without)
        if without and not before:
            logger.warning(
                "step leases suspended: lighthouse(s) %s on this etcd prefix do not honour them "
                "(an earlier release); changes apply at once until they are gone",
                ", ".join(without),
            )
        elif before and not without:
            logger.info("step leases granted again: every lighthouse on this etcd prefix honours them")
