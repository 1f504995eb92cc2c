"""Ending a manager with the process that started it, however that process ended.

``connect()`` runs a group's manager as a child of rank 0. A rank killed with
SIGKILL cannot stop its child, so the child watches instead: once its parent is
gone (it has been re-parented) it sends itself SIGTERM and shuts down as on any
SIGTERM. Polling ``getppid`` needs no cooperation from the parent and works
whether the parent exited, crashed or was killed.
"""

from __future__ import annotations

import os
import signal
import threading
import time

POLL_SECONDS = 0.1


def exit_with_parent(parent_pid: int) -> None:
    """SIGTERM this process as soon as ``parent_pid`` is no longer its parent (at once if it is not)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
