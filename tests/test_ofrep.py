"""OFREP on the lighthouse's HTTP port (issue 38, item 2), against a real ``lighthouse serve``: read
through the OpenFeature SDK with the ``openfeature-provider-ofrep`` package (a client we did not
write), and raw: bulk ETags, jobs, the Host check, malformed requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openfeature import api
from openfeature.contrib.provider.ofrep import OFREPProvider
from openfeature.evaluation_context import EvaluationContext
from openfeature.exception import ErrorCode
from openfeature.provider.no_op_provider import NoOpProvider

from tests.http_util import HttpResult, call, change, get_json
from tests.procs import LighthouseProc, ProcessPool

CONFIG: dict[str, Any] = {
    "enabled": True,
    "batch": 32,
    "lr": 0.001,
    "name": "base",
    "nested": {"a": [1, 2]},
    "unset": None,
}
TEAM_TOKEN = "team-editor-token"
FLAGS = "ofrep/v1/evaluate/flags"
DOMAIN = "lighthouse-ofrep-test"  # this module's provider, apart from any other test's


@pytest.fixture(scope="module")
def lh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LighthouseProc]:
    """One lighthouse for the module: the job ``default`` from a file, the job ``team`` editable
    only with its token (``--tokens``)."""
    home = tmp_path_factory.mktemp("ofrep")
    tokens = home / "tokens.json"
    tokens.write_text(json.dumps({"team": [TEAM_TOKEN]}))
    pool = ProcessPool(home)
    try:
        proc = pool.lighthouse(CONFIG, extra=["--tokens", str(tokens)])
        created = call(
            proc.url,
            "PUT",
            "api/jobs/team/config",
            {"lr": 0.5},
            headers={"Authorization": f"Bearer {TEAM_TOKEN}"},
        )
        assert created.status == 200, created.body
        yield proc
        assert "Traceback" not in _log(proc)
    finally:
        pool.stop_all()


@pytest.fixture
def client(lh: LighthouseProc) -> Iterator[Any]:
    api.set_provider(OFREPProvider(lh.url, timeout=10.0), DOMAIN)
    try:
        yield api.get_client(DOMAIN)
    finally:
        api.set_provider(NoOpProvider(), DOMAIN)


def _log(proc: LighthouseProc) -> str:
    assert proc.stderr_path is not None
    return Path(proc.stderr_path).read_text(errors="replace")


def head(lh: LighthouseProc, job: str = "default") -> int:
    path = "api/config" if job == "default" else f"api/jobs/{job}/config"
    version: int = get_json(lh.url, path)["version"]
    return version


def ofrep(
    lh: LighthouseProc, key: str | None, body: Any = None, headers: dict[str, str] | None = None, **kw: Any
) -> HttpResult:
    """POST one flag's (``key``) or every flag's (None) evaluation."""
    path = FLAGS if key is None else f"{FLAGS}/{key}"
    return call(lh.url, "POST", path, {"context": {}} if body is None else body, headers=headers, **kw)


def test_openfeature_sdk_reads_config_keys_as_flags(lh: LighthouseProc, client: Any) -> None:
    version = head(lh)
    expected = {"version": version, "job": "default"}
    for details in (
        client.get_boolean_details("enabled", False),
        client.get_integer_details("batch", 0),
        client.get_float_details("lr", 1.0),
        client.get_string_details("name", ""),
        client.get_object_details("nested", {}),
    ):
        assert details.error_code is None, details
        assert details.value == CONFIG[details.flag_key]
        assert (details.variant, details.reason, details.flag_metadata) == (str(version), "STATIC", expected)

    missing = client.get_float_details("momentum", 0.9)
    assert (missing.value, missing.error_code) == (0.9, ErrorCode.FLAG_NOT_FOUND)
    assert "momentum" in str(missing.error_message)
    # OFREP sends no type: the provider finds a float asked for as a bool.
    wrong = client.get_boolean_details("lr", False)
    assert (wrong.value, wrong.error_code) == (False, ErrorCode.TYPE_MISMATCH)
    # A null is OFREP's code-default flag: the caller's default, no error.
    unset = client.get_string_details("unset", "fallback")
    assert (unset.value, unset.error_code, unset.variant) == ("fallback", None, str(version))

    patched = change(lh.url, "PATCH", {"lr": 0.002})
    assert patched.status == 200, patched.body
    after = client.get_float_details("lr", 1.0)
    assert (after.value, after.variant) == (0.002, str(patched.json["version"]))
    assert patched.json["version"] > version


def test_step_in_the_context_reads_the_config_that_step_trains(lh: LighthouseProc, client: Any) -> None:
    before = client.get_float_details("lr", 1.0)
    scheduled = change(lh.url, "PATCH", {"lr": 0.004}, path="api/config?effective_step=1000")
    assert scheduled.status == 200, scheduled.body
    version = scheduled.json["version"]

    def at(step: int | None) -> Any:
        attributes = {} if step is None else {"step": step}
        return client.get_float_details("lr", 1.0, EvaluationContext(attributes=attributes))

    assert (at(999).value, at(999).variant) == (before.value, before.variant)  # the version it holds from
    assert (at(1000).value, at(1000).variant) == (0.004, str(version))
    assert at(1000).flag_metadata == {"job": "default", "version": version, "step": 1000}
    assert (at(None).value, at(None).variant) == (0.004, str(version))  # no step: the head's config
    assert get_json(lh.url, "api/config/at-step/999")["config"]["lr"] == before.value  # as the API says


def test_bulk_evaluation_has_an_etag_that_changes_with_the_config(lh: LighthouseProc) -> None:
    first = ofrep(lh, None)
    assert first.status == 200, first.body
    version = head(lh)
    flags = {flag["key"]: flag for flag in first.json["flags"]}
    assert set(flags) == set(get_json(lh.url, "api/config")["config"])
    assert flags["batch"] == {
        "key": "batch",
        "value": 32,
        "reason": "STATIC",
        "variant": str(version),
        "metadata": {"job": "default", "version": version},
    }
    assert "value" not in flags["unset"]  # null: the code default
    assert first.json["metadata"] == {"job": "default", "version": version}
    etag = first.headers["etag"]
    assert etag.startswith('"') and etag.endswith('"')

    # An empty body is no context: the same answer.
    assert call(lh.url, "POST", FLAGS, content_type=None).headers["etag"] == etag
    for held in (etag, f"W/{etag}", f'"other", {etag}', "*"):
        unchanged = ofrep(lh, None, headers={"If-None-Match": held})
        assert (unchanged.status, unchanged.body, unchanged.headers["etag"]) == (304, b"", etag), held
    assert ofrep(lh, None, headers={"If-None-Match": '"other"'}).status == 200
    at_step = ofrep(lh, None, {"context": {"step": 5}})
    assert at_step.status == 200 and at_step.headers["etag"] != etag

    patched = change(lh.url, "PATCH", {"batch": 64})
    assert patched.status == 200, patched.body
    changed = ofrep(lh, None, headers={"If-None-Match": etag})
    assert changed.status == 200
    assert changed.headers["etag"] != etag
    batch = next(flag for flag in changed.json["flags"] if flag["key"] == "batch")
    assert (batch["value"], batch["variant"]) == (64, str(patched.json["version"]))
    again = ofrep(lh, None, headers={"If-None-Match": changed.headers["etag"]})
    assert again.status == 304


def test_the_job_is_the_targeting_key_and_ofrep_is_read_only(lh: LighthouseProc, client: Any) -> None:
    team = head(lh, "team")
    # The job "team" needs a token to change, not to read (reads are open, as GET /api/config is).
    details = client.get_float_details("lr", 1.0, EvaluationContext(targeting_key="team"))
    assert (details.value, details.variant, details.error_code) == (0.5, str(team), None)
    assert details.flag_metadata == {"job": "team", "version": team}
    by_header = ofrep(lh, "lr", headers={"X-Lighthouse-Job": "team"})
    assert (by_header.status, by_header.json["value"]) == (200, 0.5)
    both = ofrep(lh, "lr", {"context": {"targetingKey": "team"}}, headers={"X-Lighthouse-Job": "team"})
    assert both.json["value"] == 0.5
    bulk = ofrep(lh, None, {"context": {"targetingKey": "team"}})
    assert [flag["key"] for flag in bulk.json["flags"]] == ["lr"]

    unknown = client.get_float_details("lr", 1.0, EvaluationContext(targeting_key="nobody"))
    assert (unknown.value, unknown.error_code) == (1.0, ErrorCode.INVALID_CONTEXT)
    assert "no job 'nobody'" in str(unknown.error_message)
    for body, headers in (
        ({"context": {"targetingKey": "nobody"}}, {}),
        ({"context": {"targetingKey": "bad/id!"}}, {}),
        ({"context": {"targetingKey": 7}}, {}),
        ({"context": {"targetingKey": "team"}}, {"X-Lighthouse-Job": "default"}),
    ):
        refused = ofrep(lh, "lr", body, headers)
        assert (refused.status, refused.json["errorCode"], refused.json["key"]) == (
            400,
            "INVALID_CONTEXT",
            "lr",
        )
        bulk_refused = ofrep(lh, None, body, headers)
        assert (bulk_refused.status, bulk_refused.json["errorCode"]) == (400, "INVALID_CONTEXT")
        assert "key" not in bulk_refused.json

    # Nothing an OFREP request says changes a config: a value in the body, another method.
    sneaky = ofrep(lh, "lr", {"context": {"targetingKey": "team"}, "value": 9, "lr": 9})
    assert (sneaky.status, sneaky.json["value"]) == (200, 0.5)
    for method in ("PUT", "PATCH", "DELETE"):
        refused = call(lh.url, method, f"{FLAGS}/lr", {"lr": 9}, headers={"X-Lighthouse-Job": "team"})
        assert refused.status == 405 and refused.headers["allow"] == "POST", method
    assert head(lh, "team") == team
    assert get_json(lh.url, "api/jobs/team/config")["config"] == {"lr": 0.5}
    # ... while changing it through the admin API needs the token.
    assert change(lh.url, "PATCH", {"lr": 9}, path="api/jobs/team/config").status == 401


def test_a_foreign_host_is_refused_as_on_every_read(lh: LighthouseProc) -> None:
    evil = {"Host": "evil.example"}
    assert call(lh.url, "GET", "api/config", headers=evil).status == 403
    for key in ("lr", None):
        refused = ofrep(lh, key, headers=evil)
        assert refused.status == 403
        assert refused.json["errorCode"] == "GENERAL"
        assert "DNS rebinding" in refused.json["errorDetails"]
        # A token of this lighthouse is what a rebound page lacks: with one, the read is answered.
        assert ofrep(lh, key, headers={**evil, "Authorization": f"Bearer {TEAM_TOKEN}"}).status == 200
        assert ofrep(lh, key, headers={**evil, "Authorization": "Bearer wrong"}).status == 403
    assert ofrep(lh, "lr", headers={"Host": f"localhost:{lh.url.rsplit(':', 1)[1].strip('/')}"}).status == 200


def test_malformed_requests_get_ofrep_errors_and_change_nothing(lh: LighthouseProc) -> None:
    version, config = head(lh), get_json(lh.url, "api/config")["config"]
    huge = b'{"context": {"x": "' + b"a" * (1024 * 1024) + b'"}}'
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"raw": b'{"context": {'}, "PARSE_ERROR", "not valid JSON"),
        ({"raw": b"\xff\xfe"}, "PARSE_ERROR", "UTF-8"),
        ({"raw": huge}, "PARSE_ERROR", "max 1048576"),
        ({"raw": b"[1, 2]"}, "PARSE_ERROR", "JSON object"),
        ({"raw": b"{}", "content_type": "text/plain"}, "PARSE_ERROR", "Content-Type"),
        ({"body": {"context": "default"}}, "INVALID_CONTEXT", "context must be a JSON object"),
        ({"body": {"context": [1]}}, "INVALID_CONTEXT", "context must be a JSON object"),
        ({"body": {"context": {"step": "7"}}}, "INVALID_CONTEXT", "step must be an integer"),
        ({"body": {"context": {"step": -1}}}, "INVALID_CONTEXT", "step must be an integer"),
        ({"body": {"context": {"step": True}}}, "INVALID_CONTEXT", "step must be an integer"),
    ]
    for key in ("lr", None):
        path = FLAGS if key is None else f"{FLAGS}/{key}"
        for kwargs, code, words in cases:
            answer = call(lh.url, "POST", path, **kwargs)
            assert answer.status == 400, (kwargs.get("body"), answer.body[:200])
            assert answer.json["errorCode"] == code
            assert words in answer.json["errorDetails"], answer.json
            assert answer.json.get("key") == key
    assert head(lh) == version
    assert get_json(lh.url, "api/config")["config"] == config
    assert "Traceback" not in _log(lh)
