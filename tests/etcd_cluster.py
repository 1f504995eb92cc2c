"""A real etcd cluster on loopback for the tests (Debian's ``etcd-server``, never a fake).

etcd needs explicit ports (its peers must know each other's before any starts), so the cluster
picks them: below the kernel's ephemeral range (where a port found free by binding port 0 is
handed to the next outgoing connection), from a slice of its own per pytest-xdist process (gw0,
gw1, ...), and never one it handed out before (a killed member restarts on its own ports).
Another process may still take a port between the pick and etcd's bind (another checkout's
suite picks from the same slices): a member that fails to bind ("address already in use" in its
log) makes ``start`` begin the whole cluster again on fresh ports, up to ``START_ATTEMPTS``
times. Elections are tuned fast (50 ms heartbeat, 500 ms election timeout) so tests that kill
the leader stay short. ``EtcdCluster.stop`` always ends every member; use it as a context manager.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from lighthouse.etcd.client import EtcdClient
from lighthouse.etcd.errors import EtcdError, EtcdUnavailable
from protos.tls import TLSConfig
from tests.procs import child_env, poll

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
START_TIMEOUT = 30.0
START_ATTEMPTS = 5  # cluster starts, each on fresh ports, while a member finds its port taken
PORT_TAKEN = "address already in use"  # etcd's log when it cannot bind a port it was given
LOWEST_PORT = 10000  # cluster ports come from above this, outside the ephemeral range


def require_etcd() -> None:
    """Fail with what to install when the etcd binary is missing (.ci/run installs it): the etcd
    backend is a feature, and a skipped test would hide that it went untested."""
    if not Path(ETCD).exists():
        pytest.fail("etcd is not installed: apt-get install etcd-server (as .ci/run does)")


@dataclass(frozen=True)
class CertFiles:
    """A throwaway CA with one server certificate (for 127.0.0.1) and one client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @property
    def client(self) -> TLSConfig:
        return TLSConfig(ca=str(self.ca), cert=str(self.client_cert), key=str(self.client_key))


