"""`Segment`: one commit-log file, named by the log offset of its first byte.

Segments are append-only; a record never straddles two of them. Readers hold
a reference while they read, so retention can delete a segment under them
without a reused file descriptor ever serving another file's bytes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from broker.errors import StoreError

SUFFIX = ".log"


def segment_name(base: int) -> str:
    """The file name of the segment starting at log offset ``base``."""
    return f"{base:020d}{SUFFIX}"


class Segment:
    """One open segment file; ``size`` is how many bytes of it belong to the log."""

    def __init__(self, path: Path, base: int) -> None:
        self.path = path
        self.base = base
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.size = os.fstat(self._fd).st_size
        self._users = 0
        self._deleted = False
        self._closed = False
        self._lock = threading.Lock()

    @property
    def end(self) -> int:
        """The log offset just past this segment's last byte."""
        return self.base + self.size

    def write(self, data: bytes) -> None:
        """Append ``data`` at ``size`` (the caller serialises writers)."""
        view = memoryview(data)
        position = self.size
        while view:
            written = os.pwrite(self._fd, view, position)
            view = view[written:]
            position += written
        self.size = position

    def read(self, position: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``position`` (fewer at the end of the file)."""
        with self._lock:
            if self._deleted:
                raise StoreError(f"segment {self.path} was deleted by retention")
            self._users += 1
        try:
            return os.pread(self._fd, length, position)
        finally:
            self._release()

    def fsync(self) -> None:
        """Force the written bytes to disk."""
        with self._lock:
            if self._deleted:
                return
            self._users += 1
        try:
            os.fsync(self._fd)
        finally:
            self._release()

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes (recovery drops a torn tail) and make it durable."""
        os.ftruncate(self._fd, size)
        os.fsync(self._fd)
        self.size = size

    def close(self) -> None:
        """Close the file once no reader holds it."""
        with self._lock:
            self._deleted = True
            if self._users or self._closed:
                return
            self._closed = True
        os.close(self._fd)

    def delete(self) -> None:
        """Remove the file; the descriptor closes when its last reader lets go."""
        self.path.unlink(missing_ok=True)
        self.close()

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            if not self._deleted or self._users or self._closed:
                return
            self._closed = True
        os.close(self._fd)
