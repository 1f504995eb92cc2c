"""etcd leases: keys that live only while their owner refreshes the lease."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import grpc

from lighthouse.etcd.connection import Connection, Stubs
from lighthouse.etcd.errors import EtcdError, EtcdUnavailable
from protos.etcd import rpc_pb2

log = logging.getLogger(__name__)


class Lease(Connection):
    """The lease calls of ``EtcdClient``."""

    def lease_grant(self, ttl: float, *, timeout: timedelta | float | None = None) -> int:
        """A new lease living ``ttl`` seconds (rounded up, etcd counts whole seconds); returns its id."""
        request = rpc_pb2.LeaseGrantRequest(TTL=max(1, int(-(-ttl // 1))))
        reply = self._call(lambda s, t: s.lease.LeaseGrant(request, timeout=t), timeout)
        if reply.error:
            raise EtcdError(grpc.StatusCode.UNKNOWN, reply.error)
        return int(reply.ID)

    def lease_revoke(self, lease_id: int, *, timeout: timedelta | float | None = None) -> None:
        """End the lease now: its keys are deleted."""
        request = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        self._call(lambda s, t: s.lease.LeaseRevoke(request, timeout=t), timeout)

    def lease_keepalive_once(self, lease_id: int, *, timeout: timedelta | float | None = None) -> int:
        """Refresh the lease; returns its remaining TTL in seconds (0 or less: it has expired)."""

        def once(s: Stubs, t: float) -> int:
            replies = s.lease.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease_id)]), timeout=t)
            try:
                return int(next(replies).TTL)
            finally:
                replies.cancel()

        return self._call(once, timeout)

    def keep_alive(self, lease_id: int, ttl: float, on_lost: Callable[[], None] | None = None) -> KeepAlive:
        """Refresh the lease every ``ttl / 3`` s in a background thread until ``stop()``."""
        return KeepAlive(self, lease_id, ttl, on_lost)


class KeepAlive:
    """Background refresh of one lease; ``on_lost`` runs once if etcd says the lease is gone."""

    def __init__(self, client: Lease, lease_id: int, ttl: float, on_lost: Callable[[], None] | None) -> None:
        self.lease_id = lease_id
        self._client = client
        self._interval = max(0.1, ttl / 3)
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etcd-keepalive-{lease_id:x}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                left = self._client.lease_keepalive_once(self.lease_id, timeout=self._interval)
            except (EtcdUnavailable, EtcdError) as exc:
                log.warning("etcd lease %x keepalive failed: %s", self.lease_id, exc)
                continue
            if left <= 0:
                log.warning("etcd lease %x expired", self.lease_id)
                if self._on_lost is not None:
                    self._on_lost()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
