"""A lighthouse's managers table in a process of its own, for tests that SIGKILL it.

Publishes one manager of the job ``default`` under the given etcd prefix, prints
``ready`` once etcd holds the summary, then keeps the manager fresh until killed.
"""

from __future__ import annotations

import argparse
import threading

from lighthouse.etcd.client import EtcdClient
from lighthouse.jobs.registry import JobRegistry
from lighthouse.peers.managers import PeerManagers
from lighthouse.store.sqlite import SqliteBackend
from protos import lighthouse_config_pb2 as pb


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoints", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    args = parser.parse_args()
    client = EtcdClient(args.endpoints)
    registry = JobRegistry(SqliteBackend(None))
    peers = PeerManagers(client, args.prefix, "dying", "dying-lighthouse:1", registry, ttl=args.ttl)
    status = pb.ManagerStatus(replica_id=args.replica_id, address="10.0.0.9:1", version=1, step=-1)
    registry.default.observe(status, "peer")
    peers.start()
    stop = threading.Event()
    while not stop.wait(0.2):
        registry.default.observe(status, "peer")
        if peers.puts and client.get(f"{args.prefix}/peers/default/dying").kvs:
            print("ready", flush=True)
            break
    while not stop.wait(0.2):
        registry.default.observe(status, "peer")


if __name__ == "__main__":
    main()
