"""Junk on the wire: random bytes, malformed protobuf, oversized messages and random HTTP requests.

Sent to a real lighthouse (gRPC + HTTP) and manager (gRPC). Afterwards both
still answer correctly, and the config and its version are unchanged.
"""

from __future__ import annotations

import json
import random
import socket
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lighthouse.client import LighthouseClient
from protos import lighthouse_config_pb2 as pb
from protos.rpc import (
    LIGHTHOUSE_GET_CONFIG,
    LIGHTHOUSE_HEARTBEAT,
    MANAGER_GET_CONFIG,
    MAX_REQUEST_BYTES,
    parse_address,
)
from tests import http_util
from tests.procs import LighthouseProc, ManagerProc, ProcessPool
from worker_client import ManagerClient

TOKEN = "s3cret-token"
CONFIG = {"lr": 0.1, "name": "junk-test", "layers": [1, 2]}
ENCODED = {"lr": "0.1", "name": "junk-test", "layers": "[1,2]"}

# Every route of the admin API (DESIGN.md plus the scheduling routes), with a concrete path.
HTTP_PATHS = [
    "/",
    "/config",
    "/static/common.js",
    "/static/nope.js",
    "/healthz",
    "/metrics",
    "/api/config",
    "/api/config/history",
    "/api/config/rollback",
    "/api/config/scheduled",
    "/api/config/scheduled/1",
    "/api/config/at-step/0",
    "/api/managers",
    "/api/nope",
    "/ofrep/v1/evaluate/flags",
    "/ofrep/v1/evaluate/flags/lr",
]
METHODS = ["GET", "HEAD", "PUT", "PATCH", "POST", "DELETE", "OPTIONS", "TRACE", "CONNECT", "BREW"]
CHANGE_METHODS = {"PUT", "PATCH", "POST", "DELETE"}
STALE = "999999"  # an If-Match that is never the live version: an authorized PUT/PATCH must get 409


@dataclass
class System:
    lh: LighthouseProc
    m: ManagerProc
    version: int

    def check_unchanged(self) -> None:
        """Both servers alive and answering, with the original config and version."""
        assert self.lh.popen.poll() is None, f"lighthouse died\n{self.lh.stderr()}"
        assert self.m.popen.poll() is None, f"manager died\n{self.m.stderr()}"
        view = http_util.live(self.lh.url)
        assert view["version"] == self.version and view["config"] == CONFIG, view
        assert http_util.get_json(self.lh.url, "healthz")["version"] == self.version
        assert http_util.call(self.lh.url, "GET", "metrics").status == 200
        with LighthouseClient(self.lh.address) as client:
            reply = client.fetch(timeout=5)
            assert reply.version == self.version and dict(reply.config_data) == ENCODED
        with ManagerClient(self.m.address, timeout=5, strict=True) as client:
            for step in (None, 7):
                cfg = client.get_config(step=step)
                assert dict(cfg) == ENCODED and cfg.version == self.version, (step, cfg, cfg.source)
                assert cfg.source in ("lighthouse", "cache"), cfg.source


@pytest.fixture
def system(procs: ProcessPool) -> Iterator[System]:
    lh = procs.lighthouse(CONFIG, extra=["--admin-token", TOKEN])
    http_util.wait_healthy(lh.url)
    m = procs.manager(lh.address, "g0", cache_ttl=0.2, lighthouse_timeout=1.0)
    sys_ = System(lh, m, http_util.live(lh.url)["version"])
    sys_.check_unchanged()
    yield sys_


def _endpoint(addr: str) -> tuple[str, int]:
    return parse_address(addr)


# ----------------------------------------------------------------------------- raw TCP


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _tcp_junk(rng: random.Random) -> list[bytes]:
    payloads = [
        b"",
        b"\x00",
        b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32),  # TLS ClientHello start
        H2_PREFACE,
        H2_PREFACE + EMPTY_SETTINGS,
        H2_PREFACE + b"\xff" * 9 + b"\x00" * 100,  # a frame with an absurd length
        H2_PREFACE
        + EMPTY_SETTINGS
        + b"\x00\x00\x05\x01\x04\x00\x00\x00\x01\xff\xfe\xfd\xfc\xfb",  # bad HPACK
        H2_PREFACE + EMPTY_SETTINGS + b"\x00\x00\x08\x00\x01\x00\x00\x00\x01" + bytes(8),  # DATA, no stream
        b"A" * 70_000,
    ]
    payloads += [rng.randbytes(rng.randrange(1, 4096)) for _ in range(20)]
    payloads += [H2_PREFACE + rng.randbytes(rng.randrange(1, 2048)) for _ in range(10)]
    return payloads


