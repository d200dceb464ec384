"""A group's position in one queue: what is done, what is out with a member, what waits.

The committed offset is the lowest offset not yet done, so a restart, which
resumes there, redelivers only what was not acknowledged. Above it the
cursor knows which offsets are done, which are *held* (delivered, leased to
a member until a deadline), which are *ready again* (a lease ended, a queue
moved) and which are *parked* (not due yet: scheduled or delayed; kept by
offset and delivery count, read from the store again once due, as the ready
messages of a group that emptied are: `broker.delivery.spill`).

What a fetch takes from one queue is out under one `Lease` (member, deadline,
the receipts and offsets it covers), and the broker's receipt table (one for
all cursors, kept here in step with ``held``) names each receipt's lease: so
an ack of a whole fetch is two dictionary look-ups per receipt and a range
per queue. A held message is kept as its row of the fetch's columns (`Held`),
one tuple: its `Delivery` is made only if it is nacked, dead-lettered or
released, never for the server, which sends the columns as they are.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, itemgetter
from typing import Any

from broker.delivery.sizes import column_sizes
from broker.delivery.values import Delivery, DeliveryColumns
from broker.delivery.waiting import Parked, Spilled

DELIVER_AT_HEADER = "x-deliver-at"
"""Seconds since the epoch before which a message is not delivered (scheduled, or a delayed retry)."""


class ByteWindow:
    """The bytes of messages (`broker.delivery.sizes`) held unacknowledged by the members that share it (a member's
    own, or one connection's on the server), and how many they may hold before they are handed
    more (``limit``; None: no bound)."""

    __slots__ = ("__weakref__", "held", "limit")

    def __init__(self, limit: int | None = None) -> None:
        self.held = 0
        self.limit = limit

    def room(self, most: int) -> int:
        """How many more bytes may be handed out, at most ``most``."""
        return most if self.limit is None else min(most, self.limit - self.held)


@dataclass(slots=True, eq=False)
class Lease:
    """Deliveries of one queue out with ``member`` together until ``deadline`` (the monotonic
    clock's: a wall clock step neither ends a lease early nor stretches it); their bodies count
    in ``window``, the member's."""

    cursor: QueueCursor
    member: str
    deadline: float
    window: ByteWindow
    delivered: bool = False  # DELIVERED ack: received, no longer counted in the prefetch window
    offsets: dict[str, int] = field(default_factory=dict)  # receipt -> queue offset, still out


Receipts = dict[str, Lease]


Held = tuple[Any, ...]
"""A delivery out under a lease, as one tuple: its row of the fetch's columns (the receipt first),
its size (`broker.delivery.sizes`), then the shape of those columns (`Shape`); its `Delivery` is
made only when needed (`delivery_of`)."""
Shape = tuple[dict[str, Any], tuple[str, ...]]
"""The fields the same for every delivery of a fetch, and the names of the fields of its rows."""


def receipt_of(held: Held) -> str:
    return held[0]  # type: ignore[no-any-return]  # the row starts with the receipt


def delivery_of(held: Held) -> Delivery:
    same, names = held[-1]
    return Delivery(**same, **dict(zip(names, held)))


_SIZE = itemgetter(-2)


def held_bytes(rows: Iterable[Held]) -> int:
    """The bytes held deliveries count in their window (each row's size, kept beside its fields)."""
    return sum(map(_SIZE, rows))


class ReceiptNames:
    """Names for the receipts of one broker: ``<broker>.<fetch>:<place in the fetch>``.

    Unique among the broker's receipts, and a receipt of an earlier broker on the
    same store names no delivery of this one (``<broker>`` is 48 random bits), so a
    stale receipt is only ever ignored. Made with one concatenation each: to a
    member a receipt is an opaque string.
    """

    def __init__(self) -> None:
        self._broker = secrets.token_hex(6)
        self._fetches = itertools.count(1)

    def __call__(self, count: int) -> list[str]:
        """The receipts of ``count`` deliveries handed out together."""
        numbers = _NUMBERS[:count] if count <= len(_NUMBERS) else map(str, range(count))
        return list(map(add, repeat(f"{self._broker}.{next(self._fetches)}:"), numbers))


_NUMBERS = tuple(map(str, range(1024)))

_run: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator of side effects in C


class QueueCursor:
    """One group's (or broadcast member's) consumption state of one (topic, queue)."""

    def __init__(self, ident: int, topic: str, queue: int, committed: int, receipts: Receipts) -> None:
        self.ident = ident
        self.topic = topic
        self.queue = queue
        self.committed = committed
        self.next = committed  # the next offset to read from the store
        self.held: dict[int, Held] = {}  # offset -> its delivery, out under a lease
        self.leases: dict[Lease, None] = {}  # the leases something of this queue is out under
        self.done: set[int] = set()
        self.acked_ahead: set[int] = set()  # acked before a restart (the ack journal), not read again yet
        self.ready: dict[int, Delivery] = {}  # offset -> its last delivery (count: deliveries so far)
        # ready, to be read from the store again (its group emptied, or it was parked and fell due)
        self.spilled = Spilled()
        self.parked = Parked()  # not due yet, by monotonic due time
        self.receipts = receipts

    @property
    def key(self) -> tuple[str, int]:
        return (self.topic, self.queue)

    def holders(self) -> set[str]:
        """The members something of this queue is out with."""
        return {lease.member for lease in self.leases}

    def lease_of(self, offset: int) -> Lease | None:
        held = self.held.get(offset)
        return self.receipts[receipt_of(held)] if held is not None else None

    def delivery(self, offset: int) -> Delivery:
        """The held delivery at ``offset``."""
        return delivery_of(self.held[offset])

    def hold(self, handed: DeliveryColumns, offsets: Sequence[int], receipts: Sequence[str],
             lease: Lease) -> None:
        """The deliveries ``handed`` (at ``offsets``, named by ``receipts``) are out under ``lease``."""
        names = tuple(handed.columns)
        if names[0] != "receipt":
            raise ValueError(f"held deliveries' columns start with the receipt, not {names[0]!r}")
        shape: Shape = (dict(handed.same), names)
        sizes = column_sizes(handed)
        self.held.update(zip(offsets, zip(*handed.columns.values(), sizes, repeat(shape))))
        lease.window.held += sum(sizes)
        lease.offsets.update(zip(receipts, offsets))
        self.receipts.update(zip(receipts, repeat(lease)))
        self.leases[lease] = None

    def relet(self, receipts: Iterable[str], lease: Lease) -> None:
        """The held deliveries ``receipts`` name stay out, under ``lease`` now (extended, DELIVERED)."""
        for receipt in receipts:
            lease.offsets[receipt] = self._let_go(receipt)
            self.receipts[receipt] = lease
        self.leases[lease] = None

    def finish(self, offset: int) -> None:
        """``offset`` is done (acked, dead-lettered, filtered out); the committed offset moves
        past every done offset in a row."""
        self._unhold(offset)
        self.ready.pop(offset, None)
        if offset >= self.committed:
            self.done.add(offset)
            self._advance()

    def finish_leased(self, lease: Lease, receipts: Sequence[str]) -> int:
        """The deliveries of ``lease`` that ``receipts`` name (distinct, already taken out of the
        receipt table) are done; how many."""
        if len(receipts) == len(lease.offsets):  # all of them: no receipt to look up
            offsets = list(lease.offsets.values())
            lease.offsets.clear()
        else:
            offsets = list(map(lease.offsets.pop, receipts))
        if not lease.offsets:
            del self.leases[lease]
        lease.window.held -= held_bytes(map(self.held.pop, offsets))
        low, high = min(offsets), max(offsets)
        if low == self.committed and high - low == len(offsets) - 1:  # exactly the next ones
            self.committed = high + 1
        else:
            self.done.update(filter(self.committed.__le__, offsets))
        self._advance()
        return len(offsets)

    def release(self, offset: int) -> None:
        """A held message goes back to be delivered again (its lease ended, its queue moved)."""
        held = self._unhold(offset)
        if held is not None:
            self.ready[offset] = delivery_of(held)

    def _unhold(self, offset: int) -> Held | None:
        """The held delivery at ``offset`` (if any) is out no more: its receipt and bytes let go."""
        held = self.held.pop(offset, None)
        if held is not None:
            self.receipts[receipt_of(held)].window.held -= held_bytes((held,))
            self._let_go(receipt_of(held))
        return held

    def _let_go(self, receipt: str) -> int:
        """``receipt`` leaves the receipt table and its lease; its offset."""
        lease = self.receipts.pop(receipt)
        offset = lease.offsets.pop(receipt)
        if not lease.offsets:
            del self.leases[lease]
        return offset

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

    def forward(self, offset: int) -> None:
        """A position reader committed up to ``offset`` while no member held the queue: what lies
        below is done (no longer ready or parked); what was acked above stays done."""
        if offset <= self.committed:
            return
        self.skip_to(offset)
        self.acked_ahead = {o for o in self.acked_ahead if o >= offset}
        self.ready = {o: message for o, message in self.ready.items() if o >= offset}
        self.spilled.drop_below(offset)
        self.parked.drop_below(offset)
        self._advance()

    def seek(self, offset: int) -> None:
        """Start again at ``offset``: everything held, ready, parked or done is forgotten."""
        for lease in self.leases:
            lease.window.held -= held_bytes(map(self.held.__getitem__, lease.offsets.values()))
            _run(map(self.receipts.pop, lease.offsets))
            lease.offsets.clear()
        self.committed = self.next = offset
        self.held.clear()
        self.leases.clear()
        self.done.clear()
        self.acked_ahead.clear()
        self.ready.clear()
        self.spilled.clear()
        self.parked.clear()

    def spill(self) -> None:
        """Its group has no member left: the messages ready again leave memory, their offsets and
        delivery counts kept, to be read from the store again when a member comes
        (`broker.delivery.spill`). Bodies, keys and headers stayed in memory for as long as the
        group stayed empty: a client could pin its window's worth in each of ``max_groups``."""
        if self.ready:
            self.spilled.extend((o, m.delivery_count) for o, m in self.ready.items())
            self.ready.clear()

    def park(self, due: float, message: Delivery) -> None:
        """``message`` waits until ``due``, by its offset and delivery count alone: it is read from
        the store again when due (`broker.delivery.spill`). Kept whole, a producer scheduling a
        gigabyte for next year made every group reading the topic hold that gigabyte until then."""
        self.parked.push(due, message.offset, message.delivery_count)

    def unpark_due(self, now: float) -> None:
        for offset, delivered in self.parked.pop_due(now):
            self.spilled.add(offset, delivered)

    def next_due(self) -> float | None:
        return self.parked.next_due()

    def pending(self, end: int) -> int:
        """Messages of the queue up to ``end`` not done yet (held, ready, parked or unread)."""
        return max(0, end - self.committed - len(self.done))
