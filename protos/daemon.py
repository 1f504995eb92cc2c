"""How a ``serve`` command lives as a process: logs to stderr, address on stdout, exit 0 on SIGTERM/SIGINT.

Shared by the lighthouse and manager CLIs so both behave the same under
torchrun, systemd, Kubernetes or a test harness.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import resource
import signal
import sys
import threading

import click

# Python's cyclic garbage collector with its defaults (700, 10, 10) in a server holding many
# long-lived objects (a lighthouse with 5,000 push streams holds several hundred thousand): an
# edit's fan-out promoted enough of its per-send objects to start a full collection every other
# edit, ~240 ms each with the event loop stopped, a quarter of the lighthouse's CPU (measured with
# benchmarks/push.py and py-spy). A young generation of 50,000 lets that garbage die young: no full
# collection in the same run, lighthouse CPU 23% -> 16%.
GC_THRESHOLDS = (50_000, 20, 100)

# glibc's malloc gives each thread that allocates an arena of its own, up to 8 per core, and hands
# little of a freed arena's memory back. A lighthouse on etcd runs some 30 threads (gRPC's, the etcd
# client's, the writers'): its RSS rose about 0.2-0.5 MB a minute through a 30-minute month
# benchmark (1.10x from minute 5) while the Python heap stayed at 5-8 MB. With 2 arenas it stayed
# flat (1.04x in 15 minutes), 6 MB lower, no slower (benchmarks/month --store etcd, one run each).
# MALLOC_ARENA_MAX in the environment wins (the operator's choice).
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)


def tune_for_many_streams() -> None:
    """For a server process holding thousands of streams; not for libraries.

    The young GC generation is enlarged (see GC_THRESHOLDS), glibc's malloc arenas capped (see
    MALLOC_ARENAS), and the soft limit of open files
    raised to the hard one: each manager holds a connection (a socket), and the usual soft
    limit of 1,024 would refuse managers past about a thousand.
    """
    gc.set_threshold(*GC_THRESHOLDS)
    limit_malloc_arenas()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` (see MALLOC_ARENAS), before the server's threads
    start; whether it did (not on another C library, nor when MALLOC_ARENA_MAX is set)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas))
    except (ValueError, OSError, AttributeError):  # no glibc: no such name, value or function
        return False


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def announce(*lines: str) -> None:
    """Print the bound addresses, first line first, flushed at once (scripts read them)."""
    for line in lines:
        click.echo(line)
    sys.stdout.flush()


class Termination:
    """SIGTERM/SIGINT handling, installed before anything starts, so a signal that arrives
    right after the address is printed still ends in a clean shutdown and exit code 0."""

    def __init__(self) -> None:
        self._received: list[str] = []
        self._done = threading.Event()
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        self._received.append(signal.Signals(signum).name)
        self._done.set()

    def wait(self) -> str:
        """Block until a signal came and return its name."""
        while not self._done.wait(1.0):
            pass
        return self._received[0]
