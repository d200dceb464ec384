"""Spark Structured Streaming ``foreachBatch`` with reliable's guarantees.

``@foreach_batch(app, name=..., token=...)`` turns ``fn(df, batch_id, tx)``
into a ``foreachBatch`` function: replayed batches are skipped (a fence in
the store), rows whose token is already recorded are dropped on the
executors, poison rows go to a dead-letter table, failures are retried with
backoff. See docs/spark.md.
"""

from __future__ import annotations

from reliable.spark.deadletters import RowDeadLetter
from reliable.spark.report import BatchReport, BatchStatus
from reliable.spark.sinks import insert_rows, read_dead_letters
from reliable.spark.wrapper import BatchWriter, foreach_batch

__all__ = [
    "BatchReport",
    "BatchStatus",
    "BatchWriter",
    "RowDeadLetter",
    "foreach_batch",
    "insert_rows",
    "read_dead_letters",
]
