"""The ``--config`` file and the store: hot reload, invalid edits, restarts, and ``--history-limit``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lighthouse.client import LighthouseClient
from tests import http_util
from tests.procs import ProcessPool, poll

RELOAD_TIMEOUT = 10.0  # the watcher polls about once a second


def _write(path: Path, text: str) -> None:
    """Replace the file's content and make sure its mtime moves (coarse-mtime filesystems)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    st = path.stat()
    if st.st_mtime_ns == before:
        os.utime(path, ns=(st.st_atime_ns, before + 1_000_000_000))


def _live_version(url: str, version: int) -> dict[str, Any] | None:
    view = http_util.live(url)
    return view if view["version"] == version else None


@pytest.mark.slow
def test_file_edits_are_reloaded_and_bad_ones_ignored(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    lh = procs.lighthouse({"lr": 0.1, "name": "a"}, config_path=path)
    http_util.wait_healthy(lh.url)
    first = http_util.live(lh.url)
    assert first["config"] == {"lr": 0.1, "name": "a"} and first["source"] == "file"
    assert first["file"]["error"] is None
    v1 = first["version"]

    # A valid edit becomes a new version with source "file".
    _write(path, json.dumps({"lr": 0.2, "name": "b", "layers": [1, 2]}))
    view = poll(lambda: _live_version(lh.url, v1 + 1), RELOAD_TIMEOUT, 0.1, "valid edit reloaded")
    assert view["config"] == {"lr": 0.2, "name": "b", "layers": [1, 2]}
    assert view["source"] == "file" and view["file"]["error"] is None
    newest = http_util.history(lh.url)[0]
    assert newest["version"] == v1 + 1 and newest["source"] == "file"
    with LighthouseClient(lh.address) as client:
        assert client.get_config(timeout=5) == {"lr": "0.2", "name": "b", "layers": "[1,2]"}

    # Invalid edits: ignored, the error shown in GET /api/config, the live config unchanged.
    bad_files = [
        ('{"lr": 0.3, "name": ', "not valid JSON"),
        ("[1, 2, 3]", "must be a JSON object"),
        ('{"lr": NaN}', "NaN"),
        ('{"lr": 0.3, "lr": 0.4}', "duplicate key"),
    ]
    for bad, reason in bad_files:
        _write(path, bad)
        view = poll(
            lambda: (v := http_util.live(lh.url))["file"]["error"] and v, RELOAD_TIMEOUT, 0.1, "file.error"
        )
        assert view["version"] == v1 + 1, f"invalid file {bad!r} changed the version"
        assert view["config"] == {"lr": 0.2, "name": "b", "layers": [1, 2]}
        error = view["file"]["error"]
        assert str(path) in error and reason in error, f"{bad!r}: {error!r}"
        with LighthouseClient(lh.address) as client:
            assert client.get_config(timeout=5) == {"lr": "0.2", "name": "b", "layers": "[1,2]"}
        # clear the error with a valid file identical to the live content: no new version
        _write(path, json.dumps({"lr": 0.2, "name": "b", "layers": [1, 2]}))
        poll(lambda: http_util.live(lh.url)["file"]["error"] is None, RELOAD_TIMEOUT, 0.1, "error cleared")
    assert http_util.live(lh.url)["version"] == v1 + 1, "re-saving the loaded content made a version"
    assert http_util.history(lh.url)[0]["version"] == v1 + 1

    # A file that becomes valid again with new content is picked up.
    _write(path, json.dumps({"lr": 0.5}))
    view = poll(lambda: _live_version(lh.url, v1 + 2), RELOAD_TIMEOUT, 0.1, "fixed file reloaded")
    assert view["config"] == {"lr": 0.5} and view["file"]["error"] is None


@pytest.mark.slow
def test_restart_keeps_dashboard_edit_unless_file_changed(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    state = tmp_path / "state"
    lh = procs.lighthouse({"lr": 0.1}, config_path=path, state_dir=state)
    http_util.wait_healthy(lh.url)
    res = http_util.change(lh.url, "PATCH", {"batch": 64})
    assert res.status == 200, res.body
    edited = res.json["version"]
    assert lh.stop() == 0

    # Unchanged file: the dashboard edit stays live, no new version.
    lh = procs.lighthouse(config_path=path, state_dir=state)
    http_util.wait_healthy(lh.url)
    view = http_util.live(lh.url)
    assert view["version"] == edited, "restart with an unchanged file made a new version"
    assert view["config"] == {"lr": 0.1, "batch": 64}, "restart with an unchanged file undid a dashboard edit"
    assert view["source"] == "api"
    assert lh.stop() == 0

    # Changed file (edited while the lighthouse was down): a new version with the file's content.
    _write(path, json.dumps({"lr": 0.3}))
    lh = procs.lighthouse(config_path=path, state_dir=state)
    http_util.wait_healthy(lh.url)
    view = http_util.live(lh.url)
    assert view["version"] == edited + 1 and view["config"] == {"lr": 0.3} and view["source"] == "file"
    hist = http_util.history(lh.url)
    assert [h["version"] for h in hist] == list(range(edited + 1, 0, -1))
    assert hist[1]["config"] == {"lr": 0.1, "batch": 64}

    # Invalid file at startup: the stored live version is served and the error shown.
    assert lh.stop() == 0
    _write(path, "{oops")
    lh = procs.lighthouse(config_path=path, state_dir=state)
    http_util.wait_healthy(lh.url)
    view = http_util.live(lh.url)
    assert view["version"] == edited + 1 and view["config"] == {"lr": 0.3}
    assert view["file"]["error"], view["file"]


@pytest.mark.slow
def test_history_limit_prunes_but_never_the_live_version(procs: ProcessPool, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    state = tmp_path / "state"
    limit = 3
    extra = ["--history-limit", str(limit)]
    lh = procs.lighthouse({"base": 0}, config_path=path, state_dir=state, extra=extra)
    http_util.wait_healthy(lh.url)
    expected: dict[str, Any] = {"base": 0}
    versions = [http_util.live(lh.url)["version"]]
    # Patches, so the live config depends on pruned versions too.
    for i in range(8):
        res = http_util.change(lh.url, "PATCH", {f"k{i}": i, "last": i})
        assert res.status == 200, res.body
        versions.append(res.json["version"])
        expected |= {f"k{i}": i, "last": i}
        hist = http_util.history(lh.url)
        assert len(hist) <= limit, [h["version"] for h in hist]
        assert hist[0]["version"] == versions[-1] and hist[0]["config"] == expected
        view = http_util.live(lh.url)
        assert view["version"] == versions[-1] and view["config"] == expected
    assert [h["version"] for h in http_util.history(lh.url)] == versions[::-1][:limit]

    # A pruned version cannot be rolled back to; a kept one can.
    gone = http_util.change(lh.url, "POST", {"version": versions[0]}, path="api/config/rollback")
    assert gone.status == 404, gone.body
    assert http_util.live(lh.url)["version"] == versions[-1]
    back = http_util.change(lh.url, "POST", {"version": versions[-2]}, path="api/config/rollback")
    assert back.status == 200, back.body
    rolled = {k: v for k, v in expected.items() if k not in ("k7",)} | {"last": 6}
    assert back.json["config"] == rolled and back.json["source"] == "rollback"

    # Limit 1 keeps exactly the live version, across a restart too.
    assert lh.stop() == 0
    lh = procs.lighthouse(config_path=path, state_dir=state, extra=["--history-limit", "1"])
    http_util.wait_healthy(lh.url)
    res = http_util.change(lh.url, "PATCH", {"z": True})
    assert res.status == 200
    hist = http_util.history(lh.url)
    assert [h["version"] for h in hist] == [res.json["version"]]
    assert hist[0]["config"] == rolled | {"z": True} == http_util.live(lh.url)["config"]
    assert lh.stop() == 0
    lh = procs.lighthouse(config_path=path, state_dir=state, extra=["--history-limit", "1"])
    http_util.wait_healthy(lh.url)
    view = http_util.live(lh.url)
    assert view["version"] == res.json["version"] and view["config"] == rolled | {"z": True}

    # A pending scheduled change is not live yet: pruning must keep what the live config depends on.
    sched = http_util.call(lh.url, "PUT", "api/config?effective_step=1000000", {"sched": 1})
    assert sched.status == 200, sched.body
    res = http_util.change(lh.url, "PATCH", {"after": 1})
    assert res.status == 200, res.body
    live_now = rolled | {"z": True, "after": 1}
    view = http_util.live(lh.url)
    assert view["live"] == live_now, view
    # The latest version's config: the put scheduled at step 1,000,000 replaces everything there.
    assert (view["version"], view["config"], view["from_step"]) == (
        res.json["version"],
        {"sched": 1},
        1_000_000,
    )
    assert sched.json["version"] in [s["version"] for s in view["scheduled"]]
    assert sched.json["version"] in [h["version"] for h in http_util.history(lh.url)]
    assert lh.stop() == 0
    lh = procs.lighthouse(config_path=path, state_dir=state, extra=["--history-limit", "1"])
    http_util.wait_healthy(lh.url)
    assert http_util.live(lh.url)["live"] == live_now
