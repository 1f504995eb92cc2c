"""Mutual TLS identities bound to jobs (issue 26): a client certificate's CN or SAN, listed in
``--manager-identities-file``, reads and reports for its jobs only; the managers table and the job's
dashboard show which identity each manager used.

Real lighthouse, manager and worker processes with throwaway certificates (tests/certs.py); the
attacker is a raw gRPC client holding a certificate the same CA signed.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from playwright.sync_api import Page, expect

from lighthouse.admin.tables import managers as managers_table
from lighthouse.rpc.manager_access import load_job_identities
from protos import lighthouse_config_pb2 as pb
from protos import lighthouse_config_pb2_grpc as pb_grpc
from protos.rpc import make_channel
from protos.tls import TLSConfig
from tests.certs import CA, Pair
from tests.grpc_calls import bearer, code_of
from tests.http_util import get_json
from tests.procs import ProcessPool, worker_records

SPIFFE_B = "spiffe://train/b/g0"
# A CN that would run script if a page put it in the DOM as HTML (at most 64 characters in a CN).
HOSTILE_CN = "<img src=x onerror=alert(3)>\"'`${alert(2)}`"
TOKEN_A = "manager-token-of-job-a-0123456789"


def manager_args(ca: CA, pair: Pair, job: str) -> list[str]:
    return [
        *("--job", job, "--lighthouse-ca", str(ca.cert)),
        *("--lighthouse-cert", str(pair.cert), "--lighthouse-key", str(pair.key)),
    ]


def report(job: str, replica: str, step: int) -> pb.LighthouseConfigRequest:
    return pb.LighthouseConfigRequest(
        job=job, status=pb.ManagerStatus(job=job, replica_id=replica, step=step)
    )


@pytest.mark.slow
def test_a_certificate_reads_and_reports_for_the_jobs_bound_to_it_only(
    procs: ProcessPool, tmp_path: Path, page: Page
) -> None:
    ca = CA(tmp_path / "pki")
    server = ca.issue("server")
    cert_a = ca.issue("g0-a", client=True)  # bound by its CN
    cert_b = ca.issue("g0-b", client=True, uris=(SPIFFE_B,))  # bound by its URI name (a SPIFFE id)
    stranger = ca.issue("stranger", client=True)  # signed by the same CA, bound to no job
    hostile = ca.issue("hostile", client=True, common_name=HOSTILE_CN)
    identities = tmp_path / "identities.json"
    identities.write_text(json.dumps({"a": ["CN=g0-a", f"CN={HOSTILE_CN}"], "b": [f"URI:{SPIFFE_B}"]}))
    identities.chmod(0o600)
    manager_tokens = tmp_path / "manager-tokens.json"
    manager_tokens.write_text(json.dumps({"a": [TOKEN_A]}))
    manager_tokens.chmod(0o600)
    configs = tmp_path / "jobs"
    configs.mkdir()
    (configs / "a.json").write_text(json.dumps({"lr": 0.1}))
    (configs / "b.json").write_text(json.dumps({"lr": 0.2}))
    lh = procs.lighthouse(
        extra=[
            *("--tls-cert", str(server.cert), "--tls-key", str(server.key), "--tls-client-ca", str(ca.cert)),
            *("--http-tls", "off", "--config-dir", str(configs)),
            *("--manager-identities-file", str(identities), "--manager-tokens-file", str(manager_tokens)),
        ]
    )
    assert "a client certificate bound to its job (--manager-identities-file)" in lh.stderr()

    # A manager of job a with its certificate trains on job a's config.
    manager_a = procs.manager(lh.address, "g0", extra=manager_args(ca, cert_a, "a"))
    records = worker_records(procs.worker(manager_a.address, group="g0", rank=0, first_step=0, steps=5))
    assert [r["config"] for r in records] == [{"lr": "0.1"}] * 5 and records[-1]["source"] != "fallback"

    def stub(pair: Pair) -> tuple[grpc.Channel, pb_grpc.LighthouseServiceStub]:
        channel = make_channel(lh.address, tls=TLSConfig(ca=ca.cert, cert=pair.cert, key=pair.key))
        return channel, pb_grpc.LighthouseServiceStub(channel)

    huge, denied = 10**12, grpc.StatusCode.PERMISSION_DENIED
    for pair in (cert_a, stranger):  # job a's manager's certificate, and one bound to no job: not for b
        channel, lighthouse = stub(pair)
        with channel:
            assert (
                code_of(lighthouse.GetConfig, report("b", "evil", huge)) == grpc.StatusCode.PERMISSION_DENIED
            )
            heartbeat = pb.LighthouseHeartbeatRequest(status=report("b", "evil", huge).status)
            assert code_of(lighthouse.Heartbeat, heartbeat) == denied
    channel, lighthouse = stub(stranger)
    with channel:
        with pytest.raises(grpc.RpcError) as unbound:
            lighthouse.GetConfig(report("a", "evil", 1), timeout=10)
        assert unbound.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "certificate CN=stranger is bound to no job" in (unbound.value.details() or "")
        # A token counts beside the certificate: the stranger holding job a's manager token is served.
        answer = lighthouse.GetConfig(report("a", "tokened", 2), metadata=bearer(TOKEN_A), timeout=10)
        assert json.loads(answer.config_data["lr"]) == 0.1
    channel, lighthouse = stub(cert_b)
    with channel:
        answer = lighthouse.GetConfig(report("b", "g0", 7), timeout=10)
        assert answer.config_data["lr"] == "0.2"
    channel, lighthouse = stub(hostile)
    with channel:
        lighthouse.Heartbeat(pb.LighthouseHeartbeatRequest(status=report("a", "h", 3).status), timeout=10)

    # Job b heard only its own manager: its step is that manager's, the refused reports left no record.
    assert get_json(lh.url, "/api/jobs/b/config")["current_step"] == 7
    rows_b = get_json(lh.url, "/api/jobs/b/managers")["managers"]
    assert [(m["replica_id"], m["identity"]) for m in rows_b] == [("g0", f"certificate URI:{SPIFFE_B}")]
    rows_a = {m["replica_id"]: m["identity"] for m in get_json(lh.url, "/api/jobs/a/managers")["managers"]}
    assert rows_a == {
        "g0": "certificate CN=g0-a",
        "tokened": "token of job a",
        "h": f"certificate CN={HOSTILE_CN}",
    }

    # `lighthouse config managers` shows them too.
    lines = managers_table(get_json(lh.url, "/api/jobs/b/managers"))
    assert lines[0].split()[:3] == ["REPLICA", "ADDRESS", "IDENTITY"], lines
    assert lines[1].split()[0] == "g0" and lines[1].split()[2:4] == ["certificate", f"URI:{SPIFFE_B}"], lines

    # The job's dashboard shows each manager's identity as text.
    page.goto(lh.url + "jobs/a")
    expect(page.locator('#managers tr[data-replica="g0"] td.identity')).to_have_text("certificate CN=g0-a")
    expect(page.locator('#managers tr[data-replica="tokened"] td.identity')).to_have_text("token of job a")
    expect(page.locator('#managers tr[data-replica="h"] td.identity')).to_have_text(
        f"certificate CN={HOSTILE_CN}"
    )
    assert page.locator("#managers img").count() == 0
    expect(page.locator('[data-testid="managers-table"] th').nth(2)).to_have_text("Identity")


def test_an_identities_file_names_certificate_names_as_openssl_spells_them(tmp_path: Path) -> None:
    path = tmp_path / "identities.json"
    path.write_text(json.dumps({"a": ["CN=g0", "DNS:g0.example", f"URI:{SPIFFE_B}", "email:g0@example"]}))
    assert load_job_identities(path) == {
        "a": ["CN=g0", "DNS:g0.example", f"URI:{SPIFFE_B}", "email:g0@example"]
    }
    for bad in (["g0"], ["CN="], ["IP:10.0.0.1"]):
        path.write_text(json.dumps({"a": bad}))
        with pytest.raises(ValueError, match=f"job 'a': '{bad[0]}' is no certificate name: write CN=..."):
            load_job_identities(path)
    path.write_text(json.dumps({"a": [""]}))
    with pytest.raises(ValueError, match="non-empty certificate name strings"):
        load_job_identities(path)
