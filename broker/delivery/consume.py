"""The consuming half of `Broker`: fetch with long polling, and the acks by receipt.

A fetch sweeps first (members silent past the session timeout leave, leases
that ended put their messages back), then takes from the queues the member
holds (a queue that moved to it after a rebalance only once its previous
holder has acked, nacked or lost what it held there, so a queue is never
held by two members and a rebalance delivers nothing twice): messages ready again first, then parked ones that fell due, then new
ones read from the store, never more than the member's prefetch window
leaves room for (paging: nothing else is read or held). A message whose tag
the member does not want is finished unseen (``UNMATCHED``); one scheduled
later is parked until due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from itertools import compress, groupby, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from broker.delivery.cursor import DELIVER_AT_HEADER, Lease, QueueCursor
from broker.delivery.group import Group, Member, dlq_topic, retry_topic
from broker.delivery.values import NO_DELIVERIES, Delivery, DeliveryColumns
from broker.store import Record, StoredBatch
from broker.store.record import NO_HEADERS

if TYPE_CHECKING:
    from broker.delivery.engine import Broker

log = structlog.get_logger("broker.delivery")
ORIGIN_TOPIC, ORIGIN_QUEUE, ORIGIN_OFFSET = "x-origin-topic", "x-origin-queue", "x-origin-offset"
DLQ_CAUSE, DELIVERY_COUNT = "x-dlq-cause", "x-delivery-count"
SWEEP_EVERY = 0.05  # seconds of clock time between sweeps
IDLE_WAIT = 0.05  # the longest a waiting fetch sleeps before it looks at the clock again
T = TypeVar("T")
_lease_of, _receipt_of = itemgetter(0), itemgetter(1)  # of what `_valid` gives


class Wakes:
    """What a waiting fetch waits for: something changed (a publish, an ack, a member left).

    Its own small lock, held only to count and notify, never across I/O: a publish on the
    server's event loop tells it without waiting for the consuming lock. A fetch notes `seen`
    before it looks (under the consuming lock) and `wait` returns at once if anything
    happened since, so no wake-up is lost between the look and the wait.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self.seen = 0

    def notify(self) -> None:
        with self._changed:
            self.seen += 1
            self._changed.notify_all()

    def wait(self, seen: int, timeout: float) -> None:
        with self._changed:
            if self.seen == seen:
                self._changed.wait(timeout)


def fetch(broker: Broker, member: str, max_messages: int, timeout: float, *,
          blocking: bool = True, cancelled: threading.Event | None = None) -> list[DeliveryColumns] | None:
    """Up to ``max_messages`` for ``member``, waiting up to ``timeout`` seconds for the first, as
    column parts (no `Delivery` made per message): the engine's one fetch. `Broker.fetch` makes
    deliveries of them, the server sends them joined. Not ``blocking`` (the server's event loop
    may not wait): what is there now, or None if another thread holds the engine's lock. Once
    ``cancelled`` is set (the caller is gone) a waiting fetch returns, taking nothing more."""
    if not broker.lock.acquire(blocking=blocking):
        return None
    try:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            if cancelled is not None and cancelled.is_set():
                return []
            seen = broker.wakes.seen
            taken = _take_now(broker, member, max_messages)
            left = deadline - time.monotonic()
            if taken or left <= 0 or not blocking:
                return taken
            broker.lock.release()
            try:
                broker.wakes.wait(seen, min(left, IDLE_WAIT))
            finally:
                broker.lock.acquire()
    finally:
        broker.lock.release()


def ack(broker: Broker, member: str, receipts: Sequence[str], *, blocking: bool = True) -> bool:
    """STANDARD for ``receipts``; not ``blocking``: nothing is done (False) if another thread
    holds the engine's lock."""
    if not broker.lock.acquire(blocking=blocking):
        return False
    try:
        _ack(broker, member, receipts)
        return True
    finally:
        broker.lock.release()


def give_back(broker: Broker, receipts: Sequence[str]) -> None:
    """The held deliveries ``receipts`` name never reached their client (its fetch was cancelled,
    its connection ended before they were sent): they are delivered again as if they had never
    been handed out, their delivery count unmoved (so not marked redelivered)."""
    with broker.lock:
        for lease, receipt in _valid(broker, receipts):
            cursor, offset = lease.cursor, lease.offsets[receipt]
            release(broker, cursor, offset)
            unseen = cursor.ready[offset]
            cursor.ready[offset] = unseen._replace(delivery_count=unseen.delivery_count - 1)
        broker.wakes.notify()


