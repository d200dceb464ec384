"""Sinks for the batch function: the store's own database (exactly once) and helpers.

`insert_rows` writes a batch's rows through the batch transaction, so they
commit together with the fence and the tokens: a crash before the commit
leaves nothing, a replay after it is skipped. The rows travel from the
executors to the driver for that (in Arrow record batches); size micro-batches
with ``maxFilesPerTrigger`` / ``maxOffsetsPerTrigger`` accordingly. Any other
sink gets at-least-once delivery of de-duplicated rows and must be idempotent
(see docs/spark.md).
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame
from sqlalchemy import Table, TableClause, column, table

from reliable.spark import deadletters
from reliable.spark.deadletters import RowDeadLetter

CHUNK_ROWS = 10_000


def insert_rows(
    df: DataFrame, tx: Any, target: str | Table | TableClause, *, chunk_rows: int = CHUNK_ROWS
) -> int:
    """Insert every row of ``df`` into ``target`` in the batch transaction ``tx``; return how many.

    ``target`` is a SQLAlchemy `Table` or the name of an existing table whose
    columns are named like ``df``'s.
    """
    into = (
        table(target, *(column(name) for name in df.columns)) if isinstance(target, str) else target
    )
    statement = into.insert()
    written = 0
    for batch in df.toArrow().to_batches(max_chunksize=chunk_rows):
        rows = batch.to_pylist()
        if rows:
            tx.execute(statement, rows)
            written += len(rows)
    return written


def read_dead_letters(store: Any, table_name: str, name: str | None = None) -> list[RowDeadLetter]:
    """The rows in dead-letter table ``table_name`` (of wrapper ``name`` when given), oldest first."""
    with store.transaction() as tx:
        deadletters.ensure_table(tx.connection, table_name)
        return deadletters.read(tx.connection, table_name, name)
