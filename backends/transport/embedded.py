"""`embedded://PATH`: the durable transport in process, a SQLite file shared by threads and processes.

The default until the project's own broker delivery layer lands. Messages
live in ``PATH/queue.db`` (see `embedded_db`); each group has a cursor per
queue and a ``deliveries`` row per outstanding message. A fetch moves the
cursors and leases what it returns in one transaction, so a process killed
after fetching loses nothing: its leases end and the messages are due again.
Delayed publishes wait in ``delayed`` and take their offset when due.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import structlog

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import TransportError
from backends.transport import embedded_log
from backends.transport.base import Capabilities
from backends.transport.embedded_db import Database
from backends.transport.embedded_log import MESSAGE_COLUMNS, dump_headers, to_message
from backends.transport.leasing import (
    DEFAULT_QUEUES,
    DEFAULT_VISIBILITY_TIMEOUT,
    DeliveryState,
    LeasingTransport,
    new_message_id,
    positive,
)
from backends.types import DeadLetter, Failure, Message, OutgoingMessage, QueueRef

log = structlog.get_logger(__name__)

IN_FLIGHT, SCHEDULED = DeliveryState.IN_FLIGHT.value, DeliveryState.SCHEDULED.value
_KEY = 'grp = ? AND topic = ? AND queue = ? AND "offset" = ?'
_DUE = """
SELECT m.id, m.topic, m.queue, m."offset", m.payload, m.key, COALESCE(d.headers, m.headers),
       d.attempt, m.published_at, d.first_failure_at, d.state
