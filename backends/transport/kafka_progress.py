"""What a Kafka member has handed out and what is done: the offset it may commit per partition.

A partition is read in order, so the offset a member may commit is the
smallest handed-out offset not yet done, or past the last handed-out one
when all are done. Offsets Kafka skips (transaction markers, compaction) are
never handed out and so never hold the position back.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from backends.types import Message, QueueRef


class Progress:
    """Handed-out and done offsets per partition (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[QueueRef, dict[int, Message]] = {}
        self._next: dict[QueueRef, int] = {}
        self._committed: dict[QueueRef, int] = {}

    def handed_out(self, messages: Iterable[Message]) -> None:
        with self._lock:
            for message in messages:
                self._open.setdefault(message.ref, {})[message.offset] = message
                self._next[message.ref] = max(self._next.get(message.ref, 0), message.offset + 1)

    def done(self, messages: Iterable[Message]) -> None:
        with self._lock:
            for message in messages:
                self._open.get(message.ref, {}).pop(message.offset, None)

    def committable(self, refs: Iterable[QueueRef]) -> dict[QueueRef, int]:
        """The next offset to read per partition of ``refs``, where it moved since the last commit."""
        with self._lock:
            positions = {}
            for ref in refs:
                if ref not in self._next:
                    continue
                still_open = self._open.get(ref)
                position = min(still_open) if still_open else self._next[ref]
                if position > self._committed.get(ref, -1):
                    positions[ref] = position
            return positions

    def still_open(self, refs: Iterable[QueueRef]) -> list[Message]:
        """Handed-out messages of ``refs`` that are not done yet."""
        with self._lock:
            return [message for ref in refs for message in self._open.get(ref, {}).values()]

    def committed(self, offsets: Mapping[QueueRef, int]) -> None:
        with self._lock:
            for ref, offset in offsets.items():
                self._committed[ref] = max(self._committed.get(ref, -1), offset)

    def forget(self, refs: Iterable[QueueRef]) -> None:
        """Drop ``refs``: another member may read them now, from the group's committed offset."""
        with self._lock:
            for ref in refs:
                self._open.pop(ref, None)
                self._next.pop(ref, None)
                self._committed.pop(ref, None)
