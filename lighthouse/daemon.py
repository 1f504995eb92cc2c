"""How a ``serve`` command lives as a process: logs to stderr, address on stdout, exit 0 on SIGTERM/SIGINT.

Shared by the lighthouse and manager CLIs so both behave the same under
torchrun, systemd, Kubernetes or a test harness.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import click


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


def wait_for_termination() -> str:
    """Block until SIGTERM or SIGINT and return the signal's name."""
    received: list[str] = []
    done = threading.Event()

    def handle(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        done.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    while not done.wait(1.0):
        pass
    return received[0]


def env_default(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None
