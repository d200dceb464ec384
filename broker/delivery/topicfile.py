"""The topic table on disk: a snapshot (``topics.json``) and a log of the topics made since.

Every new topic, and so every new group (its ``%RETRY%`` topic), rewrote and fsynced the whole
table: with 1,000 topics a new group cost a 20 KB write, and a client making groups in a loop
(within ``max_groups``) slowed every publisher behind that lock. A new topic now appends one line
``["name", queues]`` to ``topics.journal`` and fsyncs it; once the log holds as many lines as the
snapshot has topics (and at least `COMPACT_LINES`) the table is written as a new snapshot
(`broker.store.files.atomic_write`) and the log emptied, so a topic costs a constant amortized.

A crash (``kill -9``) leaves the old state or the new: the snapshot is replaced whole, and a
line cut short by a crash has no newline; it is dropped, and cut off the file, when the table
is read. A topic's queue count never changes, so a line the snapshot already holds (a crash
between the snapshot and the log's emptying) is read again harmlessly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import structlog

from broker.errors import CorruptStoreError
from broker.store.files import atomic_write, fsync_directory

log = structlog.get_logger("broker.delivery")

COMPACT_LINES = 1024
"""The fewest log lines a snapshot is written for."""


class TopicFile:
    """The topics and their queue counts at ``path`` (the snapshot) and its ``.journal`` beside it."""

    def __init__(self, path: Path, compact_lines: int = COMPACT_LINES) -> None:
        self.path = path
        self.log_path = path.with_suffix(".journal")
        self.compact_lines = compact_lines
        self.table: dict[str, int] = self._snapshot()
        self._lines = self._replay()

    def add(self, topic: str, queues: int) -> None:
        """``topic`` is made with ``queues`` queues: durable (fsynced) when this returns."""
        self.table[topic] = queues
        if self._lines + 1 >= max(self.compact_lines, len(self.table)):
            try:
                self._compact()
            except BaseException:
                del self.table[topic]
                raise
            return
        line = (json.dumps([topic, queues]) + "\n").encode()
        created = not self.log_path.exists()
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            length = os.fstat(fd).st_size
            try:
                written = 0
                while written < len(line):  # a nearly full disk takes part of a write
                    written += os.write(fd, line[written:])
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, length)  # no half line left for the next to follow
                del self.table[topic]
                raise
        finally:
            os.close(fd)
        if created:
            fsync_directory(self.path.parent)
        self._lines += 1

    def _compact(self) -> None:
        atomic_write(self.path, json.dumps(self.table).encode())
        with open(self.log_path, "wb") as emptied:
            os.fsync(emptied.fileno())
        self._lines = 0

    def _snapshot(self) -> dict[str, int]:
        try:
            return dict(json.loads(self.path.read_bytes()))
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError) as exc:
            raise CorruptStoreError(f"{self.path}: the topic table cannot be read ({exc})") from exc

    def _replay(self) -> int:
        """The log's lines, read into the table; a last line cut short by a crash is cut off."""
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return 0
        whole = data[:data.rfind(b"\n") + 1]
        lines = whole.splitlines()
        for number, line in enumerate(lines, 1):
            try:
                topic, queues = json.loads(line)
            except (ValueError, TypeError) as exc:
                raise CorruptStoreError(f"{self.log_path}: line {number} cannot be read ({exc})") from exc
            self.table[str(topic)] = int(queues)
        if len(whole) < len(data):
            log.warning("delivery.topic_line_cut", path=str(self.log_path), bytes=len(data) - len(whole))
            os.truncate(self.log_path, len(whole))
        return len(lines)