def delivered(broker: Broker, member: str, receipts: Sequence[str]) -> None:
    with broker.lock:
        broker.member(member)
        for lease, named in groupby(_valid(broker, receipts), _lease_of):
            if not lease.delivered:
                moved = list(map(_receipt_of, named))
                lease.cursor.relet(moved, Lease(lease.cursor, lease.member, lease.deadline, delivered=True))
                if lease.member in broker.held_count:
                    broker.held_count[lease.member] -= len(moved)
        broker.wakes.notify()


def extend(broker: Broker, member: str, receipts: Sequence[str]) -> None:
    """Still working: the leases of ``receipts`` start again (JetStream's in-progress)."""
    with broker.lock:
        found = broker.member(member)
        deadline = broker.clock.time() + found.lease
        for lease, named in groupby(_valid(broker, receipts), _lease_of):
            lease.cursor.relet(map(_receipt_of, named),
                               Lease(lease.cursor, lease.member, deadline, lease.delivered))

def nack(broker: Broker, member: str, receipts: Sequence[str], delay: float) -> None:
    with broker.lock:
        found = broker.member(member)
        group = broker.group_table[found.group]
        due = broker.clock.time() + max(0.0, delay)
        copies: list[tuple[QueueCursor, int, Record]] = []
        for cursor, message in _messages(broker, receipts):
            count = message.delivery_count
            if 0 <= broker.config.max_deliveries <= count:
                cause = f"delivered {count} times (max_deliveries={broker.config.max_deliveries})"
                copies.append((cursor, message.offset, _dead_letter(group, message, cause)))
            elif group.broadcast or group.ordered:  # retried in place: an ordered queue waits for it
                release(broker, cursor, message.offset)
                cursor.ready.pop(message.offset, None)
                cursor.park(due, message)
            else:
                copies.append((cursor, message.offset, _retry(group, message, due)))
        _move(broker, copies)


def dead_letter(broker: Broker, member: str, receipts: Sequence[str], reason: str) -> None:
    with broker.lock:
        group = broker.group_table[broker.member(member).group]
        _move(broker, [(cursor, message.offset, _dead_letter(group, message, reason))
                       for cursor, message in _messages(broker, receipts)])

# -- inside the lock ----------------------------------------------------------

def _take_now(broker: Broker, member: str, max_messages: int) -> list[DeliveryColumns]:
    found = broker.member(member)
    now = broker.clock.time()
    _sweep(broker, now)
    if found.ident not in broker.members:  # it was itself swept out
        found = broker.member(member)
    return _take(broker, found, max_messages, now)


def _ack(broker: Broker, member: str, receipts: Sequence[str]) -> None:
    found = broker.member(member)
    journal = None if broker.acks is None or broker.group_table[found.group].broadcast else broker.acks
    leases = list(map(broker.receipts.pop, receipts, repeat(None)))  # a repeat or a stale one: None
    start = 0
    for lease, run in groupby(leases):  # the receipts of one fetch of one queue lie together
        stop = start + len(list(run))
        if lease is not None:
            if journal is not None:
                journal.record((found.group, lease.cursor.topic, lease.cursor.queue),
                               map(lease.offsets.__getitem__, receipts[start:stop]))
            done = lease.cursor.finish_leased(lease, receipts[start:stop])
            if not lease.delivered and lease.member in broker.held_count:
                broker.held_count[lease.member] -= done
        start = stop
    broker.wakes.notify()


def _move(broker: Broker, copies: list[tuple[QueueCursor, int, Record]]) -> None:
    """Append the copies, then finish their originals (a crash between: delivered again)."""
    if copies:
        for topic in {record.topic for _, _, record in copies}:
            broker.publishing.queues(topic)  # %RETRY% and %DLQ% topics are listed like any other
        broker.store.append([record for _, _, record in copies])
        for cursor, offset, record in copies:
            if record.topic.startswith("%DLQ%"):
                log.info("delivery.dead_lettered", topic=cursor.topic, queue=cursor.queue,
                         offset=offset, dead_letter_queue=record.topic, cause=record.headers[DLQ_CAUSE])
            finish(broker, cursor, offset)
        broker.wakes.notify()

def _valid(broker: Broker, receipts: Sequence[str]) -> list[tuple[Lease, str]]:
    """The leases of the held deliveries ``receipts`` name, each once, in order; stale ones (a
    lease ended, a queue moved) are left out: their message is delivered again anyway."""
    leases = broker.receipts
    return [(lease, receipt) for receipt in dict.fromkeys(receipts)
            if (lease := leases.get(receipt)) is not None]

def _messages(broker: Broker, receipts: Sequence[str]) -> list[tuple[QueueCursor, Delivery]]:
    """The held deliveries ``receipts`` name, with their cursors (see `_valid`)."""
    return [(lease.cursor, lease.cursor.delivery(lease.offsets[receipt])) for lease, receipt in _valid(broker, receipts)]

