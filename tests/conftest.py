from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import browser, page  # noqa: F401  (the page tests' fixtures, for every module)
from tests.etcd_cluster import EtcdCluster, require_etcd
from tests.procs import ProcessPool


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessPool]:
    """Start real lighthouse/manager/worker processes; all are stopped when the test ends."""
    pool = ProcessPool(tmp_path)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture(scope="session")
def etcd1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One 1-member etcd for the session's tests that kill nothing (each uses its own prefix).

    Its data lives on tmpfs when there is one: the tests need etcd's behaviour, not its fsyncs.
    """
    require_etcd()
    shm = Path("/dev/shm")
    data = (
        Path(tempfile.mkdtemp(prefix="etcd-", dir=shm)) if shm.is_dir() else tmp_path_factory.mktemp("etcd")
    )
    try:
        with EtcdCluster(data, size=1) as cluster:
            yield cluster
    finally:
        shutil.rmtree(data, ignore_errors=True)
