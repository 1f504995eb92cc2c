"""Reported metrics on the wire (part of the contract): which names a report may use, and the
columns of ``MetricSummaries`` (packed little-endian arrays, one entry per step).

Shared by the worker client, the manager and the lighthouse, so each refuses the
same names (every accepted name is a valid Prometheus name) and reads the columns
the way the other wrote them.
"""

from __future__ import annotations

import re
import sys
from array import array
from typing import Any

METRIC_NAME_RULE = "a metric name is 1-64 characters of A-Z, a-z, 0-9 and '_', not starting with a digit"
MAX_METRICS = 32  # names one report, one group and one job hold (others are dropped and counted)
_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_checked: set[str] = set()  # names seen valid: after its first use a name costs one set lookup

# Column -> array typecode: int64 steps, uint32 counts, float64 values.
STEPS, COUNTS, VALUES = "q", "I", "d"
for _code, _size in ((STEPS, 8), (COUNTS, 4), (VALUES, 8)):
    assert array(_code).itemsize == _size, f"array({_code!r}) is not {_size} bytes on this platform"
_SWAP = sys.byteorder == "big"


def is_metric_name(name: str) -> bool:
    if name in _checked:
        return True
    if _METRIC_NAME.fullmatch(name) is None:
        return False
    if len(_checked) < 4096:  # a stream of made-up names must not grow it without bound
        _checked.add(name)
    return True


def pack(column: array[Any]) -> bytes:
    """A column as it travels: little-endian."""
    if _SWAP:
        column = array(column.typecode, column)
        column.byteswap()
    return column.tobytes()


def unpack(typecode: str, data: bytes) -> array[Any]:
    """A column from the wire; ValueError when ``data`` is not a whole number of entries."""
    column = array(typecode)
    column.frombytes(data)
    if _SWAP:
        column.byteswap()
    return column
