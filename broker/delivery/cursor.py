"""A group's position in one queue: what is done, what is out with a member, what waits.

The committed offset is the lowest offset not yet done, so a restart, which
resumes there, redelivers only what was not acknowledged. Above it the
cursor knows which offsets are done, which are *held* (delivered, leased to
a member until a deadline), which are *ready again* (a lease ended, a queue
moved) and which are *parked* (not due yet: scheduled or delayed).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from broker.store import StoredMessage

DELIVER_AT_HEADER = "x-deliver-at"
"""Seconds since the epoch before which a message is not delivered (scheduled, or a delayed retry)."""


@dataclass
class Held:
    """A message delivered to ``member`` and not yet acknowledged."""

    message: StoredMessage
    receipt: str
    member: str
    deadline: float
    count: int  # deliveries of this message so far, this one included
    delivered: bool = False  # DELIVERED ack: received, no longer counted in the prefetch window


class QueueCursor:
    """One group's (or broadcast member's) consumption state of one (topic, queue)."""

    def __init__(self, ident: int, topic: str, queue: int, committed: int) -> None:
        self.ident = ident
        self.topic = topic
        self.queue = queue
        self.committed = committed
        self.next = committed  # the next offset to read from the store
        self.held: dict[int, Held] = {}
        self.done: set[int] = set()
        self.ready: dict[int, tuple[StoredMessage, int]] = {}  # offset -> (message, deliveries so far)
        self.parked: list[tuple[float, int, StoredMessage, int]] = []  # heap of (due, offset, ...)

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.queue)

    def finish(self, offset: int) -> None:
        """``offset`` is done (acked, dead-lettered, filtered out); the committed offset moves
        past every done offset in a row."""
        self.held.pop(offset, None)
        self.ready.pop(offset, None)
        if offset < self.committed:
            return
        self.done.add(offset)
        while self.committed in self.done:
            self.done.remove(self.committed)
            self.committed += 1

    def skip_to(self, offset: int) -> int:
        """Retention removed what lay below ``offset``: move past it; how many were skipped."""
        skipped = max(0, offset - self.committed)
        if offset > self.committed:
            self.done = {o for o in self.done if o >= offset}
            self.committed = offset
        self.next = max(self.next, offset)
        return skipped

    def seek(self, offset: int) -> None:
        """Start again at ``offset``: everything held, ready, parked or done is forgotten."""
        self.committed = self.next = offset
        self.held.clear()
        self.done.clear()
        self.ready.clear()
        self.parked.clear()

    def release(self, offset: int) -> None:
        """A held message goes back to be delivered again (its lease ended, its queue moved)."""
        held = self.held.pop(offset, None)
        if held is not None:
            self.ready[offset] = (held.message, held.count)

    def park(self, due: float, message: StoredMessage, count: int) -> None:
        heapq.heappush(self.parked, (due, message.queue_offset, message, count))

    def unpark_due(self, now: float) -> None:
        while self.parked and self.parked[0][0] <= now:
            _, offset, message, count = heapq.heappop(self.parked)
            self.ready[offset] = (message, count)

    def next_due(self) -> float | None:
        return self.parked[0][0] if self.parked else None

    def pending(self, end: int) -> int:
        """Messages of the queue up to ``end`` not done yet (held, ready, parked or unread)."""
        return max(0, end - self.committed - len(self.done))
