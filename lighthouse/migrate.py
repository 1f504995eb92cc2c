"""``lighthouse migrate``: copy a SQLite state directory into an empty etcd prefix.

The copy goes through the store interface only (load from one backend,
append to the other), so every record keeps its version number, timestamps,
author and step; each job's meta (job step, pruned base, state id, file
hashes) lands with its last version, and its step switches before that. The
target must be empty: merging two histories would renumber versions that
managers and operators already know.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import click

from lighthouse import backend
from lighthouse.backend import StoreBackend
from lighthouse.etcd_client import EtcdError, EtcdTLS, StoreUnavailable
from lighthouse.server import STORE_FILE
from lighthouse.sqlite_backend import SqliteBackend, StateInUse
from lighthouse.store_url import parse_store_url

_FILE = click.Path(dir_okay=False, exists=True)


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
            target.append(job, row, {}, expected_head=head)
            head = row.version
        if switches:
            target.add_switches(job, switches)
        last = records.rows[-1]  # jobs() lists only jobs with a version
        target.append(job, last, records.meta, expected_head=head)
        _check(job, source, target)
        copied.append(CopiedJob(job, len(records.rows), records.rows[0].version, last.version, len(switches)))
    return copied


def _check(job: str, source: StoreBackend, target: StoreBackend) -> None:
    want, got = source.load(job), target.load(job)
    if got.rows != want.rows:
        raise CopyMismatch(f"job {job}: the target's versions differ from the source's")
    wrong = sorted(k for k, v in want.meta.items() if got.meta.get(k) != v)
    if wrong:
        raise CopyMismatch(f"job {job}: the target's meta differs from the source's ({', '.join(wrong)})")
    if sorted(target.switches(job)) != sorted(source.switches(job)):
        raise CopyMismatch(f"job {job}: the target's step switches differ from the source's")


def open_etcd(url: str, tls: EtcdTLS | None) -> MigrationTarget:
    """The etcd backend for a ``--store`` URL."""
    endpoints, prefix, tls_scheme = parse_store_url(url)
    if tls is None and tls_scheme:
        tls = EtcdTLS()  # the system's CA roots
    # Imported by name: the etcd backend module is developed on another branch.
    etcd_backend = importlib.import_module("lighthouse.etcd_backend")
    target: MigrationTarget = etcd_backend.EtcdBackend(endpoints, prefix, tls)
    return target


@click.command("migrate")
@click.option(
    "--state-dir",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="The SQLite state directory to copy (the lighthouse using it must be stopped).",
)
@click.option("--store", "store_url", required=True, help="Target: etcd://HOST:PORT[,HOST:PORT...][/PREFIX].")
@click.option("--etcd-ca", type=_FILE, default=None, help="CA bundle that signed etcd's certificate.")
@click.option("--etcd-cert", type=_FILE, default=None, help="Client certificate (mutual TLS).")
@click.option("--etcd-key", type=_FILE, default=None, help="Client key (mutual TLS).")
def migrate_command(
    state_dir: Path, store_url: str, etcd_ca: str | None, etcd_cert: str | None, etcd_key: str | None
) -> None:
    """Copy every job's history from --state-dir into an empty etcd prefix (refuses a non-empty one)."""
    db = state_dir / STORE_FILE
    if not db.exists():
        click.echo(f"error: no {STORE_FILE} in {state_dir}: not a lighthouse state directory", err=True)
        sys.exit(1)
    tls = EtcdTLS(etcd_ca, etcd_cert, etcd_key) if etcd_ca or etcd_cert or etcd_key else None
    source = target = None
    try:
        source = SqliteBackend(db)
        target = open_etcd(store_url, tls)
        copied = migrate(source, target)
    except StateInUse as exc:
        click.echo(f"error: {exc}; stop that lighthouse before migrating", err=True)
        sys.exit(1)
    except TargetNotEmpty:
        click.echo(f"error: {store_url} already holds data; migrate only into an empty prefix", err=True)
        sys.exit(1)
    except (ValueError, OSError, CopyMismatch, StoreUnavailable, backend.StoreUnavailable, EtcdError) as exc:
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
