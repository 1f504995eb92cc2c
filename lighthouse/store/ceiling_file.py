"""Step-lease ceilings in a pre-allocated file, overwritten in place: raising one needs no free space.

A full disk must stop no training: a lighthouse promises steps only below a stored
ceiling (see ``lighthouse.jobs.leases``), so a ceiling that cannot be written ends
every lease. SQLite appends each write to its WAL, which may need a new block; this
file never grows for a job that holds a slot, and keeps a free slot ahead for the
next job. (In place means no new block on ext4, xfs and tmpfs; copy-on-write
filesystems such as btrfs and ZFS may still need one.)

A slot is 128 bytes: the job's name (64), then two copies of (ceiling, crc32)
written in turn, the lower one each time: a torn write leaves the other, the
ceiling stored before it.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import zlib
from pathlib import Path

SLOT = 128
NAME = 64
COPY = struct.Struct("<qI")
CHUNK = 64  # slots added at a time (8 KiB)
INVALID = -2  # a copy that does not check


def _copy(name: bytes, ceiling: int) -> bytes:
    return COPY.pack(ceiling, zlib.crc32(name + struct.pack("<q", ceiling)))


class CeilingFile:
    """``job -> ceiling`` in ``path``; ``save`` raises OSError (ENOSPC) only when a new job finds no
    free slot and the file cannot grow."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        data = os.pread(self._fd, os.fstat(self._fd).st_size, 0)
        self._size = len(data) // SLOT
        self._slots: dict[str, tuple[int, list[int]]] = {}  # job -> (slot, [copy values])
        self._free: list[int] = []
        for index in range(self._size):
            raw = data[index * SLOT : (index + 1) * SLOT]
            name = raw[:NAME].rstrip(b"\0")
            values = [self._value(name, raw, NAME + i * COPY.size) for i in (0, 1)]
            if name and max(values) > INVALID:
                self._slots[name.decode("ascii", "replace")] = (index, values)
            else:
                self._free.append(index)
        with contextlib.suppress(OSError):  # a full disk at start: a new job's ceiling may wait
            self._reserve()

    @staticmethod
    def _value(name: bytes, raw: bytes, at: int) -> int:
        ceiling, crc = COPY.unpack_from(raw, at)
        return ceiling if crc == zlib.crc32(name + struct.pack("<q", ceiling)) else INVALID

    def _reserve(self) -> None:
        """Keep a free slot ahead: written with zeros now, so the next job's slot needs no space."""
        if self._free:
            return
        os.pwrite(self._fd, b"\0" * (CHUNK * SLOT), self._size * SLOT)
        os.fsync(self._fd)
        self._free.extend(range(self._size, self._size + CHUNK))
        self._size += CHUNK

    def get(self, job: str) -> int:
        """The job's stored ceiling (-1: none)."""
        with self._lock:
            held = self._slots.get(job)
            return max(held[1]) if held is not None else -1

    def save(self, job: str, ceiling: int) -> None:
        """Store ``ceiling`` durably (overwriting the job's older copy in place)."""
        name = job.encode("ascii")
        with self._lock:
            held = self._slots.get(job)
            if held is None:
                self._reserve()
                index = self._free.pop(0)
                slot = name.ljust(NAME, b"\0") + _copy(name, ceiling) + b"\0" * COPY.size
                os.pwrite(self._fd, slot.ljust(SLOT, b"\0"), index * SLOT)
                os.fdatasync(self._fd)
                self._slots[job] = (index, [ceiling, INVALID])
                with contextlib.suppress(OSError):  # else the next job's slot is taken when it comes
                    self._reserve()
                return
            index, values = held
            which = values.index(min(values))
            os.pwrite(self._fd, _copy(name, ceiling), index * SLOT + NAME + which * COPY.size)
            os.fdatasync(self._fd)
            values[which] = ceiling

    def delete(self, job: str) -> None:
        with self._lock:
            held = self._slots.pop(job, None)
            if held is None:
                return
            os.pwrite(self._fd, b"\0" * SLOT, held[0] * SLOT)
            os.fdatasync(self._fd)
            self._free.append(held[0])

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)
