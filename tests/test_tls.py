"""TLS and mutual TLS through real lighthouse, manager and worker processes, HTTPS with the admin CLI,
each failure with its message, and rotation of the server pair on disk without a restart."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from lighthouse import LighthouseClient, LighthouseServer, ServerTLS, TLSConfig
from protos.rpc import parse_address
from protos.tls import explain_rpc_error
from tests.certs import CA, Pair, serial_of
from tests.procs import ROOT, ProcessPool, child_env, last_record, poll, records_so_far, worker_records

CONFIG = {"lr": 0.25, "name": "tls"}
WORKER_TIMEOUT = 5.0
LIGHTHOUSE_TIMEOUT = 1.0
FROM_LIGHTHOUSE = {"lighthouse", "cache"}  # fetched for this call, or moments before


@dataclass
class Pki:
    ca: CA
    other: CA
    server: Pair
    client: Pair
    other_client: Pair
    expired_server: Pair
    expired_client: Pair


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca, other = CA(root / "ca"), CA(root / "other", "other-ca")
    return Pki(
        ca=ca,
        other=other,
        server=ca.issue("server"),
        client=ca.issue("client", client=True),
        other_client=other.issue("other-client", client=True),
        expired_server=ca.issue("expired-server", expired=True),
        expired_client=ca.issue("expired-client", client=True, expired=True),
    )


def server_args(pair: Pair, client_ca: Path | None = None) -> list[str]:
    args = ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key)]
    return args + (["--tls-client-ca", str(client_ca)] if client_ca else [])


def manager_args(ca: Path | None, pair: Pair | None = None) -> list[str]:
    args = ["--lighthouse-ca", str(ca)] if ca else []
    return args + (["--lighthouse-cert", str(pair.cert), "--lighthouse-key", str(pair.key)] if pair else [])


def first_record(
    procs: ProcessPool, manager_addr: str, group: str, no_step: bool = False
) -> dict[str, object]:
    worker = procs.worker(manager_addr, group=group, rank=0, steps=1, timeout=WORKER_TIMEOUT, no_step=no_step)
    return worker_records(worker)[0]


def test_tls_end_to_end(procs: ProcessPool, pki: Pki) -> None:
    lighthouse = procs.lighthouse(CONFIG, extra=server_args(pki.server))
    assert lighthouse.url.startswith("https://")
    manager = procs.manager(lighthouse.address, "g0", extra=manager_args(pki.ca.cert))
    record = first_record(procs, manager.address, "g0")
    assert record["source"] in FROM_LIGHTHOUSE
    assert record["config"] == {"lr": "0.25", "name": "tls"}


def test_mutual_tls_end_to_end(procs: ProcessPool, pki: Pki) -> None:
    lighthouse = procs.lighthouse(CONFIG, extra=server_args(pki.server, pki.ca.cert))
    manager = procs.manager(lighthouse.address, "g0", extra=manager_args(pki.ca.cert, pki.client))
    record = first_record(procs, manager.address, "g0")
    assert record["source"] in FROM_LIGHTHOUSE
    assert record["config"]["lr"] == "0.25"  # type: ignore[index]


# (lighthouse TLS, manager TLS, what the manager's log says, the side that refused, grpcio's reason in
# that side's log): each ends in the fallback. The refusing side is the one whose grpcio handshake log
# knows why: the manager for the lighthouse's certificate or a plaintext lighthouse, the lighthouse for
# a plaintext manager or the client certificate of mutual TLS.
FAILURES = {
    "plaintext-manager": ("tls", "none", "does it require TLS", "lighthouse", "WRONG_VERSION_NUMBER"),
    "untrusted-ca": (
        "tls",
        "other-ca",
        "not signed by a trusted CA",
        "manager",
        "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate",
    ),
    "expired-server": (
        "expired",
        "ca",
        "certificate has expired",
        "manager",
        "CERTIFICATE_VERIFY_FAILED: certificate has expired",
    ),
    "mtls-no-client-cert": (
        "mtls",
        "ca",
        "requires a client certificate",
        "lighthouse",
        "PEER_DID_NOT_RETURN_A_CERTIFICATE",
    ),
    "mtls-client-from-other-ca": (
        "mtls",
        "other-client",
        "requires a client certificate",
        "lighthouse",
        "unable to get local issuer certificate",
    ),
    "mtls-expired-client": (
        "mtls",
        "expired-client",
        "requires a client certificate",
        "lighthouse",
        "certificate has expired",
    ),
    "tls-manager-plaintext-lighthouse": (
        "none",
        "ca",
        "does not speak TLS",
        "manager",
        "WRONG_VERSION_NUMBER",
    ),
}
# The worker's first call waits at most the manager's lighthouse deadline; the margin is for two busy
# cores, and stays well below the worker's own deadline, which would hide a manager that waited it out.
FALLBACK_WITHIN = LIGHTHOUSE_TIMEOUT + 1.5


@pytest.mark.parametrize("case", list(FAILURES))
def test_failure_serves_fallback_within_deadline_and_says_why(
    procs: ProcessPool, pki: Pki, case: str
) -> None:
    served, dialed, message, refused_by, refusal = FAILURES[case]
    lighthouse_extra = {
        "tls": server_args(pki.server),
        "expired": server_args(pki.expired_server),
        "mtls": server_args(pki.server, pki.ca.cert),
        "none": [],
    }[served]
    manager_extra = {
        "none": [],
        "ca": manager_args(pki.ca.cert),
        "other-ca": manager_args(pki.other.cert),
        "other-client": manager_args(pki.ca.cert, pki.other_client),
        "expired-client": manager_args(pki.ca.cert, pki.expired_client),
    }[dialed]
    lighthouse = procs.lighthouse(CONFIG, extra=lighthouse_extra)
    manager = procs.manager(
        lighthouse.address, "g0", lighthouse_timeout=LIGHTHOUSE_TIMEOUT, extra=manager_extra
    )
    record = first_record(procs, manager.address, "g0")
    assert record["source"] == "fallback"
    assert record["config"] == {}
    assert float(record["elapsed"]) < FALLBACK_WITHIN < WORKER_TIMEOUT  # type: ignore[arg-type]
    poll(lambda: message in manager.stderr(), 10, what=f"'{message}' in the manager's log")
    assert "lighthouse unavailable" in manager.stderr()
    refuser = {"lighthouse": lighthouse, "manager": manager}[refused_by]
    poll(lambda: refusal in refuser.stderr(), 10, what=f"'{refusal}' in the {refused_by}'s log")


def test_python_api_client_tls(tmp_path: Path, pki: Pki) -> None:
    """``LighthouseServer(tls=...)`` and ``LighthouseClient(tls=...)``; a plaintext client fails in time."""
    config = tmp_path / "config.json"
    config.write_text('{"lr": 0.5}')
    with LighthouseServer("127.0.0.1:0", config, tls=ServerTLS(pki.server.cert, pki.server.key)) as server:
        with LighthouseClient(server.address(), tls=TLSConfig(ca=pki.ca.cert)) as client:
            assert client.get_config(timeout=5) == {"lr": "0.5"}
        with LighthouseClient(server.address()) as plain:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                plain.get_config(timeout=2)
            assert time.monotonic() - started < 2 + 1
            assert "does it require TLS" in explain_rpc_error(caught.value, tls=False)


def test_lighthouse_client_with_a_client_certificate(procs: ProcessPool, pki: Pki) -> None:
    """``LighthouseClient(tls=TLSConfig(ca, cert, key))`` against a ``lighthouse serve`` that requires
    mutual TLS: its certificate is the only way in."""
    lighthouse = procs.lighthouse(CONFIG, extra=server_args(pki.server, pki.ca.cert))
    pair = TLSConfig(ca=pki.ca.cert, cert=pki.client.cert, key=pki.client.key)
    with LighthouseClient(lighthouse.address, tls=pair) as client:
        assert client.get_config(timeout=5) == {"lr": "0.25", "name": "tls"}
    refused = {
        "no client certificate": TLSConfig(ca=pki.ca.cert),
        "one from another CA": TLSConfig(
            ca=pki.ca.cert, cert=pki.other_client.cert, key=pki.other_client.key
        ),
    }
    for case, tls in refused.items():
        with LighthouseClient(lighthouse.address, tls=tls) as client, pytest.raises(grpc.RpcError) as caught:
            client.get_config(timeout=5)
        assert "requires a client certificate" in explain_rpc_error(caught.value, tls=True), case


def test_tls_between_worker_and_manager(procs: ProcessPool, pki: Pki) -> None:
    """Opt-in TLS on the worker hop: a TLS worker gets the config, a plaintext one the fallback."""
    lighthouse = procs.lighthouse(CONFIG)
    manager = procs.manager(lighthouse.address, "g0", extra=server_args(pki.server))
    worker = procs.worker(manager.address, group="g0", rank=0, steps=1, extra=["--tls-ca", str(pki.ca.cert)])
    assert worker_records(worker)[0]["source"] in FROM_LIGHTHOUSE
    plain = first_record(procs, manager.address, "g0")
    assert plain["source"] == "fallback"
    assert float(plain["elapsed"]) < WORKER_TIMEOUT  # type: ignore[arg-type]
    get = [sys.executable, "-m", "manager", "get", "--addr", manager.address, "--cacert", str(pki.ca.cert)]
    get += ["-o", "json"]
    shown = subprocess.run(get, capture_output=True, text=True, timeout=30, env=child_env(), cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    assert '"lr": "0.25"' in shown.stdout


def admin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lighthouse", "config", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
        cwd=str(ROOT),
    )


def test_https_dashboard_with_admin_cli(procs: ProcessPool, pki: Pki) -> None:
    lighthouse = procs.lighthouse(CONFIG, extra=[*server_args(pki.server), "--admin-token", "s3cret"])
    url = lighthouse.url
    changed = admin("set", "lr=0.5", "--url", url, "--cacert", str(pki.ca.cert), "--token", "s3cret")
    assert changed.returncode == 0, changed.stderr
    assert changed.stdout.startswith("version ")
    shown = admin("show", "--url", url, "--cacert", str(pki.ca.cert), "-o", "json")
    assert shown.returncode == 0, shown.stderr
    assert '"lr": 0.5' in shown.stdout

    no_token = admin("set", "lr=1", "--url", url, "--cacert", str(pki.ca.cert))
    assert no_token.returncode == 1
    assert "pass --token TOKEN" in no_token.stderr  # refused for the token, over a working HTTPS link
    untrusted = admin("show", "--url", url, "--cacert", str(pki.other.cert))
    assert untrusted.returncode == 1
    assert "not signed by a trusted CA" in untrusted.stderr
    plain = admin("show", "--url", url.replace("https://", "http://"))
    assert plain.returncode == 1
    assert "this port serves HTTPS: use an https:// URL" in plain.stderr
    poll(lambda: "plaintext HTTP request on the HTTPS port" in lighthouse.stderr(), 10, what="log")


def test_https_mutual_tls_and_http_tls_off(procs: ProcessPool, pki: Pki) -> None:
    lighthouse = procs.lighthouse(CONFIG, extra=server_args(pki.server, pki.ca.cert))
    ca = ["--url", lighthouse.url, "--cacert", str(pki.ca.cert)]
    with_cert = admin("show", *ca, "--cert", str(pki.client.cert), "--key", str(pki.client.key))
    assert with_cert.returncode == 0, with_cert.stderr
    without = admin("show", *ca)
    assert without.returncode == 1
    assert "requires a client certificate" in without.stderr
    poll(lambda: "the client sent no certificate" in lighthouse.stderr(), 10, what="log")

    plain_dashboard = procs.lighthouse(
        CONFIG, state_dir=procs.tmp_path / "state2", extra=[*server_args(pki.server), "--http-tls", "off"]
    )
    assert plain_dashboard.url.startswith("http://")
    assert admin("show", "--url", plain_dashboard.url).returncode == 0


def served_serial(address: str, ca: Path) -> int:
    host, port = parse_address(address)
    return serial_of(ssl.get_server_certificate((host, port), ca_certs=str(ca), timeout=5))


def replace_pair(new: Pair, at: Pair) -> None:
    """What a certificate manager does: each file replaced atomically, one after the other."""
    for source, target in ((new.cert, at.cert), (new.key, at.key)):
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(source.read_bytes())
        os.replace(tmp, target)


def test_rotation_without_restart(procs: ProcessPool, pki: Pki, tmp_path: Path) -> None:
    """The lighthouse's pair is replaced on disk by one from a new CA while a worker runs: new
    connections (gRPC and HTTPS) get the new pair, and open ones keep the pair they began with. The
    running manager trusts the old CA only, so it could not make a new connection after the
    rotation: the edit it still brings afterwards came over the connection it had open."""
    new_ca = CA(tmp_path / "new-ca", "new-ca")
    live = Pair(tmp_path / "live.crt", tmp_path / "live.key")
    replace_pair(pki.server, live)

    lighthouse = procs.lighthouse(CONFIG, extra=server_args(live))
    config_file = procs.tmp_path / "config.json"  # the file procs.lighthouse wrote and it watches
    dashboard = lighthouse.url.removeprefix("https://").rstrip("/")
    old_serial = serial_of(pki.server.cert.read_bytes())
    assert served_serial(lighthouse.address, pki.ca.cert) == old_serial
    manager = procs.manager(lighthouse.address, "g0", cache_ttl=0.05, extra=manager_args(pki.ca.cert))
    worker = procs.worker(manager.address, group="g0", rank=0, steps=100_000, step_interval=0.01)
    poll(lambda: len(records_so_far(worker)) >= 20, 20, what="worker running")

    rotated = new_ca.issue("rotated-server")
    replace_pair(rotated, live)
    new_serial = serial_of(rotated.cert.read_bytes())
    poll(lambda: served_serial(lighthouse.address, new_ca.cert) == new_serial, 10, what="new gRPC pair")
    assert served_serial(dashboard, new_ca.cert) == new_serial
    with LighthouseClient(lighthouse.address, tls=TLSConfig(ca=new_ca.cert)) as client:
        assert client.get_config(timeout=5)["lr"] == "0.25"
    with LighthouseClient(lighthouse.address, tls=TLSConfig(ca=pki.ca.cert)) as old_trust:
        with pytest.raises(grpc.RpcError) as caught:
            old_trust.get_config(timeout=5)  # what the running manager's trust gets on a new connection
        assert "not signed by a trusted CA" in explain_rpc_error(caught.value, tls=True)

    config_file.write_text(json.dumps({**CONFIG, "lr": 0.5}))  # an edit made after the rotation
    poll(lambda: last_record(worker)["config"]["lr"] == "0.5", 20, what="the edit at the worker")

    # A manager started after the rotation connects with the new pair (the config at the job's
    # step: the edit, made while g0 held a step lease, took effect at a later step).
    late = procs.manager(lighthouse.address, "g1", extra=manager_args(new_ca.cert))
    assert first_record(procs, late.address, "g1", no_step=True)["config"]["lr"] == "0.5"  # type: ignore[index]

    worker.stop()
    records = records_so_far(worker)
    assert {r["source"] for r in records} <= FROM_LIGHTHOUSE, "a call failed during the rotation"
    assert {r["config"]["lr"] for r in records} == {"0.25", "0.5"}
    assert "TLS certificate reloaded" in lighthouse.stderr()
    assert "lighthouse unavailable" not in manager.stderr()


def test_tls_benchmark_smoke(tmp_path: Path) -> None:
    """``python -m benchmarks.tls`` keeps working (tiny counts; no speed asserted)."""
    args = ["--rounds", "1", "--batch", "5", "--warmup", "1", "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.tls", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=str(ROOT),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for case in ("relay_hit_plain", "relay_hit_tls", "lighthouse_plain", "lighthouse_tls", "lighthouse_mtls"):
        assert case in out.stdout
    results = json.loads((tmp_path / "tls.json").read_text())  # the shared writer's file and meta
    assert set(results["cases"]) >= {"relay_hit_plain", "lighthouse_mtls"} and results["meta"]["commit"]


def test_half_written_rotation_keeps_the_previous_pair(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    """A certificate replaced before its key (they do not match yet) is not taken: the previous pair
    stays, with a warning, until the key follows."""
    from protos.tls import ServerCertificates

    live = Pair(tmp_path / "live.crt", tmp_path / "live.key")
    replace_pair(pki.server, live)
    certificates = ServerCertificates(ServerTLS(live.cert, live.key))
    first = certificates.current()
    rotated = pki.ca.issue("half-written")
    replace_pair(Pair(rotated.cert, pki.server.key), live)  # new cert, old key
    assert certificates.current() is first
    assert "keeping the previous pair" in caplog.text
    replace_pair(rotated, live)
    assert serial_of(certificates.current().cert) == serial_of(rotated.cert.read_bytes())


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["lighthouse", "serve", "--tls-cert", "x.crt"], "--tls-cert and --tls-key go together"),
        (["lighthouse", "serve", "--tls-client-ca", "ca.crt"], "needs --tls-cert"),
        (
            ["lighthouse", "serve", "--manager-identities-file", "pyproject.toml"],
            "--manager-identities-file binds client certificates to jobs: it needs mutual TLS",
        ),
        (
            ["manager", "serve", "--lighthouse", "h:1", "--replica-id", "g", "--lighthouse-cert", "c"],
            "--lighthouse-cert and --lighthouse-key go together",
        ),
    ],
)
def test_tls_option_mistakes_are_usage_errors(command: list[str], message: str) -> None:
    args = [sys.executable, "-m", *command]
    out = subprocess.run(args, capture_output=True, text=True, timeout=30, env=child_env(), cwd=ROOT)
    assert out.returncode == 2
    assert message in out.stderr


def test_missing_certificate_file_is_a_clear_startup_error(tmp_path: Path, pki: Pki) -> None:
    args = ["--bind", "127.0.0.1:0", "--http-bind", "off", "--state-dir", str(tmp_path / "state")]
    args += ["--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", str(pki.server.key)]
    out = subprocess.run(
        [sys.executable, "-m", "lighthouse", "serve", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=child_env(),
        cwd=ROOT,
    )
    assert out.returncode == 1
    assert "nope.crt" in out.stderr
