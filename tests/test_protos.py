"""The wire contract: generated code is up to date, method paths match, addresses parse as documented."""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from protos import lighthouse_config_pb2 as pb
from protos.rpc import (
    LIGHTHOUSE_GET_CONFIG,
    LIGHTHOUSE_HEARTBEAT,
    MANAGER_GET_CONFIG,
    dialable_address,
    format_address,
    grpc_target,
    make_channel,
    parse_address,
    seconds,
    start_server,
)

ROOT = Path(__file__).resolve().parent.parent


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "protos" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(root),
    )


def test_generated_code_is_up_to_date() -> None:
    result = run_check(ROOT)
    assert result.returncode == 0, result.stderr


def test_check_detects_stale_generated_code(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("__pycache__"))
    generated = tmp_path / "protos" / "lighthouse_config_pb2.py"
    generated.write_text(generated.read_text() + "\n# hand edit\n")
    result = run_check(tmp_path)
    assert result.returncode == 1
    assert "lighthouse_config_pb2.py" in result.stderr
    assert "python protos/generate.py" in result.stderr
    (tmp_path / "protos" / "lighthouse_config_pb2_grpc.py").unlink()  # a missing file is stale too
    assert "lighthouse_config_pb2_grpc.py" in run_check(tmp_path).stderr


def test_check_covers_the_vendored_etcd_protos(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("__pycache__"))
    assert run_check(tmp_path).returncode == 0
    (tmp_path / "protos" / "etcd" / "rpc_pb2.pyi").unlink()
    result = run_check(tmp_path)
    assert result.returncode == 1 and "etcd/rpc_pb2.pyi" in result.stderr


def test_method_paths_match_the_proto() -> None:
    services = pb.DESCRIPTOR.services_by_name
    paths = {
        f"/{service.full_name}/{method.name}" for service in services.values() for method in service.methods
    }
    assert {LIGHTHOUSE_GET_CONFIG, LIGHTHOUSE_HEARTBEAT, MANAGER_GET_CONFIG} <= paths


def test_messages_carry_the_contract_fields() -> None:
    reply = pb.LighthouseConfigResponse(config_data={"学习率": "0.5"}, version=3, not_modified=False)
    again = pb.LighthouseConfigResponse.FromString(reply.SerializeToString())
    assert dict(again.config_data) == {"学习率": "0.5"} and again.version == 3
    request = pb.ManagerConfigRequest(group_rank=1)
    assert not request.HasField("step")  # step is optional: absent means "current, unpinned"
    request.step = 0
    assert request.HasField("step")
    response = pb.ManagerConfigResponse(config_data={"a": "b"}, version=2, source="cache", pinned=True)
    assert pb.ManagerConfigResponse.FromString(response.SerializeToString()) == response
    status = pb.ManagerStatus(replica_id="g", address="h:1", version=1, requests=5, cache_hits=4, step=9)
    assert pb.LighthouseConfigRequest(replica_id="g", known_version=1, status=status).status.step == 9


