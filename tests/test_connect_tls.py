"""A TLS lighthouse from a torchrun script and from ``manager serve`` without a CA file: ``connect()``
passes its ``tls=`` argument, or ``LIGHTHOUSE_CA``/``LIGHTHOUSE_CERT``/``LIGHTHOUSE_KEY``, on to the
manager it starts, and an ``https://`` lighthouse address speaks TLS trusting the system's roots."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lighthouse import TLSConfig
from tests.certs import CA, Pair
from tests.procs import LighthouseProc, ManagerProc, ProcessPool, worker_records
from worker_client import connect
from worker_client.connect import _stop_managers

CONFIG = {"lr": 0.1}
CONFIG_PROC = Path(__file__).resolve().parent / "torchrun_config_proc.py"
FROM_LIGHTHOUSE = {"lighthouse", "cache"}


@dataclass
class Pki:
    ca: CA
    server: Pair
    client: Pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = CA(tmp_path_factory.mktemp("pki"))
    return Pki(ca, ca.issue("server"), ca.issue("client", client=True))


def tls_lighthouse(procs: ProcessPool, pki: Pki, mutual: bool = False) -> LighthouseProc:
    args = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key)]
    args += ["--tls-client-ca", str(pki.ca.cert)] if mutual else []
    return procs.lighthouse(CONFIG, extra=args)


@pytest.mark.slow
def test_connect_reaches_a_mutual_tls_lighthouse_on_a_torchrun_job(procs: ProcessPool, pki: Pki) -> None:
    lh = tls_lighthouse(procs, pki, mutual=True)
    env = {
        "TORCHFT_LIGHTHOUSE": lh.address,
        "REPLICA_GROUP_ID": "0",
        "LIGHTHOUSE_CA": str(pki.ca.cert),
        "LIGHTHOUSE_CERT": str(pki.client.cert),
        "LIGHTHOUSE_KEY": str(pki.client.key),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(CONFIG_PROC), "--steps", "20", "--interval", "0.02", "--timeout", "5", "--hold-manager"]
    job = procs.spawn(cmd, "group0", env=env)
    assert job.wait(timeout=120) == 0, job.stderr()
    records = [json.loads(line) for line in job.lines() if line.startswith("{")]
    for rank in (0, 1):
        mine = [r for r in records if r["rank"] == rank and "step" in r]  # not its "start" record
        assert [r["step"] for r in mine] == list(range(20)), (rank, job.stderr())
        assert {r["source"] for r in mine} <= FROM_LIGHTHOUSE, (mine[:3], job.stderr())
        assert {r["lr"] for r in mine} == {"0.1"}


@pytest.fixture
def rank0(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Group rank 0 with a real TCPStore; the managers connect() starts are stopped afterwards."""
    from torch.distributed import TCPStore

    monkeypatch.setenv("RANK", "0")
    for name in (
        "TORCHELASTIC_RESTART_COUNT",
        "LIGHTHOUSE_JOB",
        "LIGHTHOUSE_CA",
        "LIGHTHOUSE_CERT",
        "LIGHTHOUSE_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store
    finally:
        _stop_managers()


@pytest.mark.slow
def test_connect_passes_its_tls_argument_to_the_manager_it_starts(
    procs: ProcessPool, pki: Pki, rank0: Any
) -> None:
    lh = tls_lighthouse(procs, pki)
    with connect(
        lighthouse=lh.address, replica_id="g-tls", store=rank0, tls=TLSConfig(ca=pki.ca.cert), timeout=20
    ) as client:
        cfg = client.get_config(step=0)
        assert cfg.source in FROM_LIGHTHOUSE and dict(cfg) == {"lr": "0.1"}
    # The same without it: the manager dials plaintext and its workers get the fallback.
    with connect(lighthouse=lh.address, replica_id="g-plain", store=rank0, timeout=20) as client:
        assert client.get_config(step=0).source == "fallback"


def https_manager(procs: ProcessPool, lh: LighthouseProc, env: dict[str, str]) -> ManagerProc:
    args = [sys.executable, "-m", "manager", "serve", "--lighthouse", f"https://{lh.address}"]
    args += ["--bind", "127.0.0.1:0", "--replica-id", "g0", "--cache-ttl", "0.2"]
    manager: ManagerProc = procs.spawn(args, "manager-https", ManagerProc, env=env)
    manager.address = manager.readline()
    return manager


def test_an_https_lighthouse_address_trusts_the_system_roots(procs: ProcessPool, pki: Pki) -> None:
    lh = tls_lighthouse(procs, pki)
    # The system's roots are what OpenSSL reads: SSL_CERT_FILE moves them to our test CA.
    trusting = https_manager(procs, lh, {"SSL_CERT_FILE": str(pki.ca.cert)})
    record = worker_records(procs.worker(trusting.address, group="g", rank=0, steps=1))[0]
    assert record["source"] in FROM_LIGHTHOUSE and record["config"] == {"lr": "0.1"}

    # With the real system roots the test CA is unknown: TLS was spoken, and refused.
    refusing = https_manager(procs, lh, {})
    record = worker_records(procs.worker(refusing.address, group="g", rank=0, steps=1))[0]
    assert record["source"] == "fallback"
    assert "not signed by a trusted CA" in refusing.stderr()
