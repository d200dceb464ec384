"""The store's primitives on PostgreSQL (psycopg 3).

Its unique index makes a concurrent twin wait natively. A batch of tokens is
claimed in one statement whose text stays the same whatever the batch size
(prepared once): the tokens travel as one text of lines, the claimed ones
come back in one row. A large batch is first tried with ``COPY``, and a whole
batch's claim can be sent ahead in a pipeline (`backends.store.ahead`).
Relays lock outbox rows with ``FOR UPDATE SKIP LOCKED`` and are woken by
``NOTIFY`` from the transactions that wrote rows (``LISTEN`` on a connection
of their own).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Index,
    Select,
    String,
    Table,
    any_,
    bindparam,
    create_engine,
    event,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError
from sqlalchemy.schema import CreateIndex, DropIndex
from tenacity import wait_exponential

from backends.backoff import Backoff
from backends.clock import SYSTEM_CLOCK
from backends.store.ahead import ClaimAhead
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
from backends.store.schema import tokens, write_probe

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

POOL_SIZE = 16  # one connection per worker thread
MAX_OVERFLOW = 8
INSERT_PAGE = 5_000  # rows per multi-row INSERT of executemany (offsets)
RECYCLE_SECONDS = 1800
CHUNK = 20_000

OUTBOX_CHANNEL = "reliable_outbox"
"""The ``NOTIFY`` channel of every outbox; the payload names the outbox."""
LISTEN_CHECK = 0.5  # seconds between looks at the stop event while listening
LISTEN_RETRY_MAX = 5.0  # seconds: the longest wait before listening again after an outage

log = structlog.get_logger(__name__)

_LAZY_COMMIT = "reliable_lazy_commit"
"""Execution option of a unit whose commit need not wait for the WAL's flush (``synchronous_commit``
off for that transaction: a crash of the server's machine may undo it, nothing else can)."""


_INDEX_STATE = text(
    "select i.indisvalid as valid,"
    " exists (select from pg_stat_progress_create_index p where p.index_relid = i.indexrelid) as building"
    " from pg_index i join pg_class c on c.oid = i.indexrelid"
    " where c.relname = :name and c.relnamespace = current_schema()::regnamespace"
)
"""Whether index ``:name`` can be used, and whether a build of it runs now (absent: no row)."""


def _on_begin(connection: Connection) -> None:
    if connection.get_execution_options().get(_LAZY_COMMIT):
        connection.exec_driver_sql("SET LOCAL synchronous_commit = off")


def _concurrently(connection: Connection, ddl: CreateIndex | DropIndex) -> None:
    """Run ``ddl`` CONCURRENTLY. The schema's indexes do not ask for it: ``create_all`` builds them
    with a new (empty) table, in its transaction, where PostgreSQL refuses it."""
    connection.exec_driver_sql(str(ddl.compile(dialect=connection.dialect)).replace("INDEX ", "INDEX CONCURRENTLY ", 1))


COPY_CLAIM_MIN = 5_000
"""Batches at least this large are first claimed with ``COPY`` (see `claim_by_copy`)."""


def _claim_from(tokens_set: Any) -> Any:
    return on_conflict_reclaim(
        postgresql.insert(tokens).from_select(CLAIM_COLUMNS, select(*claimed_row(tokens_set)))
    )


_LINE = literal("\n")
_CLAIMED = _claim_from(
    func.unnest(func.string_to_array(bindparam("lines", type_=String), _LINE)).column_valued("token")
).cte("claimed")
_CLAIM_LINES = select(func.count(), func.string_agg(_CLAIMED.c.token, _LINE))
_TOKEN_ARRAY = bindparam("tokens", type_=postgresql.ARRAY(String))
_CLAIM_ARRAY = _claim_from(func.unnest(_TOKEN_ARRAY).column_valued("token"))
_KNOWN = select(tokens.c.token).where(
    tokens.c.namespace == bindparam("namespace", type_=String),
    tokens.c.token == any_(_TOKEN_ARRAY),
    tokens.c.state == DONE,
    tokens.c.expires_at >= bindparam("now"),
)


class _Batch(ClaimPath):
    """Any batch: as one text of lines (far cheaper to send and read back than arrays), or
    as an array when a token holds a line break."""

    def __call__(self, connection: Connection, claim: Claim) -> set[str]:
        lines = "\n".join(claim.batch)
        if lines.count("\n") != len(claim.batch) - 1:
            parameters = {**claim.parameters, "tokens": list(claim.batch)}
            return set(connection.execute(_CLAIM_ARRAY, parameters).scalars())
        count, claimed = connection.execute(_CLAIM_LINES, {**claim.parameters, "lines": lines}).one()
        if count == len(claim.batch):
            return set(claim.batch)
        return set(claimed.split("\n")) if count else set()