@pytest.mark.parametrize(
    ("address", "parsed", "target"),
    [
        ("localhost:29510", ("localhost", 29510), "localhost:29510"),
        ("127.0.0.1:0", ("127.0.0.1", 0), "127.0.0.1:0"),
        ("[::1]:5", ("::1", 5), "[::1]:5"),
        ("[::]:0", ("::", 0), "[::]:0"),
        ("http://h:1", ("h", 1), "h:1"),
        ("HTTP://h:1/", ("h", 1), "h:1"),
        ("https://example.com:443", ("example.com", 443), "example.com:443"),
        ("http://[::1]:8080", ("::1", 8080), "[::1]:8080"),
        ("grpc://h:3", ("h", 3), "h:3"),
        ("dns:///h:4", ("h", 4), "h:4"),
        ("ipv4:1.2.3.4:5", ("1.2.3.4", 5), "1.2.3.4:5"),
        ("ipv6:[::1]:6", ("::1", 6), "[::1]:6"),
        ("  h:7  ", ("h", 7), "h:7"),
        ("h:65535", ("h", 65535), "h:65535"),
        (":29511", ("::", 29511), "[::]:29511"),  # DESIGN.md's ":29511": every interface
        ("http://:5", ("::", 5), "[::]:5"),
    ],
)
def test_parse_address(address: str, parsed: tuple[str, int], target: str) -> None:
    assert parse_address(address) == parsed
    assert grpc_target(address) == target


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("", "expected HOST:PORT"),
        ("hostonly", "expected HOST:PORT"),
        ("::1:5", "IPv6 as [ADDR]:PORT"),
        ("[::1]", "expected [IPv6]:PORT"),
        ("[::1]5", "expected [IPv6]:PORT"),
        ("[::1:5", "expected [IPv6]:PORT"),
        ("h:x", "port 'x' is not a number"),
        ("h:", "is not a number"),
        ("h:70000", "port 70000 out of range"),
        ("h:-1", "out of range"),
    ],
)
def test_parse_address_rejects(address: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_address(address)
    assert message in str(err.value)
    assert repr(address) in str(err.value)  # the message quotes what the user wrote


def test_format_and_dialable_address() -> None:
    assert format_address("::1", 5) == "[::1]:5"
    assert format_address("h", 5) == "h:5"
    assert dialable_address("127.0.0.1:0", 1234) == "127.0.0.1:1234"
    assert dialable_address("[::1]:0", 1234) == "[::1]:1234"
    for wildcard in ("[::]:0", "0.0.0.0:0"):
        host, port = parse_address(dialable_address(wildcard, 99))
        assert port == 99 and host not in ("::", "0.0.0.0")


def test_seconds() -> None:
    assert seconds(None, 5.0) == 5.0
    assert seconds(timedelta(milliseconds=250), 5.0) == 0.25
    assert seconds(2, 5.0) == 2.0 and isinstance(seconds(2, 5.0), float)


def echo_server(bind: str) -> tuple[grpc.Server, int]:
    def handle(request: pb.ManagerConfigRequest, context: grpc.ServicerContext) -> pb.ManagerConfigResponse:
        return pb.ManagerConfigResponse(version=request.group_rank, source="echo")

    handler = grpc.method_handlers_generic_handler(
        "lighthouse_config.ManagerService",
        {
            "GetConfig": grpc.unary_unary_rpc_method_handler(
                handle,
                request_deserializer=pb.ManagerConfigRequest.FromString,
                response_serializer=pb.ManagerConfigResponse.SerializeToString,
            )
        },
    )
    return start_server(bind, [handler], max_workers=2)


@pytest.mark.parametrize("bind", ["127.0.0.1:0", "[::1]:0"])
def test_channel_dials_every_documented_spelling(bind: str) -> None:
    try:
        server, port = echo_server(bind)
    except OSError as exc:  # e.g. no IPv6 loopback: fail, a skip would hide that [v6] went untested
        pytest.fail(f"cannot bind {bind}: {exc}")
    try:
        host, _ = parse_address(bind)
        for address in (format_address(host, port), f"http://{format_address(host, port)}"):
            with make_channel(address) as channel:
                call = channel.unary_unary(
                    MANAGER_GET_CONFIG,
                    request_serializer=pb.ManagerConfigRequest.SerializeToString,
                    response_deserializer=pb.ManagerConfigResponse.FromString,
                )
                reply = call(pb.ManagerConfigRequest(group_rank=7), timeout=10)
                assert (reply.version, reply.source) == (7, "echo")
    finally:
        server.stop(None)


def test_start_server_refuses_a_port_in_use() -> None:
    server, port = echo_server("127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            echo_server(f"127.0.0.1:{port}")
    finally:
        server.stop(None)


def test_start_server_rejects_a_bad_bind() -> None:
    with pytest.raises(ValueError, match="invalid address"):
        echo_server("nonsense")


def test_check_covers_the_seed_descriptor_set(tmp_path: Path) -> None:
    """The seed's proto is compiled to a descriptor set (a private pool), checked like the modules."""
    shutil.copytree(ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "protos" / "torchft_seed.binpb").write_bytes(b"")
    result = run_check(tmp_path)
    assert result.returncode == 1 and "torchft_seed.binpb" in result.stderr
    assert not list((tmp_path / "protos").glob("torchft_seed_pb2*"))  # no module for the default pool
