"""The topic side of the embedded broker: queue heads, appends, delayed publishes, reads.

Every function runs inside the caller's write transaction (``db``). A
delayed publish waits in ``delayed`` and takes its offset when due, as
RocketMQ's schedule topic does, so each queue's offsets stay contiguous.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence

from backends.types import Message

# the columns, in `Message` field order, that `to_message` reads
MESSAGE_COLUMNS = (
    'id, topic, queue, "offset", payload, key, headers, attempt, published_at, first_failure_at'
)
_INSERT_MESSAGES = (
    'INSERT INTO messages (topic, queue, "offset", id, key, headers, payload, published_at)'
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_DELAYED = (
    "INSERT INTO delayed (topic, queue, id, key, headers, payload, published_at, due_at)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_READ = (
    'SELECT id, topic, queue, "offset", payload, key, headers, 1, published_at, NULL FROM messages'
    ' WHERE topic = ? AND queue = ? AND "offset" >= ? AND "offset" < ? ORDER BY "offset"'
)

# (queue, id, key, headers JSON, payload, published_at)
Row = tuple[int, str, str | None, str, bytes, float]


def dump_headers(headers: Mapping[str, str]) -> str:
    """Headers as stored: JSON (most messages have none, so skip the encoder for them)."""
    return json.dumps(dict(headers)) if headers else "{}"


def load_headers(stored: str) -> dict[str, str]:
    return json.loads(stored) if stored != "{}" else {}


def to_message(row: Sequence) -> Message:
    """A `Message` from a row selected as ``MESSAGE_COLUMNS`` (headers as JSON)."""
    id_, topic, queue, offset, payload, key, headers, attempt, published_at, failed_at = row
    headers = load_headers(headers)
    return Message(
        id_, topic, queue, offset, payload, key, headers, attempt, published_at, failed_at
    )


def heads(db: sqlite3.Connection, topic: str, queues: int) -> list[int]:
    """The next offset of each queue of ``topic``; a new topic gets ``queues`` queues."""
    found = [
        head
        for (head,) in db.execute(
            "SELECT next_offset FROM queues WHERE topic = ? ORDER BY queue", (topic,)
        )
    ]
    if found:
        return found
    db.executemany(
        "INSERT INTO queues (topic, queue, next_offset) VALUES (?, ?, 0)",
        [(topic, queue) for queue in range(queues)],
    )
    return [0] * queues


def append(db: sqlite3.Connection, topic: str, rows: Sequence[Row], queues: int) -> None:
    """Give ``rows`` the next offsets of their queues and store them."""
    offsets = heads(db, topic, queues)
    numbered = []
    for queue, *fields in rows:
        numbered.append((topic, queue, offsets[queue], *fields))
        offsets[queue] += 1
    db.executemany(_INSERT_MESSAGES, numbered)
    db.executemany(
        "UPDATE queues SET next_offset = ? WHERE topic = ? AND queue = ?",
        [(head, topic, queue) for queue, head in enumerate(offsets)],
    )


def delay(db: sqlite3.Connection, topic: str, rows: Sequence[tuple[Row, float]]) -> None:
    """Keep ``rows`` aside until their due time (the float of each pair)."""
    db.executemany(_INSERT_DELAYED, [(topic, *row, due_at) for row, due_at in rows])


def promote(db: sqlite3.Connection, topic: str, now: float, queues: int) -> None:
    """Append the delayed publishes of ``topic`` that are due at ``now``."""
    due = db.execute(
        "SELECT seq, queue, id, key, headers, payload, published_at FROM delayed"
        " WHERE topic = ? AND due_at <= ? ORDER BY due_at, seq",
        (topic, now),
    ).fetchall()
    if due:
        append(db, topic, [row[1:] for row in due], queues)
        db.executemany("DELETE FROM delayed WHERE seq = ?", [(row[0],) for row in due])


def read(db: sqlite3.Connection, topic: str, queue: int, start: int, stop: int) -> list[Message]:
    """The messages at offsets ``start`` (included) to ``stop`` (excluded) of one queue."""
    return [to_message(row) for row in db.execute(_READ, (topic, queue, start, stop))]
