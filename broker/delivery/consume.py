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

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from broker.delivery.cursor import DELIVER_AT_HEADER, Held, QueueCursor
from broker.delivery.group import Group, Member, dlq_topic, retry_topic
from broker.delivery.values import Delivery
from broker.store import Record, StoredMessage

if TYPE_CHECKING:
    from broker.delivery.engine import Broker

log = structlog.get_logger("broker.delivery")
ORIGIN_TOPIC, ORIGIN_QUEUE, ORIGIN_OFFSET = "x-origin-topic", "x-origin-queue", "x-origin-offset"
DLQ_CAUSE, DELIVERY_COUNT = "x-dlq-cause", "x-delivery-count"
SWEEP_EVERY = 0.05  # seconds of clock time between sweeps
IDLE_WAIT = 0.05  # the longest a waiting fetch sleeps before it looks at the clock again



def fetch(broker: Broker, member: str, max_messages: int, timeout: float) -> list[Delivery]:
    deadline = time.monotonic() + max(0.0, timeout)
    with broker.lock:
        while True:
            found = broker.member(member)
            now = broker.clock.time()
            _sweep(broker, now)
            if found.ident not in broker.members:  # it was itself swept out
                found = broker.member(member)
            taken = _take(broker, found, max_messages, now)
            left = deadline - time.monotonic()
            if taken or left <= 0:
                return taken
            broker.lock.wait(min(left, IDLE_WAIT))

def ack(broker: Broker, member: str, receipts: Sequence[str]) -> None:
    with broker.lock:
        broker.member(member)
        for cursor, offset, _ in _valid(broker, receipts):
            finish(broker, cursor, offset)
        broker.lock.notify_all()

def delivered(broker: Broker, member: str, receipts: Sequence[str]) -> None:
    with broker.lock:
        broker.member(member)
        for _, _, held in _valid(broker, receipts):
            if not held.delivered:
                held.delivered = True
                broker.held_count[held.member] -= 1
        broker.lock.notify_all()


def extend(broker: Broker, member: str, receipts: Sequence[str]) -> None:
    """Still working: the leases of ``receipts`` start again (JetStream's in-progress)."""
    with broker.lock:
        found = broker.member(member)
        for _, _, held in _valid(broker, receipts):
            held.deadline = broker.clock.time() + found.lease

def nack(broker: Broker, member: str, receipts: Sequence[str], delay: float) -> None:
    with broker.lock:
        found = broker.member(member)
        group = broker.group_table[found.group]
        due = broker.clock.time() + max(0.0, delay)
        copies: list[tuple[QueueCursor, int, Record]] = []
        for cursor, offset, held in _valid(broker, receipts):
            if 0 <= broker.config.max_deliveries <= held.count:
                cause = f"delivered {held.count} times (max_deliveries={broker.config.max_deliveries})"
                copies.append((cursor, offset, _dead_letter(group, held, cause)))
            elif group.broadcast or group.ordered:  # retried in place: an ordered queue waits for it
                release(broker, cursor, offset)
                cursor.ready.pop(offset, None)
                cursor.park(due, held.message, held.count)
            else:
                copies.append((cursor, offset, _retry(group, held, due)))
        _move(broker, copies)


def dead_letter(broker: Broker, member: str, receipts: Sequence[str], reason: str) -> None:
    with broker.lock:
        group = broker.group_table[broker.member(member).group]
        _move(broker, [(c, o, _dead_letter(group, h, reason)) for c, o, h in _valid(broker, receipts)])

# -- inside the lock ----------------------------------------------------------

def _move(broker: Broker, copies: list[tuple[QueueCursor, int, Record]]) -> None:
    """Append the copies, then finish their originals (a crash between: delivered again)."""
    if copies:
        for topic in {record.topic for _, _, record in copies}:
            broker.topic_table.queues(topic)  # %RETRY% and %DLQ% topics are listed like any other
        broker.store.append([record for _, _, record in copies])
        for cursor, offset, record in copies:
            if record.topic.startswith("%DLQ%"):
                log.info("delivery.dead_lettered", topic=cursor.topic, queue=cursor.queue,
                         offset=offset, dead_letter_queue=record.topic, cause=record.headers[DLQ_CAUSE])
            finish(broker, cursor, offset)
        broker.lock.notify_all()

def _valid(broker: Broker, receipts: Sequence[str]) -> list[tuple[QueueCursor, int, Held]]:
    """The held deliveries ``receipts`` name; stale ones (a lease ended, a queue moved) are
    left out: their message is delivered again anyway."""
    found = []
    cursors = broker.cursor_by_id
    for receipt in receipts:
        parts = receipt.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        cursor = cursors.get(int(parts[0]))
        offset = int(parts[1])
        held = cursor.held.get(offset) if cursor is not None else None
        if held is not None and held.receipt == receipt and cursor is not None:
            found.append((cursor, offset, held))
    return found

def finish(broker: Broker, cursor: QueueCursor, offset: int) -> None:
    held = cursor.held.get(offset)
    if held is not None and held.member in broker.held_count and not held.delivered:
        broker.held_count[held.member] -= 1
    cursor.finish(offset)