def test_random_bytes_on_every_port(system: System) -> None:
    rng = random.Random(1234)
    http_host, http_port = http_util.host_port(system.lh.url)
    targets = [_endpoint(system.lh.address), _endpoint(system.m.address), (http_host, http_port)]
    for host, port in targets:
        for payload in _tcp_junk(rng):
            try:
                http_util.raw_exchange(host, port, payload, timeout=10)
            except ConnectionRefusedError:
                raise AssertionError(f"{host}:{port} stopped accepting connections") from None

    # Connections that send a little junk and then stall must not block anyone else.
    stalled = []
    try:
        for host, port in targets:
            for payload in (b"", H2_PREFACE[:10], b"PUT /api/config HTTP/1.1\r\nContent-Le"):
                for _ in range(8):
                    sock = socket.create_connection((host, port), timeout=5)
                    sock.sendall(payload)
                    stalled.append(sock)
        started = time.monotonic()
        system.check_unchanged()
        assert time.monotonic() - started < 10
    finally:
        for sock in stalled:
            sock.close()
    system.check_unchanged()


JSON_PUT = b"PUT /api/config HTTP/1.1\r\nContent-Type: application/json\r\n"


def test_junk_bytes_to_http_port_get_an_answer(system: System) -> None:
    """Malformed HTTP/1.x gets an error answer (never a hang, never a 500)."""
    host, port = http_util.host_port(system.lh.url)
    cases = [
        b"GARBAGE\r\n\r\n",
        b"GET\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /api/config HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",  # too many headers
        b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",  # request line too long
        b"GET /api/config HTTP/1.1\r\nX-Big: " + b"b" * 70_000 + b"\r\n\r\n",  # header line too long
        JSON_PUT + b"Content-Length: 99999999999\r\n\r\n{}",
        JSON_PUT + b"Content-Length: -1\r\n\r\n{}",
        JSON_PUT + b"Content-Length: 10\r\n\r\n{}",
        b"PATCH /api/config HTTP/1.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n",
        b"GET /api/config/history?limit=" + b"9" * 5000 + b" HTTP/1.1\r\n\r\n",
        b"GET /api/config/history?" + b"&".join(b"a=%d" % i for i in range(500)) + b" HTTP/1.1\r\n\r\n",
        b"GET /api/config/at-step/%ff%fe HTTP/1.1\r\n\r\n",
        b"GET /api/config HTTP/1.1\r\nHost: \xff\xfe\r\n\r\n",
    ]
    problems = []
    for data in cases:
        answer = http_util.raw_exchange(host, port, data, timeout=10)
        if not answer.startswith(b"HTTP/"):
            continue  # an HTTP/0.9-style junk line may get a bare body, or the connection closed
        status = int(answer[9:12])
        if status >= 500 and status not in (501, 505):
            problems.append(f"{data[:70]!r} -> {answer[:40]!r}")
        if data.startswith((b"PUT", b"PATCH")) and status == 200:
            problems.append(f"{data[:70]!r} made a change")
    system.check_unchanged()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_a_content_length_that_is_not_one_number_gets_400(system: System, method: str) -> None:
    """Not ASCII digits ("²" and "³" pass ``str.isdigit``; ``int`` refuses them: the request got no
    answer at all), or two different values: 400 and the connection closed (RFC 9112, 6.3)."""
    host, port = http_util.host_port(system.lh.url)
    head = f"{method} /api/config HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    for lengths in ([b"\xb2"], [b"\xb3"], [b"abc"], [b"+2"], [b"1_0"], [b"-1"], [b"2", b"3"]):
        framing = b"".join(b"Content-Length: " + v + b"\r\n" for v in lengths)
        answer = http_util.raw_exchange(host, port, head + auth + framing + b"\r\n{}", timeout=10)
        status = _check_answer(method, answer, f"{method} with Content-Length {lengths}")
        assert status == 400, answer[:300]
        assert b"invalid Content-Length" in answer, answer[:300]
        assert b"connection: close" in answer.lower(), answer[:300]
    system.check_unchanged()


# ------------------------------------------------------------------------------ gRPC


def _junk_channel(addr: str) -> grpc.Channel:
    return grpc.insecure_channel(
        f"{parse_address(addr)[0]}:{parse_address(addr)[1]}",
        options=[("grpc.max_send_message_length", -1), ("grpc.enable_http_proxy", 0)],
    )


