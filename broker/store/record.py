"""What goes into the store (`Record`, `RecordColumns`), what comes back (`StoredMessage`,
`StoredBatch`, `AppendResult`, `Appended`).

They are named tuples: immutable, and cheap to build by the hundred thousand. The
column forms carry a batch one sequence per field, so that callers that hold
messages by the hundred (the delivery engine) build no tuple per message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import chain, repeat
from types import MappingProxyType
from typing import NamedTuple

from broker.errors import InvalidRecordError

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


class RecordColumns(NamedTuple):
    """Records to append, one column per field of `Record`, every column of one length.

    ``continues`` (a column too, or empty: none does) marks the records whose id is the
    next of a batch run after the record just before them (`broker.store.runs`): the
    store indexes only a run's first id.
    """

    topics: Sequence[str]
    queues: Sequence[int]
    bodies: Sequence[bytes]
    keys: Sequence[str]
    tags: Sequence[str]
    headers: Sequence[Mapping[str, str]]
    message_ids: Sequence[str]
    attempts: Sequence[int]
    continues: Sequence[bool] = ()

    @classmethod
    def of(cls, records: Sequence[Record]) -> RecordColumns:
        """The columns of ``records`` (at least one, each a `Record`)."""
        if not records or not all(map(isinstance, records, repeat(Record))):
            raise InvalidRecordError("append takes a non-empty sequence of Record")
        return cls(*zip(*records))

    @classmethod
    def joined(cls, parts: Iterable[RecordColumns]) -> RecordColumns:
        """The records of ``parts``, one part after another."""
        parts = list(parts)
        joined = cls(*map(list, map(chain.from_iterable, zip(*(part[:-1] for part in parts)))))
        if not any(part.continues for part in parts):
            return joined
        return joined._replace(continues=list(chain.from_iterable(
            part.continues or repeat(False, part.length) for part in parts)))

    @property
    def length(self) -> int:
        """How many records."""
        return len(self.topics)


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


class Appended(NamedTuple):
    """Where a batch of appended records landed, one column per field of `AppendResult`."""

    topics: Sequence[str]
    queues: Sequence[int]
    queue_offsets: Sequence[int]
    log_offsets: Sequence[int]
    message_ids: Sequence[str]
    sizes: Sequence[int]

    def results(self) -> list[AppendResult]:
        return list(map(tuple.__new__, repeat(AppendResult), zip(*self)))

    def part(self, span: slice) -> Appended:
        """The records of ``span`` (positions in the batch)."""
        return Appended(self.topics[span], self.queues[span], self.queue_offsets[span],
                        self.log_offsets[span], self.message_ids[span], self.sizes[span])


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
