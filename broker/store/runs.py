"""Batch runs: the ids ``<batch id>.0``, ``<batch id>.1``, ... of a producer's batch named by one batch id.

A producer that names a whole publish with one batch id (Kafka's producer
id and sequence, per batch rather than per message) gets the ids
``<batch id>.0 ... <batch id>.(n-1)`` for its messages. The records of such a batch lie
one after another in the log, so the id index needs an entry only for the
first record of each run: a record whose id is the next of a run begun at
``<batch id>.0``, right after the record before it, is found by reading on from
there. That spares an index entry (and the engine a de-duplication entry) per
message.

Which records the writer leaves out is said by the caller
(`RecordColumns.continues`); recovery, which re-indexes from the log alone,
leaves out those that `RunTracker` finds continuing a run. Recovery may leave
out more than the writer did (a resent tail that happens to follow its
prefix in the log), never an id a lookup could not reach: every id left out
follows, in the log, the id before it in its run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from broker.store.record import StoredMessage

SEPARATOR = "."
MAX_BATCH_ID = 64  # characters of a batch id


def run_ids(batch_id: str, count: int, first: int = 0) -> list[str]:
    """The ids of positions ``first .. first + count - 1`` of ``batch_id``'s run."""
    return list(map((batch_id + SEPARATOR).__add__, map(str, range(first, first + count))))


def split_run_id(message_id: str) -> tuple[str, int] | None:
    """(batch_id, position) of an id of the run form (``batch_id.position``, the position in
    decimal without leading zeros); None for any other id."""
    batch_id, dot, position = message_id.rpartition(SEPARATOR)
    if not (dot and batch_id and position.isascii() and position.isdigit()):
        return None
    if position[0] == "0" and position != "0":
        return None
    return batch_id, int(position)


def find_run(batch_id: str, count: int, indexed: Callable[[str], StoredMessage | None],
             read_on: Callable[[StoredMessage], Iterator[StoredMessage]]) -> list[StoredMessage | None]:
    """The records of ids ``batch_id.0 .. batch_id.(count-1)`` that a store holds, None for the
    others: ``indexed`` finds an id by its own index entry, ``read_on`` gives a record and those
    after it in the log. A batch is appended from its first id on, and a resend appends what a
    torn write lost: so the walk starts at ``batch_id.0`` and, where a run breaks, goes on from
    the next id's own entry."""
    found: list[StoredMessage | None] = [None] * count
    position = 0
    while position < count and (first := indexed(run_ids(batch_id, 1, position)[0])) is not None:
        for expected, message in zip(run_ids(batch_id, count - position, position), read_on(first)):
            if message.message_id != expected:
                break
            found[position] = message
            position += 1
    return found


class RunTracker:
    """Recovery's side of the rule: which ids, read in log order, continue a run from ``.0``."""

    def __init__(self) -> None:
        self._expected = ""  # the id that would continue the current run

    def continues(self, message_id: bytes) -> bool:
        """Whether ``message_id`` (the next record's id in the log) continues the current run;
        it then becomes the run's latest."""
        expected, self._expected = self._expected, ""
        text = message_id.decode("utf-8", "replace")
        run = split_run_id(text) if "." in text else None
        if run is None:
            return False
        batch_id, position = run
        if position and text != expected:
            return False
        self._expected = run_ids(batch_id, 1, position + 1)[0]
        return position > 0  # a run begins at 0
