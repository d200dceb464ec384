"""Engines for the store: which URLs are accepted, and how each database is tuned.

SQLite is made to behave like a server database for the token claim: every
write transaction starts with ``BEGIN IMMEDIATE`` (a concurrent twin waits for
the writer instead of failing with "database is locked"), in WAL mode with a
30 s busy timeout and ``synchronous=FULL``. PostgreSQL needs nothing special:
its unique index makes the twin wait natively.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError

from backends.errors import ConfigurationError, UnsupportedURLError

T = TypeVar("T")

ALLOWED_SCHEMES = ("sqlite", "postgresql", "postgresql+psycopg")
SQLITE_BUSY_TIMEOUT_MS = 30_000
POSTGRES_POOL_SIZE = 16  # one connection per worker thread
POSTGRES_MAX_OVERFLOW = 8
POSTGRES_INSERT_PAGE = 5_000  # rows per multi-row INSERT of executemany (offsets)
POSTGRES_RECYCLE_SECONDS = 1800
SQLITE_CHUNK = 900  # tokens per IN (...) list: under SQLite's classic 999-parameter limit
POSTGRES_CHUNK = 20_000

# Execution option a read-only unit of work sets so SQLite uses a deferred BEGIN
# (WAL readers never block writers).
READ_ONLY = "reliable_read_only"


def parse_store_url(url: str) -> URL:
    """The SQLAlchemy URL for ``url``, plain ``postgresql://`` mapped to psycopg 3."""
    allowed = ", ".join(ALLOWED_SCHEMES)
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise UnsupportedURLError(
            f"store URL {url!r} cannot be parsed; allowed schemes: {allowed}"
        ) from exc
    shown = parsed.render_as_string(hide_password=True)
    if parsed.drivername not in ALLOWED_SCHEMES:
        raise UnsupportedURLError(
            f"store URL {shown!r} has scheme {parsed.drivername!r}; allowed schemes: {allowed}"
        )
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise ConfigurationError(
            f"store URL {shown!r} is an in-memory SQLite database, which each pooled connection "
            "would see empty; use a file, e.g. sqlite:///./.reliable/store.db"
        )
    return parsed


def build_engine(url: URL) -> Engine:
    """An engine tuned for ``url``'s database (pool, SQLite locking)."""
    if url.get_backend_name() == "sqlite":
        if url.database and not url.query.get("uri"):
            Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30.0})
        _tune_sqlite(engine)
        return engine
    # No pre-ping: it would cost a round trip per transaction. A connection that died
    # idle fails its next transaction as StoreUnavailableError (the message is deferred,
    # not lost), and SQLAlchemy then invalidates the pool; recycling bounds idle age.
    return create_engine(
        url,
        pool_recycle=POSTGRES_RECYCLE_SECONDS,
        pool_size=POSTGRES_POOL_SIZE,
        max_overflow=POSTGRES_MAX_OVERFLOW,
        pool_timeout=30,
        insertmanyvalues_page_size=POSTGRES_INSERT_PAGE,
        connect_args={"connect_timeout": 10},
    )


def _tune_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = FULL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        if connection.get_execution_options().get(READ_ONLY):
            connection.exec_driver_sql("BEGIN")
        else:
            connection.exec_driver_sql("BEGIN IMMEDIATE")


def is_unavailable(exc: BaseException) -> bool:
    """True when a database error means "cannot reach / use the database right now"."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def upsert(connection: Any, table: Any) -> Any:
    """The dialect's ``INSERT`` that knows ``ON CONFLICT`` (PostgreSQL or SQLite)."""
    if connection.dialect.name == "postgresql":
        return postgresql_insert(table)
    return sqlite_insert(table)


def chunk_size(connection: Any) -> int:
    """How many tokens one statement may carry and stay under the bound-parameter limit."""
    return SQLITE_CHUNK if connection.dialect.name == "sqlite" else POSTGRES_CHUNK


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """``items`` in consecutive slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
