"""``lighthouse migrate``: copy a SQLite state directory into an empty etcd prefix.

The copy goes through the store interface only (load from one backend,
append to the other), so every record keeps its version number, timestamps,
author and step; each job's meta (job step, pruned base, state id, file
hashes) lands with its last version, and its step switches before that. The
target must be empty: merging two histories would renumber versions that
managers and operators already know.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import click

from lighthouse.etcd.connection import EtcdAuth
from lighthouse.etcd.errors import EtcdError
from lighthouse.store.backend import Change, StoreBackend, StoreUnavailable
from lighthouse.store.etcd import open_etcd_store
from lighthouse.store.etcd_options import etcd_connection_options, store_auth
from lighthouse.store.sqlite import STORE_FILE, SqliteBackend, StateInUse
from protos.limits import EVERY_RECORD


class MigrationTarget(StoreBackend, Protocol):
    def is_empty(self) -> bool: ...


class TargetNotEmpty(Exception):
    pass


class CopyMismatch(Exception):
    """The target does not read back what was copied (nothing is deleted: inspect it)."""


@dataclass(frozen=True)
class CopiedJob:
    job: str
    versions: int
    first: int
    last: int
    switches: int


def migrate(source: StoreBackend, target: MigrationTarget) -> list[CopiedJob]:
    """Copy every job of ``source`` into the empty ``target`` and check it reads back the same."""
    if not target.is_empty():
        raise TargetNotEmpty("the target store already holds data; migrate only into an empty one")
    copied = []
    for job in source.jobs():
        records = source.load(job)
        switches = source.switches(job)
        head = 0
        for row in records.rows[:-1]:
            target.append(job, [row], {}, expected_head=head)
            head = row.version
        if switches:
            target.add_switches(job, switches)
        last = records.rows[-1]  # jobs() lists only jobs with a version
        target.append(job, [last], records.meta, expected_head=head)
        for schema in reversed(source.schemas(job, EVERY_RECORD)):  # oldest first: the newest stays in force
            target.add_schema(job, {k: v for k, v in schema.items() if k != "id"})
        for guard in source.guards(job):
            target.save_guard(job, guard)
        copied.append(CopiedJob(job, len(records.rows), records.rows[0].version, last.version, len(switches)))
    check(source, target)
    return copied


def check(source: StoreBackend, target: StoreBackend) -> None:
    """Raise CopyMismatch unless ``target`` holds every job of ``source`` with the same records."""
    if target.jobs() != source.jobs():
        raise CopyMismatch(f"the target holds jobs {target.jobs()}, the source {source.jobs()}")
    for job in source.jobs():
        want, got = source.load(job), target.load(job)
        if not _same_rows(want.rows, got.rows):
            raise CopyMismatch(f"job {job}: the target's versions differ from the source's")
        wrong = sorted(k for k, v in want.meta.items() if got.meta.get(k) != v)
        if wrong:
            raise CopyMismatch(f"job {job}: the target's meta differs from the source's ({', '.join(wrong)})")
        if sorted(target.switches(job)) != sorted(source.switches(job)):
            raise CopyMismatch(f"job {job}: the target's step switches differ from the source's")
        if _without_ids(target.schemas(job, EVERY_RECORD)) != _without_ids(source.schemas(job, EVERY_RECORD)):
            raise CopyMismatch(f"job {job}: the target's schema history differs from the source's")
        if target.guards(job) != source.guards(job):
            raise CopyMismatch(f"job {job}: the target's guards differ from the source's")


def _without_ids(schemas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "id"} for s in schemas]


def _same_rows(want: list[Change], got: list[Change]) -> bool:
    """Equal rows; a backend may leave out a row's resolved config (etcd, when change and config do
    not fit in one request), which the store recomputes from the rows."""
    if len(want) != len(got):
        return False
    return all(
        g == w or (not g.config and dataclasses.replace(g, config=w.config) == w)
        for w, g in zip(want, got, strict=True)
    )


def open_etcd(
    url: str, ca: str | None, cert: str | None, key: str | None, auth: EtcdAuth | None = None
) -> MigrationTarget:
    """The etcd backend a ``--store`` URL names (``lighthouse serve --store`` opens the same)."""
    target: MigrationTarget = open_etcd_store(url, ca=ca, cert=cert, key=key, auth=auth)
    return target


@click.command("migrate")
@click.option(
    "--state-dir",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="The SQLite state directory to copy (the lighthouse using it must be stopped).",
)
@click.option(
    "--store",
    "store_url",
    required=True,
    metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
    help="The empty etcd prefix to copy into (etcds:// = TLS; default prefix /lighthouse-config).",
)
@etcd_connection_options
def migrate_command(
    state_dir: Path,
    store_url: str,
    store_ca: str | None,
    store_cert: str | None,
    store_key: str | None,
    store_user: str | None,
    store_password_file: str | None,
) -> None:
    """Copy every job's history from --state-dir into an empty etcd prefix (refuses a non-empty one)."""
    db = state_dir / STORE_FILE
    if not db.exists():
        click.echo(f"error: no {STORE_FILE} in {state_dir}: not a lighthouse state directory", err=True)
        sys.exit(1)
    source: SqliteBackend | None = None
    target: MigrationTarget | None = None
    try:
        auth = store_auth(store_user, store_password_file)
        source = SqliteBackend(db)
        target = open_etcd(store_url, store_ca, store_cert, store_key, auth)
        copied = migrate(source, target)
        target.close()  # writes what the backend queued (job steps, step switches)...
        target = open_etcd(store_url, store_ca, store_cert, store_key, auth)
        check(source, target)  # ...and a fresh connection reads it all back
    except StateInUse as exc:
        click.echo(f"error: {exc}; stop that lighthouse before migrating", err=True)
        sys.exit(1)
    except TargetNotEmpty:
        click.echo(f"error: {store_url} already holds data; migrate only into an empty prefix", err=True)
        sys.exit(1)
    except (ValueError, OSError, CopyMismatch, StoreUnavailable, EtcdError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    finally:
        for store in (source, target):
            if store is not None:
                store.close()
    for job in copied:
        click.echo(
            f"{job.job}: {job.versions} version(s) {job.first}..{job.last}, {job.switches} step switch(es)"
        )
    click.echo(f"migrated {len(copied)} job(s) from {db} to {store_url}")
