"""``lighthouse serve`` and ``manager serve`` cap glibc's malloc arenas (``MALLOC_ARENAS``): with one
arena per allocating thread (glibc's default, up to 8 per core) a lighthouse's RSS kept rising
through a month benchmark on etcd; a manager, as long-lived, had 15. Counted in the real process:
every arena but the main one is a heap mapped at a 64 MiB boundary (glibc's HEAP_MAX_SIZE on
64-bit), read from ``/proc/PID/maps``."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from lighthouse.client import LighthouseClient
from protos.daemon import MALLOC_ARENAS
from tests.procs import LighthouseProc, ProcessPool, lighthouse_command
from tests.threads import CheckedThread
from worker_client import ManagerClient

HEAP_MAX_SIZE = 64 << 20
CALLERS = 8  # concurrent callers: gRPC's server threads that answer them allocate at once

pytestmark = pytest.mark.skipif(
    not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"), reason="glibc's malloc only"
)


def arena_heaps(pid: int) -> int:
    """The malloc arenas of ``pid`` besides the main one: anonymous rw mappings at 64 MiB boundaries."""
    count = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        start = int(fields[0].split("-")[0], 16)
        count += start % HEAP_MAX_SIZE == 0 and len(fields) == 5 and fields[1] == "rw-p"
    return count


def busy_lighthouse(procs: ProcessPool, env: dict[str, str] | None = None) -> LighthouseProc:
    """A lighthouse whose gRPC threads all served calls at once."""
    args = [*lighthouse_command("127.0.0.1:0", "off"), "--state-dir", str(procs.tmp_path / "state")]
    lighthouse: LighthouseProc = procs.spawn(args, "lighthouse", LighthouseProc, env)
    lighthouse.address = lighthouse.readline()

    def call() -> None:
        with LighthouseClient(lighthouse.address) as client:
            for _ in range(200):
                client.fetch(timeout=10)

    at_once(call)
    return lighthouse


def at_once(call: Callable[[], object]) -> None:
    """``call`` from CALLERS threads at once; an error of any is raised here."""
    callers = [CheckedThread(call) for _ in range(CALLERS)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.check()


def test_a_lighthouse_allocates_from_at_most_two_arenas(procs: ProcessPool) -> None:
    lighthouse = busy_lighthouse(procs)
    assert arena_heaps(lighthouse.popen.pid) <= MALLOC_ARENAS - 1


def test_a_manager_allocates_from_at_most_two_arenas(procs: ProcessPool) -> None:
    """A manager lives as long as its training job, its ranks calling from many connections."""
    manager = procs.manager(procs.lighthouse({"lr": 0.1}).address, "g0", cache_ttl=0.05)
    steps = itertools.count()

    def call() -> None:
        with ManagerClient(manager.address, timeout=10) as client:
            for _ in range(200):
                client.get_config(step=next(steps))

    at_once(call)
    assert arena_heaps(manager.popen.pid) <= MALLOC_ARENAS - 1


def test_malloc_arena_max_in_the_environment_wins(procs: ProcessPool) -> None:
    """The operator's MALLOC_ARENA_MAX stands (and the count above sees arenas when there are)."""
    lighthouse = busy_lighthouse(procs, {"MALLOC_ARENA_MAX": "64"})
    assert arena_heaps(lighthouse.popen.pid) > MALLOC_ARENAS
