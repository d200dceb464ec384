"""A process that adds topics to a `TopicFile` and stalls in the middle of one write, for the
kill -9 tests of `tests/broker/delivery/test_topic_file.py`: the test kills it there, with a
line or a snapshot half on disk."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from broker.delivery.topicfile import TopicFile


def add_then_stall(path: str, names: list[str], stall_after: int, compact_lines: int) -> None:
    """Add ``names`` (2 queues each); the first write after ``stall_after`` of them writes half its
    bytes and blocks until the process is killed."""
    table = TopicFile(Path(path), compact_lines)
    real_write: Callable[[int, bytes], int] = os.write
    added = 0

    def write(fd: int, data: bytes) -> int:
        if added < stall_after or len(data) < 2:
            return real_write(fd, data)
        real_write(fd, data[:len(data) // 2])
        os.fsync(fd)  # on disk for the test to see; the rest never comes
        threading.Event().wait()
        raise AssertionError("unreachable")

    os.write = write  # type: ignore[assignment]  # this process only
    for name in names:
        table.add(name, 2)
        added += 1
