"""``lighthouse serve --torchft``: torchft's own lighthouse behind our gRPC port, its RPCs forwarded
unchanged; called here with a client generated from the seed's torchft.proto, through our port and
straight at torchft's, and compared."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from playwright.sync_api import Page, expect

from lighthouse import LighthouseServer
from tests.browser import watch_csp
from tests.http_util import call
from tests.procs import ROOT, LighthouseProc, ProcessPool, child_env, poll
from tests.seed_proto import seed_modules

# Each starts a lighthouse process and torchft's (a busy machine takes seconds to start Python ones).
pytestmark = pytest.mark.slow

HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
QUORUM = "/torchft.LighthouseService/Quorum"


def torchft_lighthouse(procs: ProcessPool, *flags: str) -> tuple[LighthouseProc, str]:
    """``lighthouse serve --torchft``, and torchft's own address (from the line it logs)."""
    lh = procs.lighthouse(extra=["--torchft", *flags])
    found = r"its own page http://(127\.0\.0\.1:\d+)/"
    page = poll(lambda: re.search(found, lh.stderr()), 20, what="torchft's address in the log")
    return lh, page.group(1)


def torchft_status(address: str) -> str:
    """torchft's own status page (what its dashboard loads every second): its quorum, its heartbeats."""
    answer = call(f"http://{address}", "GET", "/status")
    assert answer.status == 200, answer.status
    return answer.body.decode()


def heartbeats(status: str) -> list[str]:
    """The replica groups torchft's status page lists as heartbeating."""
    section = status.split("<h2>Heartbeats</h2>", 1)[1]
    return re.findall(r"^\s*(\S+): seen \S+ ago$", section, re.M)


def quorum_request(replica: str, step: int) -> bytes:
    pb2, _ = seed_modules()
    member = pb2.QuorumMember(replica_id=replica, address="a", store_address="s", step=step, world_size=1)
    data: bytes = pb2.LighthouseQuorumRequest(requester=member).SerializeToString()
    return data


def raw(address: str, method: str, request: bytes, timeout: float = 10.0) -> bytes:
    with grpc.insecure_channel(address) as channel:
        reply: bytes = channel.unary_unary(method)(request, timeout=timeout)
        return reply


def raw_error(address: str, method: str, request: bytes, timeout: float = 10.0) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(method)(request, timeout=timeout)
    return caught.value


def test_quorum_and_heartbeat_through_our_port_get_torchfts_answers(procs: ProcessPool, page: Page) -> None:
    lh, torchft = torchft_lighthouse(procs, "--min-replicas", "1", "--join-timeout-ms", "100")
    assert call(lh.url, "GET", "/api/torchft").json["torchft"] == {
        "page": f"http://{torchft}/",
        "quorum": None,
        "heartbeats": [],
    }
    pb2, pb2_grpc = seed_modules()
    assert lh.address != torchft
    # torchft's own status page lists the replica groups whose heartbeats it received: a heartbeat
    # sent only to our port shows there (nothing else has heartbeated, and no quorum was asked yet).
    assert "g0" not in torchft_status(torchft)
    heartbeat = pb2.LighthouseHeartbeatRequest(replica_id="g0").SerializeToString()
    sent = time.monotonic()
    assert raw(lh.address, HEARTBEAT, heartbeat) == b""
    answered = time.monotonic()
    assert heartbeats(torchft_status(torchft)) == ["g0"]
    # torchft decides the quorum: the members it names through our port are the ones it has.
    through_us = pb2.LighthouseQuorumResponse.FromString(raw(lh.address, QUORUM, quorum_request("g0", 7)))
    assert [(m.replica_id, m.step) for m in through_us.quorum.participants] == [("g0", 7)]
    status = torchft_status(torchft)  # the quorum it made: the one our caller got
    assert f"Previous quorum id: {through_us.quorum.quorum_id} <br>" in status, status
    assert re.search(r"<b>g0</b> <br/>\s*Step: 7 <br/>", status), status
    direct = pb2.LighthouseQuorumResponse.FromString(raw(torchft, QUORUM, quorum_request("g0", 7)))
    assert through_us.quorum.quorum_id == direct.quorum.quorum_id >= 1
    # The seed's generated stub (a torchft user's client) works through our port; GetConfig is ours.
    with grpc.insecure_channel(lh.address) as channel:
        stub = pb2_grpc.LighthouseServiceStub(channel)
        reply = stub.Quorum(pb2.LighthouseQuorumRequest.FromString(quorum_request("g0", 8)), timeout=10)
        assert [m.step for m in reply.quorum.participants] == [8]
        assert dict(stub.GetConfig(pb2.LighthouseConfigRequest(), timeout=10).config_data) == {}
    # The dashboard shows torchft's view: the last quorum forwarded (g0 at step 8), its heartbeats.
    asked = time.monotonic()
    view = call(lh.url, "GET", "/api/torchft").json["torchft"]
    told = time.monotonic()
    assert view["quorum"]["id"] == reply.quorum.quorum_id and view["quorum"]["step"] == 8
    members = view["quorum"]["members"]
    assert [(m["replica_id"], m["step"], m["world_size"]) for m in members] == [("g0", 8, 1)]
    assert [h["replica_id"] for h in view["heartbeats"]] == ["g0"]
    # Seconds since the one heartbeat above (quorum calls are no heartbeats here), to the ms it shows.
    since = view["quorum"]["members"][0]["heartbeat_s"]
    assert asked - answered - 0.001 <= since <= told - sent + 0.001, (since, asked - answered, told - sent)
    # In Chromium, offline: every request the page makes goes to this lighthouse, none breaks the CSP.
    foreign: list[str] = []
    page.route(
        re.compile(r"^(?!" + re.escape(lh.url) + ")"),
        lambda route: (foreign.append(route.request.url), route.abort()),
    )
    csp = watch_csp(page)
    page.goto(lh.url)
    panel = page.get_by_test_id("torchft")
    expect(panel).to_be_visible()
    expect(page.get_by_test_id("torchft-quorum")).to_contain_text(f"quorum {view['quorum']['id']} at step 8")
    expect(page.locator('#torchft-members tr[data-replica="g0"] td.num').first).to_have_text("8")
    expect(page.get_by_test_id("torchft-heartbeats")).to_contain_text("heartbeating: g0")
    expect(panel).to_contain_text(f"http://{torchft}/")
    raw(lh.address, QUORUM, quorum_request("g0", 9))  # a new quorum shows on the next refresh
    expect(page.get_by_test_id("torchft-quorum")).to_contain_text("at step 9")
    assert foreign == [] and csp == []


