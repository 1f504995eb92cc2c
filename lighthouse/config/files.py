"""Loading the ``--config`` and ``--schema`` JSON files (or every job's files in ``--config-dir``),
and watching them for edits while the lighthouse runs.

Torchft's config-sharing proposal fixes the lenient behaviour: no file gives an
empty config; an unreadable or invalid file gives an empty config and a warning
naming the file and the error. ``strict`` turns those into errors instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lighthouse.config.values import ConfigError, json_type, parse_config, parse_json
from protos.job_ids import InvalidJobId, JobId, check_job_name

logger = logging.getLogger(__name__)

MAX_FILE_BYTES = 16 * 1024 * 1024
SCHEMA_SUFFIX = ".schema.json"  # DIR/<job>.schema.json is the schema of <job> in --config-dir


@dataclass(frozen=True)
class FileContent:
    """What one read of the file gave: a config, or the error that prevented one."""

    config: Any  # the config object (or the schema document); None when unreadable or invalid
    digest: str | None  # sha256 of the bytes; None when the file could not be read
    error: str | None


def read_config_file(path: Path) -> FileContent:
    """Read and parse ``path``; never raises for a bad file, the error is in the result."""
    return _read(path, lambda data: parse_config(data, what=str(path)))


def read_schema_file(path: Path) -> FileContent:
    """Read a ``--schema`` file: a JSON object (checked as a schema where it is applied)."""

    def parse(data: bytes) -> Any:
        document = parse_json(data, str(path))
        if not isinstance(document, dict):
            raise ConfigError(f"{path} must hold a JSON Schema object, got {json_type(document)}")
        return document

    return _read(path, parse)


def _read(path: Path, parse: Callable[[bytes], Any]) -> FileContent:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return FileContent(None, None, f"{path}: no such file")
    except OSError as exc:
        return FileContent(None, None, f"{path}: cannot read: {exc.strerror or exc}")
    digest = hashlib.sha256(data).hexdigest()
    if len(data) > MAX_FILE_BYTES:
        return FileContent(None, digest, f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return FileContent(parse(data), digest, None)
    except ConfigError as exc:
        return FileContent(None, digest, str(exc))


def load_initial(path: Path | None, strict: bool) -> FileContent:
    """The file's config at startup, applying the lenient or strict rule; raises ConfigError when strict."""
    if path is None:
        return FileContent({}, None, None)
    content = read_config_file(path)
    if content.error is None:
        return content
    if strict:
        raise ConfigError(content.error)
    if content.digest is None and not path.exists():
        logger.warning("config file %s does not exist; serving an empty config", path)
    else:
        logger.warning("config file ignored, serving the stored or an empty config: %s", content.error)
    return content


class _Poller:
    """A daemon thread calling ``poll()`` every ``interval`` seconds until ``stop()``."""

    def __init__(self, name: str, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def poll(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()


class FileWatcher(_Poller):
    """Polls the file's mtime and size (and hash when they move) and reports each new content once."""

    def __init__(
        self,
        path: Path,
        on_change: Callable[[FileContent], object],
        interval: float = 1.0,
        read: Callable[[Path], FileContent] = read_config_file,
    ) -> None:
        super().__init__("config-file-watcher", interval)
        self.path = path
        self._on_change = on_change
        self._read = read
        self._last_stat: tuple[float, int] | None = self._stat()
        self._last_digest: str | None = read(path).digest

    def _stat(self) -> tuple[float, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime, st.st_size)

    def poll(self) -> None:
        """One check (the thread calls it every ``interval``; tests may call it directly)."""
        stat = self._stat()
        if stat == self._last_stat or stat is None:
            return
        self._last_stat = stat
        content = self._read(self.path)
        if content.digest == self._last_digest:
            return
        self._last_digest = content.digest
        try:
            self._on_change(content)
        except Exception:
            logger.exception("applying the edited config file %s failed", self.path)


class ConfigDirWatcher(_Poller):
    """Watches ``DIR/<job>.json`` and ``DIR/<job>.schema.json``: a new file is reported at once, an
    edited one like FileWatcher; a job's schema before its config, so the config is checked against it.

    A file name that is not a valid job id is logged once and skipped. A removed file changes
    nothing (the live config and schema stay).
    """

    def __init__(
        self,
        folder: Path,
        on_config: Callable[[JobId, Path, FileContent, bool], object],
        on_schema: Callable[[JobId, Path, FileContent, FileContent | None, bool], object],
        interval: float = 1.0,
    ) -> None:
        super().__init__("config-dir-watcher", interval)
        self.folder = folder
        self._on_config = on_config
        self._on_schema = on_schema
        self._watchers: dict[str, FileWatcher] = {}
        self._refused: set[str] = set()

    def poll(self) -> None:
        self.scan()

    def scan(self, startup: bool = False) -> None:
        """Report new files, then poll known ones (the thread calls it every ``interval``)."""
        try:
            names = sorted(p.name for p in self.folder.iterdir() if p.is_file())
        except OSError as exc:
            logger.error("cannot list the config folder %s: %s", self.folder, exc.strerror or exc)
            return
        # Schemas first: a job's config is then checked against its schema.
        for name in sorted(names, key=lambda n: not n.endswith(SCHEMA_SUFFIX)):
            if not name.endswith(".json") or name in self._watchers:
                continue
            schema = name.endswith(SCHEMA_SUFFIX)
            try:
                job = check_job_name(name[: -len(SCHEMA_SUFFIX if schema else ".json")])
            except InvalidJobId as exc:
                if name not in self._refused:
                    self._refused.add(name)
                    logger.error("file %s skipped: %s", self.folder / name, exc)
                continue
            path = self.folder / name
            if schema:
                report = functools.partial(self._report_schema, job, path, None, False)
                watcher = FileWatcher(path, report, read=read_schema_file)
                config_path = self.folder / f"{job}.json"
                config = read_config_file(config_path) if startup and config_path.exists() else None
                self._report_schema(job, path, config, startup, read_schema_file(path))
            else:
                watcher = FileWatcher(path, functools.partial(self._report_config, job, path, False))
                self._report_config(job, path, startup, read_config_file(path))
            self._watchers[name] = watcher
        for watcher in list(self._watchers.values()):
            watcher.poll()

    def _report_config(self, job: JobId, path: Path, startup: bool, content: FileContent) -> None:
        try:
            self._on_config(job, path, content, startup)
        except Exception:
            logger.exception("applying the config file %s failed", path)

    def _report_schema(
        self, job: JobId, path: Path, config: FileContent | None, startup: bool, content: FileContent
    ) -> None:
        try:
            self._on_schema(job, path, content, config, startup)
        except Exception:
            logger.exception("applying the schema file %s failed", path)
