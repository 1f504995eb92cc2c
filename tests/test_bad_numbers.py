"""Numbers and shapes no store or answer can hold (issue 26 item 4), against real lighthouses.

``1e999``, integers past Python's digit limit, lone surrogates and nesting past
MAX_JSON_DEPTH are refused with 400 naming the key, the live config unchanged;
every answer is strict JSON; history answers stop at a byte budget and page.
"""

from __future__ import annotations

import json
import re
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from lighthouse.client import LighthouseClient
from lighthouse.config.values import MAX_JSON_DEPTH
from lighthouse.jobs.versions import ConfigStore
from lighthouse.store.sqlite import STORE_FILE, SqliteBackend
from lighthouse.web.routes import MAX_HISTORY_BYTES
from protos import lighthouse_config_pb2 as pb
from protos.metrics import pack
from tests.helpers_lighthouse import run_cli
from tests.http_util import HttpResult, call
from tests.procs import LighthouseProc, ProcessPool
from tests.store_edits import commit

START = {"lr": 0.1, "name": "start"}
DIGITS = sys.get_int_max_str_digits() + 1  # 4,301 with Python's default limit


def strict(body: bytes) -> Any:
    """The body as JSON, refusing NaN, Infinity and -Infinity (Python's json takes them)."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in an answer: {body[:300]!r}")

    return json.loads(body, parse_constant=refuse)


def send(lh: LighthouseProc, method: str, path: str, raw: str) -> HttpResult:
    """``raw`` as the body exactly (json.dumps could not write 1e999 or a lone surrogate)."""
    return call(lh.url, method, path, raw=raw.encode("utf-8", "surrogatepass"))


def get(lh: LighthouseProc, path: str) -> Any:
    res = call(lh.url, "GET", path)
    assert res.status == 200, (path, res.status, res.body[:300])
    return strict(res.body)


def nested(levels: int) -> str:
    """A config whose key ``deep`` makes it ``levels`` containers deep (the object counts 1)."""
    return '{"lr": 1, "deep": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}"


BAD_BODIES = [
    pytest.param('{"lr": 0.2, "big": 1e999}', "'big'", "out of range", id="1e999"),
    pytest.param('{"lr": 0.2, "big": -1e999}', "'big'", "out of range", id="-1e999"),
    pytest.param('{"lr": 0.2, "big": {"x": [1, 2e400]}}', "'big'", "out of range", id="nested-1e999"),
    pytest.param('{"lr": 0.2, "huge": ' + "7" * DIGITS + "}", "'huge'", f"{DIGITS} digits", id="digits"),
    pytest.param('{"lr": 0.2, "huge": -' + "7" * DIGITS + "}", "'huge'", f"{DIGITS} digits", id="-digits"),
    pytest.param('{"lr": 0.2, "huge": ' + "1" * 5001 + "}", "'huge'", "5001 digits", id="5001-digits"),
    pytest.param('{"lr": 0.2, "s": "a\\ud800b"}', "'s'", "lone surrogate", id="surrogate-value"),
    pytest.param('{"lr": 0.2, "s": ["\\udfff"]}', "'s'", "lone surrogate", id="surrogate-in-array"),
    pytest.param('{"lr": 0.2, "\\ud800": 1}', "'\\ud800'", "lone surrogate", id="surrogate-key"),
    pytest.param('{"lr": 0.2, "o": {"\\udc00": 1}}', "'o'", "lone surrogate", id="surrogate-inner-key"),
    pytest.param(nested(MAX_JSON_DEPTH + 1), "'deep'", "nested too deeply", id="depth"),
]


@pytest.mark.parametrize(("body", "key", "why"), BAD_BODIES)
def test_a_body_no_store_can_hold_is_a_400_naming_the_key(
    procs: ProcessPool, body: str, key: str, why: str
) -> None:
    lh = procs.lighthouse(START)
    before = get(lh, "/api/config")
    for method, path in [("PUT", "/api/config"), ("PATCH", "/api/config"), ("PUT", "/api/jobs/other/config")]:
        res = send(lh, method, path, body)
        assert res.status == 400, (method, path, res.status, res.body[:300])
        error = strict(res.body)["error"]
        assert key in error and why in error, error
    after = get(lh, "/api/config")
    assert (after["version"], after["config"]) == (before["version"], before["config"]) == (1, START)
    assert [v["version"] for v in get(lh, "/api/config/history")["versions"]] == [1]
    assert "Traceback" not in lh.stderr()


def test_numbers_at_the_limits_are_stored_as_written(procs: ProcessPool) -> None:
    lh = procs.lighthouse(START)
    longest = "9" * (DIGITS - 1)
    body = '{"lr": 1.7976931348623157e308, "low": -1.7976931348623157e308, "long": ' + longest + "}"
    assert send(lh, "PUT", "/api/config", body).status == 200
    config = strict(call(lh.url, "GET", "/api/config").body)["config"]
    assert config == {"lr": 1.7976931348623157e308, "low": -1.7976931348623157e308, "long": int(longest)}
    with LighthouseClient(lh.address) as client:
        served = client.get_config(timeout=10)
    assert served["long"] == longest and served["lr"] == "1.7976931348623157e308"


def test_a_schema_no_store_can_hold_is_a_400_naming_the_key(procs: ProcessPool) -> None:
    lh = procs.lighthouse(START)
    schema = '{"type": "object", "properties": {"lr": {"type": "number", "maximum": 1e999}}}'
    res = send(lh, "PUT", "/api/config/schema", schema)
    assert res.status == 400, res.body[:300]
    assert "'properties'" in strict(res.body)["error"]
    assert get(lh, "/api/config/schema") == {"schema": None}


def test_the_cli_refuses_1e999_naming_the_key(procs: ProcessPool, tmp_path: Path) -> None:
    lh = procs.lighthouse(START)
    config_file = tmp_path / "big.json"
    config_file.write_text('{"lr": 0.2, "big": 1e999}')
    schema_file = tmp_path / "schema.json"
    schema_file.write_text('{"type": "object", "maxProperties": 1e999}')
    for args in (
        ["config", "set", "lr=0.2", "big=1e999"],
        ["config", "set", "big=-1e999"],
        ["config", "load", str(config_file)],
        ["config", "schema", "set", str(schema_file)],
    ):
        result = run_cli(*args, "--url", lh.url)
        assert result.returncode != 0, (args, result.stdout)
        assert re.search(r"'(big|maxProperties)'.*out of range", result.stderr), (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert get(lh, "/api/config")["config"] == START
    assert get(lh, "/api/config/schema") == {"schema": None}
    # A value that is not JSON at all is still a string, as before.
    assert run_cli("config", "set", "name=1e999x", "--url", lh.url).returncode == 0
    assert get(lh, "/api/config")["config"] == {**START, "name": "1e999x"}


def test_a_config_file_with_1e999_is_not_loaded_and_says_which_key(procs: ProcessPool) -> None:
    lh = procs.lighthouse('{"lr": 0.1, "big": 1e999}')
    view = get(lh, "/api/config")
    assert view["config"] == {} and view["version"] == 0
    error = view["file"]["error"]
    assert "'big'" in error and "out of range" in error, error


def test_nesting_up_to_the_limit_is_stored_and_the_pages_carry_the_limit(procs: ProcessPool) -> None:
    lh = procs.lighthouse(START)
    res = send(lh, "PUT", "/api/config", nested(MAX_JSON_DEPTH))
    assert res.status == 200, res.body[:300]
    assert get(lh, "/api/config")["config"]["deep"] == json.loads(nested(MAX_JSON_DEPTH))["deep"]
    for page in ("/", "/config", "/jobs/default", "/jobs/default/config"):
        html = call(lh.url, "GET", page).body.decode()
        assert f'data-max-json-depth="{MAX_JSON_DEPTH}"' in html, page
        assert "{{" not in html, page


@pytest.mark.slow
def test_the_editor_shows_a_config_at_the_limit_and_refuses_one_level_more(
    procs: ProcessPool, page: Page
) -> None:
    lh = procs.lighthouse(START)
    assert send(lh, "PUT", "/api/config", nested(MAX_JSON_DEPTH)).status == 200
    page.goto(lh.url + "config")
    expect(page.locator("#loaded-version")).to_have_text("v2")  # the answers holding it parsed
    assert '"deep"' in page.input_value("#editor")
    expect(page.locator("#history tr[data-version='2']")).to_have_count(1)
    page.fill("#editor", nested(MAX_JSON_DEPTH + 1))
    expect(page.locator("#validation")).to_contain_text(f"nested too deeply (max {MAX_JSON_DEPTH} levels)")
    expect(page.locator("#save")).to_be_disabled()
    page.fill("#editor", nested(MAX_JSON_DEPTH))
    expect(page.locator("#validation")).not_to_contain_text("nested")


def test_every_answer_is_strict_json_also_with_non_finite_reports(procs: ProcessPool) -> None:
    lh = procs.lighthouse(START)
    # A replica whose batch says its sums are infinite and its extremes NaN (only a malformed or
    # overflowing report does): the series must still answer JSON, the marks counted.
    steps = array("q", [5, 6])
    inf, nan = float("inf"), float("nan")
    loss = pb.MetricSummaries(
        name="loss",
        steps=pack(steps),
        count=pack(array("I", [2, 2])),
        nonfinite=pack(array("I", [0, 2])),
        sum=pack(array("d", [inf, nan])),
        min=pack(array("d", [-inf, nan])),
        max=pack(array("d", [inf, nan])),
    )
    status = pb.ManagerStatus(replica_id="g0", step=6, metrics=[loss], metrics_batch=1)
    with LighthouseClient(lh.address) as client:
        # Served a config first, as a manager is: a replica never served one reports no metrics.
        client.fetch(pb.LighthouseConfigRequest(status=pb.ManagerStatus(replica_id="g0", step=4)), timeout=10)
        client.heartbeat(status, timeout=10)
    for bad in ('{"big": 1e999}', '{"s": "\\ud800"}'):
        assert send(lh, "PUT", "/api/config", bad).status == 400
    metrics = get(lh, "/api/metrics")
    points = {p["step"]: p for p in metrics["metrics"]["loss"]}
    assert [points[s]["nonfinite"] for s in (5, 6)] == [0, 2]  # the chart's red marks: step 6
    assert all(points[s][k] is None for s in (5, 6) for k in ("mean", "min", "max")), points
    for path in (
        "/api/config",
        "/api/config/history",
        "/api/config/timeline",
        "/api/config/scheduled",
        "/api/config/guards",
        "/api/config/schema",
        "/api/managers",
        "/api/metrics?groups=1",
        "/api/jobs",
        "/api/jobs/default",
        "/healthz",
    ):
        get(lh, path)


def test_a_version_stored_before_numbers_were_checked_is_answered_as_strict_json(
    procs: ProcessPool, tmp_path: Path
) -> None:
    """Such a version stays in the history: its infinity is answered as the string "Infinity"."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    backend = SqliteBackend(state_dir / STORE_FILE)
    store = ConfigStore(backend)
    commit(store, "put", {"lr": 0.1, "big": float("inf"), "low": [float("-inf")]}, source="api")
    store.close()
    backend.close()
    lh = procs.lighthouse(state_dir=state_dir)
    expected = {"lr": 0.1, "big": "Infinity", "low": ["-Infinity"]}
    assert get(lh, "/api/config")["config"] == expected
    assert get(lh, "/api/config/history")["versions"][0]["config"] == expected


