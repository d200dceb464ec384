"""Spark Structured Streaming ``foreachBatch`` with reliable's guarantees.

``@foreach_batch(app, name=..., token=...)`` turns ``fn(df, batch_id, tx)``
into a ``foreachBatch`` function: replayed batches are skipped (a fence in
the store), rows whose token is already recorded are dropped on the
executors, poison rows go to a dead-letter table, failures are retried with
backoff. See docs/spark.md.

The names below are imported when first used: Spark's Python workers import
``reliable.spark.source`` (the broker as a streaming source) on every
executor and for every query's start, and need none of the wrapper's modules.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reliable.spark.deadletters import RowDeadLetter
    from reliable.spark.report import BatchReport, BatchStatus
    from reliable.spark.sinks import insert_rows, read_dead_letters
    from reliable.spark.wrapper import BatchWriter, foreach_batch

_HOMES = {
    "BatchReport": "reliable.spark.report",
    "BatchStatus": "reliable.spark.report",
    "BatchWriter": "reliable.spark.wrapper",
    "RowDeadLetter": "reliable.spark.deadletters",
    "foreach_batch": "reliable.spark.wrapper",
    "insert_rows": "reliable.spark.sinks",
    "read_dead_letters": "reliable.spark.sinks",
}
__all__ = ["BatchReport", "BatchStatus", "BatchWriter", "RowDeadLetter", "foreach_batch", "insert_rows",
           "read_dead_letters"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'reliable.spark' has no attribute {name!r}")
    return getattr(import_module(home), name)
