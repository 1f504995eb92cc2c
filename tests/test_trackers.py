"""Config changes in the experiment trackers: each adapter with its real library, offline."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lighthouse.admin.client import AdminClient
from tests.procs import ProcessPool, poll
from worker_client import ManagerClient
from worker_client.changes import ConfigChange
from worker_client.trackers import MlflowTracker, TensorBoardTracker, WandbTracker, logs_here

CHANGE_AT = 3  # the step after which the test changes lr


def train(
    procs: ProcessPool,
    on_change: Callable[[ConfigChange], object],
    steps_after: int = 3,
    prefetch: bool = False,
) -> int:
    """A lighthouse and a manager; steps 0.. with ``on_change``; lr 0.01 -> 0.02 after step
    CHANGE_AT. Returns the first step the new value was served."""
    lh = procs.lighthouse({"lr": 0.01, "name": "run-1", "amp": True})
    manager = procs.manager(lh.address, "group0")
    client = ManagerClient(manager.address, timeout=5.0, prefetch=prefetch, on_change=on_change)
    switched: int | None = None
    step = 0
    try:
        first = client.get_config(step=0).version
        assert first > 0
        while switched is None or step < switched + steps_after:
            step += 1
            assert step < 500, "the change never reached the worker"
            cfg = client.get_config(step=step)
            if step == CHANGE_AT:
                AdminClient(lh.url, author="alice").patch({"lr": 0.02}, comment="plateau")
            if switched is None and cfg.get_float("lr") == 0.02:
                switched = step
            # A version names the config it comes with: the new one only from the step it took
            # effect (before, while pending, it is named apart).
            assert (cfg.version > first) == (switched is not None), (step, cfg, cfg.pending_version)
    finally:
        client.close()
    assert switched is not None and switched > CHANGE_AT
    return switched


@pytest.mark.parametrize("prefetch", [False, True])
def test_callback_once_per_change_at_its_first_step(procs: ProcessPool, prefetch: bool) -> None:
    seen: list[ConfigChange] = []
    switched = train(procs, seen.append, prefetch=prefetch)
    assert [c.step for c in seen] == [0, switched], seen
    first, second = seen
    assert first.previous_version == 0 and first.changes["lr"] == (None, "0.01")
    assert first.numbers() == {"lr": 0.01}  # a boolean and a string are no numbers
    assert second.changes == {"lr": ("0.01", "0.02")} and second.previous_version == first.version
    assert second.config["name"] == "run-1"
    # Who made the change and why, carried with the config from the lighthouse's history.
    assert (second.author, second.comment) == ("alice", "plateau"), second
    assert second.describe() == f"v{second.version} at step {switched} by alice: lr 0.01 -> 0.02 (plateau)"


def test_a_raising_callback_is_logged_once_and_training_goes_on(
    procs: ProcessPool, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[int] = []

    def broken(change: ConfigChange) -> None:
        calls.append(change.step)
        raise RuntimeError("tracker down")

    with caplog.at_level(logging.ERROR, logger="worker_client.changes"):
        switched = train(procs, broken)
    assert calls == [0, switched]
    assert [r.getMessage() for r in caplog.records].count(
        "on_change callback failed (logged once; training goes on)"
    ) == 1


def test_only_rank_0_of_group_0_logs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    assert logs_here()
    monkeypatch.setenv("REPLICA_GROUP_ID", "1")
    assert not logs_here() and logs_here(group=0)
    monkeypatch.delenv("REPLICA_GROUP_ID")
    monkeypatch.setenv("RANK", "2")
    assert not logs_here() and logs_here(rank="0")
    tracker = TensorBoardTracker(tmp_path / "tb")  # rank 2: no writer, no file
    assert tracker.writer is None and not (tmp_path / "tb").exists()


def test_tensorboard_scalar_and_text_at_the_step(procs: ProcessPool, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TensorBoardTracker(tmp_path / "tb", rank=0, group=0)
    switched = train(procs, tracker)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = [(e.step, round(e.value, 6)) for e in events.Scalars("config/lr")]
    assert scalars == [(0, 0.01), (switched, 0.02)]
    texts = events.Tensors("config/changes/text_summary")
    assert [t.step for t in texts] == [0, switched]
    text = texts[-1].tensor_proto.string_val[0].decode()
    assert text.endswith(f"at step {switched} by alice: lr 0.01 -> 0.02 (plateau)"), text


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a .wandb file: wandb 0.31 has no Python reader (its core is in Go), so the
    file's framing, LevelDB's log format (32 KiB blocks; records as crc32, length, type), is
    read here and each record parsed with wandb's own protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk  # FULL, FIRST; MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def _wandb_records_of(run_dir: Path, kind: str) -> list[Any]:
    (path,) = run_dir.glob("*.wandb")
    return [r for r in _wandb_records(path) if r.WhichOneof("record_type") == kind]


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The offline run's logged rows."""
    (path,) = run_dir.glob("*.wandb")
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in _wandb_records(path)
        if r.WhichOneof("record_type") == "history"
    ]


