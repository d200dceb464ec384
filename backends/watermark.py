"""The done-offset watermark: per queue, the offset below which every message is done.

Messages are registered as fetched and marked done in any order; only the
offset below which everything is done may be committed or saved, so a saved
position never passes a message still in flight. The worker keeps one for
the transports whose consumer keeps offsets (``reliable.commit`` re-exports
it), and a Kafka member keeps one to commit its own done prefix when it
loses a partition.

Offsets between fetched ones that were never fetched hold the position back:
another member may hold them (a leasing transport gives every member every
queue). A transport that reads each queue in order, alone (Kafka's
partitions), says so with ``reads_in_order``: the offsets it skipped hold
nothing to hand out (transaction markers, compacted records, records deleted
by retention) and count as done; and an offset below the position there is
not a message coming back but a new log (the topic was deleted and created
again, offsets start over): the queue starts again at it, nothing above done.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from backends.types import Message, QueueRef


@dataclass
class _Queue:
    """One queue's position, what is fetched and not done, and the done runs above the position."""

    position: int
    reported: int
    end: int  # one past the highest offset fetched or skipped
    in_flight: dict[int, Message] = field(default_factory=dict)
    done: dict[int, int] = field(default_factory=dict)  # runs [start, end) done above the position

    def mark(self, start: int, end: int) -> None:
        if end > self.position:
            start = max(start, self.position)
            self.done[start] = max(self.done.get(start, start), end)

    def advance(self) -> None:
        while (end := self.done.pop(self.position, None)) is not None:
            self.position = max(self.position, end)
        if self.done and min(self.done) < self.position:  # runs overlapping the position
            runs, self.done = self.done, {}
            for start, end in runs.items():
                self.mark(start, end)
            self.advance()

    def would_stand(self, offsets: set[int]) -> int:
        position = self.position
        while True:
            if position in offsets:
                position += 1
            elif position in self.done:
                position = max(position + 1, self.done[position])
            else:
                return position


class OffsetWatermark:
    """The contiguous prefix of done offsets per queue (thread-safe)."""

    def __init__(self, *, reads_in_order: bool = False) -> None:
        self.reads_in_order = reads_in_order
        """Offsets skipped between fetched ones are done (each queue read in order, by one member)."""
        self._lock = threading.Lock()
        self._queues: dict[QueueRef, _Queue] = {}

    def fetched(self, messages: Iterable[Message]) -> None:
        """Register ``messages`` as in flight; a queue not known yet starts at its first fetched offset."""
        with self._lock:
            touched: set[QueueRef] = set()
            for m in messages:
                queue = self._queues.get(m.ref)
                if queue is None:
                    queue = self._queues[m.ref] = _Queue(m.offset, m.offset, m.offset)
                elif m.offset < queue.position and self.reads_in_order:  # the log was replaced
                    queue = self._queues[m.ref] = _Queue(m.offset, m.offset, m.offset)
                elif m.offset < queue.position:  # fetched again: only it is not done any more
                    queue.position, behind = m.offset, queue.position
                    queue.mark(m.offset + 1, behind)
                elif self.reads_in_order and m.offset > queue.end:
                    queue.mark(queue.end, m.offset)
                queue.in_flight[m.offset] = m
                queue.end = max(queue.end, m.offset + 1)
                touched.add(m.ref)
            for ref in touched:
                self._queues[ref].advance()

    def mark_done(self, messages: Iterable[Message]) -> dict[QueueRef, int]:
        """Mark ``messages`` done; return the queues whose position moved since last reported.

        A message may be marked twice (saved with its transaction, then acked);
        the second time changes nothing. A queue not known is not this member's.
        """
        touched: set[QueueRef] = set()
        with self._lock:
            for m in messages:
                queue = self._queues.get(m.ref)
                if queue is not None:
                    queue.in_flight.pop(m.offset, None)
                    queue.mark(m.offset, m.offset + 1)
                    touched.add(m.ref)
            advanced: dict[QueueRef, int] = {}
            for ref in touched:
                queue = self._queues[ref]
                queue.advance()
                if queue.position > queue.reported:
                    queue.reported = advanced[ref] = queue.position
        return advanced

    def positions_if_done(self, messages: Iterable[Message]) -> dict[QueueRef, int]:
        """Where the queues of ``messages`` would stand once they are done too (nothing changes)."""
        offsets: dict[QueueRef, set[int]] = {}
        for m in messages:
            offsets.setdefault(m.ref, set()).add(m.offset)
        with self._lock:
            return {ref: self._queues[ref].would_stand(extra) for ref, extra in offsets.items()
                    if ref in self._queues}

    def start(self, positions: Mapping[QueueRef, int]) -> None:
        """Start queues at known positions (resumed from saved offsets): everything below is done."""
        with self._lock:
            for ref, offset in positions.items():
                self._queues[ref] = _Queue(offset, offset, offset)

    def forget(self, queues: Iterable[QueueRef]) -> None:
        """Drop ``queues`` (revoked, or assigned afresh): their next fetch starts them again."""
        with self._lock:
            for ref in queues:
                self._queues.pop(ref, None)

    def committable(self, queues: Iterable[QueueRef] | None = None) -> dict[QueueRef, int]:
        """The position of ``queues`` (default: every known queue): the next offset to read."""
        with self._lock:
            refs = self._queues if queues is None else [ref for ref in queues if ref in self._queues]
            return {ref: self._queues[ref].position for ref in refs}

    def in_flight(self, queues: Iterable[QueueRef]) -> list[Message]:
        """Fetched messages of ``queues`` not done yet."""
        with self._lock:
            return [m for ref in queues if ref in self._queues for m in self._queues[ref].in_flight.values()]