def test_torchfts_error_status_and_the_callers_deadline_pass_through(procs: ProcessPool) -> None:
    lh, torchft = torchft_lighthouse(procs, "--min-replicas", "2", "--join-timeout-ms", "60000")
    junk = b"\xff\xff\xff"
    ours, theirs = raw_error(lh.address, HEARTBEAT, junk), raw_error(torchft, HEARTBEAT, junk)
    assert ours.code() == theirs.code() == grpc.StatusCode.INTERNAL
    assert ours.details() == theirs.details() and "decode" in ours.details()
    # One group of two: torchft holds the quorum call; the caller's 1 s deadline ends it.
    started = time.monotonic()
    late = raw_error(lh.address, QUORUM, quorum_request("g0", 1), timeout=1.0)
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 1.0 + 3.0


def test_the_python_api_mirrors_serve() -> None:
    pb2, _ = seed_modules()
    lh = LighthouseServer(bind="127.0.0.1:0", torchft=True, min_replicas=1, join_timeout_ms=100)
    try:
        url = lh.torchft_dashboard_url()
        assert url is not None and url.startswith("http://127.0.0.1:")
        reply = pb2.LighthouseQuorumResponse.FromString(raw(lh.address(), QUORUM, quorum_request("g1", 3)))
        assert [m.replica_id for m in reply.quorum.participants] == ["g1"]
    finally:
        lh.shutdown()
    with pytest.raises(TypeError, match="min_replicas"):
        LighthouseServer(bind="127.0.0.1:0", torchft=True)


def test_without_torchft_the_quorum_methods_stay_unimplemented(procs: ProcessPool) -> None:
    lh = procs.lighthouse()
    assert raw_error(lh.address, HEARTBEAT, b"").code() == grpc.StatusCode.UNIMPLEMENTED
    assert call(lh.url, "GET", "/api/torchft").json == {"torchft": None}  # the dashboard hides its panel


def python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter in the repo, with ``args``."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=str(ROOT),
        timeout=60,
    )


NO_TORCH = """
import sys
from lighthouse.rpc.torchft_forward import TorchftLighthouse
lh = TorchftLighthouse(min_replicas=1)
print(lh.target, sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchft")))
lh.shutdown()
"""


def test_torchfts_lighthouse_starts_without_importing_torch() -> None:
    """Only torchft's compiled module is loaded (torchft/__init__.py imports torch: seconds)."""
    out = python(NO_TORCH)
    assert out.returncode == 0, out.stderr
    target, loaded = out.stdout.split(" ", 1)
    assert target.startswith("127.0.0.1:") and int(target.rsplit(":", 1)[1]) > 0, out.stdout
    assert loaded.strip() == "['torchft._torchft']", out.stdout


HIDE_TORCHFT = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "torchft" or name.startswith("torchft."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
from lighthouse.cli import main
main()
"""


def test_without_the_torchft_package_one_line_says_what_to_install(tmp_path: Path) -> None:
    args = ["serve", "--torchft", "--min-replicas", "1", "--bind", "127.0.0.1:0", "--http-bind", "off"]
    args += ["--state-dir", str(tmp_path / "state")]
    out = python(HIDE_TORCHFT, *args)
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: --torchft needs the torchft package (No module named 'torchft'): "
        "pip install 'lighthouse-config[torchft]'"
    ], out.stderr
    assert "Traceback" not in out.stderr


def test_torchft_options_need_torchft_and_torchft_needs_min_replicas(tmp_path: Path) -> None:
    for flags, message in (
        (["--torchft"], "--torchft needs --min-replicas N"),
        (["--min-replicas", "2"], "need --torchft"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "lighthouse", "serve", *flags, "--state-dir", str(tmp_path / "s")],
            capture_output=True,
            text=True,
            env=child_env(),
            cwd=str(ROOT),
            timeout=60,
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr
