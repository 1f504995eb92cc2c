"""No typo can brick a job: a change of a key's JSON type is refused (422 naming key and types)
unless asked for, on every path an operator changes a config by, with no schema in force."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests import http_util
from tests.helpers_lighthouse import run_cli
from tests.procs import ProcessPool, poll

START = {"lr": 0.1, "batch_size": 32, "name": "run-a", "warmup": None}


def _write(path: Path, text: str) -> None:
    """Replace the file at once, its mtime always moving (the watcher sees every write)."""
    before = path.stat().st_mtime_ns
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text, encoding="utf-8")
    st = temp.stat()
    if st.st_mtime_ns <= before:
        os.utime(temp, ns=(st.st_atime_ns, before + 1_000_000_000))
    temp.replace(path)


def test_config_set_of_a_mistyped_number_is_refused_and_allowed_when_explicit(
    procs: ProcessPool, tmp_path: Path
) -> None:
    lh = procs.lighthouse(START)
    http_util.wait_healthy(lh.url)
    before = http_util.live(lh.url)

    refused = run_cli("config", "set", "lr=0.0.1", "--url", lh.url)
    assert refused.returncode != 0, refused.stdout
    assert "lr: number -> string" in refused.stderr, refused.stderr
    assert "--allow-type-change" in refused.stderr
    # The typo is named before it is sent: one warning line saying what it is stored as.
    warnings = [line for line in refused.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "stored as the string '0.0.1'" in warnings[0], refused.stderr
    after = http_util.live(lh.url)
    assert (after["version"], after["config"]) == (before["version"], before["config"])

    allowed = run_cli("config", "set", "lr=0.0.1", "--allow-type-change", "--url", lh.url)
    assert allowed.returncode == 0, allowed.stderr
    assert http_util.live(lh.url)["config"]["lr"] == "0.0.1"

    # Valid JSON numbers warn of nothing; a plain word is a string, no warning either.
    fine = run_cli("config", "set", "batch_size=64", "name=run-b", "--url", lh.url)
    assert fine.returncode == 0 and fine.stderr == "", fine.stderr


def test_the_api_refuses_type_changes_unless_allowed_and_rollbacks_pass(
    procs: ProcessPool, tmp_path: Path
) -> None:
    lh = procs.lighthouse(START)
    http_util.wait_healthy(lh.url)
    v1 = http_util.live(lh.url)["version"]

    for method, body, key, types in [
        ("PATCH", {"lr": "0.0.1"}, "lr", ("number", "string")),
        ("PATCH", {"batch_size": True}, "batch_size", ("number", "boolean")),
        ("PUT", {**START, "lr": None}, "lr", ("number", "null")),  # null is its own type
        ("PUT", {**START, "warmup": 10}, "warmup", ("null", "number")),
        ("PATCH", {"name": {"a": 1}}, "name", ("string", "object")),
    ]:
        res = http_util.change(lh.url, method, body)
        assert res.status == 422, (method, body, res.status, res.body[:300])
        assert f"{key}: {types[0]} -> {types[1]}" in res.error
        assert res.json["type_changes"] == [{"key": key, "before": types[0], "after": types[1]}]
    # A scheduled change is checked too, against the config at its step.
    at_step = http_util.change(lh.url, "PATCH", {"lr": "x"}, path="api/config?effective_step=50")
    assert at_step.status == 422 and "lr: number -> string" in at_step.error
    assert http_util.live(lh.url)["version"] == v1

    # Integer and float are both numbers; a key added or deleted (PATCH null) is no type change.
    same = http_util.change(lh.url, "PATCH", {"batch_size": 64.5, "new_key": "x", "name": None})
    assert same.status == 200, same.body[:300]
    dry = http_util.change(lh.url, "PATCH", {"lr": "0.1"}, path="api/config?dry_run=1&allow_type_change=1")
    assert dry.status == 200 and dry.json["dry_run"] is True
    allowed = http_util.change(lh.url, "PATCH", {"lr": "0.1"}, path="api/config?allow_type_change=1")
    assert allowed.status == 200, allowed.body[:300]
    assert http_util.live(lh.url)["config"]["lr"] == "0.1"

    # A rollback is explicit by nature: it puts the number back.
    back = http_util.change(lh.url, "POST", {"version": v1}, path="api/config/rollback")
    assert back.status == 200, back.body[:300]
    assert http_util.live(lh.url)["config"]["lr"] == 0.1


def test_a_file_reload_with_a_type_change_is_refused_as_the_files_error(
    procs: ProcessPool, tmp_path: Path
) -> None:
    path = tmp_path / "config.json"
    lh = procs.lighthouse(START, config_path=path)
    http_util.wait_healthy(lh.url)
    before = http_util.live(lh.url)

    _write(path, json.dumps({**START, "lr": "0.0.1"}))
    view = poll(lambda: (v := http_util.live(lh.url))["file"]["error"] and v, 10.0, 0.1, "the file's error")
    assert "lr: number -> string" in view["file"]["error"], view["file"]
    assert (view["version"], view["config"]) == (before["version"], before["config"])

    _write(path, json.dumps({**START, "lr": 0.05}))  # fixed: loads, the error goes
    fixed = poll(
        lambda: (v := http_util.live(lh.url))["config"]["lr"] == 0.05 and v, 10.0, 0.1, "the fixed file"
    )
    assert fixed["file"]["error"] is None