def _wandb_config(run_dir: Path) -> dict[str, Any]:
    """The run's config as its config records left it (the last update of each key wins)."""
    (path,) = run_dir.glob("*.wandb")
    config: dict[str, Any] = {}
    for r in _wandb_records(path):
        kind = r.WhichOneof("record_type")
        items = r.config.update if kind == "config" else r.run.config.update if kind == "run" else []
        config.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return config


def test_wandb_offline_run_holds_the_update(
    procs: ProcessPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="lighthouse-test", dir=str(tmp_path), config={"lr": 0.5})
    try:
        switched = train(procs, WandbTracker(rank=0, group=0))
    finally:
        run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    # finish() returns before wandb-core has written every record: wait for the run's last one
    poll(lambda: _wandb_records_of(run_dir, "exit") or None, 30, what="the offline run's exit record")
    config = _wandb_config(run_dir)
    assert config["lr"] == 0.02 and config["name"] == "run-1" and config["amp"] is True
    rows = [(r["_step"], r["config/lr"]) for r in _wandb_history(run_dir) if "config/lr" in r]
    assert rows == [(0, 0.01), (switched, 0.02)]


def test_mlflow_metric_history_with_the_step(
    procs: ProcessPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the local file store, as the issue asks
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    with mlflow.start_run() as run:
        switched = train(procs, MlflowTracker(rank=0, group=0))
    client = mlflow.MlflowClient()
    history = client.get_metric_history(run.info.run_id, "config/lr")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.01), (switched, 0.02)]
    tags = client.get_run(run.info.run_id).data.tags
    assert tags["config.change"].endswith(f"at step {switched} by alice: lr 0.01 -> 0.02 (plateau)")
    names = sorted(os.path.basename(a.path) for a in client.list_artifacts(run.info.run_id, "config_changes"))
    assert names == sorted(f"v{v}.txt" for v in (1, int(tags["config.version"])))


def test_the_watcher_skips_fallbacks_stepless_calls_and_versions_named_before_their_step() -> None:
    from worker_client import Config
    from worker_client.changes import ChangeWatcher

    seen: list[ConfigChange] = []
    watch = ChangeWatcher(seen.append)
    watch.seen(Config({"lr": "0.1"}, version=1, source="lighthouse", step=None))  # peek-like: no step
    watch.seen(Config(version=0, source="fallback", step=0))
    watch.seen(Config({"lr": "0.1"}, version=1, source="lighthouse", step=1))
    watch.seen(Config(version=0, source="fallback", step=2))  # an outage is no change...
    watch.seen(Config({"lr": "0.1"}, version=1, source="cache", step=3))  # ...nor its end
    watch.seen(Config({"lr": "0.1"}, version=2, source="lighthouse", step=4))  # v2 named, not in effect
    watch.seen(Config({"lr": "0.2", "wd": "0"}, version=2, source="lighthouse", step=6))
    watch.seen(Config({"lr": "0.2", "wd": "0"}, version=2, source="lighthouse", step=7))
    # One version, a new config from a later step: a change scheduled earlier (by bob) took effect
    # after v2 (that state names both); its author and comment come with it.
    later = Config({"lr": "0.3", "wd": "0"}, version=2, source="cache", step=9, effective_step=9)
    later.author, later.comment = "bob", "decay"
    watch.seen(later)
    watch.seen(Config({"lr": "0.3", "wd": "0"}, version=2, source="cache", step=10, effective_step=9))
    assert [(c.step, c.version, c.previous_version, c.changes) for c in seen] == [
        (1, 1, 0, {"lr": (None, "0.1")}),
        (6, 2, 1, {"lr": ("0.1", "0.2"), "wd": (None, "0")}),
        (9, 2, 2, {"lr": ("0.2", "0.3")}),
    ]
    assert seen[1].describe() == "v2 at step 6: lr 0.1 -> 0.2, wd (none) -> 0"
    assert seen[2].describe() == "v2 at step 9 by bob: lr 0.2 -> 0.3 (decay)"
