"""The dashboard's port under attack (issue 26, item 5): slow bodies, foreign Host names, claimed
authors, secrets others can read. Real lighthouse processes; the attacker is a raw socket."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.certs import CA
from tests.http_util import call, host_port
from tests.procs import LighthouseProc, ProcessPool, lighthouse_command, poll

SLOW_BODY_HEAD = (
    b"PUT /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n"
)
SLOW_HEADERS = b"GET /api/config HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (an answer before the close is read and dropped)."""
    try:
        while chunk := sock.recv(65536, socket.MSG_DONTWAIT):
            del chunk
        return True  # EOF
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def _drip(
    lh: LighthouseProc,
    count: int,
    seconds: float,
    during: float,
    meanwhile: Callable[[], None] | None = None,
    until: Callable[[list[float], list[bytes]], bool] | None = None,
) -> tuple[list[float], list[bytes], int]:
    """``count`` connections each sending one byte every ``seconds`` (half stuck in the headers, half
    in the body) for at most ``during`` s, or until ``until(closed, answers)``: when each was closed
    (s after it opened, inf: never), what each got before, and the most threads the lighthouse had
    meanwhile."""
    host, port = host_port(lh.url)
    socks, opened = [], []
    for i in range(count):
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(SLOW_BODY_HEAD if i % 2 else SLOW_HEADERS[:20])
        sock.setblocking(False)  # with a timeout, recv would first wait for data
        socks.append(sock)
        opened.append(time.monotonic())
    closed = [float("inf")] * count
    answers = [b""] * count
    most = 0
    end = time.monotonic() + during
    offset = 20
    while time.monotonic() < end and any(c == float("inf") for c in closed):
        if until is not None and until(closed, answers):
            break
        most = max(most, _threads(lh.pid))
        for i, sock in enumerate(socks):
            if closed[i] != float("inf"):
                continue
            try:
                answers[i] += sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            except OSError:
                closed[i] = time.monotonic() - opened[i]
                continue
            if _closed(sock):
                closed[i] = time.monotonic() - opened[i]
                continue
            data = b"1" if i % 2 else SLOW_HEADERS[offset : offset + 1]
            try:
                sock.send(data)
            except OSError:
                closed[i] = time.monotonic() - opened[i]
        offset += 1
        if meanwhile is not None and offset == 21:
            meanwhile()
        time.sleep(seconds)  # the attacker's pace, not a wait for an outcome
    for sock in socks:
        sock.close()
    return closed, answers, most


@pytest.mark.slow
def test_slow_requests_are_cut_off_at_the_deadline_and_threads_stay_bounded(procs: ProcessPool) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=("--http-request-timeout", "3"))
    assert call(lh.url, "GET", "/api/config").status == 200
    baseline = _threads(lh.pid)
    meanwhile: list[int] = []

    def normal_request() -> None:  # while 50 slow ones are open
        meanwhile.append(call(lh.url, "GET", "/api/config").status)

    closed, _, most = _drip(lh, 50, 1.0, during=20.0, meanwhile=normal_request)
    assert meanwhile == [200], closed
    # Each sent a byte a second (a per-read timeout never fires) and was cut off by the 3 s deadline.
    assert all(2.5 <= c <= 9.0 for c in closed), closed
    assert most <= baseline + 50 + 4, (baseline, most)
    poll(lambda: _threads(lh.pid) <= baseline + 2, timeout=10, what="the slow connections' threads end")
    assert call(lh.url, "GET", "/api/config").status == 200


def _refused(answer: bytes) -> bool:
    return answer.startswith(b"HTTP/1.1 503")


