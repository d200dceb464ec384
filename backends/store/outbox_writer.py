"""``tx.publish``'s side of the outbox: the rows a transaction writes.

`OutboxWriter` turns one ``tx.publish(...)`` call into its row (validated,
body encoded, message id drawn); every transaction class calls it, so the
rules live once. `Outgoing` holds a transaction's rows until its commit
writes them (and refuses a message id the caller chose that a sent row kept
for the retention carries: `Outgoing.reused`); `Deferred` holds a lease-mode
handler's calls until its result is stored. The relay's side is
`backends.store.outbox`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from typing import Any

from sqlalchemy import CompoundSelect, Executable, insert, select, union_all

from backends.clock import Clock
from backends.errors import OutboxMessageError
from backends.store.dialect import Dialect
from backends.store.outbox import RowState
from backends.store.outbox_rules import check_publish
from backends.store.schema import outbox, outbox_sent
from backends.types import CONTENT_TYPE, JSON, encode_body, new_message_id

PublishHook = Callable[[str, Mapping[str, str] | None], AbstractContextManager[Mapping[str, str]]]
"""Runs around every ``tx.publish(topic, ..., headers=...)``: entered before its row is made, it
gives the headers the row carries (the app's middleware adds to them, `reliable.middleware`)."""


@contextmanager
def unhooked(topic: str, headers: Mapping[str, str] | None) -> Iterator[Mapping[str, str]]:
    """The `PublishHook` of a store no app hooked: the headers as given."""
    yield headers or {}


_HOOKED: ContextVar[bool] = ContextVar("reliable_outbox_hooked", default=False)
"""Set while `Deferred.write` writes calls its hook has run for already."""
_DRAWN: ContextVar[bool] = ContextVar("reliable_outbox_drawn", default=False)
"""Set while `Deferred.write` writes a call whose message id it drew (the caller passed none)."""


class OutboxWriter:
    """Turns ``tx.publish(...)`` calls into the rows a transaction writes (one place for every
    transaction class): each call is checked and its row made at once (`row`); the rows go in
    with one ``statement`` (an ``executemany``) when the transaction commits."""

    statement: Executable = insert(outbox)

    def __init__(self, name: str, clock: Clock, message_ids: Callable[[], str] = new_message_id) -> None:
        self.name, self.clock, self.message_ids = name, clock, message_ids
        self.on_publish: PublishHook = unhooked

    def row(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float = 0.0,
        content_type: str = JSON,
        message_id: str | None = None,
    ) -> dict[str, Any]:
        """The row of one publish (through `on_publish`); `OutboxMessageError` names what is wrong
        with the call."""
        check_publish(topic, key, headers, delay, message_id)
        with (unhooked if _HOOKED.get() else self.on_publish)(topic, headers) as sent_headers:
            try:
                payload = encode_body(body, content_type)
            except (TypeError, ValueError) as exc:
                raise OutboxMessageError(
                    f"tx.publish to {topic!r}: body cannot be encoded as {content_type}: {exc}") from exc
            now = self.clock.time()
            return {
                "outbox": self.name, "message_id": message_id or self.message_ids(), "topic": topic, "key": key,
                "headers": json.dumps({CONTENT_TYPE: content_type, **sent_headers}), "payload": payload,
                "deliver_at": now + delay, "state": RowState.PENDING.value, "created_at": now,
            }


class Outgoing:
    """The rows one transaction publishes, written together just before it commits; the sync and
    the async transaction each hold one, so the rules live here once. Once the transaction ends
    (its rows taken for the commit, or rolled back) a publish raises: its row would never be
    written, and the caller would hold the id of a message that is never sent."""

    def __init__(self, writer: OutboxWriter) -> None:
        self.writer = writer
        self.rows: list[dict[str, Any]] = []
        self.chosen: list[str] = []  # the message ids the caller passed (`refuse_sent_ids`)
        self._ended = False
        self._lock = threading.Lock()  # a publish on another thread, against the commit taking the rows

    def publish(self, topic: str, body: Any, *, key: str | None = None, headers: Mapping[str, str] | None = None,
                delay: float = 0.0, content_type: str = JSON, message_id: str | None = None) -> str:
        _refuse_if(self._ended, topic)
        row = self.writer.row(topic, body, key=key, headers=headers, delay=delay, content_type=content_type,
                              message_id=message_id)
        with self._lock:
            _refuse_if(self._ended, topic)
            self.rows.append(row)
            if message_id is not None and not _DRAWN.get():
                self.chosen.append(message_id)
        return str(row["message_id"])

    def rolled_back_to(self, mark: int) -> None:
        """A savepoint taken when ``mark`` rows were published rolled back: its rows go with it."""
        with self._lock:
            kept = {row["message_id"] for row in self.rows[:mark]}
            del self.rows[mark:]
            self.chosen = [message_id for message_id in self.chosen if message_id in kept]

    def end(self) -> list[dict[str, Any]]:
        """The transaction commits with these rows, or rolls back: no publish joins it after this."""
        with self._lock:
            self._ended = True
            return list(self.rows)

    def reused(self, dialect: Dialect) -> CompoundSelect | None:
        """The statement finding the message ids the caller chose that a sent row (kept for the
        retention, moved out or where it was) carries already; None when the caller chose none.
        Run before the rows' ``INSERT`` (a sent row kept in ``reliable_outbox``, under its unique
        index, would fail it) and again after it: there, on PostgreSQL, a row of the same id that
        a relay is moving out made the ``INSERT`` wait on the unique index for the relay's commit,
        which the next statement then sees."""
        if not self.chosen:
            return None
        return union_all(
            select(outbox_sent.c.message_id).where(dialect.among(outbox_sent.c.message_id, self.chosen)),
            select(outbox.c.message_id).where(dialect.among(outbox.c.message_id, self.chosen),
                                              outbox.c.state == RowState.SENT.value),
        ).limit(3)

    @staticmethod
    def refuse_reused(found: Sequence[str]) -> None:
        """`OutboxMessageError` if ``found`` (what `reused` found) names any message id."""
        if found:
            raise OutboxMessageError(
                f"tx.publish: message_id {', '.join(map(repr, found))} was sent already (its row is kept for "
                "the [outbox] retention): a message id names one message, and consumers and brokers drop a "
                "second message under it as a duplicate; choose a new id, or leave message_id out to draw one")



def _refuse_if(ended: bool, topic: str) -> None:
    if ended:
        raise OutboxMessageError(
            f"tx.publish to {topic!r} after its transaction ended (committed or rolled back): the message "
            "would never be written; publish before the handler returns, or in a new store transaction")


class Deferred:
    """``tx.publish`` for a lease-mode handler, which runs outside any transaction: each call is
    checked at once, and written in the transaction that stores the handler's result (so the
    messages are published once the result is stored, never by a call whose result is not)."""

    def __init__(self, on_publish: PublishHook = unhooked) -> None:
        self.calls: list[dict[str, Any]] = []
        self.on_publish = on_publish  # run when the handler calls, not again when the rows are written
        self._ended = False
        self._lock = threading.Lock()

    def publish(self, topic: str, body: Any, *, key: str | None = None, headers: Mapping[str, str] | None = None,
                delay: float = 0.0, content_type: str = JSON, message_id: str | None = None) -> str:
        _refuse_if(self._ended, topic)
        check_publish(topic, key, headers, delay, message_id)
        with self.on_publish(topic, headers) as sent_headers:
            call = {"topic": topic, "body": body, "key": key, "headers": dict(sent_headers), "delay": delay,
                    "content_type": content_type, "message_id": message_id or new_message_id(),
                    "drawn": message_id is None}
        with self._lock:
            _refuse_if(self._ended, topic)
            self.calls.append(call)
        return str(call["message_id"])

    def end(self) -> list[dict[str, Any]]:
        """The calls so far; no publish joins them after this (the attempt's result is being
        stored with them, or the attempt raised and they are dropped)."""
        with self._lock:
            self._ended = True
            return list(self.calls)

    def write(self, tx: Any) -> None:
        """Write the calls' rows in ``tx`` (a `Transaction`)."""
        hooked = _HOOKED.set(True)
        try:
            for call in self.end():
                drawn = _DRAWN.set(call["drawn"])
                try:
                    tx.publish(call["topic"], call["body"], key=call["key"], headers=call["headers"],
                               delay=call["delay"], content_type=call["content_type"], message_id=call["message_id"])
                finally:
                    _DRAWN.reset(drawn)
        finally:
            _HOOKED.reset(hooked)
