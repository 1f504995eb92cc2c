"""A thin, typed, thread-safe etcd v3 client on the stubs generated from etcd's own protos.

Why its own package: the store backend needs only a handful of etcd calls (get,
put, delete, a compare-and-append transaction, leases, a prefix watch), each
with a deadline and failover across the cluster's endpoints; a maintained
Python client that fits grpcio threads and protobuf>=7 does not exist.

Split as etcd's clientv3 is: the client is its key-value calls on top of the lease
(``lease``) and watch (``watch``) calls, all sharing one ``connection`` (channels, failover).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import grpc

from lighthouse.etcd.errors import EtcdUnavailable
from lighthouse.etcd.lease import Lease
from lighthouse.etcd.types import (
    Compare,
    GetResult,
    KeyValue,
    Op,
    TxnResult,
    as_bytes,
    compare_pb,
    op_pb,
    range_end_for,
)
from lighthouse.etcd.watch import Watcher
from protos.etcd import rpc_pb2
from protos.rpc import seconds


class EtcdClient(Lease, Watcher):
    """Calls to one etcd cluster with failover across its endpoints. Safe to share between threads."""

    # -- key-value -------------------------------------------------------------

    def get(
        self,
        key: str | bytes,
        *,
        prefix: bool = False,
        revision: int = 0,
        serializable: bool = False,
        limit: int = 0,
        keys_only: bool = False,
        timeout: timedelta | float | None = None,
    ) -> GetResult:
        """The key (or every key under the prefix, sorted by key) at ``revision`` (0: latest).

        ``serializable`` reads the answering member's local copy: it works without a
        quorum but may be stale; the default read is linearizable (needs a quorum).
        ``limit`` caps how many keys come back (0: all); ``keys_only`` leaves values empty.
        """
        k = as_bytes(key)
        request = rpc_pb2.RangeRequest(
            key=k,
            range_end=range_end_for(k, prefix),
            revision=revision,
            serializable=serializable,
            limit=limit,
            keys_only=keys_only,
        )
        reply = self._call(lambda s, t: s.kv.Range(request, timeout=t), timeout)
        return GetResult([KeyValue.from_pb(kv) for kv in reply.kvs], reply.header.revision)

    def put(
        self,
        key: str | bytes,
        value: str | bytes,
        *,
        lease: int = 0,
        timeout: timedelta | float | None = None,
    ) -> int:
        """Store ``value`` at ``key``; returns the revision of the write."""
        request = rpc_pb2.PutRequest(key=as_bytes(key), value=as_bytes(value), lease=lease)
        reply = self._call(lambda s, t: s.kv.Put(request, timeout=t), timeout)
        return int(reply.header.revision)

    def delete(
        self, key: str | bytes, *, prefix: bool = False, timeout: timedelta | float | None = None
    ) -> int:
        """Delete the key (or every key under the prefix); returns how many were deleted."""
        k = as_bytes(key)
        request = rpc_pb2.DeleteRangeRequest(key=k, range_end=range_end_for(k, prefix))
        reply = self._call(lambda s, t: s.kv.DeleteRange(request, timeout=t), timeout)
        return int(reply.deleted)

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
        *,
        timeout: timedelta | float | None = None,
    ) -> TxnResult:
        """Atomically: if every compare holds run ``success``, else ``failure``."""
        request = rpc_pb2.TxnRequest(
            compare=[compare_pb(c) for c in compare],
            success=[op_pb(op) for op in success],
            failure=[op_pb(op) for op in failure],
        )
        reply = self._call(lambda s, t: s.kv.Txn(request, timeout=t), timeout)
        gets = [
            [KeyValue.from_pb(kv) for kv in r.response_range.kvs]
            for r in reply.responses
            if r.WhichOneof("response") == "response_range"
        ]
        return TxnResult(bool(reply.succeeded), int(reply.header.revision), gets)

    # -- cluster ---------------------------------------------------------------

    def status(
        self, endpoint: int | None = None, *, timeout: timedelta | float | None = None
    ) -> rpc_pb2.StatusResponse:
        """The Maintenance.Status of one endpoint (by index), without failover; None: of the endpoint
        in use, failing over as every call does."""
        request = rpc_pb2.StatusRequest()
        if endpoint is None:
            answer: rpc_pb2.StatusResponse = self._call(
                lambda s, t: s.maintenance.Status(request, timeout=t), timeout
            )
            return answer
        stubs = self._stubs_for(endpoint)
        t = seconds(timeout, self.timeout)
        try:
            reply: rpc_pb2.StatusResponse = stubs.maintenance.Status(request, timeout=t)
        except grpc.RpcError as exc:
            raise EtcdUnavailable(
                f"etcd endpoint {self.endpoints[endpoint]} cannot be reached: {exc}"
            ) from None
        return reply