FROM deliveries d JOIN messages m ON m.topic = d.topic AND m.queue = d.queue AND m."offset" = d."offset"
WHERE d.grp = ? AND d.topic = ? AND d.due_at <= ? ORDER BY d.due_at LIMIT ?"""
_UNREAD = """
SELECT q.queue, q.next_offset, COALESCE(c.next_offset, 0) FROM queues q
LEFT JOIN cursors c ON c.grp = ? AND c.topic = q.topic AND c.queue = q.queue
WHERE q.topic = ? ORDER BY q.queue"""
_SET_CURSOR = """
INSERT INTO cursors (grp, topic, queue, next_offset) VALUES (?, ?, ?, ?)
ON CONFLICT (grp, topic, queue) DO UPDATE SET next_offset = excluded.next_offset"""
_HAS_WORK = """
SELECT EXISTS (SELECT 1 FROM deliveries WHERE grp = ? AND topic = ? AND due_at <= ?)
    OR EXISTS (SELECT 1 FROM delayed WHERE topic = ? AND due_at <= ?)
    OR EXISTS (SELECT 1 FROM queues q LEFT JOIN cursors c
               ON c.grp = ? AND c.topic = q.topic AND c.queue = q.queue
               WHERE q.topic = ? AND q.next_offset > COALESCE(c.next_offset, 0))"""
_LEASE_DUE = (
    f"UPDATE deliveries SET state = '{IN_FLIGHT}', attempt = attempt + 1, due_at = ? WHERE {_KEY}"
)
_EXTEND = f"UPDATE deliveries SET due_at = ? WHERE state = '{IN_FLIGHT}' AND {_KEY}"
_LEASE_FRESH = (
    'INSERT INTO deliveries (grp, topic, queue, "offset", state, attempt, due_at)'
    f" VALUES (?, ?, ?, ?, '{IN_FLIGHT}', 1, ?)"
)
_NACK = (
    "UPDATE deliveries SET state = ?, first_failure_at = COALESCE(first_failure_at, ?), due_at = ?"
    f" WHERE {_KEY}"
)
_DEAD_LETTER = (
    'INSERT INTO dead_letters (grp, topic, queue, "offset", id, key, headers, payload, attempt,'
    " published_at, first_failure_at, failure) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class EmbeddedTransport(LeasingTransport):
    """A durable `Transport` in ``directory/queue.db``; several processes may share it."""

    def __init__(
        self,
        directory: str | Path,
        clock: Clock = SYSTEM_CLOCK,
        *,
        queues: int = DEFAULT_QUEUES,
        visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
        poll_interval: float = 0.05,
        busy_timeout: float = 30.0,
        synchronous: str = "FULL",
    ) -> None:
        super().__init__(
            clock, queues, visibility_timeout, positive("poll_interval", poll_interval)
        )
        self._db = Database(directory, positive("busy_timeout", busy_timeout), synchronous)
        self._rotation = itertools.count()

    @property
    def path(self) -> Path:
        """The database file."""
        return self._db.path

    capabilities = Capabilities(drain=True, dead_letter_queue=True)

    def _ack(self, group: str, messages: Sequence[Message]) -> None:
        if messages:
            with self._db.write() as db:
                db.executemany(
                    f"DELETE FROM deliveries WHERE {_KEY}",
                    [(group, m.topic, m.queue, m.offset) for m in messages],
                )

    def _nack(self, group: str, message: Message, due_at: float, failed_at: float) -> None:
        key = (group, message.topic, message.queue, message.offset)
        with self._db.write() as db:  # no row: already done, a late nack does not resurrect it
            db.execute(_NACK, (SCHEDULED, failed_at, due_at, *key))

    def _extend(self, group: str, messages: Sequence[Message], until: float) -> None:
        with self._db.write() as db:
            db.executemany(_EXTEND, [(until, group, m.topic, m.queue, m.offset) for m in messages])

    def _commit(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        raise TransportError("the embedded stand-in does not keep consumer offsets")

    def _queue_count(self, topic: str) -> int:
        with self._db.write() as db:
            return len(embedded_log.heads(db, topic, self._queues))

    def _dead_letter(self, group: str, message: Message, failure: Failure) -> bool:
        key = (group, message.topic, message.queue, message.offset)
        with self._db.write() as db:
            if db.execute(f"DELETE FROM deliveries WHERE {_KEY}", key).rowcount == 0:
                return False
            db.execute(
                _DEAD_LETTER,
                (
                    *key,
                    message.id,
                    message.key,
                    dump_headers(message.headers),
                    message.payload,
                    message.attempt,
                    message.published_at,
                    message.first_failure_at,
                    json.dumps(asdict(failure)),
                ),
            )
        return True

    def _pending(self, group: str, topic: str) -> int:
        unread = sum(head - cursor for _, head, cursor in self._db.read(_UNREAD, (group, topic)))
        ((outstanding,),) = self._db.read(
            "SELECT COUNT(*) FROM deliveries WHERE grp = ? AND topic = ?", (group, topic)
        )
        ((delayed,),) = self._db.read("SELECT COUNT(*) FROM delayed WHERE topic = ?", (topic,))
        return unread + outstanding + delayed

    def _next_due(self, group: str, topic: str) -> float | None:
        return self._earliest(group, topic, f"AND state = '{SCHEDULED}'")

    def _seek(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        with self._db.write() as db:
            for ref, offset in offsets.items():
                heads = embedded_log.heads(db, ref.topic, self._queues)
                if not 0 <= ref.queue < len(heads) or offset < 0:
                    raise TransportError(f"cannot seek {ref} to offset {offset}: no such place")
                offset = min(offset, heads[ref.queue])
                db.execute(_SET_CURSOR, (group, ref.topic, ref.queue, offset))
                db.execute(
                    "DELETE FROM deliveries WHERE grp = ? AND topic = ? AND queue = ?"
                    ' AND "offset" >= ?',
                    (group, ref.topic, ref.queue, offset),
                )
        self._signal()

    def dead_letter_records(self, group: str) -> list[DeadLetter]:
        self._check_open()
        rows = self._db.read(
            f"SELECT {MESSAGE_COLUMNS}, failure, seq FROM dead_letters WHERE grp = ? ORDER BY seq",
            (group,),
        )
        return [
            DeadLetter(group, to_message(row[:10]), None, Failure(**json.loads(row[10])), row[11])
            for row in rows
        ]

    def close(self) -> None:
        super().close()
        self._db.close()

    # primitives of LeasingTransport

    def _append(self, topic: str, messages: Sequence[OutgoingMessage], now: float) -> None:
        with self._db.write() as db:
            queues = len(embedded_log.heads(db, topic, self._queues))
            ready: list[embedded_log.Row] = []
            delayed: list[tuple[embedded_log.Row, float]] = []
            for message in messages:
                row = (
                    self._router.queue_for(topic, message.key, queues),
                    message.message_id or new_message_id(),
                    message.key,
                    dump_headers(message.headers),
                    message.payload,
                    now,
                )
                if message.delay > 0:
                    delayed.append((row, now + message.delay))
                else:
                    ready.append(row)
            embedded_log.append(db, topic, ready, queues)
            embedded_log.delay(db, topic, delayed)
        self._signal()

    def _claim(
        self, group: str, topic: str, max_messages: int, now: float, lease_for: float
    ) -> list[Message]:
        if not self._db.read(_HAS_WORK, (group, topic, now, topic, now, group, topic))[0][0]:
            return []  # nothing for us: do not take the write lock other processes may want
        lease = now + lease_for
        with self._db.write() as db:
            embedded_log.promote(db, topic, now, self._queues)
            due = self._take_due(db, group, topic, now, max_messages)
            db.executemany(_LEASE_DUE, [(lease, group, topic, m.queue, m.offset) for m in due])
            fresh = self._take_fresh(db, group, topic, max_messages - len(due))
            db.executemany(_LEASE_FRESH, [(group, topic, m.queue, m.offset, lease) for m in fresh])
        return due + fresh

    def _wake_at(self, group: str, topic: str) -> float | None:
        return self._earliest(group, topic, "")

    # helpers

    def _take_due(
        self, db: sqlite3.Connection, group: str, topic: str, now: float, limit: int
    ) -> list[Message]:
        """Scheduled redeliveries and ended leases that are due, earliest first."""
        due = []
        for row in db.execute(_DUE, (group, topic, now, limit)):
            message = to_message(row[:10])
            message = replace(message, attempt=message.attempt + 1)  # _LEASE_DUE counts it
            if row[10] == IN_FLIGHT:
                log.warning(
                    "transport.lease_expired",
                    group=group,
                    topic=topic,
                    queue=message.queue,
                    offset=message.offset,
                    attempt=message.attempt,
                )
            due.append(message)
        return due

    def _take_fresh(
        self, db: sqlite3.Connection, group: str, topic: str, limit: int
    ) -> list[Message]:
        """Up to ``limit`` unread messages, shared out over the queues in turn; moves the cursors."""
        unread = {
            queue: (cursor, head - cursor)
            for queue, head, cursor in db.execute(_UNREAD, (group, topic))
        }
        if limit <= 0 or not unread:
            return []
        start = next(self._rotation)
        order = [queue % len(unread) for queue in range(start, start + len(unread))]
        shares = dict.fromkeys(order, 0)
        while limit > 0 and any(shares[q] < unread[q][1] for q in order):
            for queue in order:
                if limit > 0 and shares[queue] < unread[queue][1]:
                    shares[queue] += 1
                    limit -= 1
        fresh = []
        for queue in (q for q in order if shares[q]):
            cursor = unread[queue][0]
            fresh += embedded_log.read(db, topic, queue, cursor, cursor + shares[queue])
            db.execute(_SET_CURSOR, (group, topic, queue, cursor + shares[queue]))
        return fresh

    def _earliest(self, group: str, topic: str, condition: str) -> float | None:
        ((scheduled,),) = self._db.read(
            f"SELECT MIN(due_at) FROM deliveries WHERE grp = ? AND topic = ? {condition}",
            (group, topic),
        )
        ((delayed,),) = self._db.read("SELECT MIN(due_at) FROM delayed WHERE topic = ?", (topic,))
        due = [when for when in (scheduled, delayed) if when is not None]
        return min(due) if due else None
