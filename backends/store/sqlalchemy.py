"""`SqlStore`: the `Store` on any supported SQLAlchemy database (SQLite, PostgreSQL).

Every public operation is written once here, over the primitives of the URL's `Dialect`
(`backends.store.sqlite`, `backends.store.postgresql`): the template method, with the primitives
supplied per database. Core only (no ORM): the claim and the lookups are one statement each. A
store is safe to share between threads; every transaction takes its own pooled connection. Database
errors that mean "cannot reach the database" become `StoreUnavailableError`; the user's own
exceptions inside a transaction propagate unchanged. A transaction that published (``tx.publish``)
wakes the outbox's relays once it commits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import wraps
from typing import Any, NoReturn, ParamSpec, TypeVar

import structlog
from sqlalchemy import Connection, Engine
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import StoreUnavailableError
from backends.refusal import FirstContact
from backends.store import deadletters, progress
from backends.store import tokens as records
from backends.store.aio import AsyncSqlStore, lock_order
from backends.store.base import LeaseOutcome, Store, Transaction
from backends.store.claims import Claim
from backends.store.dialect import Dialect
from backends.store.engine import is_unavailable, parse_store_url, refusal
from backends.store.outbox import SqlOutbox
from backends.store.outbox_writer import Deferred, OutboxWriter, Outgoing, PublishHook
from backends.store.postgresql import AsyncPostgreSQL, PostgreSQL
from backends.store.refusals import WriteRefusals
from backends.store.schema import add_late_indexes, metadata
from backends.store.sqlite import SQLite
from backends.types import JSON, DeadLetter, QueueRef
from backends.urls import redact

log = structlog.get_logger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def _guarded(method: Callable[P, R]) -> Callable[P, R]:
    """Raise a database outage inside a framework operation as `StoreUnavailableError`."""
    @wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except DBAPIError as exc:
            if is_unavailable(exc):
                raise StoreUnavailableError(f"store unavailable during {method.__name__}: {exc.orig}") from exc
            raise

    return wrapper


class SqlTransaction(Transaction):
    """One database transaction on a pooled connection; see `Transaction`."""

    def __init__(self, connection: Connection, dialect: Dialect, clock: Clock, outbox: OutboxWriter) -> None:
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
        return self._outgoing.publish(topic, body, key=key, headers=headers, delay=delay, content_type=content_type,
                                      message_id=message_id)

    @_guarded
    def write_outbox(self) -> None:
        """Write the published rows (one ``executemany``) and announce them; just before the commit.
        No publish joins them after this."""
        if rows := self._outgoing.end():
            reused = self._outgoing.reused(self._dialect)
            if reused is not None:
                Outgoing.refuse_reused(self.connection.execute(reused).scalars().all())
            self.connection.execute(self._outgoing.writer.statement, rows)
            if reused is not None:
                Outgoing.refuse_reused(self.connection.execute(reused).scalars().all())
            self._dialect.announce_outbox(self.connection, self._outgoing.writer.name)

    def rolled_back(self) -> None:
        """The transaction rolled back: its rows go with it, and no publish joins them after this."""
        self._outgoing.end()

    @_guarded
    def claim(self, namespace: str, tokens: Sequence[str], ttl: float) -> set[str]:
        batch = lock_order(tokens)
        return records.claim(self.connection, self._dialect, namespace, batch, self._clock.time(), ttl)

    @contextmanager
    def savepoint(self) -> Iterator[None]:
        nested = self.connection.begin_nested()
        published = self.published
        try:
            yield
        except BaseException:
            if nested.is_active:
                nested.rollback()
            self._outgoing.rolled_back_to(published)
            raise
        else:
            nested.commit()

    @_guarded
    def save_offsets(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        progress.save_offsets(self.connection, self._dialect, group, offsets)

    @_guarded
    def add_dead_letter(self, letter: DeadLetter) -> int | None:
        return deadletters.add(self.connection, self._dialect, letter, self._clock.time())

    @_guarded
    def fence(self, name: str, batch_id: int, run_id: str) -> bool:
        return progress.fence(self.connection, self._dialect, name, batch_id, run_id, self._clock.time())

    @_guarded
    def claim_ahead(self, namespace: str, tokens: Sequence[str], ttl: float) -> Any:
        if not tokens:
            return None
        now = self._clock.time()
        return self._dialect.claim_ahead(self.connection, Claim(namespace, lock_order(tokens), now, now + ttl))


DIALECTS: dict[str, type[Dialect]] = {"sqlite": SQLite, "postgresql": PostgreSQL}
"""The dialect of each backend name a store URL may have (`ALLOWED_SCHEMES`)."""

ASYNC_DIALECTS: dict[str, type[Dialect]] = {"sqlite": SQLite, "postgresql": AsyncPostgreSQL}
"""The same, for transactions on the asyncio drivers (`backends.store.aio`)."""


class SqlStore(Store):
    """The durable store on SQLite or PostgreSQL; tables are created on first use."""

    def __init__(self, url: str | URL, clock: Clock = SYSTEM_CLOCK, *, outbox: str = "default") -> None:
        self.url = parse_store_url(url) if isinstance(url, str) else url
        self.dialect = DIALECTS[self.url.get_backend_name()]()
        self.engine: Engine = self.dialect.engine(self.url)
        self._clock = clock
        self._outbox_writer = OutboxWriter(outbox, clock)
        self.outbox = SqlOutbox(outbox, self.url, self.dialect, clock, self._unit, lambda: self._unit(read_only=True),
                                claim=lambda: self._unit(lazy_commit=True))
        self._tables_ready = False
        self._tables_lock = threading.Lock()
        self._writes = WriteRefusals(repr(self), lambda: self.dialect.full_disk(self.url))
        self._contact = FirstContact("[store] url", redact(self.url.render_as_string(hide_password=False)))

    def __repr__(self) -> str:
        return f"SqlStore({redact(self.url.render_as_string(hide_password=False))!r})"

    # -- transactions -------------------------------------------------------------------

    def hook_publish(self, hook: PublishHook) -> None:
        self._outbox_writer.on_publish = hook

    def transaction(self) -> AbstractContextManager[SqlTransaction]:
        return self._transaction(lazy_commit=False)

    @contextmanager
    def _transaction(self, lazy_commit: bool) -> Iterator[SqlTransaction]:
        connection = self._begin(lazy_commit=lazy_commit)
        tx = SqlTransaction(connection, self.dialect, self._clock, self._outbox_writer)
        before = self._written(connection)
        try:
            yield tx
            tx.write_outbox()
            wrote = before is not None and self._written(connection) not in (None, before)
        except BaseException as exc:
            self._writes.failed(exc)
            tx.rolled_back()
            self._rollback_quietly(connection)
            connection.close()
            raise
        try:
            connection.commit()
        except DBAPIError as exc:
            self._rollback_quietly(connection)
            self._raise(exc, "commit")
        finally:
            connection.close()
        if wrote:
            self._writes.committed()
        if tx.published:
            self.outbox.wakeup.notify()

    def _written(self, connection: Connection) -> Any:
        """The dialect's mark of what the transaction on ``connection`` wrote so far, asked only
        while writes are refused (`backends.store.refusals`); else None, with no query."""
        if self._writes.refusal is None:
            return None
        try:
            return connection.execute(self.dialect.written).scalar()
        except DBAPIError:  # a transaction the handler's own failure aborted: it does not commit
            return None

    def _begin(self, read_only: bool = False, lazy_commit: bool = False) -> Connection:
        self._ensure_tables()
        try:
            connection = self.engine.connect()
        except DBAPIError as exc:
            self._raise(exc, "connect")
        self._contact.accepted()
        try:
            if read_only:
                self.dialect.read_only(connection)
            elif lazy_commit:
                self.dialect.lazy_commit(connection)
            connection.begin()
        except DBAPIError as exc:
            connection.close()
            self._raise(exc, "begin")
        return connection

    @contextmanager
    def _unit(self, read_only: bool = False, lazy_commit: bool = False) -> Iterator[Connection]:
        """A short transaction of the store's own, committed on exit (outages wrapped); with
        ``lazy_commit``, one whose commit need not wait for the disk (`Dialect.lazy_commit`)."""
        with self._read() if read_only else self._write(lazy_commit) as connection:
            try:
                yield connection
            except DBAPIError as exc:
                self._raise(exc, "query")

    @contextmanager
    def _write(self, lazy_commit: bool = False) -> Iterator[Connection]:
        with self._transaction(lazy_commit) as tx:
            yield tx.connection

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        connection = self._begin(read_only=True)
        try:
            yield connection
        finally:
            self._rollback_quietly(connection)
            connection.close()

    def _rollback_quietly(self, connection: Connection) -> None:
        try:
            connection.rollback()
        except DBAPIError as exc:  # the connection is gone; the database rolls back for us
            log.warning("store.rollback_failed", store=repr(self), error=str(exc.orig))

    def _raise(self, exc: DBAPIError, step: str) -> NoReturn:
        """Re-raise ``exc``, as `StoreUnavailableError` when it means an outage (saying so when
        the disk holding the database is full, whatever words the database chose); a refusal of
        the URL's login or database as `FirstContact.refused` says."""
        if (words := refusal(exc)) is not None:
            raise self._contact.refused(words, StoreUnavailableError) from exc
        if not is_unavailable(exc):
            raise exc
        self._writes.failed(exc)
        full = self.dialect.full_disk(self.url)
        error = f"{exc.orig}; the disk holding {full} is full" if full else str(exc.orig)
        log.warning("store.unavailable", store=repr(self), step=step, error=error)
        raise StoreUnavailableError(f"{self!r} cannot be reached ({step}): {error}") from exc

    def _ensure_tables(self) -> None:
        if self._tables_ready:
            return
        with self._tables_lock:
            if self._tables_ready:
                return
            self._create(lambda: metadata.create_all(self.engine, checkfirst=True))
            with self.engine.begin() as connection:
                deadletters.add_late_columns(connection)
            self._create(lambda: add_late_indexes(self.engine, self.dialect))
            self._tables_ready = True
            log.info("store.ready", store=repr(self))

    def _create(self, create: Callable[[], object]) -> None:
        """Run ``create``, again if another process created some of it between its check and CREATE."""
        try:
            create()
        except DBAPIError as exc:
            if is_unavailable(exc):
                self._raise(exc, "create tables")
            create()

    def open_async(self, connections: int) -> AsyncSqlStore:
        """Async transactions on this database for one event loop, ``connections`` at once
        (`backends.store.aio`); the tables are created before its first transaction."""
        dialect = ASYNC_DIALECTS[self.url.get_backend_name()]()
        return AsyncSqlStore(dialect.async_engine(self.url, connections), dialect, self._clock, repr(self),
                             self._outbox_writer, self.outbox.wakeup, self._writes, self._ensure_tables)

    # -- operations in a short transaction of their own --------------------------------

    def known(self, namespace: str, tokens: Sequence[str]) -> set[str]:
        if not tokens:
            return set()
        with self._unit(read_only=True) as connection:
            return self.dialect.known(connection, namespace, list(dict.fromkeys(tokens)), self._now())

    def forget(self, namespace: str, tokens: Sequence[str]) -> int:
        if not tokens:
            return 0
        with self._unit() as connection:
            return records.forget(connection, self.dialect, namespace, list(dict.fromkeys(tokens)))

    def lease(self, namespace: str, token: str, lease_seconds: float) -> LeaseOutcome:
        with self._unit() as connection:
            return records.lease(connection, self.dialect, namespace, token, self._now(), lease_seconds)

    def complete_lease(self, namespace: str, token: str, result: Any, ttl: float,
                       publish: Deferred | None = None) -> None:
        with self.transaction() as tx:
            try:
                records.complete_lease(tx.connection, self.dialect, namespace, token, result, self._now(), ttl)
                if publish is not None:
                    publish.write(tx)
            except DBAPIError as exc:
                self._raise(exc, "query")

    def ping_write(self) -> None:
        with self._unit() as connection:
            self.dialect.ping_write(connection, self._now())

    def renew_lease(self, namespace: str, token: str, lease_seconds: float) -> bool:
        with self._unit() as connection:
            return records.renew_lease(connection, namespace, token, self._now(), lease_seconds)

    def release_lease(self, namespace: str, token: str) -> None:
        with self._unit() as connection:
            records.release_lease(connection, namespace, token)

    def purge_expired(self) -> int:
        with self._unit() as connection:
            purged = records.purge_expired(connection, self._now())
        log.info("store.purged", store=repr(self), tokens=purged)
        return purged

    def load_offsets(self, group: str) -> dict[QueueRef, int]:
        with self._unit(read_only=True) as connection:
            return progress.load_offsets(connection, group)

    def save_offsets(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        """Upsert offsets in a transaction of their own (outside any handler)."""
        with self._unit() as connection:
            progress.save_offsets(connection, self.dialect, group, offsets)

    def dead_letters(self, group: str, limit: int = 100, after_id: int = 0, body_limit: int | None = None) -> list[DeadLetter]:
        with self._unit(read_only=True) as connection:
            return deadletters.page(connection, group, limit, after_id, body_limit)

    def get_dead_letter(self, letter_id: int) -> DeadLetter | None:
        with self._unit(read_only=True) as connection:
            return deadletters.get(connection, letter_id)

    def delete_dead_letters(self, ids: Sequence[int]) -> int:
        with self._unit() as connection:
            return deadletters.remove(connection, self.dialect, list(ids), self._now())

    def dead_letter_ids(self, group: str, ids: Sequence[int] | None = None, *, min_replays: int = 0) -> list[int]:
        with self._unit(read_only=True) as connection:
            return deadletters.ids_of(connection, self.dialect, group, ids, min_replays)

    def take_dead_letters(self, group: str, ids: Sequence[int], hold: float) -> list[DeadLetter]:
        with self._unit() as connection:
            return deadletters.take(connection, self.dialect, group, ids, now := self._now(), now + hold)

    def settle_dead_letters(self, sent: Sequence[int], unsent: Sequence[int]) -> int:
        with self._unit() as connection:
            return deadletters.settle(connection, self.dialect, list(sent), list(unsent))

    def count_dead_letters(self, group: str) -> int:
        with self._unit(read_only=True) as connection:
            return deadletters.count(connection, group)

    def dead_letter_groups(self) -> list[str]:
        with self._unit(read_only=True) as connection:
            return deadletters.groups(connection)

    def mark_replayed(self, ids: Sequence[int]) -> int:
        """Count one more replay on each dead letter in ``ids``; return how many."""
        with self._unit() as connection:
            return deadletters.mark_replayed(connection, self.dialect, list(ids))

    def write_refusal(self) -> str | None:
        return self._writes.refusal

    def close(self) -> None:
        self.engine.dispose()

    def _now(self) -> float:
        return self._clock.time()
