"""Reading a topic by position, outside any group: what a stream processor (Spark) needs.

A stream processor keeps its own positions (its checkpoint) and asks for
exact ranges: the same (topic, queue, offset range) always gives the same
messages. It tells the broker how far it has committed, so the group's
offsets (lag, retention) follow it: `Positions.commit_group` moves them,
never back and never past a queue's end. `Positions` reads the store, the
topic table and the offset book it is given; it reaches into no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from broker.delivery.offsets import OffsetBook
from broker.delivery.topics import check_name
from broker.delivery.values import Delivery, DeliveryColumns
from broker.errors import DeliveryError
from broker.store import MessageStore


class Positions:
    """Reads by position and a stream processor's offsets; ``has_members(group)``: whether the
    group has live members now (its offsets are then the broker's, moved by their acks);
    ``forward(group, topic, offsets)``: the in-memory cursors of a group whose members all left
    move forward with a commit; ``save()``: write the offsets; ``queues(topic)``: a topic's
    queue count (the publishing component's topic table)."""

    def __init__(self, store: MessageStore, queues: Callable[[str], int], offsets: OffsetBook,
                 lock: AbstractContextManager[Any], has_members: Callable[[str], bool],
                 forward: Callable[[str, str, Sequence[int]], None],
                 save: Callable[[], None], max_bytes: int | None = None) -> None:
        """``max_bytes``: of messages one read hands out at most (at least one)."""
        self._store = store
        self._max_bytes = max_bytes
        self._queues = queues
        self._offsets = offsets
        self._lock = lock
        self._has_members = has_members
        self._forward = forward
        self._save = save

    def read(self, topic: str, queue: int, offset: int, max_messages: int) -> list[Delivery]:
        """Up to ``max_messages`` messages of (topic, queue) from ``offset`` on; no lease, no receipt."""
        return self.read_columns(topic, queue, offset, max_messages).deliveries()

    def read_columns(self, topic: str, queue: int, offset: int, max_messages: int) -> DeliveryColumns:
        """`read` column by column, as the store reads them: no `Delivery` per message (what the
        server sends, and what a columnar reader such as Spark's Arrow source takes)."""
        check_name("topic", topic, internal=True)
        if offset < 0 or max_messages < 1:
            raise DeliveryError(f"read of {topic}/{queue}: offset {offset} must be >= 0 and "
                                f"max_messages {max_messages} >= 1")
        batch = self._store.read_batch(topic, queue, offset, max_messages, self._max_bytes)
        count = len(batch.queue_offsets)
        return DeliveryColumns(count, {"receipt": "", "topic": topic, "queue": queue}, {
            "offset": list(batch.queue_offsets), "message_id": batch.message_ids, "body": batch.bodies,
            "key": batch.keys, "tag": batch.tags, "headers": batch.headers,
            "delivery_count": [attempt + 1 for attempt in batch.attempts],
            "published_at": batch.store_times}) if count else DeliveryColumns(0, {}, {})

    def queue_offsets(self, topic: str) -> list[list[int]]:
        """``[first kept, end]`` per queue of ``topic`` (created if new)."""
        check_name("topic", topic, internal=True)
        with self._lock:
            count = self._queues(topic)
        return [[self._store.min_offset(topic, q), self._store.max_offset(topic, q)] for q in range(count)]

    def group_offsets(self, group: str, topic: str) -> list[int | None]:
        """``group``'s committed offset per queue of ``topic`` (None: never committed)."""
        with self._lock:
            count = self._queues(topic)
            return [self._offsets.get((group, topic, q)) for q in range(count)]

    def commit_group(self, group: str, topic: str, offsets: Sequence[int]) -> None:
        """Record ``offsets`` (the next offset per queue) as ``group``'s; never moves one back, and
        never past a queue's end. Refused while the group has live members; once they all left
        (or were silent past the session timeout) the group's cursors move forward too, so a
        member joining later starts there, and what it acked above stays done."""
        check_name("group", group)
        with self._lock:
            if len(offsets) != self._queues(topic):
                raise DeliveryError(f"commit_group {group!r}: {len(offsets)} offsets for "
                                    f"{self._queues(topic)} queues of {topic!r}")
            if self._has_members(group):
                raise DeliveryError(f"group {group!r} has live members: its offsets are the broker's "
                                    "(their acks move them); commit_group is for groups that read by position")
            ends = [self._store.max_offset(topic, queue) for queue in range(len(offsets))]
            beyond = [(q, o, end) for q, (o, end) in enumerate(zip(offsets, ends)) if not 0 <= o <= end]
            if beyond:  # past the end, the group would skip every message written up to there
                raise DeliveryError(f"commit_group {group!r}: offsets (queue, offset, end) {beyond} of "
                                    f"{topic!r} are not between 0 and the queue's end")
            for queue, offset in enumerate(offsets):
                saved = self._offsets.get((group, topic, queue))
                self._offsets.put((group, topic, queue), max(int(offset), saved or 0))
            self._forward(group, topic, offsets)
        self._save()


def first_at(store: MessageStore, topic: str, queue: int, when: float) -> int:
    """The first offset of (topic, queue) stored at or after ``when`` (the end if none):
    a binary search over store times, which grow with the offset."""
    low, high = store.min_offset(topic, queue), store.max_offset(topic, queue)
    while low < high:
        middle = (low + high) // 2
        found = store.read(topic, queue, middle, max_count=1)
        if not found:
            return high
        if found[0].store_time < when:
            low = found[0].queue_offset + 1
        else:
            high = middle
    return low
