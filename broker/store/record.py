"""What goes into the store (`Record`), what comes back (`StoredMessage`, `StoredBatch`, `AppendResult`).

They are named tuples: immutable, and cheap to build by the hundred thousand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from types import MappingProxyType
from typing import NamedTuple

NO_HEADERS: Mapping[str, str] = MappingProxyType({})


class Record(NamedTuple):
    """A message to append to a topic queue.

    An empty ``message_id`` lets the store assign one (unique per store).
    ``attempt`` counts deliveries already tried (0 for a fresh message).
    """

    topic: str
    queue: int
    body: bytes
    key: str = ""
    tag: str = ""
    headers: Mapping[str, str] = NO_HEADERS
    message_id: str = ""
    attempt: int = 0


class StoredMessage(NamedTuple):
    """A record as the store keeps it: its place (topic, queue, offset) and log position."""

    topic: str
    queue: int
    queue_offset: int
    log_offset: int
    message_id: str
    key: str
    tag: str
    headers: Mapping[str, str]
    body: bytes
    store_time: float
    attempt: int


class AppendResult(NamedTuple):
    """Where an appended record landed; ``size`` is its framed size in the log."""

    topic: str
    queue: int
    queue_offset: int
    log_offset: int
    message_id: str
    size: int


class StoredBatch(NamedTuple):
    """Messages of one (topic, queue) read together, one list (column) per field, in offset order.

    Readers that handle messages by the hundred (the delivery engine) take the
    columns as they are; `messages` gives the same as `StoredMessage` values.
    """

    topic: str
    queue: int
    queue_offsets: Sequence[int]
    log_offsets: Sequence[int]
    message_ids: Sequence[str]
    keys: Sequence[str]
    tags: Sequence[str]
    headers: Sequence[Mapping[str, str]]
    bodies: Sequence[bytes]
    store_times: Sequence[float]
    attempts: Sequence[int]

    def messages(self) -> list[StoredMessage]:
        count = len(self.queue_offsets)
        return list(map(tuple.__new__, repeat(StoredMessage), zip(
            repeat(self.topic, count), repeat(self.queue), self.queue_offsets, self.log_offsets,
            self.message_ids, self.keys, self.tags, self.headers, self.bodies, self.store_times,
            self.attempts)))
