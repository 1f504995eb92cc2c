"""Managers given several lighthouses (``--lighthouse A,B``) stick to one, move on when it dies,
and spread over the list. The lighthouses here share a config file, not a store (the etcd
tests run the same with a shared store)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from lighthouse.client import HEDGE_FRACTION, LighthouseClient
from protos import lighthouse_config_pb2 as pb
from protos.rpc import split_addresses
from tests.http_util import get_json
from tests.procs import LighthouseProc, ProcessPool, poll, records_so_far, worker_records
from tests.stuck_lighthouse import get_config_server


def test_split_addresses() -> None:
    assert split_addresses("a:1, [::1]:2,http://c:3") == ["a:1", "[::1]:2", "http://c:3"]
    for bad in ("", " , ", "a:1,nope"):
        with pytest.raises(ValueError):
            split_addresses(bad)


def test_spread_key_picks_the_first_lighthouse() -> None:
    firsts = {LighthouseClient("a:1,b:2,c:3", spread_key=f"group{i}").current for i in range(12)}
    assert firsts == {"a:1", "b:2", "c:3"}  # twelve groups use every lighthouse
    assert LighthouseClient("a:1,b:2").current == "a:1"


def two_lighthouses(procs: ProcessPool, tmp_path: Path) -> tuple[LighthouseProc, LighthouseProc]:
    config = {"lr": 0.25}
    return (
        procs.lighthouse(config, state_dir=tmp_path / "s1", config_path=tmp_path / "c1.json"),
        procs.lighthouse(config, state_dir=tmp_path / "s2", config_path=tmp_path / "c2.json"),
    )


@pytest.mark.slow
def test_manager_fails_over_when_its_lighthouse_is_killed(procs: ProcessPool, tmp_path: Path) -> None:
    a, b = two_lighthouses(procs, tmp_path)
    lighthouses = {a.address: a, b.address: b}
    m = procs.manager(f"{a.address},{b.address}", "group0", cache_ttl=0.2)
    worker = procs.worker(m.address, group="g", rank=0, steps=400, step_interval=0.01, wait=True)

    def user() -> str | None:
        for addr, lh in lighthouses.items():
            if get_json(lh.url, "api/managers")["managers"]:
                return addr
        return None

    first = poll(user, 10, what="the manager's lighthouse")
    poll(lambda: len(records_so_far(worker)) > 20, 20, what="worker steps")
    lighthouses[first].signal(signal.SIGKILL)
    other = next(lh for addr, lh in lighthouses.items() if addr != first)
    poll(lambda: get_json(other.url, "api/managers")["managers"], 10, what="manager on the other lighthouse")
    records = worker_records(worker, timeout=60)
    sources = {r["source"] for r in records}
    assert "fallback" not in sources, sources
    assert all(r["config"] == {"lr": "0.25"} for r in records)


def test_client_fails_over_within_its_deadline(procs: ProcessPool, tmp_path: Path) -> None:
    a, b = two_lighthouses(procs, tmp_path)
    a.signal(signal.SIGKILL)
    a.popen.wait(10)
    client = LighthouseClient(f"{a.address},{b.address}")
    assert client.get_config(timeout=3) == {"lr": "0.25"}
    assert client.current == b.address
    b.signal(signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        client.get_config(timeout=1)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    client.close()


class _LighthouseStopping:
    """A gRPC server (in this process) answering every GetConfig CANCELLED, as a stopping gRPC
    server answers the calls that arrive while it stops (measured with grpcio 1.85's server: 6 of
    1,351 calls racing ``server.stop(grace)``; the others were refused or answered)."""

    def __init__(self) -> None:
        self.calls = 0
        self.server, self.address = get_config_server(self._get_config, workers=2)

    def _get_config(self, request: pb.LighthouseConfigRequest, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")


TIMEOUT = 20.0


def test_a_call_its_lighthouse_cancelled_while_stopping_goes_to_the_next(
    procs: ProcessPool, tmp_path: Path
) -> None:
    """A lighthouse stopping during a rolling upgrade answers a call that arrives meanwhile
    CANCELLED (not UNAVAILABLE): the next lighthouse is asked at once. It was not: a manager of the
    upgraded lighthouse served the fallback for a second (CI, test_rolling_upgrade)."""
    _, b = two_lighthouses(procs, tmp_path)
    stopping = _LighthouseStopping()
    try:
        with LighthouseClient(f"{stopping.address},{b.address}") as client:
            started = time.monotonic()
            assert client.get_config(timeout=TIMEOUT) == {"lr": "0.25"}
            # Before the hedge (5 s), which asks b without the fix too: the answer moved it.
            assert time.monotonic() - started < HEDGE_FRACTION * TIMEOUT
            assert stopping.calls == 1 and client.current == b.address
    finally:
        stopping.server.stop(grace=0)
