"""What users would otherwise use for a per-step config read: TCPStore, Redis, torchft's lighthouse.

Each peer's server runs in its own process on loopback and is timed from the
benchmark's process with its usual Python client. A peer that is not installed
(or fails to start) is skipped with the reason, never silently.

torchft 0.2.0's lighthouse has no config RPC: its closest per-step call is
``LighthouseClient.heartbeat`` (a tiny unary gRPC call to its Rust server), so
that is what is timed, as the cost of a round trip to a Rust gRPC server.

Run as a child: ``python -m benchmarks.peers tcpstore|torchft`` prints the address, serves until SIGTERM.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from benchmarks.procs import Children, free_port
from benchmarks.stack import CONFIG, encoded_config
from tests.procs import Proc, poll

REDIS_SERVER = "/usr/bin/redis-server"


@dataclass
class Peer:
    name: str
    label: str
    call: Callable[[], Any]
    close: Callable[[], None] = field(default=lambda: None)


PEER_ERRORS = (ImportError, OSError, AssertionError, TimeoutError, RuntimeError, ValueError)


def launch_peers(children: Children, skipped: dict[str, str]) -> dict[str, Any]:
    """Start the peers' servers (they start in parallel); ``connect_peers`` then builds the clients."""
    launched: dict[str, Any] = {}
    for name, module in (("tcpstore", "torch.distributed"), ("torchft", "torchft")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            skipped[name] = f"{module} not installed"
            continue
        launched[name] = children.python(name, "-m", "benchmarks.peers", name)
    try:
        launched["redis"] = _launch_redis(children)
    except PEER_ERRORS as exc:
        skipped["redis"] = _why(exc)
    return launched


def connect_peers(launched: dict[str, Any], skipped: dict[str, str]) -> list[Peer]:
    peers: list[Peer] = []
    connectors = {"tcpstore": _tcpstore, "redis": _redis, "torchft": _torchft}
    for name, handle in launched.items():
        try:
            peers.extend(connectors[name](handle))
        except PEER_ERRORS as exc:
            skipped[name] = _why(exc)
    return peers


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _tcpstore(child: Proc) -> list[Peer]:
    import torch
    import torch.distributed as dist

    port = int(child.readline())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    return [
        Peer(
            "tcpstore_get",
            f"torch {torch.__version__.split('+')[0]} TCPStore.get (config as one JSON value)",
            lambda: store.get("config"),
        )
    ]


def _launch_redis(children: Children) -> int:
    import redis  # noqa: F401  (skip early when the client is missing)

    if not shutil.which(REDIS_SERVER):
        raise OSError(f"{REDIS_SERVER} not found (apt-get install redis-server)")
    port = free_port()
    children.command(
        "redis",
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
    )
    return port


def _redis(port: int) -> list[Peer]:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def ping() -> bool:
        with contextlib.suppress(redis.ConnectionError):
            return bool(client.ping())
        return False

    poll(ping, 20, what="redis-server")
    client.set("config", json.dumps(CONFIG))
    client.hset("config_hash", mapping=encoded_config())
    return [
        Peer(
            "redis_get",
            f"redis-py {redis.__version__} GET (config as one JSON value)",
            lambda: client.get("config"),
        ),
        Peer(
            "redis_hgetall",
            "redis-py HGETALL (config as a hash)",
            lambda: client.hgetall("config_hash"),
            client.close,
        ),
    ]


def _torchft(child: Proc) -> list[Peer]:
    from torchft._torchft import LighthouseClient  # type: ignore[import-not-found]

    version = importlib.metadata.version("torchft")
    addr = child.readline()
    client = LighthouseClient(addr, connect_timeout=timedelta(seconds=10))
    timeout = timedelta(seconds=5)
    return [
        Peer(
            "torchft_heartbeat",
            f"torchft {version} lighthouse heartbeat (Rust gRPC; no config RPC)",
            lambda: client.heartbeat("bench", timeout=timeout),
        )
    ]


def _serve_tcpstore() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("config", json.dumps(CONFIG))
    print(store.port, flush=True)
    _wait()


def _serve_torchft() -> None:
    from torchft._torchft import LighthouseServer  # type: ignore[import-not-found]

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    port = server.address().rsplit(":", 1)[1]
    print(f"http://127.0.0.1:{port}", flush=True)  # it prints the hostname; stay on loopback
    _wait()
    server.shutdown()


def _wait() -> None:
    from protos.daemon import Termination

    Termination().wait()


if __name__ == "__main__":
    {"tcpstore": _serve_tcpstore, "torchft": _serve_torchft}[sys.argv[1]]()