MALFORMED = [
    b"\x0a",  # field 1 LEN, no length
    b"\x0a\xff\xff\xff\xff\x0f",  # length far past the end
    b"\x0a\x05abc",  # truncated string
    b"\x0a\x02\xc3\x28",  # invalid UTF-8 in a string field
    b"\x10" + b"\xff" * 11,  # varint longer than 10 bytes
    b"\x10\x80\x80\x80\x80\x80\x80\x80\x80\x80\x7f",  # varint overflowing 64 bits
    b"\x0f",  # wire type 7
    b"\x0c",  # END_GROUP with no START_GROUP
    b"\x00",  # field number 0
    b"\x22\x03\x0a\x01",  # nested message, truncated inside
    b"\x22\x7f" + b"\x00" * 10,  # nested length past the end
    b"\x0b" * 500,  # 500 nested groups (recursion limit)
    b"\x22\x02\x22\x00" * 1 + b"\x22" * 300,  # nested LEN tags without lengths
    b"\x15\x01\x02",  # fixed32 cut short
    b"\x19\x01\x02\x03",  # fixed64 cut short
    b"\xf8\xff\xff\xff\x0f\x01",  # unknown, largest field number (valid)
    b"\x80\x80\x80\x80\x80\x01\x01",  # field number beyond 2^29
]


def _valid_but_odd() -> dict[str, list[bytes]]:
    status = pb.ManagerStatus(replica_id="junk\x00\u2603", address="::::", version=-5, step=-7)
    status.switches.add(version=-1, step=-1)
    return {
        LIGHTHOUSE_GET_CONFIG: [
            pb.LighthouseConfigRequest(known_version=-1, known_state_id="\u2603" * 50).SerializeToString(),
            pb.LighthouseConfigRequest(known_version=2**63 - 1, status=status).SerializeToString(),
        ],
        LIGHTHOUSE_HEARTBEAT: [pb.LighthouseHeartbeatRequest(status=status).SerializeToString()],
        MANAGER_GET_CONFIG: [
            pb.ManagerConfigRequest(group_rank=-1, step=-5).SerializeToString(),
            pb.ManagerConfigRequest(group_rank=2**62, known_version=-9).SerializeToString(),
        ],
    }


REPLY_TYPES = {
    LIGHTHOUSE_GET_CONFIG: pb.LighthouseConfigResponse,
    LIGHTHOUSE_HEARTBEAT: pb.LighthouseHeartbeatResponse,
    MANAGER_GET_CONFIG: pb.ManagerConfigResponse,
}


@pytest.mark.slow
def test_malformed_protobuf_to_every_rpc(system: System) -> None:
    rng = random.Random(99)
    methods = {
        LIGHTHOUSE_GET_CONFIG: system.lh.address,
        LIGHTHOUSE_HEARTBEAT: system.lh.address,
        MANAGER_GET_CONFIG: system.m.address,
    }
    odd = _valid_but_odd()
    outcomes: dict[str, set[str]] = {}
    for path, addr in methods.items():
        channel = _junk_channel(addr)
        try:
            call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            payloads = MALFORMED + odd[path] + [rng.randbytes(rng.randrange(1, 300)) for _ in range(40)]
            for payload in payloads:
                try:
                    reply = call(payload, timeout=5)
                except grpc.RpcError as exc:
                    code = exc.code()
                    assert code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), (
                        f"{path} {payload[:40]!r}: {code} {exc.details()}"
                    )
                    outcomes.setdefault(path, set()).add(code.name)
                    continue
                parsed = REPLY_TYPES[path].FromString(reply)  # whatever is answered is a valid reply
                outcomes.setdefault(path, set()).add("OK")
                if path != LIGHTHOUSE_HEARTBEAT:
                    assert parsed.version in (0, system.version), parsed
                    if not getattr(parsed, "not_modified", False) and parsed.version:
                        assert dict(parsed.config_data) == ENCODED
        finally:
            channel.close()
    # the clearly malformed ones were refused, the valid ones answered
    for path in methods:
        assert "OK" in outcomes[path] and {"INTERNAL", "INVALID_ARGUMENT"} & outcomes[path], outcomes
    system.check_unchanged()


def _big_unknown_field(size: int) -> bytes:
    """Field 31 (unknown to every message here) holding ``size`` bytes: parses fine, just large."""
    return b"\xfa\x01" + _varint(size) + b"x" * size


@pytest.mark.slow
@pytest.mark.parametrize("path", [LIGHTHOUSE_GET_CONFIG, LIGHTHOUSE_HEARTBEAT, MANAGER_GET_CONFIG])
def test_oversized_grpc_requests_are_refused(system: System, path: str) -> None:
    addr = system.m.address if path == MANAGER_GET_CONFIG else system.lh.address
    channel = _junk_channel(addr)
    try:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        for size in (MAX_REQUEST_BYTES + 1, 300 * 1024, 4 * 1024 * 1024):
            with pytest.raises(grpc.RpcError) as info:
                call(_big_unknown_field(size), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (size, info.value.details())
        # just under the limit is a normal request
        reply = REPLY_TYPES[path].FromString(call(_big_unknown_field(MAX_REQUEST_BYTES - 1024), timeout=10))
        assert reply.version == system.version
    finally:
        channel.close()
    system.check_unchanged()


# ------------------------------------------------------------------------------ HTTP

header_names = st.sampled_from(
    [
        "Content-Type",
        "Content-Length",
        "Transfer-Encoding",
        "Accept",
        "If-None-Match",
        "X-Author",
        "X-Change-Comment",
        "Expect",
        "Cookie",
        "Origin",
        "X-Junk",
    ]
) | st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_", min_size=1, max_size=20)
header_values = st.sampled_from(
    [
        "application/json",
        "application/json; charset=latin-1",
        "text/plain",
        "chunked",
        "100-continue",
        "-1",
        "0",
    ]
) | st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=255), max_size=60)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
bodies = (
    st.binary(max_size=300)
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.dictionaries(st.text(max_size=300), json_values, max_size=5).map(lambda v: json.dumps(v).encode())
)
queries = st.sampled_from(
    ["", "?limit=5", "?limit=-1", "?limit=abc", "?effective_step=3", "?effective_step=x", "?comment=%ff"]
) | st.text(alphabet="abcdefghij=&%?0123456789", max_size=30).map(lambda s: "?" + s)


