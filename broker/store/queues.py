"""`QueueTable`: every consume queue of a store, found on disk or created on first use."""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator
from pathlib import Path

from crc32c import crc32c

from broker.errors import InvalidRecordError
from broker.store.consumequeue import ConsumeQueue

TOPIC_NAME = re.compile(r"[A-Za-z0-9_.%\-]{1,200}")
MAX_QUEUE = 65_535


def check_place(topic: str, queue: int) -> None:
    """Reject a topic name or queue number the store cannot keep."""
    if not isinstance(topic, str) or not TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        raise InvalidRecordError(
            f"topic {topic!r} must be 1-200 characters of letters, digits, '_', '.', '%' or '-'"
        )
    if not isinstance(queue, int) or isinstance(queue, bool) or not 0 <= queue <= MAX_QUEUE:
        raise InvalidRecordError(f"queue {queue!r} of topic {topic!r} must be 0..{MAX_QUEUE}")


def tag_hash(tag: str) -> int:
    """The consume-queue hash of a tag (0: no tag), for filtering without reading the log."""
    return crc32c(tag.encode()) if tag else 0


class QueueTable:
    """The consume queues under ``directory/<topic>/<queue>/``."""

    def __init__(self, directory: Path, entries_per_file: int) -> None:
        self.directory = directory
        self.entries_per_file = entries_per_file
        self._queues: dict[tuple[str, int], ConsumeQueue] = {}
        directory.mkdir(parents=True, exist_ok=True)
        for topic_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
            for queue_dir in sorted(p for p in topic_dir.iterdir() if p.name.isdigit()):
                self.ensure(topic_dir.name, int(queue_dir.name))

    def get(self, topic: str, queue: int) -> ConsumeQueue | None:
        return self._queues.get((topic, queue))

    def ensure(self, topic: str, queue: int) -> ConsumeQueue:
        """The consume queue of (topic, queue), created if new."""
        found = self._queues.get((topic, queue))
        if found is None:
            path = self.directory / topic / str(queue)
            found = ConsumeQueue(path, topic, queue, self.entries_per_file)
            self._queues = {**self._queues, (topic, queue): found}
        return found

    def __iter__(self) -> Iterator[ConsumeQueue]:
        return iter(list(self._queues.values()))

    def places(self) -> list[tuple[str, int]]:
        """Every (topic, queue) the store knows, sorted."""
        return sorted(self._queues)

    def lengths(self) -> dict[str, int]:
        """Queue lengths keyed as the checkpoint keeps them."""
        return {f"{q.topic}/{q.queue}": q.length for q in self}

    def kept(self) -> dict[str, list[int]]:
        """Per queue, keyed as `lengths`: where its byte count starts and the bytes counted."""
        return {f"{q.topic}/{q.queue}": [q.kept_from, q.kept_bytes] for q in self}

    def settle(self, log_min: int, lengths: dict[str, int], kept: dict[str, list[int]]) -> None:
        """Count every queue's kept bytes after recovery, from what the checkpoint saved."""
        for q in self:
            name = f"{q.topic}/{q.queue}"
            saved = (lengths[name], *kept[name]) if name in lengths and name in kept else None
            q.settle(q.first_offset(log_min), saved)  # type: ignore[arg-type]

    def drop_below(self, log_min: int) -> None:
        """Retention moved the log's start to ``log_min``: uncount, and delete whole files, below it."""
        for q in self:
            q.forget_below(q.first_offset(log_min))
            q.drop_files_below(log_min)

    def take_dirty(self) -> list[tuple[Path, mmap.mmap]]:
        """Every consume-queue file written since the last call (writer lock held)."""
        return [mapped for consume_queue in self for mapped in consume_queue.take_dirty()]

    def close(self) -> None:
        for consume_queue in self:
            consume_queue.close()