def finish(broker: Broker, cursor: QueueCursor, offset: int) -> None:
    _uncount(broker, cursor.lease_of(offset))
    cursor.finish(offset)

def release(broker: Broker, cursor: QueueCursor, offset: int) -> None:
    _uncount(broker, cursor.lease_of(offset))
    cursor.release(offset)

def _uncount(broker: Broker, lease: Lease | None) -> None:
    """A delivery of ``lease`` leaves its member's prefetch window (unless DELIVERED took it out)."""
    if lease is not None and lease.member in broker.held_count and not lease.delivered:
        broker.held_count[lease.member] -= 1

def _sweep(broker: Broker, now: float) -> None:
    if 0 <= now - broker.last_sweep < SWEEP_EVERY:
        return
    broker.last_sweep = now
    for member in list(broker.members.values()):
        if now - member.last_seen > broker.config.session_timeout:
            broker._drop(member, "delivery.member_expired")
    for group in broker.group_table.values():
        for cursor in group.all_cursors():
            for lease in [lease for lease in cursor.leases if lease.deadline <= now]:
                for offset in sorted(lease.offsets.values()):
                    log.debug("delivery.lease_expired", group=group.name, topic=cursor.topic,
                              queue=cursor.queue, offset=offset, member=lease.member)
                lapse(broker, group, cursor, lease.offsets.values(), "its lease expired")


def lapse(broker: Broker, group: Group, cursor: QueueCursor, offsets: Iterable[int], why: str) -> None:
    """Held deliveries at ``offsets`` ended without an ack (``why``: a lease expired, a member
    left): each is delivered again, or, once ``max_deliveries`` is spent, moved to the
    dead-letter queue, as a nack would be (a message that kills its consumer ends there too)."""
    limit = broker.config.max_deliveries
    spent: list[tuple[QueueCursor, int, Record]] = []
    for offset in sorted(offsets):
        message = cursor.delivery(offset) if limit >= 0 else None
        if message is not None and message.delivery_count >= limit:
            cause = (f"delivered {message.delivery_count} times, the last ending without an ack "
                     f"({why}; max_deliveries={limit})")
            spent.append((cursor, offset, _dead_letter(group, message, cause)))
        else:
            release(broker, cursor, offset)
    _move(broker, spent)

def _take(broker: Broker, member: Member, max_messages: int, now: float) -> list[DeliveryColumns]:
    """What ``member`` is handed now, one part per queue read (and per queue's messages ready again)."""
    group = broker.group_table[member.group]
    room = min(max_messages, member.prefetch - broker.held_count[member.ident])
    taken = _Taken()
    for cursor in group.cursors_of(member):
        if len(taken) >= room:
            break
        if any(lease.member != member.ident for lease in cursor.leases):
            continue  # the queue moved here; its previous holder still finishes what it has
        cursor.unpark_due(now)
        if group.ordered:
            _take_in_order(broker, group, member, cursor, now, taken)
            continue
        if cursor.ready:
            again = [cursor.ready.pop(offset) for offset in sorted(cursor.ready)[: room - len(taken)]]
            taken.add(_hand_again(broker, member, cursor, again, now))
        while len(taken) < room and _read(broker, group, member, cursor, room - len(taken), now, taken):
            pass
    return taken.parts


class _Taken:
    """The parts a fetch hands out, and how many deliveries they hold."""

    def __init__(self) -> None:
        self.parts: list[DeliveryColumns] = []
        self.count = 0

    def add(self, part: DeliveryColumns) -> None:
        if part.count:
            self.parts.append(part)
            self.count += part.count

    def __len__(self) -> int:
        return self.count


def _take_in_order(broker: Broker, group: Group, member: Member, cursor: QueueCursor, now: float,
                   taken: _Taken) -> None:
    """Ordered: the queue's next message only when nothing of it is held or waiting."""
    if cursor.held or cursor.parked:
        return
    if cursor.ready:
        taken.add(_hand_again(broker, member, cursor, [cursor.ready.pop(min(cursor.ready))], now))
        return
    before = len(taken)
    while len(taken) == before and _read(broker, group, member, cursor, 1, now, taken):
        pass


