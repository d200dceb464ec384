"""The store's primitives on SQLite (the embedded default).

SQLite is made to behave like a server database for the token claim: every
write transaction starts with ``BEGIN IMMEDIATE`` (a concurrent twin waits for
the writer instead of failing with "database is locked"), in WAL mode with a
30 s busy timeout and ``synchronous=FULL``; a read-only unit uses a deferred
``BEGIN`` (WAL readers never block writers). A batch of tokens travels as one
JSON array read back with ``json_each``: the statement text stays the same
whatever the batch size, and no bound-parameter limit applies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    String,
    Table,
    bindparam,
    create_engine,
    event,
    func,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL

from backends.store.claims import (
    CLAIM_COLUMNS,
    DONE,
    Claim,
    ClaimPath,
    OneRow,
    claimed_row,
    on_conflict_reclaim,
)
from backends.store.dialect import Dialect
from backends.store.schema import outbox, tokens

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

BUSY_TIMEOUT_MS = 30_000
CHUNK = 900  # values per IN (...) list: under SQLite's classic 999-parameter limit

_READ_ONLY = "reliable_read_only"
"""Execution option of a read-only unit: its BEGIN is deferred."""
_LAZY_COMMIT = "reliable_lazy_commit"
"""Execution option of a unit whose commit need not wait for the disk: ``synchronous=NORMAL``."""
_SYNCHRONOUS = "reliable_synchronous"
"""Where a connection's ``info`` keeps its ``synchronous`` level (only changed between transactions)."""

_TOKENS = func.json_each(bindparam("tokens", type_=String)).table_valued("value")

# "WHERE true" keeps INSERT ... SELECT ... ON CONFLICT unambiguous for SQLite's parser.
_CLAIM = on_conflict_reclaim(
    sqlite.insert(tokens).from_select(CLAIM_COLUMNS, select(*claimed_row(_TOKENS.c.value)).where(true()))
)
_KNOWN = select(tokens.c.token).where(
    tokens.c.namespace == bindparam("namespace", type_=String),
    tokens.c.token.in_(select(_TOKENS.c.value)),
    tokens.c.state == DONE,
    tokens.c.expires_at >= bindparam("now"),
)


class _JsonBatch(ClaimPath):
    """Any batch, as one JSON array."""

    def __call__(self, connection: Connection, claim: Claim) -> set[str]:
        parameters = {**claim.parameters, "tokens": json.dumps(list(claim.batch))}
        return set(connection.execute(_CLAIM, parameters).scalars())


class SQLite(Dialect):
    chunk = CHUNK

    def engine(self, url: URL) -> Engine:
        if url.database and not url.query.get("uri"):
            # tokens and dead letters with their bodies: a directory it creates is the owner's alone
            Path(url.database).expanduser().parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
        event.listen(engine, "connect", _on_connect)
        event.listen(engine, "begin", _on_begin)
        return engine

    written = text("select total_changes()")  # rows this connection changed, ever

    def full_disk(self, url: URL) -> str | None:
        # a full disk is not always SQLITE_FULL: the WAL index (-shm) that cannot grow is an I/O error
        if not url.database or url.query.get("uri"):
            return None
        directory = Path(url.database).expanduser().absolute().parent
        try:
            free = os.statvfs(directory).f_bavail
        except OSError:
            return None
        return str(directory) if free == 0 else None

    def async_engine(self, url: URL, connections: int) -> AsyncEngine:
        # SQLite writes one transaction at a time: messages in flight queue for one connection in
        # the pool (first come, first served) rather than in SQLite's busy handler, which polls
        # imported here: SQLAlchemy's asyncio loads its ORM, which only async handlers need
        from sqlalchemy.ext.asyncio import create_async_engine

        del connections
        engine = create_async_engine(url.set(drivername="sqlite+aiosqlite"), pool_size=1, max_overflow=0,
                                     pool_timeout=BUSY_TIMEOUT_MS / 1000,
                                     connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
        event.listen(engine.sync_engine, "connect", _on_connect)
        event.listen(engine.sync_engine, "begin", _on_begin)
        return engine

    def insert(self, table: Table) -> Any:
        return sqlite.insert(table)

    def read_only(self, connection: Connection) -> None:
        connection.execution_options(**{_READ_ONLY: True})

    def lazy_commit(self, connection: Connection) -> None:
        connection.execution_options(**{_LAZY_COMMIT: True})

    def claim_paths(self) -> ClaimPath:
        return OneRow(sqlite.insert) | _JsonBatch()

    def mark_sent(self, connection: Connection, where: ColumnElement[bool], changed: dict[str, ColumnElement[Any]]) -> None:
        # in place: a move deletes each row from five B-trees (its random message id's among them)
        # and inserts it into three, where the update changes the row and its three state indexes;
        # 500 rows wrote 150 pages to the WAL moved and 58 updated, and every page is written
        # again, and synced, by the checkpoint
        connection.execute(update(outbox).where(where).values(changed))

    def among(self, column: ColumnElement[Any], values: Sequence[Any]) -> ColumnElement[bool]:
        listed = func.json_each(bindparam(None, json.dumps(list(values)), type_=String)).table_valued("value")
        return column.in_(select(listed.c.value))

    def known(self, connection: Connection, namespace: str, batch: Sequence[str], now: float) -> set[str]:
        parameters = {"namespace": namespace, "tokens": json.dumps(list(batch)), "now": now}
        return set(connection.execute(_KNOWN, parameters).scalars())


def _on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = FULL")
    finally:
        cursor.close()


def _on_begin(connection: Any) -> None:
    options = connection.get_execution_options()
    if options.get(_READ_ONLY):
        connection.exec_driver_sql("BEGIN")
        return
    # WAL with synchronous=NORMAL: the commit is not fsynced; a power loss may undo it, nothing
    # else can, and the database stays whole
    level = "NORMAL" if options.get(_LAZY_COMMIT) else "FULL"
    if connection.connection.info.get(_SYNCHRONOUS, "FULL") != level:
        connection.exec_driver_sql(f"PRAGMA synchronous = {level}")
        connection.connection.info[_SYNCHRONOUS] = level
    connection.exec_driver_sql("BEGIN IMMEDIATE")