class _CopyFirst(ClaimPath):
    """A large batch of DONE tokens is first claimed with ``COPY`` (`claim_by_copy`); after a
    conflict in a namespace, ``then`` claims its batches until one is all new again."""

    def __init__(self, then: ClaimPath, min_size: int = COPY_CLAIM_MIN) -> None:
        self.then, self.min_size = then, min_size
        self._conflicted: set[str] = set()  # namespaces whose last large claim met a known token

    def __call__(self, connection: Connection, claim: Claim) -> set[str] | None:
        if len(claim.batch) < self.min_size or claim.state != DONE:
            return self.then(connection, claim)
        if claim.namespace not in self._conflicted:
            if claim_by_copy(connection, claim):
                return set(claim.batch)
            self._conflicted.add(claim.namespace)
        claimed = self.then(connection, claim)
        if claimed is not None and len(claimed) == len(claim.batch):
            self._conflicted.discard(claim.namespace)
        return claimed


class PostgreSQL(Dialect):
    chunk = CHUNK
    locks_rows = True
    written = text("select txid_current_if_assigned() is not null")  # an id is drawn at the first write

    def engine(self, url: URL) -> Engine:
        # No pre-ping: it would cost a round trip per transaction. A connection that died
        # idle fails its next transaction as StoreUnavailableError (the message is deferred,
        # not lost), and SQLAlchemy then invalidates the pool; recycling bounds idle age.
        engine = create_engine(
            url,
            pool_recycle=RECYCLE_SECONDS,
            pool_size=POOL_SIZE,
            max_overflow=MAX_OVERFLOW,
            pool_timeout=30,
            insertmanyvalues_page_size=INSERT_PAGE,
            connect_args={"connect_timeout": 10},
        )
        event.listen(engine, "begin", _on_begin)
        return engine

    def async_engine(self, url: URL, connections: int) -> AsyncEngine:
        # imported here: SQLAlchemy's asyncio loads its ORM, which only async handlers need
        from sqlalchemy.ext.asyncio import create_async_engine

        return create_async_engine(  # psycopg's async driver: one connection per message in flight,
            url,                     # no overflow (a shared server's max_connections is the limit)
            pool_recycle=RECYCLE_SECONDS,
            pool_size=connections,
            max_overflow=0,
            pool_timeout=30,
            insertmanyvalues_page_size=INSERT_PAGE,
            connect_args={"connect_timeout": 10},
        )

    def insert(self, table: Table) -> Any:
        return postgresql.insert(table)

    def read_only(self, connection: Connection) -> None:
        # a lone SELECT needs no BEGIN/ROLLBACK round trips around it
        connection.execution_options(isolation_level="AUTOCOMMIT")

    def lazy_commit(self, connection: Connection) -> None:
        connection.execution_options(**{_LAZY_COMMIT: True})

    def ping_write(self, connection: Connection, now: float) -> None:
        # PostgreSQL refuses only a write that must grow a file (53100, "could not extend file"):
        # a row that fits a page the table has passes on a full disk. TRUNCATE gives the table a
        # new, empty file, which the row must grow by a page.
        connection.execute(text(f"truncate {write_probe.name}"))
        connection.execute(insert(write_probe).values(written_at=now))

    def claim_paths(self) -> ClaimPath:
        return _CopyFirst(OneRow(postgresql.insert) | _Batch())

    def known(self, connection: Connection, namespace: str, batch: Sequence[str], now: float) -> set[str]:
        parameters = {"namespace": namespace, "tokens": list(batch), "now": now}
        return set(connection.execute(_KNOWN, parameters).scalars())

    def claim_ahead(self, connection: Connection, claim: Claim) -> ClaimAhead:
        return ClaimAhead(connection, claim)

    def among(self, column: ColumnElement[Any], values: Sequence[Any]) -> ColumnElement[bool]:
        return column == any_(bindparam(None, list(values), type_=postgresql.ARRAY(column.type)))

    def add_index(self, engine: Engine, index: Index) -> None:
        # CONCURRENTLY: a large table keeps taking writes while it is indexed (a plain build locks
        # them out until it ends); it runs outside any transaction, in steps of its own
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            state = connection.execute(_INDEX_STATE, {"name": index.name}).one_or_none()
            if state is not None and (state.valid or state.building):
                return  # built, or being built by another process that starts at the same time
            if state is not None:  # left unusable by a build that died: built anew
                _concurrently(connection, DropIndex(index, if_exists=True))
            _concurrently(connection, CreateIndex(index, if_not_exists=True))

    def move(self, connection: Connection, source: Table, target: Table, where: ColumnElement[bool],
             changed: dict[str, ColumnElement[Any]]) -> None:
        # one statement: each row is found once, and deleted as it is read
        moved = source.delete().where(where).returning(*source.columns).cte("moved")
        connection.execute(insert(target).from_select(
            [c.name for c in source.columns], select(*(changed.get(c.name, moved.c[c.name]) for c in source.columns))))

    def skip_locked(self, statement: Select[Any]) -> Select[Any]:
        return statement.with_for_update(skip_locked=True)

    def announce_outbox(self, connection: Connection, name: str) -> None:
        connection.execute(select(func.pg_notify(OUTBOX_CHANNEL, name)))

    def listen_outbox(self, url: URL, name: str, wake: Callable[[], None], stopping: threading.Event) -> None:
        import psycopg  # the postgres extra; only reached on PostgreSQL

        conninfo = url.set(drivername="postgresql").render_as_string(hide_password=False)
        reconnect = Backoff(SYSTEM_CLOCK, wait_exponential(multiplier=0.1, max=LISTEN_RETRY_MAX))
        while not stopping.is_set():
            try:  # named after the outbox, so an operator finds it in pg_stat_activity
                with psycopg.connect(conninfo, autocommit=True, connect_timeout=10,
                                     application_name=f"reliable outbox {name}") as connection:
                    connection.execute(f"LISTEN {OUTBOX_CHANNEL}")
                    wake()  # rows announced while nobody listened
                    log.info("outbox.listening", outbox=name, channel=OUTBOX_CHANNEL)
                    reconnect.succeeded()
                    while not stopping.is_set():
                        if any(n.payload == name for n in connection.notifies(timeout=LISTEN_CHECK)):
                            wake()
            except psycopg.Error as exc:
                reconnect.failed(_listen_failed(name, exc), stopping)


