"""A group's position in one queue: what is done, what is out with a member, what waits.

The committed offset is the lowest offset not yet done, so a restart, which
resumes there, redelivers only what was not acknowledged. Above it the
cursor knows which offsets are done, which are *held* (delivered, leased to
a member until a deadline), which are *ready again* (a lease ended, a queue
moved) and which are *parked* (not due yet: scheduled or delayed).

What a fetch takes from one queue shares one `Lease`, and every held
delivery is also found by its receipt in the broker's receipt table (one
table for all cursors, kept here in step with ``held``), so an ack of a
whole fetch is a dictionary look-up per receipt and a range per queue.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

from broker.delivery.values import Delivery

DELIVER_AT_HEADER = "x-deliver-at"
"""Seconds since the epoch before which a message is not delivered (scheduled, or a delayed retry)."""


@dataclass(slots=True, eq=False)
class Lease:
    """Deliveries of one queue handed to ``member`` together, leased until ``deadline``."""

    cursor: QueueCursor
    member: str
    deadline: float
    delivered: bool = False  # DELIVERED ack: received, no longer counted in the prefetch window


class Held(NamedTuple):
    """A message delivered and not yet acknowledged (its delivery count is the delivery's)."""

    delivery: Delivery
    lease: Lease

    @property
    def member(self) -> str:
        return self.lease.member


Receipts = dict[str, Held]
"""Every held delivery of a broker by its receipt."""

_new_held = tuple.__new__
_run: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of side effects in C (itertools' "consume")


class QueueCursor:
    """One group's (or broadcast member's) consumption state of one (topic, queue)."""

    def __init__(self, ident: int, topic: str, queue: int, committed: int, receipts: Receipts) -> None:
        self.ident = ident
        self.topic = topic
        self.queue = queue
        self.committed = committed
        self.next = committed  # the next offset to read from the store
        self.held: dict[int, Held] = {}
        self.done: set[int] = set()
        self.ready: dict[int, Delivery] = {}  # offset -> its last delivery (count: deliveries so far)
        self.parked: list[tuple[float, int, Delivery]] = []  # heap of (due, offset, message)
        self.receipts = receipts

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.queue)

    def hold(self, deliveries: Sequence[Delivery], offsets: Sequence[int], receipts: Sequence[str],
             lease: Lease) -> None:
        """``deliveries`` (at ``offsets``, named by ``receipts``) are out under ``lease``."""
        helds = list(map(_new_held, repeat(Held), zip(deliveries, repeat(lease))))
        self.held.update(zip(offsets, helds))
        self.receipts.update(zip(receipts, helds))

    def relet(self, held: Held, lease: Lease) -> None:
        """``held`` stays out, under another lease (extended, or DELIVERED)."""
        again = Held(held.delivery, lease)
        self.held[held.delivery.offset] = again
        self.receipts[held.delivery.receipt] = again

    def finish(self, offset: int) -> None:
        """``offset`` is done (acked, dead-lettered, filtered out); the committed offset moves
        past every done offset in a row."""
        held = self.held.pop(offset, None)
        if held is not None:
            del self.receipts[held.delivery.receipt]
        self.ready.pop(offset, None)
        if offset >= self.committed:
            self.done.add(offset)
            self._advance()

    def finish_held(self, offsets: Sequence[int], receipts: Sequence[str]) -> None:
        """The held deliveries at ``offsets`` (distinct, named by ``receipts``) are done."""
        _run(map(self.held.pop, offsets))
        _run(map(self.receipts.pop, receipts))
        low, high = min(offsets), max(offsets)
        if low == self.committed and high - low == len(offsets) - 1:  # exactly the next ones
            self.committed = high + 1
        else:
            self.done.update(filter(self.committed.__le__, offsets))
        self._advance()

    def _advance(self) -> None:
        done = self.done
        while self.committed in done:
            done.remove(self.committed)
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
        for held in self.held.values():
            del self.receipts[held.delivery.receipt]
        self.committed = self.next = offset
        self.held.clear()
        self.done.clear()
        self.ready.clear()
        self.parked.clear()

    def release(self, offset: int) -> None:
        """A held message goes back to be delivered again (its lease ended, its queue moved)."""
        held = self.held.pop(offset, None)
        if held is not None:
            del self.receipts[held.delivery.receipt]
            self.ready[offset] = held.delivery

    def park(self, due: float, message: Delivery) -> None:
        heapq.heappush(self.parked, (due, message.offset, message))

    def unpark_due(self, now: float) -> None:
        while self.parked and self.parked[0][0] <= now:
            _, offset, message = heapq.heappop(self.parked)
            self.ready[offset] = message

    def next_due(self) -> float | None:
        return self.parked[0][0] if self.parked else None

    def pending(self, end: int) -> int:
        """Messages of the queue up to ``end`` not done yet (held, ready, parked or unread)."""
        return max(0, end - self.committed - len(self.done))