def test_connections_past_the_cap_get_503_and_hold_no_thread(procs: ProcessPool) -> None:
    timeout = 30.0  # a request's deadline: what a connection served but stuck is held for
    extra = ("--http-request-timeout", str(int(timeout)), "--http-max-connections", "8")
    lh = procs.lighthouse({"lr": 0.1}, extra=extra)
    assert call(lh.url, "GET", "/api/config").status == 200
    baseline = _threads(lh.pid)

    def all_refused_closed(closed: list[float], answers: list[bytes]) -> bool:
        refused = [i for i, a in enumerate(answers) if _refused(a)]
        return len(refused) >= 30 - 8 - 1 and all(closed[i] != float("inf") for i in refused)

    # Dripping until every refused connection is closed, for less than the deadline.
    closed, answers, most = _drip(lh, 30, 0.5, during=timeout - 5, until=all_refused_closed)
    assert most <= baseline + 8 + 2, (baseline, most)
    refused = [i for i, a in enumerate(answers) if _refused(a)]
    assert len(refused) >= 30 - 8 - 1, answers  # the cap, give or take the first probe's thread
    assert b"too many connections" in answers[refused[0]]
    # Refused and closed, not held to the request's deadline as the 8 served (still open) are.
    assert all(closed[i] < timeout for i in refused), [closed[i] for i in refused]
    assert sum(c == float("inf") for c in closed) >= 8 - 1, closed
    poll(lambda: call(lh.url, "GET", "/api/config").status == 200, timeout=10, what="served again")


@pytest.mark.slow
def test_reads_answer_only_under_allowed_host_names(procs: ProcessPool, tmp_path: Path) -> None:
    lh = procs.lighthouse({"lr": 0.1}, extra=("--allowed-host", "lighthouse.internal"))
    _, port = host_port(lh.url)
    for path in ("/api/config", "/", "/jobs/default/config", "/api/managers", "/metrics"):
        refused = call(lh.url, "GET", path, headers={"Host": "evil.example"})
        assert refused.status == 403, (path, refused.status)
        assert (
            "DNS rebinding" in refused.json["error"]
            and "--allowed-host evil.example" in refused.json["error"]
        )
    for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", "lighthouse.internal:1", "[::1]"):
        answer = call(lh.url, "GET", "/api/config", headers={"Host": host})
        assert answer.status == 200 and answer.json["config"] == {"lr": 0.1}, host
    assert call(lh.url, "GET", "/", headers={"Host": f"localhost:{port}"}).status == 200
    assert call(lh.url, "GET", "/healthz", headers={"Host": "evil.example"}).status == 200  # no data
    # A token is what a rebound page cannot have: reads with one are answered under any name.
    secured = procs.lighthouse({"lr": 0.1}, state_dir=tmp_path / "s2", extra=("--admin-token", "t"))
    headers = {"Host": "evil.example", "Authorization": "Bearer t"}
    assert call(secured.url, "GET", "/api/config", headers=headers).status == 200
    wrong = {"Host": "evil.example", "Authorization": "Bearer nope"}
    assert call(secured.url, "GET", "/api/config", headers=wrong).status == 403


def _history(url: str, job: str) -> list[tuple[str, str]]:
    answer = call(url, "GET", f"/api/jobs/{job}/config/history").json
    return [(v["author"], json.dumps(v["config"], sort_keys=True)) for v in answer["versions"]]


@pytest.mark.slow
def test_the_author_is_stored_with_its_credential_and_system_names_cannot_be_claimed(
    procs: ProcessPool, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"b": ["tb"]}))
    admin = tmp_path / "admin-token"
    admin.write_text("adm\n")
    tokens.chmod(0o600)
    admin.chmod(0o600)
    lh = procs.lighthouse(extra=("--tokens", str(tokens), "--admin-token-file", str(admin)))
    job_b = {"Authorization": "Bearer tb"}
    for claimed in ("guard", "GUARD", "file", "token", "admin token", "eve (admin token)", "-"):
        refused = call(
            lh.url, "PATCH", "/api/jobs/b/config", {"lr": 9}, headers={**job_b, "X-Author": claimed}
        )
        assert refused.status == 400 and "X-Author" in refused.json["error"], claimed
    assert (
        call(lh.url, "PATCH", "/api/jobs/b/config", {"lr": 1}, headers={**job_b, "X-Author": "alice"}).status
        == 200
    )
    assert call(lh.url, "PATCH", "/api/jobs/b/config", {"lr": 2}, headers=job_b).status == 200
    by_admin = {"Authorization": "Bearer adm"}
    answer = call(lh.url, "PATCH", "/api/jobs/b/config", {"lr": 3}, headers={**by_admin, "X-Author": "bob"})
    assert answer.status == 200 and answer.json["author"] == "bob (admin token)"
    assert [author for author, _ in _history(lh.url, "b")] == [
        "bob (admin token)",
        "token of job b",
        "alice (token of job b)",
    ]
    assert "can be read by other users" not in lh.stderr()
    # An open lighthouse: the name as claimed, and still no system name.
    open_lh = procs.lighthouse(state_dir=tmp_path / "open")
    assert call(open_lh.url, "PUT", "/api/config", {"lr": 1}, headers={"X-Author": "guard"}).status == 400
    assert (
        call(open_lh.url, "PUT", "/api/config", {"lr": 1}, headers={"X-Author": "alice"}).json["author"]
        == "alice"
    )
    assert call(open_lh.url, "PUT", "/api/config", {"lr": 2}).json["author"] == "-"