def _listen_failed(outbox: str, error: Exception) -> Callable[[int, float], None]:
    """What a failed ``LISTEN`` logs before its wait: failures in a row, the wait, the error."""
    return lambda failures, wait: log.warning("outbox.listen_failed", outbox=outbox, failures=failures,
                                              retry_in=round(wait, 3), error=str(error))


_COPY = f"COPY {tokens.name} (namespace, token, state, created_at, expires_at) FROM STDIN"


class AsyncPostgreSQL(PostgreSQL):
    """PostgreSQL under async transactions: ``COPY`` needs psycopg's sync cursor, so every
    batch is claimed with ``INSERT ... ON CONFLICT``."""

    def claim_paths(self) -> ClaimPath:
        return OneRow(postgresql.insert) | _Batch()


def claim_by_copy(connection: Connection, claim: Claim) -> bool:
    """Claim all of ``claim``'s batch with one ``COPY``; False if any token has a row.

    ``COPY`` inserts about twice as fast as ``INSERT ... ON CONFLICT`` but
    cannot skip a conflict: a token with any row (done, leased, expired, or
    being inserted by a concurrent twin that then commits) fails it with a
    unique violation. It runs in a savepoint, so a failure rolls back to where
    it started and the caller claims the batch the usual way.
    """
    import psycopg  # the postgres extra; only reached on PostgreSQL

    nested = connection.begin_nested()
    try:
        driver = connection.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cursor, cursor.copy(_COPY) as copy:
            data = copy_rows(claim.namespace, claim.batch, claim.now, claim.expires_at)
            if data is not None:
                copy.write(data)
            else:  # a NUL in a token: let the driver refuse it, as the INSERT would
                for token in claim.batch:
                    copy.write_row((claim.namespace, token, DONE, claim.now, claim.expires_at))
    except psycopg.errors.UniqueViolation:
        nested.rollback()
        return False
    except psycopg.Error as exc:  # as SQLAlchemy would raise it: outages are recognised
        nested.rollback()
        raise DBAPIError.instance(_COPY, None, exc, psycopg.Error) from exc
    except BaseException:
        nested.rollback()
        raise
    nested.commit()
    return True


_COPY_ESCAPES = (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))


def copy_rows(namespace: str, batch: Sequence[str], now: float, expires_at: float) -> str | None:
    """The ``COPY`` text of ``batch``'s DONE rows, built in a few passes over one string.

    Per row, ``write_row`` costs more than PostgreSQL's own insert of it; here
    the tokens are joined with NUL (which no PostgreSQL text can hold), escaped
    for the text format all at once, and the NULs replaced by the rest of a row
    and the start of the next. None when a token holds a NUL.
    """
    body = "\0".join(batch)
    if body.count("\0") != len(batch) - 1:
        return None
    for plain, escaped in _COPY_ESCAPES:
        body = body.replace(plain, escaped)
        namespace = namespace.replace(plain, escaped)
    start, end = f"{namespace}\t", f"\t{DONE}\t{now!r}\t{expires_at!r}\n"
    return start + body.replace("\0", end + start) + end
