"""What lighthouses on one etcd prefix share beyond the store: each one's own keys under a folder,
on an etcd lease of its own, and a watch of everyone's.

Two things ride on it: the managers table (``peer_managers``) and the reported
metrics (``peer_series``). A lighthouse writes its part at most once an interval,
in as few transactions as etcd takes (at most MAX_TXN_OPS operations and
MAX_TXN_BYTES each), however many managers call. Its keys live on its lease: a
lighthouse that dies stops refreshing it and etcd deletes them when it expires;
``stop()`` revokes it, so the others drop them at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TypeVar

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.errors import EtcdError, EtcdUnavailable
from lighthouse.etcd.lease import KeepAlive
from lighthouse.etcd.types import Delete, Event, Put
from lighthouse.etcd.watch import Watch
from lighthouse.jobs.registry import JobRegistry, TooManyJobs
from lighthouse.jobs.state import LighthouseState
from lighthouse.store.backend import StoreUnavailable
from protos.job_ids import InvalidJobId, check_job_name

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL = 1.0  # seconds between two rounds of writing this lighthouse's part
LEASE_TTL = 5.0  # seconds its keys outlive it (its etcd lease)
MAX_TXN_OPS = 100  # etcd refuses a transaction of more than 128 operations by default
MAX_TXN_BYTES = 1 << 20  # and a request over 1.5 MiB

T = TypeVar("T")


def hold_job(registry: JobRegistry, job: str) -> LighthouseState | None:
    """The state of a job named in another lighthouse's key (its id is checked here), held from now
    on; None (logged) when this lighthouse cannot hold it (a bad id, too many jobs, the store out of
    reach)."""
    try:
        return registry.serve(check_job_name(job))
    except (InvalidJobId, TooManyJobs, StoreUnavailable, EtcdError) as exc:
        logger.warning("not holding job %r seen on a peer: %s", job[:100], exc)
        return None


def batches(ops: Sequence[tuple[T, Put | Delete]]) -> Iterator[list[tuple[T, Put | Delete]]]:
    """``ops`` (each with what it is about) in runs etcd takes as one transaction."""
    batch: list[tuple[T, Put | Delete]] = []
    size = 0
    for item in ops:
        op = item[1]
        op_size = len(op.value) if isinstance(op, Put) else 0
        if batch and (len(batch) >= MAX_TXN_OPS or size + op_size > MAX_TXN_BYTES):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += op_size
    if batch:
        yield batch


class EtcdShare:
    """Publishes this lighthouse's part under ``root`` (the store prefix's ``folder``) on its
    lease and watches everyone's.

    A subclass says what is shared: ``_load`` reads every key under ``root`` (at start, and when
    the watch fell behind a compaction) and returns the revision it read, ``_on_events`` takes
    the changes the watch delivers, ``publish`` writes this lighthouse's part (with ``_txn``),
    ``_lease_taken`` forgets what the previous lease held.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        folder: str,
        instance_id: str,
        *,
        interval: float,
        ttl: float,
        what: str,
    ) -> None:
        self.client = client
        self.root = root = f"{prefix.rstrip('/')}/{folder}/"
        self.instance_id = instance_id
        self.interval = interval
        self.ttl = ttl
        self.what = what  # for the log: "the managers table"
        self._lease = 0
        self._lease_lost = threading.Event()
        self._keepalive: KeepAlive | None = None
        self._watch: Watch | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-share-{root}", daemon=True)
        self.puts = 0  # etcd writes made (one transaction counts once)
        self.rounds = 0  # publishing rounds done, written or not: what a wait for "nothing written" counts

    # ------------------------------------------------------------ subclass hooks
    def _load(self) -> int:
        raise NotImplementedError

    def _on_events(self, events: list[Event]) -> None:
        raise NotImplementedError

    def publish(self) -> None:
        raise NotImplementedError

    def _lease_taken(self) -> None:
        """A new lease: what the old one held is gone (or going)."""

    # ------------------------------------------------------------ writing
    def _ensure_lease(self) -> int:
        if self._lease and not self._lease_lost.is_set():
            return self._lease
        if self._keepalive is not None:
            self._keepalive.stop()
            self._keepalive = None
        self._lease_lost.clear()
        self._lease = self.client.lease_grant(self.ttl)
        self._lease_taken()
        self._keepalive = self.client.keep_alive(self._lease, self.ttl, self._lease_lost.set)
        return self._lease

    def _txn(self, ops: list[Put | Delete]) -> bool:
        """Write ``ops`` in one transaction; False (logged) when etcd refused or could not take it."""
        try:
            self.client.txn([], ops, timeout=self.interval * 2)
        except EtcdError as exc:
            if "lease not found" in exc.details:  # it expired while etcd was out of reach
                logger.warning("the lease sharing %s expired; taking a new one", self.what)
                self._lease_lost.set()
            else:
                logger.warning("sharing %s failed: %s", self.what, exc)
            return False
        self.puts += 1
        return True

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        failing = False  # log a failure once, and the recovery, not every round
        while not self._stop.is_set():
            try:
                if self._watch is None:
                    revision = self._load()
                    self._watch = self.client.watch(
                        self.root,
                        start_revision=revision + 1,
                        on_events=self._on_events,
                        on_compacted=self._load,
                    )
                self.publish()
            except (EtcdUnavailable, EtcdError) as exc:
                if not failing:
                    logger.warning("cannot share %s through etcd: %s", self.what, exc)
                failing = True
            else:
                if failing:
                    logger.info("sharing %s through etcd again", self.what)
                failing = False
            self.rounds += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        """Stop publishing and watching, and withdraw this lighthouse's keys."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self._watch is not None:
            self._watch.stop()
        if self._keepalive is not None:
            self._keepalive.stop()
        if self._lease:
            try:
                self.client.lease_revoke(self._lease, timeout=1.0)
            except (EtcdUnavailable, EtcdError) as exc:
                logger.info("%s left to expire with its lease: %s", self.what, exc)
