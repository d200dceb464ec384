"""The row dead-letter table: rows a batch could not use, each with its error.

A row whose validation raised (or that has no token), or every row of a batch
whose retries are spent when the wrapper is told to dead-letter it, is kept
here as JSON with the error's type and text, the batch id and the time. The
records are written in the batch's own transaction, so a replayed batch never
writes them twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    select,
)

from backends.errors import ConfigurationError

ROW = "row"  # scope: one row failed validation
BATCH = "batch"  # scope: the whole batch failed past its retries

_TABLES: dict[str, Table] = {}
_METADATA = MetaData()


@dataclass(frozen=True)
class PoisonRow:
    """A row the batch cannot use, as the driver collects it: its token (None when it has
    none), the row as JSON, and the error that refused it."""

    token: str | None
    row_json: str
    error_type: str
    error_message: str


@dataclass(frozen=True)
class RowDeadLetter:
    """One dead-lettered row: the row as JSON and why it was refused."""

    name: str
    batch_id: int
    run_id: str
    token: str | None
    row_json: str
    error_type: str
    error_message: str
    failed_at: float
    scope: str = ROW
    id: int | None = None

    @property
    def row(self) -> Any:
        """The row, decoded from JSON."""
        return json.loads(self.row_json)


def table_for(name: str) -> Table:
    """The SQLAlchemy table called ``name`` (one definition per process)."""
    if not name.replace("_", "").isalnum() or not name[0].isalpha() or len(name) > 60:
        raise ConfigurationError(
            f"dead_letters={name!r} is not allowed; expected a table name of letters, digits and "
            "underscores, starting with a letter, at most 60 characters"
        )
    if name not in _TABLES:
        _TABLES[name] = Table(
            name,
            _METADATA,
            Column("id", Integer, primary_key=True, autoincrement=True),
            Column("name", String(200), nullable=False),
            Column("batch_id", BigInteger, nullable=False),
            Column("run_id", String(64), nullable=False),
            Column("token", String(512)),
            Column("row_json", Text, nullable=False),
            Column("error_type", String(200), nullable=False),
            Column("error_message", Text, nullable=False),
            Column("failed_at", Float, nullable=False),
            Column("scope", String(10), nullable=False),
            Index(f"ix_{name}_name_batch", "name", "batch_id"),
        )
    return _TABLES[name]


def ensure_table(connection: Connection, name: str) -> Table:
    """Create the dead-letter table ``name`` if it does not exist yet."""
    table = table_for(name)
    table.create(connection, checkfirst=True)
    return table


def record(connection: Connection, name: str, letters: Sequence[RowDeadLetter]) -> int:
    """Insert ``letters`` (in the caller's transaction); return how many."""
    if not letters:
        return 0
    table = table_for(name)
    rows = [
        {
            "name": letter.name,
            "batch_id": letter.batch_id,
            "run_id": letter.run_id,
            "token": letter.token,
            "row_json": letter.row_json,
            "error_type": letter.error_type,
            "error_message": letter.error_message,
            "failed_at": letter.failed_at,
            "scope": letter.scope,
        }
        for letter in letters
    ]
    connection.execute(table.insert(), rows)
    return len(rows)


def read(connection: Connection, table: str, name: str | None = None) -> list[RowDeadLetter]:
    """The dead letters in ``table`` (of wrapper ``name`` when given), oldest first."""
    t = table_for(table)
    statement = select(t).order_by(t.c.id)
    if name is not None:
        statement = statement.where(t.c.name == name)
    return [RowDeadLetter(**_fields(row._mapping)) for row in connection.execute(statement)]


def tokens_in(connection: Connection, table: str, name: str, tokens: Sequence[str]) -> set[str]:
    """Which of ``tokens`` already have a dead letter of wrapper ``name`` in ``table``."""
    t = table_for(table)
    found: set[str] = set()
    for start in range(0, len(tokens), 1000):
        part = list(tokens[start:start + 1000])
        statement = select(t.c.token).where(t.c.name == name, t.c.token.in_(part))
        found.update(row[0] for row in connection.execute(statement))
    return found


def row_json(row: Mapping[str, Any]) -> str:
    """A row as JSON; values JSON cannot hold (timestamps, decimals, bytes) become strings."""
    return json.dumps(dict(row), default=str, ensure_ascii=False, separators=(",", ":"))


def _fields(mapping: Any) -> dict[str, Any]:
    return {key: mapping[key] for key in RowDeadLetter.__dataclass_fields__}


def letters_from(
    rows: Iterable[PoisonRow],
    *,
    name: str,
    batch_id: int,
    run_id: str,
    failed_at: float,
    scope: str = ROW,
) -> list[RowDeadLetter]:
    """The dead letters of ``rows``, refused in batch ``batch_id`` of ``run_id``."""
    return [
        RowDeadLetter(name=name, batch_id=batch_id, run_id=run_id, token=row.token,
                      row_json=row.row_json, error_type=row.error_type,
                      error_message=row.error_message, failed_at=failed_at, scope=scope)
        for row in rows
    ]
