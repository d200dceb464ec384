"""The batch fence: which run a micro-batch belongs to, and whether it was already committed.

Spark gives ``foreachBatch`` the batch id; after a driver restart it replays
the last batch whose offsets were logged but whose commit was not, with the
same id. The fence records (name, batch id, run id) in the batch's own store
transaction, so a replay of a committed batch is recognised and skipped.

The *run id* is the streaming query's ``id``: Spark writes it to
``<checkpointLocation>/metadata`` when the checkpoint is created and reads it
back on every restart, so it is stable across restarts of one checkpoint and
new for a fresh checkpoint. A fresh checkpoint that reuses a fence name thus
starts again at batch 0 under a new run id, which the store reports as a
`FenceConflictError` rather than silently skipping the new run's batches.
"""

from __future__ import annotations

import json
from typing import Any

import structlog

from backends.errors import ConfigurationError, FenceConflictError
from backends.store.base import Transaction

log = structlog.get_logger("reliable.spark")

QUERY_ID_PROPERTY = "sql.streaming.queryId"
"""The local property Spark sets on the micro-batch thread to the query's ``id``."""


def run_identity(df: Any, checkpoint_location: str | None = None) -> str:
    """The id of the streaming query that produced ``df`` (its checkpoint's identity).

    Read from the micro-batch thread's local property; outside a running query
    (a batch function called by hand) from ``<checkpoint_location>/metadata``.
    """
    session = df.sparkSession
    query_id = session.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
    if query_id:
        return str(query_id)
    if checkpoint_location:
        return _checkpoint_id(session, checkpoint_location)
    raise ConfigurationError(
        "cannot tell which streaming query this batch belongs to: the batch function was not "
        "called by a running query and no checkpoint_location was given to foreach_batch"
    )


def _checkpoint_id(session: Any, checkpoint_location: str) -> str:
    path = checkpoint_location.rstrip("/") + "/metadata"
    try:
        lines = [row.value for row in session.read.text(path).collect()]
        return str(json.loads(lines[0])["id"])
    except Exception as exc:  # any filesystem Spark reads: the error types vary
        raise ConfigurationError(
            f"checkpoint_location={checkpoint_location!r}: cannot read the query id from {path} ({exc})"
        ) from exc


def open_batch(tx: Transaction, name: str, batch_id: int, run_id: str) -> bool:
    """Record the batch in ``tx``; False (logged) when it is a replay of a committed batch."""
    try:
        fresh = tx.fence(name, batch_id, run_id)
    except FenceConflictError:
        log.error("spark.fence.conflict", name=name, batch_id=batch_id, run_id=run_id)
        raise
    if not fresh:
        log.info("spark.batch.replayed", name=name, batch_id=batch_id, run_id=run_id)
    return fresh
