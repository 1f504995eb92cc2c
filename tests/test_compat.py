"""Compatibility with torchft's config-sharing proposal: lenient files, LighthouseClient, http://."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from lighthouse import LighthouseClient
from manager import ManagerServer
from tests.http_util import call
from tests.procs import ProcessPool, worker_records
from worker_client import ManagerClient


def worker_view(procs: ProcessPool, lighthouse_addr: str) -> list[dict[str, object]]:
    m = procs.manager(lighthouse_addr, "g0")
    return worker_records(procs.worker(m.address, group="g0", rank=0, steps=3))


@pytest.mark.slow
def test_no_config_file_serves_an_empty_config(procs: ProcessPool) -> None:
    lh = procs.lighthouse(None, http_bind="off")
    assert LighthouseClient(lh.address).get_config(timeout=timedelta(seconds=5)) == {}
    for r in worker_view(procs, lh.address):
        assert r["config"] == {}
        assert r["source"] != "fallback"  # a real (empty) answer, not an outage
    assert "Traceback" not in lh.stderr()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"lr": 0.1,,}', "not valid JSON"),
        ("[1, 2, 3]", "must be a JSON object, got an array"),
        ('"just a string"', "must be a JSON object, got a string"),
    ],
)
def test_bad_file_serves_empty_and_warns_naming_the_file(
    procs: ProcessPool, tmp_path: Path, text: str, error: str
) -> None:
    path = tmp_path / "torchft-config.json"
    lh = procs.lighthouse(text, config_path=path)
    assert lh.popen.poll() is None  # lenient: still serving
    assert LighthouseClient(lh.address).get_config(timeout=timedelta(seconds=5)) == {}
    warnings = [line for line in lh.stderr().splitlines() if "WARNING" in line and str(path) in line]
    assert warnings, lh.stderr()
    assert any(error in line for line in warnings), warnings
    assert all(r["config"] == {} and r["source"] != "fallback" for r in worker_view(procs, lh.address))
    health = call(lh.url, "GET", "/healthz")
    assert health.status == 200, health.body


def test_missing_file_serves_empty_and_warns(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "does-not-exist.json"
    lh = procs.lighthouse(None, config_path=path, http_bind="off")
    assert LighthouseClient(lh.address).get_config(timeout=5) == {}
    assert any(str(path) in line and "WARNING" in line for line in lh.stderr().splitlines()), lh.stderr()


def test_torchft_style_lighthouse_client_on_a_fresh_lighthouse(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text('{"lr": 0.001, "name": "x", "nested": {"a": [1]}, "flag": true}')
    # --lighthouse-config: the flag name of torchft's proposal.
    lh = procs.lighthouse(None, http_bind="off", extra=["--lighthouse-config", str(path)])
    config = LighthouseClient(lh.address).get_config(timeout=timedelta(seconds=5))
    assert config == {"lr": "0.001", "name": "x", "nested": '{"a":[1]}', "flag": "true"}
    assert type(config) is dict
    with LighthouseClient(f"http://{lh.address}") as client:
        assert client.get_config(timeout=5.0) == config


def test_lighthouse_client_unreachable_raises_within_its_timeout() -> None:
    client = LighthouseClient("127.0.0.1:1")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError):
        client.get_config(timeout=timedelta(seconds=0.5))
    assert time.monotonic() - started < 0.5 + 2.0
    client.close()


def test_http_addresses_accepted_by_manager_server_and_client(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.5, "名": "値"}, http_bind="off")
    server = ManagerServer(lighthouse_addr=f"http://{lh.address}", bind="127.0.0.1:0", replica_id="g0")
    try:
        assert server.address().startswith("127.0.0.1:")
        with ManagerClient(f"http://{server.address()}", timeout=timedelta(seconds=5)) as client:
            cfg = client.get_config(step=7)
            assert cfg == {"lr": "0.5", "名": "値"}
            assert cfg.version >= 1 and cfg.source in ("cache", "lighthouse") and cfg.pinned
            assert cfg.get_float("lr", 1e-3) == 0.5
            again = client.get_config(step=7)
            assert again == cfg and again.version == cfg.version
        with ManagerClient(server.address(), timeout=5.0, strict=True) as client:
            assert client.get_config() == {"lr": "0.5", "名": "値"}
    finally:
        server.shutdown()
