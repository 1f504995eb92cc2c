"""The seed's wire and spellings: ``torchft.LighthouseService/GetConfig`` called by a client generated
from the seed's own proto, ``--lighthouse_config``, and ``LighthouseServer(..., lighthouse_config=)``."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from lighthouse import LighthouseClient, LighthouseServer
from protos.rpc import make_channel
from protos.torchft_seed import SEED_GET_CONFIG
from tests.http_util import change
from tests.procs import ProcessPool
from tests.seed_proto import seed_modules

FILE = {"learning_rate": 0.001, "batch_size": 64, "model_type": "transformer", "warmup": 1e-7}
AS_STRINGS = {"learning_rate": "0.001", "batch_size": "64", "model_type": "transformer", "warmup": "1e-7"}


def seed_get_config(address: str, job: str | None = None) -> dict[str, str]:
    """GetConfig through the seed's generated stub."""
    pb2, pb2_grpc = seed_modules()
    with make_channel(address) as channel:
        stub = pb2_grpc.LighthouseServiceStub(channel)
        metadata = [("lighthouse-job", job)] if job is not None else None
        reply = stub.GetConfig(pb2.LighthouseConfigRequest(), timeout=10, metadata=metadata)
        return dict(reply.config_data)


def test_the_method_path_is_the_seeds() -> None:
    pb2, _ = seed_modules()
    service = pb2.DESCRIPTOR.services_by_name["LighthouseService"]
    assert f"/{service.full_name}/{service.methods_by_name['GetConfig'].name}" == SEED_GET_CONFIG
    assert [f.name for f in pb2.LighthouseConfigResponse.DESCRIPTOR.fields] == ["config_data"]


def test_seed_client_without_a_file(procs: ProcessPool) -> None:
    lh = procs.lighthouse()
    assert seed_get_config(lh.address) == {}


def test_seed_client_with_a_file_then_a_change(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(FILE))
    lh = procs.lighthouse(extra=["--lighthouse_config", str(path)])
    assert seed_get_config(lh.address) == AS_STRINGS
    result = change(lh.url, "PUT", {"lr": 0.00001, "nested": {"b": 1, "a": 2}})
    assert result.status == 200, result.body
    assert seed_get_config(lh.address) == {"lr": "0.00001", "nested": '{"a":2,"b":1}'}


def test_seed_client_gets_the_empty_config_for_invalid_json(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text('{"learning_rate": "0.001", "batch_size": 32 // invalid comment')
    lh = procs.lighthouse(extra=["--lighthouse_config", str(path)])
    assert seed_get_config(lh.address) == {}


def test_seed_client_names_a_job_in_metadata(procs: ProcessPool) -> None:
    lh = procs.lighthouse()
    assert change(lh.url, "PUT", {"lr": 0.5}, path="api/jobs/j1/config").status == 200
    assert seed_get_config(lh.address, job="j1") == {"lr": "0.5"}
    assert seed_get_config(lh.address) == {}
    with pytest.raises(grpc.RpcError) as err:
        seed_get_config(lh.address, job="no spaces")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_python_api_in_the_seeds_spelling(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(FILE))
    with LighthouseServer(bind="[::]:0", lighthouse_config=path) as lh:
        client = LighthouseClient(lh.address(), connect_timeout=timedelta(seconds=5))
        try:
            assert client.get_config(timeout=timedelta(seconds=5)) == AS_STRINGS
            assert seed_get_config(lh.address()) == AS_STRINGS
            lh.state.change("put", {"lr": 2e-4}, source="api")
            assert client.get_config(timeout=timedelta(seconds=5)) == {"lr": "0.0002"}
            assert seed_get_config(lh.address()) == {"lr": "0.0002"}
        finally:
            client.close()
    with (
        caplog.at_level(logging.INFO, logger="lighthouse.server"),
        LighthouseServer("[::]:0", 1, 100, quorum_tick_ms=100, lighthouse_config=str(path)) as lh,
    ):
        assert seed_get_config(lh.address()) == AS_STRINGS
    assert "ignoring torchft's quorum arguments min_replicas=1, join_timeout_ms=100" in caplog.text
    with pytest.raises(TypeError, match="not both"):
        LighthouseServer(bind="[::]:0", config_path=path, lighthouse_config=path)