def _read(broker: Broker, group: Group, member: Member, cursor: QueueCursor, count: int,
          now: float, taken: _Taken) -> bool:
    """Read up to ``count`` new messages of ``cursor``'s queue; False when there are none."""
    batch = broker.store.read_batch(cursor.topic, cursor.queue, cursor.next,
                                    max_count=min(count, broker.config.read_batch))
    offsets = batch.queue_offsets
    if not offsets:
        return False
    if offsets[0] > cursor.next:
        skipped = cursor.skip_to(offsets[0])
        if skipped:
            log.warning("delivery.gap_skipped", group=group.name, topic=cursor.topic,
                        queue=cursor.queue, skipped=skipped, reason="retention deleted them")
    cursor.next = offsets[-1] + 1
    if member.tags is not None or cursor.acked_ahead or batch.headers.count(NO_HEADERS) != len(offsets):
        batch = _sort_out(member, cursor, batch, now)
    taken.add(_hand_new(broker, member, cursor, batch, now))
    return True


def _sort_out(member: Member, cursor: QueueCursor, batch: StoredBatch, now: float) -> StoredBatch:
    """What of ``batch`` is delivered now: a tag the member does not want is consumed unseen
    (``UNMATCHED``), a message scheduled later is parked until due, one acked before a restart
    is finished unseen."""
    keep: list[bool] = []
    headers = list(batch.headers)
    for index, message in enumerate(batch.messages()):
        if message.queue_offset in cursor.acked_ahead:  # acked before a restart: done already
            cursor.acked_ahead.discard(message.queue_offset)
            cursor.finish(message.queue_offset)
            keep.append(False)
            continue
        if not member.wants(message.tag):
            cursor.finish(message.queue_offset)
            keep.append(False)
            continue
        due = message.headers.get(DELIVER_AT_HEADER)
        if due is not None:
            headers[index] = {k: v for k, v in message.headers.items() if k != DELIVER_AT_HEADER}
            if float(due) > now:
                cursor.park(float(due), Delivery(
                    "", message.topic, message.queue, message.queue_offset, message.message_id,
                    message.body, message.key, message.tag, headers[index], message.attempt,
                    message.store_time))
                keep.append(False)
                continue
        keep.append(True)
    return StoredBatch(batch.topic, batch.queue, _kept(batch.queue_offsets, keep),
                       _kept(batch.log_offsets, keep), _kept(batch.message_ids, keep),
                       _kept(batch.keys, keep), _kept(batch.tags, keep), _kept(headers, keep),
                       _kept(batch.bodies, keep), _kept(batch.store_times, keep),
                       _kept(batch.attempts, keep))


def _kept(column: Sequence[T], keep: list[bool]) -> list[T]:
    return list(compress(column, keep))


def _hand_new(broker: Broker, member: Member, cursor: QueueCursor, batch: StoredBatch,
              now: float) -> DeliveryColumns:
    """Deliver ``batch`` (read from the store) to ``member``: one lease, one receipt each."""
    offsets, attempts = list(batch.queue_offsets), batch.attempts  # one int per offset, shared by every table
    count = len(offsets)
    if not count:
        return NO_DELIVERIES
    receipts = broker.receipt_names(count)
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
    cursor.hold(handed, offsets, receipts, Lease(cursor, member.ident, now + member.lease))
    broker.held_count[member.ident] += count
    return handed


def _hand_again(broker: Broker, member: Member, cursor: QueueCursor, messages: list[Delivery],
                now: float) -> DeliveryColumns:
    """Deliver again what a lease, a nack or a schedule put back (ready): a new receipt each."""
    receipts = broker.receipt_names(len(messages))
    handed = DeliveryColumns.of([m._replace(receipt=receipt, delivery_count=m.delivery_count + 1)
                                 for m, receipt in zip(messages, receipts)])
    cursor.hold(handed, [m.offset for m in messages], receipts, Lease(cursor, member.ident, now + member.lease))
    broker.held_count[member.ident] += handed.count
    return handed


def _origin(message: Delivery) -> dict[str, str]:
    """The headers naming where a message was first published (kept through every copy)."""
    headers = dict(message.headers)
    headers.pop(DELIVER_AT_HEADER, None)
    if ORIGIN_TOPIC not in headers:
        headers.update({ORIGIN_TOPIC: message.topic, ORIGIN_QUEUE: str(message.queue),
                        ORIGIN_OFFSET: str(message.offset)})
    return headers


def _retry(group: Group, message: Delivery, due: float) -> Record:
    headers = {**_origin(message), DELIVER_AT_HEADER: repr(due)}
    return Record(retry_topic(group.name), 0, message.body, message.key, message.tag, headers,
                  message.message_id, message.delivery_count)


def _dead_letter(group: Group, message: Delivery, cause: str) -> Record:
    count = message.delivery_count
    headers = {**_origin(message), DLQ_CAUSE: cause, DELIVERY_COUNT: str(count)}
    return Record(dlq_topic(group.name), 0, message.body, message.key, message.tag, headers,
                  message.message_id, count)
