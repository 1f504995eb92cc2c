"""A typed etcd v3 client on the stubs generated from etcd's own protos, split the way etcd's
clientv3 is: ``types`` and ``errors``, the ``connection`` (failover), ``client`` (key-value),
``lease``, ``watch``. Imports nothing of the lighthouse's: the store and the peers build on it."""

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.connection import EtcdAuth
from lighthouse.etcd.errors import EtcdAuthFailed, EtcdError, EtcdUnavailable
from lighthouse.etcd.lease import KeepAlive
from lighthouse.etcd.types import Compare, Delete, Event, Get, GetResult, KeyValue, Op, Put, TxnResult
from lighthouse.etcd.watch import WATCH_PROGRESS_INTERVAL, WATCH_SILENCE_TIMEOUT, Watch

__all__ = [
    "WATCH_PROGRESS_INTERVAL",
    "WATCH_SILENCE_TIMEOUT",
    "Compare",
    "Delete",
    "EtcdAuth",
    "EtcdAuthFailed",
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailable",
    "Event",
    "Get",
    "GetResult",
    "KeepAlive",
    "KeyValue",
    "Op",
    "Put",
    "TxnResult",
    "Watch",
]
