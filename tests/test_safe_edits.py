"""Safe edits with real processes: a JSON Schema checked on every change path, dry runs that store
nothing, schema changes refused while the config violates them, and the seed's value rules."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lighthouse.client import LighthouseClient
from tests import http_util
from tests.helpers_lighthouse import run_cli
from tests.http_util import HttpResult, call
from tests.procs import LighthouseProc, ProcessPool, poll, records_so_far

RELOAD_TIMEOUT = 10.0
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "lr": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "description": "learning rate"},
        "optimizer": {"enum": ["adam", "sgd"], "description": "which optimizer"},
        "batch_size": {"type": "integer", "minimum": 1},
        "momentum": {"type": "number"},
    },
    "required": ["lr", "batch_size"],
    "additionalProperties": False,
    "dependentRequired": {"momentum": ["optimizer"]},
}
GOOD = {"lr": 0.1, "optimizer": "adam", "batch_size": 32}


def _write(path: Path, text: str) -> None:
    """Replace the file at once (the watcher never reads half of it); its mtime always moves."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text, encoding="utf-8")
    st = temp.stat()
    if st.st_mtime_ns <= before:
        os.utime(temp, ns=(st.st_atime_ns, before + 1_000_000_000))
    temp.replace(path)


def _file_error(url: str, fragment: str) -> dict[str, Any]:
    """The live view once its file error mentions ``fragment``."""
    return poll(
        lambda: (v := http_util.live(url))["file"]["error"] and fragment in v["file"]["error"] and v,
        RELOAD_TIMEOUT,
        0.1,
        f"file error with {fragment!r}",
    )


def _start(procs: ProcessPool, tmp_path: Path, config: Any = GOOD, schema: Any = SCHEMA) -> LighthouseProc:
    schema_path = tmp_path / "schema.json"
    schema_path.write_text(json.dumps(schema))
    lh = procs.lighthouse(
        config,
        config_path=tmp_path / "config.json",
        state_dir=tmp_path / "state",
        extra=["--schema", str(schema_path)],
    )
    http_util.wait_healthy(lh.url)
    return lh


def _refused(result: HttpResult, *paths: str) -> list[dict[str, str]]:
    """Assert a 422 naming exactly ``paths``; the violations."""
    assert result.status == 422, (result.status, result.body[:500])
    answer = result.json
    assert "violates the schema" in answer["error"]
    violations: list[dict[str, str]] = answer["violations"]
    assert sorted({v["path"] for v in violations}) == sorted(paths), violations
    assert all(v["message"] for v in violations)
    return violations


