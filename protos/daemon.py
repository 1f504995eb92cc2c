"""How a ``serve`` command lives as a process: logs to stderr, address on stdout, exit 0 on SIGTERM/SIGINT.

Shared by the lighthouse and manager CLIs so both behave the same under
torchrun, systemd, Kubernetes or a test harness.
"""

from __future__ import annotations

import contextlib
import gc
import logging
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


def tune_for_many_streams() -> None:
    """For a server process holding thousands of streams; not for libraries.

    The young GC generation is enlarged (see GC_THRESHOLDS), and the soft limit of open files
    raised to the hard one: each manager holds a connection (a socket), and the usual soft
    limit of 1,024 would refuse managers past about a thousand.
    """
    gc.set_threshold(*GC_THRESHOLDS)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


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
