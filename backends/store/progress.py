"""Progress records: consumer offsets per queue, and batch fences for replayed batches."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import Connection, case, delete, select

from backends.errors import FenceConflictError
from backends.store.dialect import Dialect
from backends.store.schema import fences, offsets
from backends.types import QueueRef

FENCE_HISTORY = 1_000  # batches kept per fence name below the newest (for inspection)


def save_offsets(
    connection: Connection, dialect: Dialect, group: str, positions: Mapping[QueueRef, int]
) -> None:
    """Upsert the next offset to consume per queue; a saved position never moves backwards."""
    if not positions:
        return
    insert = dialect.insert(offsets)
    statement = insert.on_conflict_do_update(
        index_elements=[offsets.c.group, offsets.c.topic, offsets.c.queue],
        set_={"next_offset": case(
            (insert.excluded.next_offset > offsets.c.next_offset, insert.excluded.next_offset),
            else_=offsets.c.next_offset,
        )},
    )
    rows = [
        {"group": group, "topic": ref.topic, "queue": ref.queue, "next_offset": offset}
        for ref, offset in sorted(positions.items())  # a fixed order avoids deadlocks
    ]
    connection.execute(statement, rows)


def load_offsets(connection: Connection, group: str) -> dict[QueueRef, int]:
    """The offsets saved for ``group``."""
    statement = select(offsets.c.topic, offsets.c.queue, offsets.c.next_offset).where(
        offsets.c.group == group
    )
    return {
        QueueRef(row.topic, row.queue): row.next_offset for row in connection.execute(statement)
    }


def fence(
    connection: Connection, dialect: Dialect, name: str, batch_id: int, run_id: str, now: float
) -> bool:
    """Record batch ``batch_id`` of ``name``; False if it (or a later batch) was recorded.

    Batch ids of one run only grow, so any id at or below the newest recorded
    one is a replay. The same name recorded by another run at or beyond
    ``batch_id`` means the name is being reused (e.g. a fresh checkpoint): a
    `FenceConflictError`, never a silent skip.
    """
    newest = connection.execute(
        select(fences.c.batch_id, fences.c.run_id)
        .where(fences.c.name == name)
        .order_by(fences.c.batch_id.desc())
        .limit(1)
    ).first()
    if newest is not None and batch_id <= newest.batch_id:
        _check_run(name, batch_id, run_id, newest.run_id)
        return False
    insert = dialect.insert(fences)
    inserted = connection.execute(
        insert.values(name=name, batch_id=batch_id, run_id=run_id, recorded_at=now)
        .on_conflict_do_nothing(index_elements=[fences.c.name, fences.c.batch_id])
        .returning(fences.c.batch_id)
    ).first()
    if inserted is None:  # a concurrent twin recorded it first (we waited on its key)
        winner = connection.execute(
            select(fences.c.run_id).where(fences.c.name == name, fences.c.batch_id == batch_id)
        ).scalar_one()
        _check_run(name, batch_id, run_id, winner)
        return False
    connection.execute(
        delete(fences).where(fences.c.name == name, fences.c.batch_id < batch_id - FENCE_HISTORY)
    )
    return True


def _check_run(name: str, batch_id: int, run_id: str, recorded_run_id: str) -> None:
    if recorded_run_id != run_id:
        raise FenceConflictError(
            f"fence {name!r}: batch {batch_id} was already recorded by run {recorded_run_id!r}, "
            f"not by run {run_id!r} (is a fresh checkpoint reusing the name?)"
        )
