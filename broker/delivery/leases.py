"""`Leases`: the deliveries out with members, and every way one ends.

What a fetch takes from one queue goes out under one lease (`cursor.Lease`);
the receipt table names each receipt's lease, and each member's prefetch
window counts what it holds. A receipt settles a delivery only for the member
holding it: receipts are guessable (`cursor.ReceiptNames`), so one naming
another member's delivery (another group's) is ignored like a stale one. A held delivery ends in one of these ways:
acked (done), nacked (copied to ``%RETRY%<group>`` to come back after its
delay, or parked in place where the queue is ordered or broadcast),
dead-lettered (copied to ``%DLQ%<group>``), given back (it never reached its
client: ready again, its count unmoved), marked DELIVERED (out of the window,
still leased), or lapsed (its lease expired or its member left: ready again,
or dead-lettered once ``max_deliveries`` is spent). A copy is appended before
its original is finished, so a crash between delivers it again, never loses it.

`Leases` owns the receipt table and the windows and is called under the
consuming lock (`consume.Consuming`); the cursors it works on are the groups'
(`membership.Membership`), made by `cursor` so they share its receipt table.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import groupby, repeat
from operator import itemgetter
from typing import Any

import structlog

from broker.delivery import copies
from broker.delivery.ackjournal import AckJournal
from broker.delivery.config import DeliveryConfig
from broker.delivery.copies import Copy
from broker.delivery.cursor import ByteWindow, Lease, QueueCursor, ReceiptNames, Receipts
from broker.delivery.group import DLQ_CAUSE, Group, Member
from broker.delivery.values import NO_DELIVERIES, Delivery, DeliveryColumns
from broker.store import MessageStore, StoredBatch
from broker.store.record import NO_HEADERS

log = structlog.get_logger("broker.delivery")
_lease_of, _receipt_of = itemgetter(0), itemgetter(1)  # of what `_valid` gives


class Leases:
    """The receipt table and the prefetch windows; copies go to the ``store`` (a topic's queue
    count asked of ``queues`` first, so the copies' topics are listed) and ``changed`` is told
    whenever deliveries become ready or done."""

    def __init__(self, store: MessageStore, config: DeliveryConfig, queues: Callable[[str], int],
                 changed: Callable[[], None]) -> None:
        self._store = store
        self._config = config
        self._queues = queues
        self._changed = changed
        self.receipts: Receipts = {}  # the lease of every held delivery, by receipt
        self._held: dict[str, int] = {}  # per member: deliveries in its prefetch window
        self._windows: dict[str, ByteWindow] = {}  # per member: the bytes it holds, maybe with others
        self._names = ReceiptNames()
        self._cursor_ids = itertools.count(1)

    def cursor(self, topic: str, queue: int, committed: int) -> QueueCursor:
        """A new cursor of (topic, queue) from ``committed``, its leases in this receipt table."""
        return QueueCursor(next(self._cursor_ids), topic, queue, committed, self.receipts)

    # -- prefetch windows -------------------------------------------------------------

    def open_window(self, member: str) -> None:
        self._held[member] = 0
        self._windows[member] = ByteWindow()

    def close_window(self, member: str) -> None:
        self._held.pop(member, None)
        self._windows.pop(member, None)

    def share_window(self, member: str, window: ByteWindow) -> None:
        """``member``'s bodies count in ``window`` from now on (the server's: one per connection,
        bounding the bytes all its members hold together); it must hold nothing yet. A member
        that already left (timed out) has nothing to bound."""
        own = self._windows.get(member)
        if own is None:
            return
        if own.held:
            raise ValueError(f"member {member!r} already holds deliveries; share a window before its first fetch")
        self._windows[member] = window

    def byte_room(self, member: Member, most: int) -> int:
        """How many more bytes of bodies ``member`` may be handed, at most ``most``."""
        return self._windows[member.ident].room(most)

    def held(self, member: str) -> int:
        """The deliveries in ``member``'s prefetch window."""
        return self._held[member]

    def room(self, member: Member) -> int:
        """How many more deliveries ``member``'s prefetch window takes."""
        return member.prefetch - self._held[member.ident]

    # -- handing out --------------------------------------------------------------------

    def hand_new(self, member: Member, cursor: QueueCursor, batch: StoredBatch, now: float) -> DeliveryColumns:
        """Deliver ``batch`` (read from the store) to ``member``: one lease, one receipt each."""
        offsets, attempts = list(batch.queue_offsets), batch.attempts  # one int per offset, shared by every table
        count = len(offsets)
        if not count:
            return NO_DELIVERIES
        receipts = self._names(count)
        same: dict[str, Any] = {"topic": cursor.topic, "queue": cursor.queue}
        columns: dict[str, Sequence[Any]] = {"receipt": receipts, "offset": offsets,
                                              "message_id": batch.message_ids, "body": batch.bodies}
        stored_at = batch.store_times  # one time per append: mostly one for the whole batch
        for name, column, empty in (("key", batch.keys, ""), ("tag", batch.tags, ""),
                                    ("headers", batch.headers, NO_HEADERS),
                                    ("published_at", stored_at, stored_at[0])):
            if column.count(empty) == count:
                same[name] = empty
            else:
                columns[name] = column
        if attempts.count(attempts[0]) == count:  # first deliveries, or all retried as often
            same["delivery_count"] = attempts[0] + 1
        else:
            columns["delivery_count"] = list(map((1).__add__, attempts))
        handed = DeliveryColumns(count, same, columns)
        cursor.hold(handed, offsets, receipts, Lease(cursor, member.ident, now + member.lease,
                                                     self._windows[member.ident]))
        self._held[member.ident] += count
        return handed

    def hand_again(self, member: Member, cursor: QueueCursor, messages: list[Delivery],
                   now: float) -> DeliveryColumns:
        """Deliver again what a lease, a nack or a schedule put back (ready): a new receipt each."""
        if not messages:
            return NO_DELIVERIES
        receipts = self._names(len(messages))
        handed = DeliveryColumns.of([m._replace(receipt=receipt, delivery_count=m.delivery_count + 1)
                                     for m, receipt in zip(messages, receipts)])
        cursor.hold(handed, [m.offset for m in messages], receipts,
                    Lease(cursor, member.ident, now + member.lease, self._windows[member.ident]))
        self._held[member.ident] += handed.count
        return handed

    # -- the ends of a delivery ---------------------------------------------------------

    def ack(self, member: Member, receipts: Sequence[str], journal: AckJournal | None) -> None:
        """STANDARD for ``receipts`` (a repeated or stale one, or another member's, is ignored),
        each recorded in ``journal`` when there is one."""
        leases = list(map(self.receipts.pop, receipts, repeat(None)))
        start = 0
        for lease, run in groupby(leases):  # the receipts of one fetch of one queue lie together
            stop = start + len(list(run))
            if lease is not None and lease.member != member.ident:  # not its own: put back untouched
                self.receipts.update(dict.fromkeys(receipts[start:stop], lease))
            elif lease is not None:
                if journal is not None:
                    journal.record((member.group, lease.cursor.topic, lease.cursor.queue),
                                   map(lease.offsets.__getitem__, receipts[start:stop]))
                done = lease.cursor.finish_leased(lease, receipts[start:stop])
                if not lease.delivered and lease.member in self._held:
                    self._held[lease.member] -= done
            start = stop
        self._changed()

    def nack(self, group: Group, member: Member, receipts: Sequence[str], due: float,
             parked_due: float) -> None:
        """REDELIVERED: each of ``member``'s is delivered again at ``due`` (wall time, written in its
        retry copy) or, retried in place, parked until ``parked_due`` (the monotonic clock's), or
        dead-lettered once spent."""
        limit = self._config.max_deliveries
        moved: list[Copy] = []
        for cursor, message in self._messages(member, receipts):
            count = message.delivery_count
            if 0 <= limit <= count:
                cause = f"delivered {count} times (max_deliveries={limit})"
                moved.append((cursor, message.offset, copies.dead_letter(group.name, message, cause)))
            elif group.broadcast or group.ordered:  # retried in place: an ordered queue waits for it
                self.release(cursor, message.offset)
                cursor.ready.pop(message.offset, None)
                cursor.park(parked_due, message)
            else:
                moved.append((cursor, message.offset, copies.retry(group.name, message, due)))
        self._move(moved)

    def dead_letter(self, member: Member, receipts: Sequence[str], reason: str) -> None:
        """POISON: each of ``member``'s is copied to its group's ``%DLQ%`` with ``reason``."""
        self._move([(cursor, message.offset, copies.dead_letter(member.group, message, reason))
                    for cursor, message in self._messages(member, receipts)])

    def give_back(self, receipts: Sequence[str], member: Member | None) -> None:
        """The held deliveries ``receipts`` name (``member``'s; None: the engine's own) never reached
        their client: delivered again as if never handed out, their delivery count unmoved (so not
        marked redelivered)."""
        for lease, receipt in self._valid(receipts, member):
            cursor, offset = lease.cursor, lease.offsets[receipt]
            self.release(cursor, offset)
            unseen = cursor.ready[offset]
            cursor.ready[offset] = unseen._replace(delivery_count=unseen.delivery_count - 1)
        self._changed()

    def delivered(self, member: Member, receipts: Sequence[str]) -> None:
        """DELIVERED: ``member``'s stay leased but leave the prefetch window."""
        for lease, named in groupby(self._valid(receipts, member), _lease_of):
            if not lease.delivered:
                moved = list(map(_receipt_of, named))
                lease.cursor.relet(moved, Lease(lease.cursor, lease.member, lease.deadline, lease.window,
                                                delivered=True))
                if lease.member in self._held:
                    self._held[lease.member] -= len(moved)
        self._changed()

    def extend(self, member: Member, receipts: Sequence[str], deadline: float) -> None:
        """Still working: the leases of ``member``'s ``receipts`` run until ``deadline`` now."""
        for lease, named in groupby(self._valid(receipts, member), _lease_of):
            lease.cursor.relet(map(_receipt_of, named),
                               Lease(lease.cursor, lease.member, deadline, lease.window, lease.delivered))

    def member_left(self, group: Group, member: str, cursors: Iterable[QueueCursor]) -> None:
        """What ``member`` held in ``cursors`` lapses (see `lapse`)."""
        for cursor in list(cursors):
            for lease in [lease for lease in cursor.leases if lease.member == member]:
                self.lapse(group, cursor, lease.offsets.values(), "its member left")

    def expire(self, now: float, cursors: Iterator[tuple[Group, QueueCursor]]) -> None:
        """Every lease of ``cursors`` whose deadline passed lapses (see `lapse`)."""
        for group, cursor in cursors:
            for lease in [lease for lease in cursor.leases if lease.deadline <= now]:
                for offset in sorted(lease.offsets.values()):
                    log.debug("delivery.lease_expired", group=group.name, topic=cursor.topic,
                              queue=cursor.queue, offset=offset, member=lease.member)
                self.lapse(group, cursor, lease.offsets.values(), "its lease expired")

    def lapse(self, group: Group, cursor: QueueCursor, offsets: Iterable[int], why: str) -> None:
        """Held deliveries at ``offsets`` ended without an ack (``why``: a lease expired, a member
        left): each is delivered again, or, once ``max_deliveries`` is spent, moved to the
        dead-letter queue, as a nack would be (a message that kills its consumer ends there too)."""
        limit = self._config.max_deliveries
        spent: list[Copy] = []
        for offset in sorted(offsets):
            message = cursor.delivery(offset) if limit >= 0 else None
            if message is not None and message.delivery_count >= limit:
                cause = (f"delivered {message.delivery_count} times, the last ending without an ack "
                         f"({why}; max_deliveries={limit})")
                spent.append((cursor, offset, copies.dead_letter(group.name, message, cause)))
            else:
                self.release(cursor, offset)
        self._move(spent)

    def finish(self, cursor: QueueCursor, offset: int) -> None:
        """``offset`` is done, held or not (see `QueueCursor.finish`)."""
        self._uncount(cursor.lease_of(offset))
        cursor.finish(offset)

    def release(self, cursor: QueueCursor, offset: int) -> None:
        """``offset``, held, is ready to be delivered again (see `QueueCursor.release`)."""
        self._uncount(cursor.lease_of(offset))
        cursor.release(offset)

    # -- helpers ----------------------------------------------------------------------------

    def _uncount(self, lease: Lease | None) -> None:
        """A delivery of ``lease`` leaves its member's prefetch window (unless DELIVERED took it out)."""
        if lease is not None and lease.member in self._held and not lease.delivered:
            self._held[lease.member] -= 1

    def _move(self, moved: list[Copy]) -> None:
        """Append the copies, then finish their originals (a crash between: delivered again)."""
        if moved:
            for topic in {record.topic for _, _, record in moved}:
                self._queues(topic)  # %RETRY% and %DLQ% topics are listed like any other
            self._store.append([record for _, _, record in moved])
            for cursor, offset, record in moved:
                if record.topic.startswith("%DLQ%"):
                    log.info("delivery.dead_lettered", topic=cursor.topic, queue=cursor.queue,
                             offset=offset, dead_letter_queue=record.topic, cause=record.headers[DLQ_CAUSE])
                self.finish(cursor, offset)
            self._changed()

    def _valid(self, receipts: Sequence[str], member: Member | None) -> list[tuple[Lease, str]]:
        """The leases of the held deliveries ``receipts`` name, each once, in order; stale ones (a
        lease ended, a queue moved) are left out: their message is delivered again anyway. So are
        those another member holds, unless ``member`` is None (the engine's own receipts)."""
        leases = self.receipts
        return [(lease, receipt) for receipt in dict.fromkeys(receipts)
                if (lease := leases.get(receipt)) is not None and (member is None or lease.member == member.ident)]

    def _messages(self, member: Member, receipts: Sequence[str]) -> list[tuple[QueueCursor, Delivery]]:
        """The deliveries ``member`` holds that ``receipts`` name, with their cursors (see `_valid`)."""
        return [(lease.cursor, lease.cursor.delivery(lease.offsets[receipt]))
                for lease, receipt in self._valid(receipts, member)]