def test_history_of_a_big_config_pages_within_the_byte_budget(procs: ProcessPool) -> None:
    lh = procs.lighthouse(START)
    blob = "x" * 900_000
    for i in range(5):  # each entry holds the config and the change: about 1.8 MB
        res = send(lh, "PUT", "/api/config", json.dumps({"blob": blob, "i": i}))
        assert res.status == 200, res.body[:300]
    versions = list(range(6, 0, -1))

    seen: list[int] = []
    path = "/api/config/history?limit=100000"
    while True:
        res = call(lh.url, "GET", path)
        assert res.status == 200 and len(res.body) <= MAX_HISTORY_BYTES, (path, len(res.body))
        answer = strict(res.body)
        seen += [v["version"] for v in answer["versions"]]
        if "next_before" not in answer:
            assert "truncated" not in answer
            break
        assert answer["truncated"] is True and answer["next_before"] == seen[-1]
        assert len(seen) < len(versions)
        path = f"/api/config/history?limit=100000&before={answer['next_before']}"
    assert seen == versions

    # The feed (after=V, what `config watch` follows) pages too, oldest first.
    fed: list[int] = []
    after = 0
    while True:
        res = call(lh.url, "GET", f"/api/config/history?after={after}&limit=100000")
        assert res.status == 200 and len(res.body) <= MAX_HISTORY_BYTES, len(res.body)
        answer = strict(res.body)
        fed += [v["version"] for v in answer["versions"]]
        if "next_after" not in answer:
            break
        after = answer["next_after"]
    assert fed == versions[::-1]

    # A page the limit ends names the next one too, and before and after do not mix.
    small = get(lh, "/api/config/history?limit=1")
    assert [v["version"] for v in small["versions"]] == [6] and small["next_before"] == 6
    assert "truncated" not in small
    assert call(lh.url, "GET", "/api/config/history?after=1&before=3").status == 400

    # The CLI asks for as many pages as its --limit needs.
    result = run_cli("config", "history", "--limit", "6", "-o", "json", "--url", lh.url, timeout=60)
    assert result.returncode == 0, result.stderr
    assert [v["version"] for v in json.loads(result.stdout)["versions"]] == versions
    table = run_cli("config", "history", "--limit", "6", "--url", lh.url, timeout=60)
    assert table.returncode == 0, table.stderr
    heads = [line.split()[0] for line in table.stdout.splitlines() if line and not line[0].isspace()]
    assert heads == [str(v) for v in versions], heads


def test_the_editor_pages_a_big_history(procs: ProcessPool, page: Page) -> None:
    lh = procs.lighthouse(START)
    for i in range(3):
        assert send(lh, "PUT", "/api/config", json.dumps({"blob": "y" * 900_000, "i": i})).status == 200
    page.goto(lh.url + "config")
    rows = page.locator("#history tr[data-version]")
    expect(rows).to_have_count(2)  # versions 4 and 3 fill the first page
    page.click("[data-testid=history-older]")
    expect(rows).to_have_count(4)
    assert [rows.nth(i).get_attribute("data-version") for i in range(4)] == ["4", "3", "2", "1"]
    expect(page.locator("[data-testid=history-older]")).to_have_count(0)