def release(broker: Broker, cursor: QueueCursor, offset: int) -> None:
    held = cursor.held.get(offset)
    if held is not None and held.member in broker.held_count and not held.delivered:
        broker.held_count[held.member] -= 1
    cursor.release(offset)

def _sweep(broker: Broker, now: float) -> None:
    if 0 <= now - broker.last_sweep < SWEEP_EVERY:
        return
    broker.last_sweep = now
    for member in list(broker.members.values()):
        if now - member.last_seen > broker.config.session_timeout:
            broker._drop(member, "delivery.member_expired")
    for group in broker.group_table.values():
        for cursor in group.all_cursors():
            for offset, held in list(cursor.held.items()):
                if held.deadline <= now:
                    log.debug("delivery.lease_expired", group=group.name, topic=cursor.topic,
                              queue=cursor.queue, offset=offset, member=held.member)
                    release(broker, cursor, offset)

def _take(broker: Broker, member: Member, max_messages: int, now: float) -> list[Delivery]:
    group = broker.group_table[member.group]
    room = min(max_messages, member.prefetch - broker.held_count[member.ident])
    taken: list[Delivery] = []
    for cursor in group.cursors_of(member):
        if len(taken) >= room:
            break
        if any(held.member != member.ident for held in cursor.held.values()):
            continue  # the queue moved here; its previous holder still finishes what it has
        cursor.unpark_due(now)
        if group.ordered:
            _take_in_order(broker, group, member, cursor, now, taken)
            continue
        for offset in sorted(cursor.ready)[: room - len(taken)]:
            message, count = cursor.ready.pop(offset)
            taken.append(_hand(broker, member, cursor, message, count + 1, now))
        while len(taken) < room and _read(broker, group, member, cursor, room - len(taken), now, taken):
            pass
    return taken

def _take_in_order(broker: Broker, group: Group, member: Member, cursor: QueueCursor, now: float,
                   taken: list[Delivery]) -> None:
    """Ordered: the queue's next message only when nothing of it is held or waiting."""
    if cursor.held or cursor.parked:
        return
    if cursor.ready:
        offset = min(cursor.ready)
        message, count = cursor.ready.pop(offset)
        taken.append(_hand(broker, member, cursor, message, count + 1, now))
        return
    before = len(taken)
    while len(taken) == before and _read(broker, group, member, cursor, 1, now, taken):
        pass


def _read(broker: Broker, group: Group, member: Member, cursor: QueueCursor, count: int,
          now: float, taken: list[Delivery]) -> bool:
    """Read up to ``count`` new messages of ``cursor``'s queue; False when there are none."""
    batch = broker.store.read(cursor.topic, cursor.queue, cursor.next,
                            max_count=min(count, broker.config.read_batch))
    if not batch:
        return False
    if batch[0].queue_offset > cursor.next:
        skipped = cursor.skip_to(batch[0].queue_offset)
        if skipped:
            log.warning("delivery.gap_skipped", group=group.name, topic=cursor.topic,
                        queue=cursor.queue, skipped=skipped, reason="retention deleted them")
    for message in batch:
        cursor.next = message.queue_offset + 1
        if not member.wants(message.tag):
            cursor.finish(message.queue_offset)  # UNMATCHED: consumed without delivery
            continue
        due = message.headers.get(DELIVER_AT_HEADER)
        if due is not None and float(due) > now:
            cursor.park(float(due), message, message.attempt)
            continue
        taken.append(_hand(broker, member, cursor, message, message.attempt + 1, now))
    return True

def _hand(broker: Broker, member: Member, cursor: QueueCursor, message: StoredMessage,
          count: int, now: float) -> Delivery:
    receipt = f"{cursor.ident}:{message.queue_offset}:{count}"
    cursor.held[message.queue_offset] = Held(message, receipt, member.ident, now + member.lease, count)
    broker.held_count[member.ident] += 1
    headers = message.headers
    if DELIVER_AT_HEADER in headers:
        headers = {k: v for k, v in headers.items() if k != DELIVER_AT_HEADER}
    return Delivery(receipt, message.topic, message.queue, message.queue_offset, message.message_id,
                    message.body, message.key, message.tag, headers, count, message.store_time)


def _origin(held: Held) -> dict[str, str]:
    """The headers naming where a message was first published (kept through every copy)."""
    message = held.message
    headers = dict(message.headers)
    headers.pop(DELIVER_AT_HEADER, None)
    if ORIGIN_TOPIC not in headers:
        headers.update({ORIGIN_TOPIC: message.topic, ORIGIN_QUEUE: str(message.queue),
                        ORIGIN_OFFSET: str(message.queue_offset)})
    return headers


def _retry(group: Group, held: Held, due: float) -> Record:
    message = held.message
    headers = {**_origin(held), DELIVER_AT_HEADER: repr(due)}
    return Record(retry_topic(group.name), 0, message.body, message.key, message.tag, headers,
                  message.message_id, held.count)


def _dead_letter(group: Group, held: Held, cause: str) -> Record:
    message = held.message
    headers = {**_origin(held), DLQ_CAUSE: cause, DELIVERY_COUNT: str(held.count)}
    return Record(dlq_topic(group.name), 0, message.body, message.key, message.tag, headers,
                  message.message_id, held.count)
