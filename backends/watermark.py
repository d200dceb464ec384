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
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from backends.types import Message, QueueRef

MAX_DONE_RUNS = 4096
"""Separate runs of done offsets a queue keeps above its position. A member reading a queue alone
has one per gap among the messages it holds in flight (a fetch's worth at most). A member of a
leasing transport, which gives every member every queue, has one per stretch of offsets the
others took, which it never sees done: without a bound these grew by one for about every message
it finished, for as long as it ran. Past the bound a new separate run is not kept: the position
stops below it, which is only ever lower (those messages come again after a restart and are
skipped by their tokens), never past a message not done."""


@runtime_checkable
class GroupProgress(Protocol):
    """A membership whose transport tells what the group as a whole finished (a leasing transport's:
    its members share every queue, so a member's own done offsets stop at the first another took)."""

    def finished_below(self, in_hand: Mapping[QueueRef, AbstractSet[int]]) -> dict[QueueRef, int]:
        """Per queue of ``in_hand``, the offset below which the group has nothing read and
        unfinished but ``in_hand``'s offsets (the member's own in flight)."""
        ...


class _Runs:
    """Disjoint runs ``[start, end)`` of done offsets, in order; touching runs are joined."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def __len__(self) -> int:
        return len(self.starts)

    def add(self, start: int, end: int, keep: bool = False) -> None:
        """Mark ``[start, end)`` done, joined to the runs it touches; unless ``keep``, dropped if
        it would be a separate run past `MAX_DONE_RUNS`."""
        first = bisect_left(self.ends, start)  # the runs from here on end at or after start
        after = bisect_right(self.starts, end)  # the runs before this start at or before end
        if first < after:
            start, end = min(start, self.starts[first]), max(end, self.ends[after - 1])
        elif len(self.starts) >= MAX_DONE_RUNS and not keep:
            return
        self.starts[first:after], self.ends[first:after] = [start], [end]

    def reach(self, position: int) -> int:
        """How far ``position`` moves over the runs starting at or below it (which are dropped)."""
        taken = bisect_right(self.starts, position)
        if taken:
            position = max(position, self.ends[taken - 1])
            del self.starts[:taken], self.ends[:taken]
        return position

    def would_reach(self, position: int, offsets: set[int]) -> int:
        """How far ``position`` would move over the runs and ``offsets`` (nothing changes)."""
        following = bisect_left(self.ends, position + 1)  # runs ending at or below it do not count
        while True:
            if position in offsets:
                position += 1
            elif following < len(self.starts) and self.starts[following] <= position:
                position = max(position, self.ends[following])
                following += 1
            else:
                return position


@dataclass
class _Queue:
    """One queue's position, what is fetched and not done, and the done runs above the position."""

    position: int
    reported: int
    end: int  # one past the highest offset fetched or skipped
    in_flight: dict[int, Message] = field(default_factory=dict)
    done: _Runs = field(default_factory=_Runs)  # runs done above the position

    def mark(self, start: int, end: int) -> None:
        if end > self.position:  # a run from the position is kept, however many are: it moves it
            self.done.add(max(start, self.position), end, keep=start <= self.position)

    def advance(self) -> None:
        self.position = self.done.reach(self.position)

    def would_stand(self, offsets: set[int]) -> int:
        return self.done.would_reach(self.position, offsets)


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

    def held(self) -> dict[QueueRef, frozenset[int]]:
        """The queues where an offset this member never fetched (another member of a leasing
        transport took it) stops its done offsets short of what it fetched, with its offsets in
        flight there: once they are done too, its position would still wait on the others'."""
        with self._lock:
            return {ref: frozenset(queue.in_flight) for ref, queue in self._queues.items()
                    if queue.would_stand(set(queue.in_flight)) < queue.end}

    def finished(self, positions: Mapping[QueueRef, int]) -> dict[QueueRef, int]:
        """The group as a whole finished every message below ``positions`` but this member's own in
        flight (the other members too, as their transport tells): those offsets are done, so the
        known queues move up to them, never back. Returns the queues whose position moved since
        last reported, as `mark_done` does."""
        advanced: dict[QueueRef, int] = {}
        with self._lock:
            for ref, offset in positions.items():
                queue = self._queues.get(ref)
                if queue is None or offset <= queue.position:
                    continue
                start = queue.position
                for own in sorted(o for o in queue.in_flight if start <= o < offset):
                    queue.mark(start, own)
                    start = own + 1
                queue.mark(start, offset)
                queue.advance()
                queue.end = max(queue.end, offset)
                if queue.position > queue.reported:
                    queue.reported = advanced[ref] = queue.position
        return advanced

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
