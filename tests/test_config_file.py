"""Loading the ``--config`` file (lenient and strict) and watching it for edits."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest

from lighthouse.config import files as config_file
from lighthouse.config.files import FileContent, FileWatcher, load_initial, read_config_file
from lighthouse.config.values import ConfigError
from tests.procs import poll


def write(path: Path, text: str, mtime: float | None = None) -> None:
    """Write ``text``; set a distinct mtime so the watcher's stat check sees the edit on any filesystem."""
    path.write_text(text, encoding="utf-8")
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def test_read_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    text = '{"lr": 0.001, "名前": "ラン", "nested": {"a": [1, null]}}'
    write(path, text)
    content = read_config_file(path)
    assert content.error is None
    assert content.config == {"lr": 0.001, "名前": "ラン", "nested": {"a": [1, None]}}
    assert content.digest == hashlib.sha256(text.encode()).hexdigest()


def test_read_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    content = read_config_file(path)
    assert content == FileContent(None, None, f"{path}: no such file")


def test_read_unreadable_path(tmp_path: Path) -> None:
    content = read_config_file(tmp_path)  # a directory cannot be read as a file
    assert content.config is None and content.digest is None
    assert content.error is not None and content.error.startswith(f"{tmp_path}: cannot read")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1,,}', "is not valid JSON"),
        ("", "is not valid JSON"),
        ("[1, 2, 3]", "must be a JSON object, got an array"),
        ('"text"', "must be a JSON object, got a string"),
        ('{"a": NaN}', "NaN is not valid JSON"),
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"": 1}', "empty key"),
    ],
)
def test_read_bad_content_names_file_and_error(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.json"
    write(path, text)
    content = read_config_file(path)
    assert content.config is None
    assert content.digest == hashlib.sha256(text.encode()).hexdigest()  # readable: hashed
    assert content.error is not None
    assert str(path) in content.error
    assert expected in content.error


def test_read_oversized_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_file, "MAX_FILE_BYTES", 64)
    path = tmp_path / "big.json"
    write(path, '{"k": "' + "x" * 100 + '"}')
    content = read_config_file(path)
    assert content.config is None
    assert content.error == f"{path}: larger than 64 bytes"
    write(path, '{"k": "small"}')
    assert read_config_file(path).config == {"k": "small"}


def test_load_initial_without_path_is_empty() -> None:
    assert load_initial(None, strict=False) == FileContent({}, None, None)
    assert load_initial(None, strict=True) == FileContent({}, None, None)


def test_load_initial_missing_file_lenient_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "missing.json"
    with caplog.at_level(logging.WARNING, logger="lighthouse.config.files"):
        content = load_initial(path, strict=False)
    assert content.config is None and content.error is not None
    assert any(str(path) in r.getMessage() and "does not exist" in r.getMessage() for r in caplog.records)


def test_load_initial_invalid_lenient_warns_with_parse_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "broken.json"
    write(path, '{"lr": }')
    with caplog.at_level(logging.WARNING, logger="lighthouse.config.files"):
        content = load_initial(path, strict=False)
    assert content.config is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(path) in w and "not valid JSON" in w and "line 1" in w for w in warnings), warnings


@pytest.mark.parametrize("text", [None, "{oops", "[1]"])
def test_load_initial_strict_raises_naming_the_file(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "strict.json"
    if text is not None:
        write(path, text)
    with pytest.raises(ConfigError) as err:
        load_initial(path, strict=True)
    assert str(path) in str(err.value)


def test_load_initial_strict_valid(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    write(path, '{"a": "b"}')
    assert load_initial(path, strict=True).config == {"a": "b"}


def test_watcher_reports_each_new_content_once(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    write(path, '{"v": 1}', mtime=1_000_000)
    seen: list[FileContent] = []
    watcher = FileWatcher(path, seen.append, interval=60)

    watcher.poll()
    assert seen == []  # the content at construction is not a change

    write(path, '{"v": 2}', mtime=1_000_010)
    watcher.poll()
    watcher.poll()
    assert [c.config for c in seen] == [{"v": 2}]

    # Touched, same bytes: the hash says nothing changed.
    os.utime(path, (1_000_020, 1_000_020))
    watcher.poll()
    assert len(seen) == 1

    # Same size, new content, new mtime: reported.
    write(path, '{"v": 3}', mtime=1_000_030)
    watcher.poll()
    assert [c.config for c in seen] == [{"v": 2}, {"v": 3}]


def test_watcher_reports_invalid_edits_and_ignores_deletion(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    write(path, '{"v": 1}', mtime=1_000_000)
    seen: list[FileContent] = []
    watcher = FileWatcher(path, seen.append, interval=60)

    write(path, '{"v": ', mtime=1_000_010)
    watcher.poll()
    assert len(seen) == 1
    assert seen[0].config is None and seen[0].error is not None and str(path) in seen[0].error

    path.unlink()
    watcher.poll()
    assert len(seen) == 1  # a vanished file is not an edit

    write(path, '{"v": 4}', mtime=1_000_020)
    watcher.poll()
    assert [c.config for c in seen[1:]] == [{"v": 4}]


def test_watcher_survives_a_failing_callback(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "w.json"
    write(path, '{"v": 1}', mtime=1_000_000)
    calls: list[FileContent] = []

    def explode(content: FileContent) -> None:
        calls.append(content)
        raise RuntimeError("boom")

    watcher = FileWatcher(path, explode, interval=60)
    write(path, '{"v": 2}', mtime=1_000_010)
    with caplog.at_level(logging.ERROR, logger="lighthouse.config.files"):
        watcher.poll()
    assert len(calls) == 1
    assert any("boom" in (r.exc_text or "") or r.exc_info for r in caplog.records)
    write(path, '{"v": 3}', mtime=1_000_020)
    watcher.poll()
    assert len(calls) == 2


def test_watcher_thread_picks_up_edits(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    write(path, '{"v": 1}', mtime=1_000_000)
    seen: list[FileContent] = []
    got = threading.Event()

    def on_change(content: FileContent) -> None:
        seen.append(content)
        got.set()

    watcher = FileWatcher(path, on_change, interval=0.02)
    watcher.start()
    try:
        write(path, '{"v": "edited"}', mtime=1_000_010)
        poll(got.is_set, 10, what="watcher callback")
        assert seen[-1].config == {"v": "edited"}
    finally:
        watcher.stop()
    assert not watcher._thread.is_alive()