def _state(url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The live view (without volatile fields) and the whole history."""
    view = http_util.live(url)
    return {k: view[k] for k in ("version", "config", "scheduled")}, http_util.history(url)


@pytest.mark.slow
def test_every_change_path_is_checked_and_a_worker_never_sees_a_refused_value(
    procs: ProcessPool, tmp_path: Path
) -> None:
    lh = _start(procs, tmp_path)
    assert http_util.live(lh.url)["config"] == GOOD
    manager = procs.manager(lh.address, "g0")
    worker = procs.worker(
        manager.address, group="g0", rank=0, steps=100_000, step_interval=0.02, no_step=True
    )
    before = _state(lh.url)

    # PUT: a number out of range, a value not in the enum, a missing required key, an unknown key.
    bad_put = {"lr": 5, "optimizer": "lamb", "bogus": 1}
    violations = _refused(
        http_util.change(lh.url, "PUT", bad_put), "/lr", "/optimizer", "/batch_size", "/bogus"
    )
    assert any("maximum" in v["message"] for v in violations if v["path"] == "/lr")
    # PATCH: a type error, and a deleted required key.
    _refused(http_util.change(lh.url, "PATCH", {"batch_size": "32"}), "/batch_size")
    _refused(http_util.change(lh.url, "PATCH", {"lr": None}), "/lr")
    _refused(http_util.change(lh.url, "PATCH", {"lr": -1}, if_match=before[0]["version"]), "/lr")
    # Scheduled: checked on the config it produces at its step.
    scheduled = _refused(call(lh.url, "PATCH", "api/config?effective_step=100", {"lr": 2}), "/lr")
    assert "from step 100" in scheduled[0]["message"]
    assert _state(lh.url) == before

    # A scheduled change valid by itself; then an edit made now that is valid now but breaks the
    # config from step 100 on (momentum needs an optimizer, which that change removes).
    ok = call(lh.url, "PATCH", "api/config?effective_step=100", {"optimizer": None})
    assert ok.status == 200, ok.body
    affected = _refused(http_util.change(lh.url, "PATCH", {"momentum": 0.9}), "")
    assert "from step 100" in affected[0]["message"] and "optimizer" in affected[0]["message"]
    cancel = call(lh.url, "DELETE", f"api/config/scheduled/{ok.json['version']}")
    assert cancel.status == 200
    before = _state(lh.url)

    # Rollback to a version the (now stricter) schema refuses.
    relaxed = {**SCHEMA, "properties": {**SCHEMA["properties"], "lr": {"type": "number", "maximum": 10}}}
    assert call(lh.url, "PUT", "api/config/schema", relaxed).status == 200
    high = http_util.change(lh.url, "PATCH", {"lr": 5})
    assert high.status == 200
    assert http_util.change(lh.url, "PATCH", {"lr": 0.2}).status == 200
    assert call(lh.url, "PUT", "api/config/schema", SCHEMA).status == 200
    before = _state(lh.url)
    target = {"version": high.json["version"]}
    _refused(call(lh.url, "POST", "api/config/rollback?dry_run=1", target), "/lr")
    _refused(http_util.change(lh.url, "POST", target, path="api/config/rollback"), "/lr")
    assert _state(lh.url) == before

    # File reload: the violation becomes the file error; the live config stays.
    config_path = tmp_path / "config.json"
    _write(config_path, json.dumps({**GOOD, "lr": 7}))
    view = _file_error(lh.url, "/lr")
    assert str(config_path) in view["file"]["error"]
    assert _state(lh.url) == before
    _write(config_path, json.dumps({**GOOD, "lr": 0.3}))
    poll(lambda: http_util.live(lh.url)["config"]["lr"] == 0.3, RELOAD_TIMEOUT, 0.1, "valid file reloaded")
    assert http_util.live(lh.url)["file"]["error"] is None
    final = http_util.live(lh.url)["version"]

    # The worker kept polling the whole time and saw only accepted configs.
    poll(lambda: any(r["version"] == final for r in records_so_far(worker)), 20, 0.05, "worker sees final")
    worker.stop()
    seen = {r["config"].get("lr") for r in records_so_far(worker) if r["source"] == "lighthouse"}
    assert seen <= {"0.1", "5", "0.2", "0.3"}, seen  # lr=5 was accepted under the relaxed schema
    assert not any("bogus" in r["config"] or "momentum" in r["config"] for r in records_so_far(worker))
    assert all(r["config"].get("lr") not in ("2", "7", "-1") for r in records_so_far(worker))


@pytest.mark.slow
def test_dry_runs_answer_what_the_change_would_do_and_store_nothing(
    procs: ProcessPool, tmp_path: Path
) -> None:
    lh = _start(procs, tmp_path)
    before = _state(lh.url)
    head = before[0]["version"]

    put = call(lh.url, "PUT", "api/config?dry_run=1", {**GOOD, "lr": 0.5, "momentum": 0.9})
    patch = call(lh.url, "PATCH", "api/config?dry_run=1", {"optimizer": None})
    scheduled = call(lh.url, "PATCH", "api/config?dry_run=1&effective_step=500", {"lr": 0.01})
    rollback = call(lh.url, "POST", "api/config/rollback?dry_run=1", {"version": head})
    for answer in (put, patch, scheduled, rollback):
        assert answer.status == 200, answer.body
        assert answer.json["dry_run"] is True and answer.json["version"] == head + 1
    assert put.json["changes"] == {"lr": {"before": 0.1, "after": 0.5}, "momentum": {"after": 0.9}}
    assert put.json["config"] == {**GOOD, "lr": 0.5, "momentum": 0.9}
    assert patch.json["changes"] == {"optimizer": {"before": "adam"}}
    assert scheduled.json["changes"] == {"lr": {"before": 0.1, "after": 0.01}}
    assert scheduled.json["config"] == {**GOOD, "lr": 0.01} and scheduled.json["effective_step"] == 500
    assert scheduled.json["live"] == GOOD and scheduled.json["from_step"] == 500
    assert rollback.json["changes"] == {} and rollback.json["config"] == GOOD
    # Refusals are the same as the real request's.
    _refused(call(lh.url, "PUT", "api/config?dry_run=1", {"lr": 3}), "/lr", "/batch_size")
    _refused(call(lh.url, "PATCH", "api/config?dry_run=1", {"lr": 3}), "/lr")
    stale = call(lh.url, "PATCH", "api/config?dry_run=1", {"lr": 0.2}, headers={"If-Match": str(head - 1)})
    assert stale.status == 409
    assert call(lh.url, "POST", "api/config/rollback?dry_run=1", {"version": 999}).status == 404
    schema_dry = call(lh.url, "PUT", "api/config/schema?dry_run=1", {"type": "object"})
    assert schema_dry.status == 200 and schema_dry.json["dry_run"] is True
    assert _state(lh.url) == before
    assert len(http_util.get_json(lh.url, "api/config/schema/history")["schemas"]) == 1

    # The real request answers what its dry run said.
    real = call(lh.url, "PUT", "api/config", {**GOOD, "lr": 0.5, "momentum": 0.9})
    assert real.status == 200
    for key in ("version", "config", "changes", "op", "effective_step"):
        assert real.json[key] == put.json[key], key
    assert real.json["dry_run"] is False

    # The CLI prints the diff and stores nothing.
    now = http_util.live(lh.url)["version"]
    out = _cli_ok(lh, "set", "lr=0.25", "momentum=null", "--dry-run")
    assert f"would make version {now + 1}" in out and "~ lr: 0.5 -> 0.25" in out
    assert "- momentum: 0.9" in out
    refused = _cli(lh, "set", "lr=9", "--dry-run")
    assert refused.returncode == 1 and "/lr" in refused.stderr and refused.stderr.count("\n") == 1
    load_file = tmp_path / "load.json"
    load_file.write_text(json.dumps({"lr": 0.4, "batch_size": 8}))
    out = _cli_ok(lh, "load", str(load_file), "--dry-run")
    assert "- optimizer" in out and "- momentum: 0.9" in out and "~ batch_size: 32 -> 8" in out
    out = _cli_ok(lh, "rollback", str(head), "--dry-run")
    assert "- momentum: 0.9" in out and "~ lr: 0.5 -> 0.1" in out
    dry_patch = _cli_ok(lh, "set", "optimizer=sgd", "--at-step", "400", "--dry-run")
    assert (
        "(takes effect at step 400 in every group)" in dry_patch
        and '~ optimizer: "adam" -> "sgd"' in dry_patch
    )
    assert http_util.live(lh.url)["version"] == now
    assert _cli_ok(lh, "set", "lr=0.25") == f"version {now + 1}\n"


def test_schema_changes_are_checked_kept_in_a_history_and_watched(procs: ProcessPool, tmp_path: Path) -> None:
    lh = _start(procs, tmp_path)
    described = http_util.get_json(lh.url, "api/config/schema")
    assert described["schema"] == SCHEMA and described["source"] == "file"

    # The live config violates it: refused, unless forced.
    strict = {**SCHEMA, "properties": {**SCHEMA["properties"], "lr": {"type": "number", "maximum": 0.01}}}
    _refused(call(lh.url, "PUT", "api/config/schema", strict), "/lr")
    assert http_util.get_json(lh.url, "api/config/schema")["schema"] == SCHEMA
    # A pending scheduled change that violates it: refused too.
    assert call(lh.url, "PATCH", "api/config?effective_step=300", {"optimizer": "sgd"}).status == 200
    adam_only = {**SCHEMA, "properties": {**SCHEMA["properties"], "optimizer": {"enum": ["adam"]}}}
    pending = _refused(call(lh.url, "PUT", "api/config/schema", adam_only), "/optimizer")
    assert "from step 300" in pending[0]["message"]
    # Not a schema at all: 400 saying where.
    invalid = call(lh.url, "PUT", "api/config/schema", {"type": "nonsense"})
    assert invalid.status == 400 and "not a valid JSON Schema" in invalid.error
    assert (
        call(
            lh.url, "PUT", "api/config/schema", {"$schema": "http://json-schema.org/draft-07/schema#"}
        ).status
        == 400
    )

    forced = call(lh.url, "PUT", "api/config/schema?force=1", strict, headers={"X-Author": "alice"})
    assert forced.status == 200 and {v["path"] for v in forced.json["violations"]} == {"/lr"}
    history = http_util.get_json(lh.url, "api/config/schema/history")["schemas"]
    assert [(h["source"], h["author"]) for h in history] == [("api", "alice"), ("file", "-")]
    assert history[0]["schema"] == strict and history[0]["created_at"] >= history[1]["created_at"]

    # The schema file is watched: an invalid edit is a file error, a valid one the new schema.
    schema_path = tmp_path / "schema.json"
    _write(schema_path, '{"type": 12}')
    view = _file_error(lh.url, str(schema_path))
    assert "not a valid JSON Schema" in view["file"]["error"]
    assert http_util.get_json(lh.url, "api/config/schema")["schema"] == strict
    _write(schema_path, json.dumps({"type": "object", "required": ["lr"]}))
    poll(
        lambda: (
            http_util.get_json(lh.url, "api/config/schema")["schema"]
            == {"type": "object", "required": ["lr"]}
        ),
        RELOAD_TIMEOUT,
        0.1,
        "schema file reloaded",
    )
    assert http_util.live(lh.url)["file"]["error"] is None
    assert call(lh.url, "DELETE", "api/config/schema").status == 200
    assert http_util.change(lh.url, "PATCH", {"anything": "goes"}).status == 200


def test_a_schema_and_config_edited_together_load_at_startup(procs: ProcessPool, tmp_path: Path) -> None:
    """A fresh job starts on a config file the schema accepts; a file it refuses is the file error."""
    lh = _start(procs, tmp_path)
    assert http_util.live(lh.url)["config"] == GOOD
    procs.stop_all()
    lh = _start(procs, tmp_path, config={"lr": 0.1}, schema={**SCHEMA, "required": ["lr"]})
    view = http_util.live(lh.url)
    assert view["config"] == {"lr": 0.1} and view["file"]["error"] is None
    procs.stop_all()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    lh = _start(procs, fresh, config={"lr": 3, "batch_size": 1})
    view = http_util.live(lh.url)
    assert view["version"] == 0 and "/lr" in view["file"]["error"]


def test_config_file_null_nested_and_unicode_values_are_served_by_the_value_rules(
    procs: ProcessPool, tmp_path: Path
) -> None:
    text = (
        '{"gone": null, "nested": {"a": [1, null, {"ключ": "値"}], "b": true}, "émoji🚀": "✓",'
        ' "text_null": "null", "n": 0.001, "list": []}'
    )
    lh = procs.lighthouse(text)
    view = http_util.live(lh.url)
    assert view["version"] == 1 and view["file"]["error"] is None, "a null key must not empty the config"
    assert view["config"] == json.loads(text)
    with LighthouseClient(lh.address) as client:
        assert client.get_config(timeout=5) == {
            "gone": "null",
            "nested": '{"a":[1,null,{"ключ":"値"}],"b":true}',
            "émoji🚀": "✓",
            "text_null": "null",
            "n": "0.001",
            "list": "[]",
        }
    # PUT: null is a value; PATCH: null deletes the key.
    assert http_util.change(lh.url, "PUT", {"x": None, "y": 1}).status == 200
    assert http_util.live(lh.url)["config"] == {"x": None, "y": 1}
    assert http_util.change(lh.url, "PATCH", {"x": None}).status == 200
    assert http_util.live(lh.url)["config"] == {"y": 1}
    with LighthouseClient(lh.address) as client:
        assert client.get_config(timeout=5) == {"y": "1"}
    # A problem with one key names that key.
    bad = http_util.change(lh.url, "PUT", {"ok": 1, "k" * 300: 2})
    assert bad.status == 400 and "kkkk" in bad.error


def _cli(lh: LighthouseProc, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("config", *args, "--url", lh.url)


def _cli_ok(lh: LighthouseProc, *args: str) -> str:
    result = _cli(lh, *args)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return result.stdout


@pytest.mark.parametrize("document", [[1], "text", {"type": "object", "$defs": {"x": {"minimum": "a"}}}])
def test_a_bad_schema_file_at_startup_is_a_file_error(
    procs: ProcessPool, tmp_path: Path, document: Any
) -> None:
    lh = _start(procs, tmp_path, schema=document)
    view = http_util.live(lh.url)
    assert view["config"] == GOOD and "schema.json" in view["file"]["error"]
    assert http_util.get_json(lh.url, "api/config/schema")["schema"] is None


def test_schema_cli(procs: ProcessPool, tmp_path: Path) -> None:
    lh = _start(procs, tmp_path)
    assert json.loads(_cli_ok(lh, "schema", "show", "-o", "json"))["schema"] == SCHEMA
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({**SCHEMA, "properties": {**SCHEMA["properties"], "lr": {"maximum": 0.01}}}))
    refused = _cli(lh, "schema", "set", str(strict))
    assert refused.returncode == 1 and "/lr" in refused.stderr and refused.stderr.count("\n") == 1
    out = _cli_ok(lh, "schema", "set", str(strict), "--force", "--dry-run")
    assert "violated (forced): /lr" in out and "nothing stored" in out
    assert len(json.loads(_cli_ok(lh, "schema", "history", "-o", "json"))["schemas"]) == 1
    assert _cli_ok(lh, "schema", "set", str(strict), "--force").endswith("schema set\n")
    history = json.loads(_cli_ok(lh, "schema", "history", "-o", "json"))["schemas"]
    assert [h["comment"] for h in history] == [str(strict), str(tmp_path / "schema.json")]
    not_json = tmp_path / "bad.json"
    not_json.write_text("{")
    assert "not valid JSON" in _cli(lh, "schema", "set", str(not_json)).stderr


def test_a_bare_dry_run_flag_is_a_dry_run_and_a_bad_one_is_refused(
    procs: ProcessPool, tmp_path: Path
) -> None:
    lh = _start(procs, tmp_path)
    before = _state(lh.url)
    assert call(lh.url, "PATCH", "api/config?dry_run", {"lr": 0.2}).json["dry_run"] is True
    bad = call(lh.url, "PATCH", "api/config?dry_run=maybe", {"lr": 0.2})
    assert bad.status == 400 and "dry_run" in bad.error
    assert _state(lh.url) == before
