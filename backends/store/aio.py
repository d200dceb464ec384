"""The store's async transaction, for ``async def`` handlers, on the same database.

An async handler writes through an `AsyncSqlTransaction` (SQLAlchemy 2's
async engine: psycopg's async driver on PostgreSQL, aiosqlite on SQLite), and
the token is claimed in that same transaction, as for sync handlers. Only
what a handler's transaction needs is async (claim, savepoint, offsets, dead
letters, fences, the outbox rows ``tx.publish`` writes, commit); lookups, leases and dead-letter pages stay on the
sync `SqlStore`. Every framework statement runs the very function the sync
store runs (`backends.store.tokens`, `progress`, `deadletters`) through
``AsyncConnection.run_sync``, so the SQL is written once.

An async engine belongs to the event loop it first connects on: each loop
opens its own `AsyncSqlStore` (`SqlStore.open_async`) and closes it there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import structlog
from sqlalchemy.exc import DBAPIError

from backends.clock import Clock
from backends.errors import StoreUnavailableError
from backends.store import deadletters, progress
from backends.store import tokens as records
from backends.store.dialect import Dialect
from backends.store.engine import is_unavailable
from backends.store.outbox import Wakeup
from backends.store.outbox_writer import OutboxWriter, Outgoing
from backends.store.refusals import WriteRefusals
from backends.types import JSON, DeadLetter, QueueRef

if TYPE_CHECKING:  # SQLAlchemy's asyncio loads its ORM: only a store's async engine imports it
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = structlog.get_logger(__name__)

R = TypeVar("R")


def lock_order(tokens: Sequence[str]) -> list[str]:
    """``tokens`` distinct and sorted: one lock order for every transaction (no deadlocks)."""
    return sorted(dict.fromkeys(tokens))


def _raise(exc: DBAPIError, step: str) -> NoReturn:
    """Re-raise ``exc``, as `StoreUnavailableError` when it means an outage."""
    if not is_unavailable(exc):
        raise exc
    raise StoreUnavailableError(f"store unavailable during {step}: {exc.orig}") from exc


class AsyncSqlTransaction:
    """One database transaction of an async handler: ``await tx.execute(...)`` for its writes.

    ``connection`` is the SQLAlchemy ``AsyncConnection``. The framework's own
    operations mirror `backends.store.base.Transaction`, awaited.
    """

    def __init__(self, connection: AsyncConnection, dialect: Dialect, clock: Clock, outbox: OutboxWriter) -> None:
        self.connection = connection
        self._dialect = dialect
        self._clock = clock
        self._outgoing = Outgoing(outbox)  # outbox rows, written in one go at commit

    @property
    def published(self) -> int:
        """How many messages this transaction publishes (so far)."""
        return len(self._outgoing.rows)

    def publish(self, topic: str, body: Any, *, key: str | None = None, headers: Mapping[str, str] | None = None,
                delay: float = 0.0, content_type: str = JSON, message_id: str | None = None) -> str:
        """See `Transaction.publish` (not awaited: the rows are written at commit)."""
        return self._outgoing.publish(topic, body, key=key, headers=headers, delay=delay, content_type=content_type,
                                      message_id=message_id)

    async def write_outbox(self) -> None:
        """Write the published rows (one ``executemany``) and announce them; just before the commit.
        No publish joins them after this."""
        if rows := self._outgoing.end():
            reused = self._outgoing.reused(self._dialect)
            try:
                if reused is not None:
                    Outgoing.refuse_reused((await self.connection.execute(reused)).scalars().all())
                await self.connection.execute(self._outgoing.writer.statement, rows)
                if reused is not None:
                    Outgoing.refuse_reused((await self.connection.execute(reused)).scalars().all())
            except DBAPIError as exc:
                _raise(exc, "write_outbox")
            await self._run("announce_outbox", self._dialect.announce_outbox, self._outgoing.writer.name)

    def rolled_back(self) -> None:
        """The transaction rolled back: its rows go with it, and no publish joins them after this."""
        self._outgoing.end()

    async def execute(self, statement: Any, parameters: Any = None, /) -> Any:
        """Run a statement in this transaction (the handler's own writes)."""
        if parameters is None:
            return await self.connection.execute(statement)
        return await self.connection.execute(statement, parameters)

    async def claim(self, namespace: str, tokens: Sequence[str], ttl: float) -> set[str]:
        """See `Transaction.claim`: a concurrent twin's uncommitted row makes this wait."""
        return await self._run("claim", records.claim, self._dialect, namespace, lock_order(tokens),
                               self._clock.time(), ttl)

    @asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """A nested transaction: an exception inside rolls back to it and propagates."""
        nested = await self.connection.begin_nested()
        published = self.published
        try:
            yield
        except BaseException:
            if nested.is_active:
                await nested.rollback()
            self._outgoing.rolled_back_to(published)
            raise
        else:
            await nested.commit()

    async def save_offsets(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        await self._run("save_offsets", progress.save_offsets, self._dialect, group, offsets)

    async def add_dead_letter(self, letter: DeadLetter) -> int | None:
        return await self._run("add_dead_letter", deadletters.add, self._dialect, letter, self._clock.time())

    async def fence(self, name: str, batch_id: int, run_id: str) -> bool:
        return await self._run("fence", progress.fence, self._dialect, name, batch_id, run_id, self._clock.time())

    async def _run(self, step: str, fn: Callable[..., R], *args: Any) -> R:
        try:
            return await self.connection.run_sync(fn, *args)
        except DBAPIError as exc:
            _raise(exc, step)


class AsyncSqlStore:
    """Async transactions on a store's database, for one event loop (see the module)."""

    def __init__(self, engine: AsyncEngine, dialect: Dialect, clock: Clock, name: str, outbox: OutboxWriter,
                 wakeup: Wakeup, writes: WriteRefusals, tables: Callable[[], None]) -> None:
        self.engine, self._dialect, self._clock, self._name = engine, dialect, clock, name
        self._outbox, self._wakeup = outbox, wakeup
        self._writes = writes  # the sync store's: one state of the disk for both
        self._tables = tables  # the sync store's creation of the tables, done once
        self._tables_ready = False

    def __repr__(self) -> str:
        return f"AsyncSqlStore({self._name})"

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSqlTransaction]:
        """Begin; commit on normal exit, roll back on an exception (and re-raise it)."""
        if not self._tables_ready:  # here, not when the loop starts: a store down then is an outage
            await asyncio.to_thread(self._tables)
            self._tables_ready = True
        try:
            connection = await self.engine.connect()
        except DBAPIError as exc:
            self._failed(exc, "connect")
        try:
            try:
                await connection.begin()
            except DBAPIError as exc:
                self._failed(exc, "begin")
            tx = AsyncSqlTransaction(connection, self._dialect, self._clock, self._outbox)
            before = await self._written(connection)
            try:
                yield tx
                await tx.write_outbox()
                wrote = before is not None and await self._written(connection) not in (None, before)
            except BaseException as exc:
                self._writes.failed(exc)
                tx.rolled_back()
                await self._rollback_quietly(connection)
                raise
            try:
                await connection.commit()
            except DBAPIError as exc:
                await self._rollback_quietly(connection)
                self._failed(exc, "commit")
        finally:
            await connection.close()
        if wrote:
            self._writes.committed()
        if tx.published:
            self._wakeup.notify()  # the relays of this process

    async def _written(self, connection: AsyncConnection) -> Any:
        """See `SqlStore._written`."""
        if self._writes.refusal is None:
            return None
        try:
            return (await connection.execute(self._dialect.written)).scalar()
        except DBAPIError:
            return None

    def _failed(self, exc: DBAPIError, step: str) -> NoReturn:
        self._writes.failed(exc)
        _raise(exc, step)

    async def _rollback_quietly(self, connection: AsyncConnection) -> None:
        try:
            await connection.rollback()
        except DBAPIError as exc:  # the connection is gone; the database rolls back for us
            log.warning("store.rollback_failed", store=repr(self), error=str(exc.orig))

    async def close(self) -> None:
        await self.engine.dispose()
