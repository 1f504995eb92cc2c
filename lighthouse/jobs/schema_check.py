"""A job's schema guard: the schema its store holds, the check every commit passes, the --schema file.

One per ``LighthouseState`` (so one per job): it keeps the schema in the job's
store, refuses a planned commit whose new configs break it, and refuses a new
schema that the configs still ahead of the job break (unless forced).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from lighthouse.config.files import FileContent
from lighthouse.config.schema import Schema, SchemaViolation, load_schema
from lighthouse.config.values import ConfigError
from lighthouse.jobs.versions import ConfigStore, Plan, Segment

logger = logging.getLogger(__name__)


class JobSchema:
    def __init__(self, store: ConfigStore, path: Path | None = None) -> None:
        self.store = store
        self.path = path.resolve() if path is not None else None
        self.error: str | None = None  # why the --schema file is not in force
        self.schema: Schema | None = None
        # Held across a read of the store and the copy it makes (reload), and across a write and
        # its copy (set): a reload that read before our new schema was stored cannot put the old
        # one back over it (commits would be checked against the old one until the next event).
        self._copy_lock = threading.Lock()
        self.reload()

    def reload(self) -> None:
        """Take the schema the store holds (at start, and when another lighthouse changed it)."""
        with self._copy_lock:
            stored = self.store.schema()
            self.schema = load_schema(stored["schema"]) if stored and stored["schema"] is not None else None

    def check(self, plan: Plan) -> None:
        """Refuse a commit when a config it makes, live or at a later step, breaks the schema.

        Only segments whose content is new are checked: a change never fails for a
        scheduled config it leaves as it was.
        """
        old = [s.config for s in plan.segments_before]
        violations = self._violations(list(plan.segments_after), plan.step, self.schema, skip=old)
        if violations:
            raise SchemaViolation(violations)

    def set(
        self,
        document: Any,
        *,
        source: str,
        author: str = "-",
        comment: str = "",
        force: bool = False,
        dry_run: bool = False,
        against: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Replace the schema (None removes it); refused while the live config or a pending
        scheduled config (or ``against``, a config about to load) violates it, unless ``force``."""
        schema = load_schema(document) if document is not None else None
        store = self.store
        with store.commit_lock:  # no commit between the check and the new schema
            if schema is None:
                violations = []
            elif against is not None:
                violations = schema.violations(against)
            else:
                violations = self._violations(store.segments(), store.current_step, schema)
            if violations and not force:
                raise SchemaViolation(violations, "the live config")
            if dry_run:
                return {"schema": document, "violations": violations, "dry_run": True}
            with self._copy_lock:
                row = store.set_schema(document, source=source, author=author, comment=comment)
                self.schema = schema
        logger.info("schema changed (%s by %s)", source, author)
        return {**row, "violations": violations, "dry_run": False}

    def apply_file(
        self, content: FileContent, against: dict[str, Any] | None = None, force: bool = False
    ) -> None:
        """A new schema from the --schema file when its content is new; a bad one only sets ``error``."""
        path = self.path
        assert path is not None
        if content.error is not None:
            self.error = content.error
            logger.error("schema file not loaded, schema unchanged: %s", content.error)
            return
        assert content.digest is not None
        if self.store.file_hash(str(path)) == content.digest:
            self.error = None
            return  # unchanged since last loaded: the stored (maybe edited) schema stays
        try:
            self.set(content.config, source="file", comment=str(path), against=against, force=force)
        except ConfigError as exc:  # not a schema, or the live config violates it
            self.error = f"{path}: {exc}"
            logger.error("schema file not loaded, schema unchanged: %s", self.error)
            return
        self.error = None
        self.store.set_file_hash(str(path), content.digest)

    def apply_initial_file(
        self, content: FileContent, config: FileContent | None, config_path: Path | None
    ) -> None:
        """At startup the schema file may also be met by the config file about to load (when that is
        new): a schema and a config edited together while the lighthouse was down both load."""
        if self.store.head == 0:  # nothing to protect yet: the first config is checked instead
            self.apply_file(content, force=True)
            return
        new = config is not None and config.config is not None and config_path is not None
        if new and config and self.store.file_hash(str(config_path)) != config.digest:
            self.apply_file(content, against=config.config)
            if self.error is None:
                return
        self.apply_file(content)

    @staticmethod
    def _violations(
        segments: list[Segment],
        step: int,
        schema: Schema | None,
        skip: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, str]]:
        """The schema's violations in every segment still ahead of (or at) ``step``, but for
        segments holding one of the ``skip`` configs; a later segment's say from which step."""
        if schema is None:
            return []
        out: list[dict[str, str]] = []
        looked: dict[str, Any] | None = None
        for seg, following in zip(segments, [*segments[1:], None], strict=False):
            if following is not None and following.from_step <= step:
                continue  # only steps the job has passed
            if looked is not None and seg.config == looked:
                continue  # the same config on (a change that left it as it was): said already
            looked = seg.config
            if skip is not None and seg.config in skip:
                continue
            at = "" if seg.from_step <= max(step, 0) else f" (from step {seg.from_step})"
            out.extend(
                {"path": v["path"], "message": v["message"] + at} for v in schema.violations(seg.config)
            )
        return out
