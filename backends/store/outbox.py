"""The transactional outbox in the store: rows a transaction writes, handed to a relay once committed.

``tx.publish``'s side (the rows a transaction writes) is
`backends.store.outbox_writer`. `SqlOutbox` is the store's side of the relay: ``claim``
opens a transaction holding the next rows that may be sent (locked with
``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so relays never take the same row;
on SQLite the write transaction holds the whole database), keeps the rows of
a key in order, and marks what the relay reports sent (moved to the sent rows)
or refused. ``status``, ``rows``, ``retry`` and ``purge_sent`` serve the CLI,
the metrics and the retention. `Wakeup` is how a commit wakes an idle relay.
"""

from __future__ import annotations

import enum
import json
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any, NamedTuple

from sqlalchemy import (
    ColumnElement,
    CompoundSelect,
    Connection,
    ScalarSelect,
    Select,
    TextClause,
    bindparam,
    exists,
    func,
    literal,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.engine import URL

from backends.clock import Clock
from backends.store.dialect import Dialect
from backends.store.schema import outbox, outbox_sent
from backends.types import OutgoingMessage

Unit = Callable[[], AbstractContextManager[Connection]]
"""Opens a transaction of the store's own, committed on a normal exit."""


class RowState(enum.Enum):
    """Where an outbox row stands."""

    PENDING = "pending"  # committed, not yet confirmed by the transport
    SENT = "sent"  # the transport confirmed it (moved to the sent rows, purged after the retention)
    FAILED = "failed"  # the transport refused it; its key waits until `SqlOutbox.retry`


_PENDING = text("reliable_outbox.state = 'pending'")  # literal, so SQLite uses the partial index
_UNSENT = text("reliable_outbox.state <> 'sent'")
_FAILED = text("failed.state = 'failed'")  # of the alias in `_pending`
_FAILED_HERE = text("reliable_outbox.state = 'failed'")
_STATE_IS = {RowState.PENDING: _PENDING, RowState.FAILED: _FAILED_HERE,
             RowState.SENT: text("reliable_outbox.state = 'sent'")}
"""Written as the partial indexes' own conditions, so that the planner may find pending and
failed rows through them rather than among the sent rows SQLite keeps in place."""


def _up_to(state: TextClause) -> ScalarSelect[int]:
    return select(func.count()).where(outbox.c.outbox == bindparam("outbox"), state,
                                      outbox.c.id <= bindparam("top")).scalar_subquery()


_UNSENT_UP_TO = select(_up_to(_PENDING) + _up_to(_FAILED_HERE))
"""How many unsent rows of outbox ``:outbox`` have an id up to ``:top``: the pending ones through
their partial index (a range of it), the FAILED ones through theirs."""
_STATES = {state.value: state for state in RowState}
_COLUMNS = (outbox.c.id, outbox.c.message_id, outbox.c.topic, outbox.c.key, outbox.c.headers, outbox.c.payload,
            outbox.c.deliver_at, outbox.c.state, outbox.c.created_at, outbox.c.sent_at, outbox.c.error)
"""What `_row` reads, in its order."""
_SENT_COLUMNS = tuple(outbox_sent.c[column.name] for column in _COLUMNS)


class OutboxRow(NamedTuple):
    """One row of the outbox: a message to publish, and where it stands (a named tuple: a relay
    reads thousands a second, and one is made five times faster than a frozen dataclass)."""

    id: int
    message_id: str
    topic: str
    key: str | None
    headers: Mapping[str, str]
    payload: bytes
    deliver_at: float
    state: RowState
    created_at: float
    sent_at: float | None = None
    error: str | None = None

    def outgoing(self, now: float) -> OutgoingMessage:
        """The message to publish at ``now``: the row's id, the delay left of its own."""
        return OutgoingMessage(self.payload, key=self.key, headers=self.headers,
                               delay=max(self.deliver_at - now, 0.0), message_id=self.message_id)


@dataclass(frozen=True)
class OutboxStatus:
    """The backlog of one outbox."""

    outbox: str
    backlog: int  # PENDING rows
    failed: int
    sent: int  # SENT rows not yet purged
    oldest_unsent_at: float | None  # written-at of the oldest PENDING or FAILED row

    def oldest_unsent_age(self, now: float) -> float:
        """Seconds the oldest unsent row has waited (0 with nothing unsent)."""
        return 0.0 if self.oldest_unsent_at is None else max(now - self.oldest_unsent_at, 0.0)


class Wakeup:
    """Tells waiting relays that rows were committed; a commit between a look and a wait is not missed.

    A relay reads ``generation`` before it looks for rows, then waits for it to
    change (paced by wall time, like any wait for another thread).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.generation = 0

    def notify(self) -> None:
        with self._changed:
            self.generation += 1
            self._changed.notify_all()

    def wait(self, seen: int, timeout: float) -> bool:
        """Wait until a notification after ``seen`` or ``timeout``; True if one came."""
        with self._changed:
            return self._changed.wait_for(lambda: self.generation != seen, timeout)


class Claimed:
    """The rows a relay may send now, in the transaction that holds them; its marks commit with it."""

    def __init__(self, connection: Connection, rows: list[OutboxRow], clock: Clock, dialect: Dialect) -> None:
        self._connection, self.rows, self._clock, self._dialect = connection, rows, clock, dialect

    def sent(self, rows: Sequence[OutboxRow]) -> None:
        """The transport confirmed ``rows``: marked SENT (`Dialect.mark_sent`: moved to the sent rows,
        or where they are), kept for the retention."""
        if not rows:
            return
        marked: dict[str, ColumnElement[Any]] = {"state": literal(RowState.SENT.value),
                                                 "sent_at": literal(self._clock.time())}
        self._dialect.mark_sent(self._connection, self._dialect.among(outbox.c.id, [r.id for r in rows]), marked)

    def failed(self, row: OutboxRow, error: str) -> None:
        """The transport refused ``row`` for good: it waits, with the rows of its key, for a retry."""
        self._connection.execute(update(outbox).where(outbox.c.id == row.id)
                                 .values(state=RowState.FAILED.value, error=error))


class SqlOutbox:
    """One named outbox in a SQL store: what relays claim, and what operators inspect."""

    def __init__(self, name: str, url: URL, dialect: Dialect, clock: Clock, write: Unit, read: Unit, claim: Unit) -> None:
        self.name, self._url, self._dialect, self._clock = name, url, dialect, clock
        self._write, self._read, self._claim = write, read, claim
        self.wakeup = Wakeup()
        self._pending = _pending(dialect)
        self._status = _status(name)

    def listen(self, stopping: threading.Event) -> None:
        """Wake this outbox's relays when another process commits rows, until ``stopping`` is set
        (PostgreSQL's ``LISTEN``; returns at once where the database cannot announce)."""
        self._dialect.listen_outbox(self._url, self.name, self.wakeup.notify, stopping)

    @contextmanager
    def claim(self, limit: int) -> Iterator[Claimed]:
        """A transaction holding up to ``limit`` rows that may be sent now, in id order.

        A row is held back while an earlier unsent row of its key is not held
        here too (another relay's, or FAILED): the rows of a key go out in
        order, one relay at a time. Its commit does not wait for the disk
        (`Dialect.lazy_commit`): a mark lost with the machine is a resend."""
        with self._claim() as connection:
            candidates = [_row(r) for r in connection.execute(self._pending, {"outbox": self.name, "limit": limit})]
            if self._dialect.locks_rows:
                candidates = self._in_key_order(connection, candidates)
            yield Claimed(connection, candidates, self._clock, self._dialect)

    def _in_key_order(self, connection: Connection, candidates: list[OutboxRow]) -> list[OutboxRow]:
        """``candidates`` less the rows of a key from its first unsent row another relay holds.

        First counted: when every unsent row up to the last candidate is a candidate (one relay,
        nothing refused: the usual pass), none is held elsewhere, and the rows of the keys need
        not be read back (a count costs the database a fraction of sending them)."""
        keys = list({r.key for r in candidates if r.key is not None})
        if not keys:
            return candidates
        mine, top = {r.id for r in candidates}, candidates[-1].id
        if connection.execute(_UNSENT_UP_TO, {"outbox": self.name, "top": top}).scalar_one() == len(mine):
            return candidates
        held_elsewhere: dict[str, float] = {}  # per key: its first unsent row this claim does not hold
        for row_id, key in connection.execute(select(outbox.c.id, outbox.c.key).where(
                outbox.c.outbox == self.name, self._dialect.among(outbox.c.key, keys), outbox.c.id <= top, _UNSENT)):
            if row_id not in mine:
                held_elsewhere[key] = min(held_elsewhere.get(key, math.inf), row_id)
        return [r for r in candidates if r.key is None or r.id < held_elsewhere.get(r.key, math.inf)]

    def status(self) -> OutboxStatus:
        """How many rows wait, failed and were sent, and when the oldest unsent one was written.
        One statement over both tables: on PostgreSQL each statement of a read sees its own
        snapshot, and a row moved between two would be counted twice. The sent rows kept in
        ``reliable_outbox`` (SQLite's, an earlier version's) are counted in the index of their
        ``sent_at``, which only they have, and passed over there when the unsent rows are read
        (through that index or the unsent rows' own, as the planner likes): a day of them read from
        the table took 10 times longer."""
        with self._read() as connection:
            found = connection.execute(self._status).all()
        counts = Counter[str]()
        for state, count, _ in found:
            counts[state] += count
        oldest = min((at for state, _, at in found if state != RowState.SENT.value and at is not None), default=None)
        return OutboxStatus(self.name, counts[RowState.PENDING.value], counts[RowState.FAILED.value],
                            counts[RowState.SENT.value], oldest)

    def rows(self, state: RowState | None = None, limit: int = 100, after_id: int = 0) -> list[OutboxRow]:
        """Rows with id > ``after_id`` (of ``state``, or any), oldest first: of the outbox and,
        unless only unsent ones are asked for, of the sent rows moved out of it (in one statement,
        so a row moved meanwhile is listed once)."""
        statement = select(*_COLUMNS).where(outbox.c.outbox == self.name, outbox.c.id > after_id)
        if state is not None:
            statement = statement.where(_STATE_IS[state])
        listed: Select[Any] | CompoundSelect = statement
        if state in (None, RowState.SENT):
            listed = union_all(statement, select(*_SENT_COLUMNS).where(
                outbox_sent.c.outbox == self.name, outbox_sent.c.id > after_id))
        with self._read() as connection:
            return [_row(r) for r in connection.execute(listed.order_by("id").limit(limit))]

    def retry(self, ids: Sequence[int] | None = None) -> list[int]:
        """Make FAILED rows (all, or those of ``ids``) pending again; return their ids."""
        statement = update(outbox).where(outbox.c.outbox == self.name, _FAILED_HERE)
        if ids is not None:
            statement = statement.where(outbox.c.id.in_(list(ids)))
        with self._write() as connection:
            retried = connection.execute(statement.values(state=RowState.PENDING.value, error=None)
                                         .returning(outbox.c.id)).scalars().all()
        self.wakeup.notify()
        return sorted(retried)

    def purge_sent(self, before: float) -> int:
        """Delete SENT rows sent before ``before`` (the retention); return how many."""
        with self._write() as connection:
            moved = connection.execute(outbox_sent.delete().where(
                outbox_sent.c.outbox == self.name, outbox_sent.c.sent_at < before)).rowcount
            kept_in_place = connection.execute(outbox.delete().where(  # SQLite's, an earlier version's
                outbox.c.outbox == self.name, outbox.c.state == RowState.SENT.value,
                outbox.c.sent_at < before)).rowcount
        return int(moved) + int(kept_in_place)


def _status(name: str) -> CompoundSelect:
    """Per state: the rows of outbox ``name``, and the written-at of the oldest unsent one."""
    unsent = select(outbox.c.state, func.count(), func.min(outbox.c.created_at)).where(
        outbox.c.outbox == name, _UNSENT, outbox.c.sent_at.is_(None)).group_by(outbox.c.state)
    sent, none = literal(RowState.SENT.value), literal(None)
    in_place = select(sent, func.count(), none).where(outbox.c.outbox == name, outbox.c.sent_at.is_not(None))
    moved = select(sent, func.count(), none).where(outbox_sent.c.outbox == name)
    return union_all(unsent, in_place, moved)


def _pending(dialect: Dialect) -> Select[Any]:
    """The first ``:limit`` pending rows of outbox ``:outbox`` not behind a FAILED row of their key,
    locked (skipping rows another relay holds)."""
    failed = outbox.alias("failed")
    behind_failed = exists().where(failed.c.outbox == outbox.c.outbox, failed.c.key == outbox.c.key, _FAILED,
                                   failed.c.id < outbox.c.id)
    return dialect.skip_locked(select(*_COLUMNS).where(outbox.c.outbox == bindparam("outbox"), _PENDING, ~behind_failed)
                               .order_by(outbox.c.id).limit(bindparam("limit")))


@lru_cache(maxsize=256)
def _headers(stored: str) -> Mapping[str, str]:
    """The headers of a row, read once per distinct text (rows of one writer share theirs)."""
    return MappingProxyType(json.loads(stored))


def _row(record: Any) -> OutboxRow:
    """The `OutboxRow` of a record of `_COLUMNS` (read by position: a relay reads thousands a second)."""
    row_id, message_id, topic, key, headers, payload, deliver_at, state, created_at, sent_at, error = record
    return OutboxRow(row_id, message_id, topic, key, _headers(headers), bytes(payload), deliver_at, _STATES[state],
                     created_at, sent_at, error)