def test_secret_files_others_can_read_are_warned_about(procs: ProcessPool, tmp_path: Path) -> None:
    pair = CA(tmp_path / "pki").issue("localhost")
    Path(pair.key).chmod(0o644)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"b": ["tb"]}))
    tokens.chmod(0o640)
    admin = tmp_path / "admin-token"
    admin.write_text("adm")
    admin.chmod(0o604)
    lh = procs.lighthouse(
        extra=(
            "--tls-cert", str(pair.cert), "--tls-key", str(pair.key),
            "--http-tls", "off", "--tokens", str(tokens), "--admin-token-file", str(admin),
        )
    )  # fmt: skip
    log = lh.stderr()
    for flag, path, mode in (
        ("--tls-key", pair.key, "644"),
        ("--tokens", tokens, "640"),
        ("--admin-token-file", admin, "604"),
    ):
        assert f"{flag} {path} can be read by other users (mode {mode})" in log, log
    assert (
        call(lh.url, "PATCH", "/api/config", {"lr": 1}, headers={"Authorization": "Bearer adm"}).status == 200
    )


@pytest.mark.slow
def test_admin_token_from_env_or_file_and_a_warning_for_the_flag(procs: ProcessPool, tmp_path: Path) -> None:
    def serve(name: str, *flags: str, env: dict[str, str] | None = None) -> LighthouseProc:
        args = [*lighthouse_command(), "--state-dir", str(tmp_path / name), *flags]
        proc: LighthouseProc = procs.spawn(args, name, LighthouseProc, env=env)
        proc.address = proc.readline()
        proc.url = proc.readline()
        return proc

    by_env = serve("env", env={"LIGHTHOUSE_ADMIN_TOKEN": "from-env"})
    assert call(by_env.url, "PATCH", "/api/config", {"lr": 1}).status == 401
    ok = call(by_env.url, "PATCH", "/api/config", {"lr": 1}, headers={"Authorization": "Bearer from-env"})
    assert ok.status == 200 and ok.json["author"] == "admin token"
    assert "visible to every user in ps" not in by_env.stderr()
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    token_file.chmod(0o600)
    by_file = serve("file", "--admin-token-file", str(token_file))
    assert (
        call(
            by_file.url, "PATCH", "/api/config", {"lr": 1}, headers={"Authorization": "Bearer from-env"}
        ).status
        == 401
    )
    assert (
        call(
            by_file.url, "PATCH", "/api/config", {"lr": 1}, headers={"Authorization": "Bearer from-file"}
        ).status
        == 200
    )
    by_flag = serve("flag", "--admin-token", "from-flag")
    assert "--admin-token is visible to every user in ps" in by_flag.stderr()
    assert (
        call(
            by_flag.url, "PATCH", "/api/config", {"lr": 1}, headers={"Authorization": "Bearer from-flag"}
        ).status
        == 200
    )
    empty = tmp_path / "empty"
    empty.write_text("\n")
    failed = procs.spawn(
        [*lighthouse_command(), "--state-dir", str(tmp_path / "e"), "--admin-token-file", str(empty)], "empty"
    )
    assert failed.wait(30) == 1 and "is empty" in failed.stderr()
    assert not os.environ.get("LIGHTHOUSE_ADMIN_TOKEN")  # the test's own environment was not changed