def make_certs(directory: Path) -> CertFiles:
    """Issue the certificates with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("the openssl CLI is not installed: apt-get install openssl")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=30)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca")
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        (directory / f"{name}.ext").write_text(
            f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n"
        )
        run("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return CertFiles(
        directory / "ca.crt",
        directory / "server.crt",
        directory / "server.key",
        directory / "client.crt",
        directory / "client.key",
    )


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick): for a dial that must find nothing there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default when unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def worker_ports() -> range:
    """This process's slice of the ports outside the ephemeral range: the larger span below or
    above it, cut in one slice per xdist process (``PYTEST_XDIST_WORKER`` gw0, gw1, ...; the whole
    span without xdist), so the suite's processes never pick each other's ports."""
    low, high = _ephemeral_range()
    span = max(range(LOWEST_PORT, max(low, LOWEST_PORT)), range(high + 1, 65536), key=len)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[:2] == "gw" and worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1"), index + 1)
    size = len(span) // count
    return range(span.start + index * size, span.start + (index + 1) * size)


_handed_out: set[int] = set()  # the cluster ports this process picked: a killed member's stays its own


def cluster_port() -> int:
    """A port of this process's slice that it never handed out and that nothing listens on now."""
    ports = worker_ports()
    for _ in range(1000):
        port = random.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise AssertionError(f"no free port found in {ports}")


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1 with data under ``tmp``."""

    def __init__(
        self, tmp: Path, size: int = 3, tls: CertFiles | None = None, extra_args: Sequence[str] = ()
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.tls = tls
        self.extra_args = list(extra_args)
        self.client_tls = tls.client if tls else None
        self.members = [
            Member(f"m{i}", cluster_port(), cluster_port(), tmp / f"m{i}", tmp / f"m{i}.log")
            for i in range(size)
        ]
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self.start_attempts = 0  # how many starts ``start`` took (more than 1: a port was taken)

    @property
    def endpoints(self) -> str:
        """``host:port,host:port,...``: what a client is given."""
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> EtcdCluster:
        """Start every member and wait until each is healthy. A member that could not bind its port
        begins the whole cluster again on fresh ports (each member's ports are in every member's
        ``--initial-cluster``: one cannot move alone); ``start_attempts`` says how many it took."""
        while True:
            self.start_attempts += 1
            logged = {m.name: m.log_path.stat().st_size if m.log_path.exists() else 0 for m in self.members}
            try:
                for m in self.members:
                    self.start_member(m, wait=False)
                self._wait_started()
                return self
            except BaseException:
                self.stop()
                taken = [m for m in self.members if PORT_TAKEN in self._logged_since(m, logged[m.name])]
                if not taken or self.start_attempts >= START_ATTEMPTS:
                    raise
            self._move(taken)

    @staticmethod
    def _logged_since(m: Member, offset: int) -> str:
        return m.log_path.read_bytes()[offset:].decode(errors="replace") if m.log_path.exists() else ""

    def _move(self, taken: list[Member]) -> None:
        """Fresh ports for every member, and empty data dirs (a member that started knows the old
        cluster): the next start is a new cluster."""
        for m in taken:
            with m.log_path.open("a") as log:
                log.write(f"--- a port was taken ({PORT_TAKEN}): the cluster starts again on fresh ports\n")
        for m in self.members:
            shutil.rmtree(m.data_dir, ignore_errors=True)
            m.client_port, m.peer_port = cluster_port(), cluster_port()
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _wait_started(self) -> None:
        """Every member healthy; fails at once when any member exited (a port taken, say), not after
        the others waited in vain for its vote."""

        def healthy(m: Member) -> bool:
            for other in self.members:
                if not other.running():
                    raise AssertionError(
                        f"etcd {other.name} exited ({other.popen and other.popen.poll()})\n{other.log()}"
                    )
            return self._healthy(m)

        for m in self.members:
            poll(lambda m=m: healthy(m), START_TIMEOUT, interval=0.1, what=f"etcd {m.name} healthy")

    def start_member(self, m: Member, wait: bool = True) -> None:
        """Start (or restart, on its existing data dir) one member."""
        scheme = "https" if self.tls else "http"
        args = [
            ETCD,
            f"--name={m.name}",
            f"--data-dir={m.data_dir}",
            f"--listen-client-urls={scheme}://{m.endpoint}",
            f"--advertise-client-urls={scheme}://{m.endpoint}",
            f"--listen-peer-urls={m.peer_url}",
            f"--initial-advertise-peer-urls={m.peer_url}",
            f"--initial-cluster={self._initial}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=lighthouse-test",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--logger=zap",
            "--log-outputs=stderr",
            *self.extra_args,
        ]
        if self.tls:
            args += [
                f"--cert-file={self.tls.server_cert}",
                f"--key-file={self.tls.server_key}",
                f"--trusted-ca-file={self.tls.ca}",
                "--client-cert-auth",
            ]
        with m.log_path.open("ab") as log:
            m.popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=child_env()
            )
        if wait:
            self.wait_healthy()

    def kill(self, m: Member) -> None:
        """SIGKILL one member (no clean shutdown) and reap it."""
        if m.popen is not None and m.popen.poll() is None:
            m.popen.send_signal(signal.SIGKILL)
            m.popen.wait(timeout=10)

    def _healthy(self, m: Member) -> bool:
        """The member answers and knows a leader, and a linearizable read through it succeeds."""
        if not m.running():
            raise AssertionError(f"etcd {m.name} exited ({m.popen and m.popen.poll()})\n{m.log()}")
        with EtcdClient(m.endpoint, timeout=1.0, tls=self.client_tls) as client:
            try:
                if client.status(0).leader == 0:
                    return False
                client.get("health")
            except (EtcdUnavailable, EtcdError):
                return False
        return True

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Every running member is healthy (poll with a deadline)."""
        for m in self.members:
            if m.running():
                poll(lambda m=m: self._healthy(m), timeout, interval=0.1, what=f"etcd {m.name} healthy")

    def leader(self, timeout: float = START_TIMEOUT) -> Member:
        """The member the running members agree is the leader."""

        def find() -> Member | None:
            for m in self.members:
                if not m.running():
                    continue
                with EtcdClient(m.endpoint, timeout=1.0, tls=self.client_tls) as client:
                    try:
                        status = client.status(0)
                    except EtcdUnavailable:
                        continue
                if status.leader and status.leader == status.header.member_id:
                    return m
            return None

        return poll(find, timeout, interval=0.1, what="an etcd leader")

    def stop(self) -> None:
        """SIGKILL every member: the data is throwaway, and a graceful stop of a cluster
        losing its quorum member by member takes seconds (leader transfer, timeouts)."""
        for m in self.members:
            self.kill(m)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