def _send(
    host: str, port: int, method: str, target: str, headers: list[tuple[str, str]], body: bytes
) -> bytes:
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n".encode("latin-1")
    for name, value in headers:
        head += f"{name}: {value}\r\n".encode("latin-1")
    if not any(name.lower() == "content-length" for name, _ in headers):
        head += f"Content-Length: {len(body)}\r\n".encode()
    return http_util.raw_exchange(host, port, head + b"\r\n" + body, timeout=10)


def _check_answer(method: str, answer: bytes, what: str, path: str = "") -> int:
    """A clear answer: no server error, no change made, errors as JSON (OFREP's errors as OFREP
    words them, and its POSTs are reads: ``check_unchanged`` shows they changed nothing)."""
    assert answer.startswith(b"HTTP/1."), f"{what}: no HTTP answer: {answer[:200]!r}"
    status = int(answer[9:12])
    assert status < 500 or status in (501, 505), f"{what}: {answer[:500]!r}"
    ofrep = path.startswith("/ofrep/")
    if method in CHANGE_METHODS and not (ofrep and method == "POST"):
        assert status != 200, f"{what}: junk request made a change: {answer[:500]!r}"
    head, _, payload = answer.partition(b"\r\n\r\n")
    if status >= 400 and method != "HEAD":
        assert b"application/json" in head.lower(), f"{what}: error is not JSON: {answer[:300]!r}"
        error = json.loads(payload)
        words = ("error", "errorCode", "errorDetails") if ofrep else ("error",)  # 405: the router's
        assert any(word in error for word in words), f"{what}: {payload[:300]!r}"
    return status


@pytest.mark.slow
def test_every_http_endpoint_with_every_method(system: System) -> None:
    host, port = http_util.host_port(system.lh.url)
    seen: set[int] = set()
    for path in HTTP_PATHS:
        for method in METHODS:
            for auth in ([], [("Authorization", f"Bearer {TOKEN}"), ("If-Match", STALE)]):
                headers = [("Content-Type", "application/json"), *auth]
                for body in (b"{not json", b"[1,2]", b'{"version": "x"}', b"\xff\xfe", b""):
                    answer = _send(host, port, method, path, headers, body)
                    seen.add(_check_answer(method, answer, f"{method} {path} {auth} {body!r}", path))
    assert {200, 400, 401, 404, 405} <= seen, seen
    system.check_unchanged()


@pytest.mark.slow
def test_random_http_requests(system: System) -> None:
    host, port = http_util.host_port(system.lh.url)

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        database=None,
    )
    @given(
        path=st.sampled_from(HTTP_PATHS),
        query=queries,
        method=st.sampled_from(METHODS) | st.text(alphabet=string.ascii_uppercase, min_size=1, max_size=8),
        headers=st.lists(st.tuples(header_names, header_values), max_size=6),
        body=bodies,
        authorized=st.booleans(),
    )
    def run(
        path: str, query: str, method: str, headers: list[tuple[str, str]], body: bytes, authorized: bool
    ) -> None:
        hdrs = [
            (n, v) for n, v in headers if n.lower() not in ("authorization", "if-match", "connection", "host")
        ]
        if authorized:
            # With the right token a request could be a real change: make it one that must fail (a stale
            # If-Match for PUT/PATCH; rollback bodies that name a real version are skipped).
            hdrs += [("Authorization", f"Bearer {TOKEN}"), ("If-Match", STALE)]
            if path == "/api/config/rollback":
                try:
                    parsed: Any = json.loads(body)
                except ValueError:
                    parsed = None
                assume(not (isinstance(parsed, dict) and isinstance(parsed.get("version"), int)))
        answer = _send(host, port, method, path + query, hdrs, body)
        _check_answer(method, answer, f"{method} {path}{query} {hdrs} {body[:100]!r}", path)

    run()
    system.check_unchanged()
