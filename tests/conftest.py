from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import ProcessPool


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessPool]:
    """Start real lighthouse/manager/worker processes; all are stopped when the test ends."""
    pool = ProcessPool(tmp_path)
    try:
        yield pool
    finally:
        pool.stop_all()
