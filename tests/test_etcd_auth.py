"""The etcd store with etcd's RBAC on: the lighthouse logs in (``--store-user``, the password from
a file or ``$LIGHTHOUSE_STORE_PASSWORD``), keeps working after its token expired or etcd forgot it
(a restart), and a wrong password stops it at start in one line. Real etcd, auth enabled through
its gRPC API (etcdctl may be missing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lighthouse.etcd.client import EtcdClient
from protos.etcd import auth_pb2, rpc_pb2
from protos.tls import TLSConfig
from tests.chaos.proxy import Proxy
from tests.etcd_cluster import EtcdCluster, Member, make_certs, require_etcd
from tests.http_util import change, live, wait_healthy
from tests.procs import LighthouseProc, ProcessPool, poll

PREFIX = "/auth-test"
USER, PASSWORD = "trainer", "s3cret-pw"
TOKEN_TTL = 2  # seconds etcd keeps an unused simple token (default 300)


def enable_auth(endpoint: str, tls: TLSConfig | None = None) -> None:
    """root (required by AuthEnable) and USER with a read-write role on PREFIX only, then auth on."""
    with EtcdClient(endpoint, tls=tls) as client:

        def call(method: str, request: object) -> None:
            client._call(lambda s, t: getattr(s.auth, method)(request, timeout=t), None)

        call("UserAdd", rpc_pb2.AuthUserAddRequest(name="root", password="root-pw"))
        call("RoleAdd", rpc_pb2.AuthRoleAddRequest(name="root"))
        call("UserGrantRole", rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"))
        call("UserAdd", rpc_pb2.AuthUserAddRequest(name=USER, password=PASSWORD))
        call("RoleAdd", rpc_pb2.AuthRoleAddRequest(name="lighthouse"))
        perm = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE, key=PREFIX.encode(), range_end=b"/auth-tesu"
        )
        call("RoleGrantPermission", rpc_pb2.AuthRoleGrantPermissionRequest(name="lighthouse", perm=perm))
        call("UserGrantRole", rpc_pb2.AuthUserGrantRoleRequest(user=USER, role="lighthouse"))
        call("AuthEnable", rpc_pb2.AuthEnableRequest())


def password_file(tmp_path: Path, password: str = PASSWORD) -> Path:
    path = tmp_path / "etcd-password"
    path.write_text(password + "\n")
    path.chmod(0o600)
    return path


def etcd_tokens(member: Member, message: str) -> set[str]:
    """The tokens etcd's log names in its ``message`` lines: "deleted a simple token" (one expired,
    unused for TOKEN_TTL), "invalid auth token" (a call carried one etcd did not know)."""
    text = member.log_path.read_text(errors="replace") if member.log_path.exists() else ""
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return {line["token"] for line in lines if line.get("msg") == message}


def logins(lh: LighthouseProc) -> int:
    """How often the lighthouse logged in to etcd (its debug log says so each time)."""
    assert lh.stderr_path is not None
    return lh.stderr_path.read_text(errors="replace").count(f"logged in to etcd as {USER!r}")


def edit_everywhere(a_url: str, b_url: str, value: int) -> None:
    """An edit through a, served by b (b learns it from its etcd watch), and one back through b."""
    res = change(a_url, "PATCH", {"from_a": value})
    assert res.status == 200, res.body
    v = int(res.json["version"])
    poll(lambda: live(b_url)["version"] >= v, 10, what=f"b serves a's edit {v}")
    res = change(b_url, "PATCH", {"from_b": value})
    assert res.status == 200, res.body
    v = int(res.json["version"])
    poll(lambda: live(a_url)["version"] >= v, 10, what=f"a serves b's edit {v}")
    assert live(a_url)["config"] == live(b_url)["config"]


@pytest.mark.slow
def test_lighthouses_log_in_and_outlive_their_tokens(tmp_path: Path, procs: ProcessPool) -> None:
    require_etcd()
    with EtcdCluster(tmp_path / "etcd", size=1, extra_args=[f"--auth-token-ttl={TOKEN_TTL}"]) as cluster:
        enable_auth(cluster.endpoints)
        store = f"etcd://{cluster.endpoints}{PREFIX}/job"
        login = ["--store-user", USER, "--store-password-file", str(password_file(tmp_path))]
        login += ["--log-level", "debug"]  # each login to etcd logged
        member = cluster.members[0]
        # Each lighthouse reaches etcd through a link the test can cut: one in touch with etcd uses
        # its token every second (the look at its store's health), so only one cut off outlives it.
        links = [Proxy(member.endpoint) for _ in range(2)]
        try:
            a, b = (
                procs.lighthouse(store=f"etcd://{link.address}{PREFIX}/job", extra=login) for link in links
            )
            for lh in (a, b):
                wait_healthy(lh.url)
            edit_everywhere(a.url, b.url, 1)
            before = [logins(a), logins(b)]
            assert min(before) >= 1, before
            # Cut off past the tokens' TTL: etcd drops the token each lighthouse used last (it logs each
            # token it drops; the ones it dropped before were refused and replaced already).
            gone = etcd_tokens(member, "deleted a simple token")
            for link in links:
                link.cut()

            def dropped() -> set[str]:
                tokens = etcd_tokens(member, "deleted a simple token") - gone
                return tokens if len(tokens) >= 2 else set()

            expired = poll(
                dropped, TOKEN_TTL + 15, interval=0.1, what="etcd dropping both lighthouses' tokens"
            )
            for link in links:
                link.heal()
            edit_everywhere(a.url, b.url, 2)
            # Each lighthouse came with its expired token, was refused, and logged in again.
            refused = etcd_tokens(member, "invalid auth token")
            assert expired <= refused, (expired, refused)
            after = [logins(a), logins(b)]
            assert after[0] > before[0] and after[1] > before[1], (before, after)
            # A restarted etcd knows no token: the watch streams reopen refused, log in, resume.
            cluster.kill(member)
            cluster.start_member(member, wait=False)
            poll(lambda: change(a.url, "PATCH", {"after_restart": 1}, timeout=10).status == 200, 30,
                 interval=0.5, what="an edit accepted after etcd's restart")  # fmt: skip
            edit_everywhere(a.url, b.url, 3)
            assert live(b.url)["config"]["after_restart"] == 1
        finally:
            procs.stop_all()  # before etcd stops
            for link in links:
                link.close()

        # A wrong password (here from the environment) stops the lighthouse at start, in one line.
        wrong = procs.spawn(
            [sys.executable, "-m", "lighthouse", "serve", "--http-bind", "off", "--bind", "127.0.0.1:0",
             "--store", store, "--store-user", USER],
            "lighthouse", env={"LIGHTHOUSE_STORE_PASSWORD": "not-it"},
        )  # fmt: skip
        assert wrong.wait(timeout=30) == 1
        err = wrong.stderr().strip()
        assert "authentication failed" in err and USER in err, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err

        no_password = procs.spawn(
            [sys.executable, "-m", "lighthouse", "serve", "--http-bind", "off", "--bind", "127.0.0.1:0",
             "--store", store, "--store-user", USER],
            "lighthouse",
        )  # fmt: skip
        assert no_password.wait(timeout=30) == 1
        assert "LIGHTHOUSE_STORE_PASSWORD" in no_password.stderr(), no_password.stderr()


@pytest.mark.slow
def test_auth_and_mutual_tls_together(tmp_path: Path, procs: ProcessPool) -> None:
    require_etcd()
    certs = make_certs(tmp_path / "certs")
    with EtcdCluster(tmp_path / "etcd", size=1, tls=certs) as cluster:
        enable_auth(cluster.endpoints, cluster.client_tls)
        store = f"etcds://{cluster.endpoints}{PREFIX}/tls"
        flags = ["--store-ca", str(certs.ca), "--store-cert", str(certs.client_cert)]
        flags += ["--store-key", str(certs.client_key)]
        flags += ["--store-user", USER, "--store-password-file", str(password_file(tmp_path))]
        try:
            a, b = (procs.lighthouse(store=store, extra=flags) for _ in range(2))
            for lh in (a, b):
                wait_healthy(lh.url)
            edit_everywhere(a.url, b.url, 1)
        finally:
            procs.stop_all()
        wrong = procs.spawn(
            [sys.executable, "-m", "lighthouse", "serve", "--http-bind", "off", "--bind", "127.0.0.1:0",
             "--store", store, *flags[:-1], str(password_file(tmp_path / "..", "nope"))],
            "lighthouse",
        )  # fmt: skip
        assert wrong.wait(timeout=30) == 1
        assert "authentication failed" in wrong.stderr(), wrong.stderr()
