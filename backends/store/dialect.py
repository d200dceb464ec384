"""What differs between the databases a store runs on: a few primitives per dialect.

`SqlStore` writes every public operation once over a `Dialect`: how the
engine is built, the ``INSERT`` that knows ``ON CONFLICT``, how a read-only
unit begins, how a batch of tokens is claimed and looked up, whether a
claim can be sent ahead, how a write probe proves the disk takes writes, and
how the outbox's rows are locked and announced. `backends.store.sqlite` and
`backends.store.postgresql` implement them; nothing else asks which
database it is on.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Index,
    Select,
    Table,
    TextClause,
    insert,
    select,
)
from sqlalchemy.engine import URL

from backends.store.claims import Claim, ClaimPath
from backends.store.schema import outbox, outbox_sent, write_probe

if TYPE_CHECKING:  # imported by the async path only: it loads SQLAlchemy's ORM (0.15 s a start)
    from sqlalchemy.ext.asyncio import AsyncEngine


class Dialect(ABC):
    """The primitives of one database, for one store (a claim path may keep state)."""

    chunk: int
    """How many values one ``IN (...)`` list may carry (under the bound-parameter limit)."""
    locks_rows: bool = False
    """Whether transactions lock rows (``skip_locked`` skips those others hold); where they do
    not, a write transaction holds the whole database."""
    written: TextClause
    """A query whose answer changes once the open transaction writes a row: a transaction
    that committed proves the disk takes writes only if it wrote (`backends.store.refusals`)."""

    def __init__(self) -> None:
        self.claim: ClaimPath = self.claim_paths()

    def full_disk(self, url: URL) -> str | None:
        """The directory of the database's files when the disk holding them has no room left,
        else None (a server database's disk cannot be seen from here)."""
        return None

    @abstractmethod
    def engine(self, url: URL) -> Engine:
        """An engine tuned for this database (pool, locking)."""

    @abstractmethod
    def async_engine(self, url: URL, connections: int) -> AsyncEngine:
        """The same database through its asyncio driver, tuned alike, with a pool of
        ``connections`` (one per message in flight; `backends.store.aio`)."""

    @abstractmethod
    def insert(self, table: Table) -> Any:
        """The dialect's ``INSERT`` construct, which knows ``ON CONFLICT``."""

    @abstractmethod
    def read_only(self, connection: Connection) -> None:
        """Prepare ``connection``, not yet begun, for a unit of work that only reads."""

    @abstractmethod
    def claim_paths(self) -> ClaimPath:
        """The ways this database claims a batch, chained with ``|`` (the last always decides)."""

    @abstractmethod
    def known(self, connection: Connection, namespace: str, batch: Sequence[str], now: float) -> set[str]:
        """The tokens of ``batch`` recorded DONE and not expired at ``now``, in one query."""

    def claim_ahead(self, connection: Connection, claim: Claim) -> Any:
        """Send ``claim`` without waiting for it (a `backends.store.ahead.ClaimAhead`), or None
        where the database cannot."""
        return None

    @abstractmethod
    def among(self, column: ColumnElement[Any], values: Sequence[Any]) -> ColumnElement[bool]:
        """``column`` is one of ``values``, bound as one parameter: the statement's text stays the
        same whatever their number, and no bound-parameter limit applies."""

    def lazy_commit(self, connection: Connection) -> None:
        """Prepare ``connection``, not yet begun, for a unit whose commit need not wait for the
        disk: a crash of the machine (not of a process) may undo it. Only for writes that are
        safe to lose: the relay's marks, whose loss sends the rows again under the same message
        ids, as a relay killed before its commit does. Elsewhere the commit waits as any other."""

    def ping_write(self, connection: Connection, now: float) -> None:
        """Replace the write probe's row (`backends.store.schema.write_probe`): a write the disk
        must find room for, as a handler's would (SQLite appends the pages it changed to its WAL
        at commit); the database's refusal of it propagates."""
        connection.execute(write_probe.delete())
        connection.execute(insert(write_probe).values(written_at=now))

    def add_index(self, engine: Engine, index: Index) -> None:
        """Build ``index`` on its table, which exists already, unless it is there (an index that a
        later version added to a table an earlier one made)."""
        index.create(engine, checkfirst=True)

    def move(self, connection: Connection, source: Table, target: Table, where: ColumnElement[bool],
             changed: dict[str, ColumnElement[Any]]) -> None:
        """Move the rows of ``source`` that match ``where`` to ``target`` (of the same columns),
        with the values of ``changed`` (by column name) in place of theirs."""
        names = [c.name for c in source.columns]
        connection.execute(insert(target).from_select(names, select(*(changed.get(c.name, c) for c in source.columns))
                                                      .where(where)))
        connection.execute(source.delete().where(where))

    def mark_sent(self, connection: Connection, where: ColumnElement[bool], changed: dict[str, ColumnElement[Any]]) -> None:
        """Record the outbox rows of ``where`` sent, with the values of ``changed`` (state, sent at):
        moved to the sent rows, where a row's move costs the database less than its update (on
        PostgreSQL the update is a new version of the row in three indexes)."""
        self.move(connection, outbox, outbox_sent, where, changed)

    def skip_locked(self, statement: Select[Any]) -> Select[Any]:
        """``statement`` locking the rows it selects, skipping those another transaction holds
        (where the database locks rows; elsewhere the write transaction holds them all)."""
        return statement

    def announce_outbox(self, connection: Connection, name: str) -> None:
        """Tell relays in other processes, once the transaction commits, that outbox ``name``
        has new rows (where the database can; elsewhere they poll)."""

    def listen_outbox(self, url: URL, name: str, wake: Callable[[], None], stopping: threading.Event) -> None:
        """Call ``wake`` whenever another process announces outbox ``name``, until ``stopping``
        is set (returns at once where the database cannot announce)."""
