"""The release before step leases (9e6485e), installed from this checkout's history: what a rolling
upgrade starts from, and what a host rolled back to it runs (tests/test_rolling_upgrade.py, the
chaos suite's ``old_release`` fault)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT

OLD_RELEASE = "9e6485e"  # the last release before step leases: flat lighthouse/*.py files


def install(folder: Path) -> Path:
    """That release's tree in ``folder`` (once: a tree already there is reused)."""
    tree = folder / f"release-{OLD_RELEASE}"
    if (tree / "lighthouse").is_dir():
        return tree
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{OLD_RELEASE}^{{commit}}"], capture_output=True
    )
    if found.returncode != 0:
        raise RuntimeError(
            f"commit {OLD_RELEASE} (the release before step leases) is not in this clone: "
            "fetch the full history (git fetch --unshallow) to run the tests of mixed releases"
        )
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", OLD_RELEASE], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def lighthouse_command(bind: str, http_bind: str, store: str) -> list[str]:
    """``lighthouse serve`` of the old release on ``store`` (run with ``env(tree)``; -P: this
    checkout's lighthouse package, in the working directory, must not shadow the old one)."""
    return [
        sys.executable,
        "-P",
        "-m",
        "lighthouse",
        "serve",
        "--bind",
        bind,
        "--http-bind",
        http_bind,
        "--store",
        store,
    ]


def env(tree: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(tree)}
