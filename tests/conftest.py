from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser import browser, page  # noqa: F401  (the page tests' fixtures, for every module)
from tests.etcd_cluster import EtcdCluster, require_etcd
from tests.procs import ProcessPool

# Bytecode caches on, whatever the environment says (some images set PYTHONDONTWRITEBYTECODE=1): the
# suite starts thousands of Python processes, and without .pyc files each one compiles the project
# again (0.1 s of CPU each), and each xdist process rewrites every test module's asserts (12 s).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first: those with a test given a longer timeout, then those with slow tests,
    then the rest. The two xdist processes then end on short tests together, not one on a torchft job
    while the other idles. Each module's tests keep their file order (module fixtures rely on it)."""

    def rank(item: pytest.Item) -> tuple[int, int]:
        timeout = item.get_closest_marker("timeout")
        declared = int(timeout.args[0]) if timeout and timeout.args else 0
        return (-declared, 0 if item.get_closest_marker("slow") else 1)

    module_rank: dict[str, tuple[int, int]] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        module_rank[module] = min(module_rank.get(module, (0, 1)), rank(item))
    items.sort(key=lambda item: module_rank[item.nodeid.split("::")[0]])


CPU_AT_SETUP = pytest.StashKey[os.times_result]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[CPU_AT_SETUP] = os.times()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Each test's CPU seconds, in the JUnit report's properties (``cpu_s`` of the test process,
    ``children_cpu_s`` of the processes it started and reaped): the suite is CPU-bound on 2 cores,
    so these, not the wall-clock times, say which tests to make cheaper."""
    yield
    start = item.stash.get(CPU_AT_SETUP, None)
    if start is not None:
        end = os.times()
        item.user_properties.append(("cpu_s", round(end.user + end.system - start.user - start.system, 2)))
        children = end.children_user + end.children_system - start.children_user - start.children_system
        item.user_properties.append(("children_cpu_s", round(children, 2)))


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
