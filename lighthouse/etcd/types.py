"""etcd's values as Python sees them (KeyValue, Event, the results) and the operations a
transaction runs (Compare, Get, Put, Delete), with the requests they become."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protos.etcd import kv_pb2, rpc_pb2


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_pb(cls, kv: kv_pb2.KeyValue) -> KeyValue:
        return cls(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease)


@dataclass(frozen=True)
class Event:
    """One change seen by a watch; for a delete, ``kv`` holds the key and the deletion's revision."""

    type: Literal["put", "delete"]
    kv: KeyValue

    @property
    def revision(self) -> int:
        return self.kv.mod_revision


@dataclass(frozen=True)
class GetResult:
    kvs: list[KeyValue]
    revision: int  # the store's revision the read saw


@dataclass(frozen=True)
class Compare:
    """``target(key) op value``: e.g. ``Compare(b"head", "mod", "==", 7)``.

    A key that does not exist has mod/create revision and version 0. With ``range_end``
    the compare holds for every key in [key, range_end) (true when there is none).
    """

    key: str | bytes
    target: Literal["mod", "create", "version", "value"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes | str
    range_end: str | bytes | None = None


@dataclass(frozen=True)
class Get:
    key: str | bytes
    prefix: bool = False


@dataclass(frozen=True)
class Put:
    key: str | bytes
    value: str | bytes
    lease: int = 0


@dataclass(frozen=True)
class Delete:
    """One key, every key under it (``prefix``), or the keys in [key, ``range_end``)."""

    key: str | bytes
    prefix: bool = False
    range_end: str | bytes | None = None


Op = Get | Put | Delete


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    gets: list[list[KeyValue]]  # one list per Get of the branch that ran, in order


def as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def range_end_for(key: bytes, prefix: bool) -> bytes:
    return prefix_end(key) if prefix else b""


_TARGETS = {
    "mod": rpc_pb2.Compare.MOD,
    "create": rpc_pb2.Compare.CREATE,
    "version": rpc_pb2.Compare.VERSION,
    "value": rpc_pb2.Compare.VALUE,
}
_RESULTS = {
    "==": rpc_pb2.Compare.EQUAL,
    "!=": rpc_pb2.Compare.NOT_EQUAL,
    "<": rpc_pb2.Compare.LESS,
    ">": rpc_pb2.Compare.GREATER,
}


def compare_pb(c: Compare) -> rpc_pb2.Compare:
    msg = rpc_pb2.Compare(key=as_bytes(c.key), target=_TARGETS[c.target], result=_RESULTS[c.op])
    if c.range_end is not None:
        msg.range_end = as_bytes(c.range_end)
    if c.target == "value":
        if isinstance(c.value, int):
            raise TypeError("a value compare takes str or bytes")
        msg.value = as_bytes(c.value)
    else:
        if not isinstance(c.value, int):
            raise TypeError(f"a {c.target} compare takes an int")
        setattr(msg, {"mod": "mod_revision", "create": "create_revision"}.get(c.target, "version"), c.value)
    return msg


def op_pb(op: Op) -> rpc_pb2.RequestOp:
    if isinstance(op, Get):
        key = as_bytes(op.key)
        return rpc_pb2.RequestOp(
            request_range=rpc_pb2.RangeRequest(key=key, range_end=range_end_for(key, op.prefix))
        )
    if isinstance(op, Put):
        return rpc_pb2.RequestOp(
            request_put=rpc_pb2.PutRequest(key=as_bytes(op.key), value=as_bytes(op.value), lease=op.lease)
        )
    key = as_bytes(op.key)
    end = as_bytes(op.range_end) if op.range_end is not None else range_end_for(key, op.prefix)
    return rpc_pb2.RequestOp(request_delete_range=rpc_pb2.DeleteRangeRequest(key=key, range_end=end))
