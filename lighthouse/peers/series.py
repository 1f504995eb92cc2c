"""The reported metrics of a job whose managers talk to several lighthouses on one etcd prefix.

Each lighthouse takes the batches its own managers send (``JobSeries.take_status``)
and publishes them, as received, under ``{prefix}/series/{job}/{instance}/{seq}``
on its lease (see ``etcd_share``): one key per job and round, at most one round a
second. Every lighthouse watches ``{prefix}/series/`` and takes the others'
batches into its own series of the job, so each one holds the whole job (summaries
merge exactly, whatever the order they arrive in) and any dashboard, API or guard
sees every group.

A lighthouse keeps its newest KEEP_BATCHES keys per job (about two minutes) and
deletes older ones: a lighthouse that starts (or restarts) takes the batches still
there, so it has the last minutes of the others' reports at once; older steps it
learns only from reports to come. What a lighthouse took stays in its memory after
the publisher's keys are gone.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from google.protobuf.message import DecodeError

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.types import Delete, Event, KeyValue, Put
from lighthouse.jobs.registry import JobRegistry
from lighthouse.peers.share import LEASE_TTL, PUBLISH_INTERVAL, EtcdShare, batches, hold_job
from protos import lighthouse_config_pb2 as pb

logger = logging.getLogger(__name__)

SERIES_DIR = "series"
KEEP_BATCHES = 120  # keys per job this lighthouse keeps for newcomers (older ones are deleted)
MAX_BATCH_BYTES = 512 * 1024  # one key's value (etcd takes requests up to 1.5 MiB)
MAX_UNSENT = 256  # batches held while etcd cannot take them (the oldest are dropped beyond)


class PeerSeries(EtcdShare):
    """Shares what this lighthouse's managers report with the other lighthouses, and takes theirs."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        instance_id: str,
        registry: JobRegistry,
        *,
        interval: float = PUBLISH_INTERVAL,
        ttl: float = LEASE_TTL,
    ) -> None:
        super().__init__(
            client, prefix, SERIES_DIR, instance_id, interval=interval, ttl=ttl, what="the reported metrics"
        )
        self.registry = registry
        self._seq = 0
        self._unsent: deque[tuple[str, bytes]] = deque(maxlen=MAX_UNSENT)  # (job, batch) to publish
        self._kept: dict[str, deque[str]] = {}  # job -> our keys still in etcd, oldest first
        self._taken: dict[tuple[str, str], int] = {}  # (job, instance) -> newest seq taken

    # ------------------------------------------------------------ publishing
    def publish(self) -> None:
        """One round: every job's new batches as one key each (or more when large); old keys go."""
        for state in self.registry.states():
            for value in _encode(state.series.take_outbox()):
                self._unsent.append((state.job, value))
        if not self._unsent:
            return
        lease = self._ensure_lease()
        ops: list[tuple[str, Put | Delete]] = []
        for job, value in self._unsent:
            self._seq += 1
            key = f"{self.root}{job}/{self.instance_id}/{self._seq:020d}"
            ops.append((key, Put(key, value, lease=lease)))
        for batch in batches(ops):
            if not self._txn([op for _, op in batch]):
                return  # what is left stays unsent: the next round tries again
            for key, _ in batch:
                self._unsent.popleft()
                job = key[len(self.root) :].partition("/")[0]
                self._kept.setdefault(job, deque()).append(key)
        self._forget_old()

    def _forget_old(self) -> None:
        """Delete this lighthouse's keys beyond the newest KEEP_BATCHES of each job."""
        doomed = [
            (job, Delete(kept.popleft()))
            for job, kept in self._kept.items()
            for _ in range(max(0, len(kept) - KEEP_BATCHES))
        ]
        for batch in batches(doomed):
            self._txn([op for _, op in batch])  # best effort: they also go with the lease

    def _lease_taken(self) -> None:
        self._kept.clear()  # the old lease's keys are gone (or going) with it

    # ------------------------------------------------------------ taking
    def _parse_key(self, key: bytes) -> tuple[str, str, int] | None:
        """(job, instance, seq) of another lighthouse's batch; None for ours or a malformed key."""
        parts = key.decode(errors="replace")[len(self.root) :].split("/")
        if len(parts) != 3 or parts[1] == self.instance_id or not (parts[2].isascii() and parts[2].isdigit()):
            return None
        return parts[0], parts[1], int(parts[2])

    def _take(self, kv: KeyValue) -> None:
        parsed = self._parse_key(kv.key)
        if parsed is None:
            return
        job, instance, seq = parsed
        if seq <= self._taken.get((job, instance), 0):
            return  # taken already (the watch resumed after a compaction, say)
        try:
            batch = pb.MetricPeerBatch.FromString(kv.value)
        except DecodeError as exc:
            logger.warning("ignoring a malformed metrics batch at %r: %s", kv.key[:200], exc)
            return
        state = hold_job(self.registry, job)
        if state is None:
            return
        self._taken[(job, instance)] = seq
        for group in batch.groups:
            state.series.take(group.replica_id, group.metrics)

    def _on_events(self, events: list[Event]) -> None:
        for event in events:
            if event.type == "put":
                self._take(event.kv)

    def _load(self) -> int:
        """Take every batch still under the folder (at start, and after a compaction)."""
        result = self.client.get(self.root, prefix=True)
        for kv in sorted(result.kvs, key=lambda kv: kv.key):  # each lighthouse's in order
            self._take(kv)
        return result.revision


def _encode(outbox: list[tuple[str, Any]]) -> list[bytes]:
    """What managers sent, as MetricPeerBatch values of at most about MAX_BATCH_BYTES each."""
    values: list[bytes] = []
    batch = pb.MetricPeerBatch()
    for replica, summaries in outbox:
        batch.groups.add(replica_id=replica, metrics=summaries)
        if batch.ByteSize() >= MAX_BATCH_BYTES:
            values.append(batch.SerializeToString())
            batch = pb.MetricPeerBatch()
    if batch.groups:
        values.append(batch.SerializeToString())
    return values
