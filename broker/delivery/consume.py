"""`Consuming`, the engine's consuming component: groups, fetch with long polling, acks by receipt.

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

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import compress, groupby, repeat
from operator import itemgetter
from typing import Any, TypeVar

import structlog

from broker.delivery import admin
from broker.delivery.ackjournal import COMPACT_BYTES, Acked, AckJournal
from broker.delivery.allocation import Strategy
from broker.delivery.config import DeliveryConfig
from broker.delivery.cursor import DELIVER_AT_HEADER, Lease, QueueCursor, ReceiptNames, Receipts
from broker.delivery.group import (
    DELIVERY_COUNT,
    DLQ_CAUSE,
    ORIGIN_OFFSET,
    ORIGIN_QUEUE,
    ORIGIN_TOPIC,
    Group,
    Member,
    dlq_topic,
    retry_topic,
)
from broker.delivery.offsets import OffsetBook
from broker.delivery.reading import first_at
from broker.delivery.values import NO_DELIVERIES, Delivery, DeliveryColumns, GroupInfo, QueueLag
from broker.errors import DeliveryError, UnknownMemberError
from broker.store import Clock, MessageStore, Record, StoredBatch
from broker.store.record import NO_HEADERS

log = structlog.get_logger("broker.delivery")
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


class Consuming:
    """Groups, members, their leases and receipts, and the prefetch windows: the engine's
    consuming component, under a lock of its own.

    It reads the store, asks the publishing side for a topic's queue count (``queues``) and
    appends the retry and dead-letter copies itself (their queue is always 0). The offset book
    is shared with `reading.Positions` and `admin.DeadLetters`, which are handed this lock.
    ``acks``: the ack journal under ``sync`` (`ackjournal`), ``acked_before`` what it replayed.
    """

    def __init__(self, store: MessageStore, offsets: OffsetBook, config: DeliveryConfig, clock: Clock,
                 strategy: Strategy, queues: Callable[[str], int], wakes: Wakes,
                 acks: AckJournal | None, acked_before: Acked) -> None:
        self._store = store
        self._offsets = offsets
        self._config = config
        self._clock = clock
        self._strategy = strategy
        self._queues = queues
        self._wakes = wakes
        self.acks = acks
        self._acked_before = acked_before  # taken by `_cursor`
        self.lock = threading.RLock()
        self.group_table: dict[str, Group] = {}
        self.members: dict[str, Member] = {}
        self.held_count: dict[str, int] = {}
        self.receipts: Receipts = {}  # the lease of every held delivery, by receipt
        self._receipt_names = ReceiptNames()
        self._cursor_ids = itertools.count(1)
        self._last_sweep = float("-inf")
        self._needed: dict[tuple[str, int], int] = offsets.lowest_needed()

    # -- groups and members -------------------------------------------------------

    def join(self, group: str, topics: Sequence[str], *, broadcast: bool = False,
             from_end: bool = False, prefetch: int | None = None, lease: float | None = None,
             tags: Sequence[str] | None = None, ordered: bool = False,
             from_time: float | None = None) -> str:
        """A new member of ``group`` (see `Broker.join`); names already checked."""
        with self.lock:
            existing = self.group_table.get(group)
            if existing is not None and (existing.broadcast, existing.ordered) != (broadcast, ordered):
                kind = "broadcasting" if existing.broadcast else "clustering"
                kind += ", ordered" if existing.ordered else ""
                raise DeliveryError(f"group {group!r} is {kind}; a member cannot join it otherwise")
            found = existing or Group(group, broadcast=broadcast, strategy=self._strategy, ordered=ordered)
            self.group_table[group] = found
            member = found.new_member(tuple(topics), prefetch or self._config.prefetch,
                                      lease or self._config.lease, self._clock.time(),
                                      frozenset(tags) if tags else None)
            self.members[member.ident] = member
            self.held_count[member.ident] = 0
            self._rebalance(found, from_end, from_time)
            log.info("delivery.member_joined", group=group, member=member.ident, topics=list(topics),
                     queues=len(member.queues))
            return member.ident

    def leave(self, member: str) -> None:
        with self.lock:
            found = self.members.get(member)
            if found is not None:
                self._drop(found, "delivery.member_left")

    def assignment(self, member: str) -> list[tuple[str, int]]:
        with self.lock:
            return list(self.member(member).queues)

    def has_members(self, group: str) -> bool:
        with self.lock:
            return group in self.group_table

    def member(self, ident: str) -> Member:
        """The live member ``ident`` (its heartbeat noted), or `UnknownMemberError`."""
        found = self.members.get(ident)
        if found is None:
            raise UnknownMemberError(f"member {ident!r} is not in its group (it left or timed out)")
        found.last_seen = self._clock.time()
        return found

    def _drop(self, member: Member, event: str) -> None:
        group = self.group_table[member.group]
        # every cursor: a queue that moved away at a rebalance may still hold its messages
        owned = member.own.values() if group.broadcast else group.cursors.values()
        for cursor in list(owned):
            for lease in [lease for lease in cursor.leases if lease.member == member.ident]:
                self.lapse(group, cursor, lease.offsets.values(), "its member left")
        del group.members[member.ident]
        del self.members[member.ident]
        self.held_count.pop(member.ident, None)
        self._rebalance(group, from_end=False)
        log.info(event, group=member.group, member=member.ident)
        self._wakes.notify()

    def _rebalance(self, group: Group, from_end: bool, from_time: float | None = None) -> None:
        moved = group.rebalance(self._queues)
        for member in group.members.values():
            table = member.own if group.broadcast else group.cursors
            for topic, queue in member.queues:
                if (topic, queue) not in table:
                    table[(topic, queue)] = self._cursor(group, topic, queue, from_end, from_time)
        if moved:  # the new holder waits until the old one has finished what it holds
            log.info("delivery.rebalanced", group=group.name, generation=group.generation,
                     moved=len(moved), members=len(group.members))

    def _cursor(self, group: Group, topic: str, queue: int, from_end: bool,
                from_time: float | None) -> QueueCursor:
        saved = None if group.broadcast else self._offsets.get((group.name, topic, queue))
        if saved is None and from_time is not None:
            saved = first_at(self._store, topic, queue, from_time)
        if saved is None:
            saved = self._store.max_offset(topic, queue) if from_end else self._store.min_offset(topic, queue)
        cursor = QueueCursor(next(self._cursor_ids), topic, queue, saved, self.receipts)
        if not group.broadcast:
            cursor.acked_ahead = self._acked_before.pop((group.name, topic, queue), set())
        return cursor

    def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Seek the queues ``member`` holds to the given next offsets (offsets kept by the consumer)."""
        with self.lock:
            found = self.member(member)
            group = self.group_table[found.group]
            table = found.own if group.broadcast else group.cursors
            for key, offset in offsets.items():
                key = (key[0], int(key[1]))
                if key not in found.queues or key not in table:
                    raise DeliveryError(f"member {member!r} does not hold queue {key[0]}/{key[1]}")
                cursor = table[key]
                for held in list(cursor.held):
                    self.release(cursor, held)
                cursor.seek(int(offset))
                if not group.broadcast:
                    self._offsets.put((group.name, *key), int(offset))
                    if self.acks is not None:  # what was acked before no longer counts at a restart
                        self.acks.record((group.name, *key), int(offset))
        if self.acks is not None and not group.broadcast:  # `sync`: confirmed once durable
            self.acks.synced()

    def synced(self) -> None:
        """Under ``sync``: return once the acks recorded so far are durable."""
        if self.acks is not None:
            self.acks.synced()

    async def synced_async(self) -> None:
        """`synced` awaited on an event loop."""
        if self.acks is not None:
            await self.acks.synced_async()

    def close(self) -> None:
        """Close the ack journal (after the store's last commit, which writes what it queues)."""
        if self.acks is not None:
            self.acks.close()

    # -- inspection -----------------------------------------------------------------

    def pending(self, group: str, topics: Sequence[str]) -> int:
        """Messages of ``topics`` (and the group's retry topic) not yet done by ``group``."""
        with self.lock:
            found = self.group_table.get(group)
            total = 0
            for topic in (*topics, retry_topic(group)):
                for queue in range(self._queues(topic)):
                    end = self._store.max_offset(topic, queue)
                    cursor = found.cursors.get((topic, queue)) if found and not found.broadcast else None
                    if cursor is not None:
                        total += cursor.pending(end)
                        continue
                    saved = self._offsets.get((group, topic, queue))
                    total += end - (saved if saved is not None else self._store.min_offset(topic, queue))
            return total

    def next_due(self, group: str) -> float | None:
        """When the earliest parked (delayed or scheduled) message of ``group`` falls due."""
        with self.lock:
            found = self.group_table.get(group)
            dues = [d for c in (found.all_cursors() if found else ()) if (d := c.next_due()) is not None]
            return min(dues) if dues else None

    def groups(self) -> list[GroupInfo]:
        with self.lock:
            return admin.groups(self._offsets, self.group_table)

    def lag(self, group: str) -> list[QueueLag]:
        with self.lock:
            return admin.lag(self._store, self._offsets, group, self.group_table.get(group))

    def needed(self) -> dict[tuple[str, int], int]:
        """The lowest offset some group still needs per queue, as of the last `save_offsets`
        (the store's retention keeps it)."""
        return dict(self._needed)

    def save_offsets(self) -> None:
        """Record every clustering cursor's committed offset and write the file."""
        with self.lock:
            for group in self.group_table.values():
                if not group.broadcast:
                    for (topic, queue), cursor in group.cursors.items():
                        self._offsets.put((group.name, topic, queue), cursor.committed)
            needed = self._offsets.lowest_needed()
            if self.acks is not None and self.acks.size > COMPACT_BYTES:
                self._offsets.flush()  # the committed offsets first: the new journal holds only what is above
                self.acks.compact({**self._acked_before, **{
                    (group.name, *key): cursor.done | cursor.acked_ahead for group in self.group_table.values()
                    if not group.broadcast for key, cursor in group.cursors.items()}})
        self._needed = needed
        self._offsets.flush()

    # -- fetch and acks -----------------------------------------------------------------

    def fetch(self, member: str, max_messages: int, timeout: float, *,
              blocking: bool = True, cancelled: threading.Event | None = None) -> list[DeliveryColumns] | None:
        """Up to ``max_messages`` for ``member``, waiting up to ``timeout`` seconds for the first, as
        column parts (no `Delivery` made per message): the engine's one fetch. `Broker.fetch` makes
        deliveries of them, the server sends them joined. Not ``blocking`` (the server's event loop
        may not wait): what is there now, or None if another thread holds the engine's lock. Once
        ``cancelled`` is set (the caller is gone) a waiting fetch returns, taking nothing more."""
        if not self.lock.acquire(blocking=blocking):
            return None
        try:
            deadline = time.monotonic() + max(0.0, timeout)
            while True:
                if cancelled is not None and cancelled.is_set():
                    return []
                seen = self._wakes.seen
                taken = self._take_now(member, max_messages)
                left = deadline - time.monotonic()
                if taken or left <= 0 or not blocking:
                    return taken
                self.lock.release()
                try:
                    self._wakes.wait(seen, min(left, IDLE_WAIT))
                finally:
                    self.lock.acquire()
        finally:
            self.lock.release()


    def ack(self, member: str, receipts: Sequence[str], *, blocking: bool = True) -> bool:
        """STANDARD for ``receipts``; not ``blocking``: nothing is done (False) if another thread
        holds the engine's lock."""
        if not self.lock.acquire(blocking=blocking):
            return False
        try:
            self._ack(member, receipts)
            return True
        finally:
            self.lock.release()


    def give_back(self, receipts: Sequence[str]) -> None:
        """The held deliveries ``receipts`` name never reached their client (its fetch was cancelled,
        its connection ended before they were sent): they are delivered again as if they had never
        been handed out, their delivery count unmoved (so not marked redelivered)."""
        with self.lock:
            for lease, receipt in self._valid(receipts):
                cursor, offset = lease.cursor, lease.offsets[receipt]
                self.release(cursor, offset)
                unseen = cursor.ready[offset]
                cursor.ready[offset] = unseen._replace(delivery_count=unseen.delivery_count - 1)
            self._wakes.notify()


    def delivered(self, member: str, receipts: Sequence[str]) -> None:
        with self.lock:
            self.member(member)
            for lease, named in groupby(self._valid(receipts), _lease_of):
                if not lease.delivered:
                    moved = list(map(_receipt_of, named))
                    lease.cursor.relet(moved, Lease(lease.cursor, lease.member, lease.deadline, delivered=True))
                    if lease.member in self.held_count:
                        self.held_count[lease.member] -= len(moved)
            self._wakes.notify()


    def extend(self, member: str, receipts: Sequence[str]) -> None:
        """Still working: the leases of ``receipts`` start again (JetStream's in-progress)."""
        with self.lock:
            found = self.member(member)
            deadline = self._clock.time() + found.lease
            for lease, named in groupby(self._valid(receipts), _lease_of):
                lease.cursor.relet(map(_receipt_of, named),
                                   Lease(lease.cursor, lease.member, deadline, lease.delivered))

    def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        with self.lock:
            found = self.member(member)
            group = self.group_table[found.group]
            due = self._clock.time() + max(0.0, delay)
            copies: list[tuple[QueueCursor, int, Record]] = []
            for cursor, message in self._messages(receipts):
                count = message.delivery_count
                if 0 <= self._config.max_deliveries <= count:
                    cause = f"delivered {count} times (max_deliveries={self._config.max_deliveries})"
                    copies.append((cursor, message.offset, _dead_letter(group, message, cause)))
                elif group.broadcast or group.ordered:  # retried in place: an ordered queue waits for it
                    self.release(cursor, message.offset)
                    cursor.ready.pop(message.offset, None)
                    cursor.park(due, message)
                else:
                    copies.append((cursor, message.offset, _retry(group, message, due)))
            self._move(copies)


    def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        with self.lock:
            group = self.group_table[self.member(member).group]
            self._move([(cursor, message.offset, _dead_letter(group, message, reason))
                           for cursor, message in self._messages(receipts)])

    # -- inside the lock ----------------------------------------------------------

    def _take_now(self, member: str, max_messages: int) -> list[DeliveryColumns]:
        found = self.member(member)
        now = self._clock.time()
        self._sweep(now)
        if found.ident not in self.members:  # it was itself swept out
            found = self.member(member)
        return self._take(found, max_messages, now)


    def _ack(self, member: str, receipts: Sequence[str]) -> None:
        found = self.member(member)
        journal = None if self.acks is None or self.group_table[found.group].broadcast else self.acks
        leases = list(map(self.receipts.pop, receipts, repeat(None)))  # a repeat or a stale one: None
        start = 0
        for lease, run in groupby(leases):  # the receipts of one fetch of one queue lie together
            stop = start + len(list(run))
            if lease is not None:
                if journal is not None:
                    journal.record((found.group, lease.cursor.topic, lease.cursor.queue),
                                   map(lease.offsets.__getitem__, receipts[start:stop]))
                done = lease.cursor.finish_leased(lease, receipts[start:stop])
                if not lease.delivered and lease.member in self.held_count:
                    self.held_count[lease.member] -= done
            start = stop
        self._wakes.notify()


    def _move(self, copies: list[tuple[QueueCursor, int, Record]]) -> None:
        """Append the copies, then finish their originals (a crash between: delivered again)."""
        if copies:
            for topic in {record.topic for _, _, record in copies}:
                self._queues(topic)  # %RETRY% and %DLQ% topics are listed like any other
            self._store.append([record for _, _, record in copies])
            for cursor, offset, record in copies:
                if record.topic.startswith("%DLQ%"):
                    log.info("delivery.dead_lettered", topic=cursor.topic, queue=cursor.queue,
                             offset=offset, dead_letter_queue=record.topic, cause=record.headers[DLQ_CAUSE])
                self.finish(cursor, offset)
            self._wakes.notify()

    def _valid(self, receipts: Sequence[str]) -> list[tuple[Lease, str]]:
        """The leases of the held deliveries ``receipts`` name, each once, in order; stale ones (a
        lease ended, a queue moved) are left out: their message is delivered again anyway."""
        leases = self.receipts
        return [(lease, receipt) for receipt in dict.fromkeys(receipts)
                if (lease := leases.get(receipt)) is not None]

    def _messages(self, receipts: Sequence[str]) -> list[tuple[QueueCursor, Delivery]]:
        """The held deliveries ``receipts`` name, with their cursors (see `_valid`)."""
        return [(lease.cursor, lease.cursor.delivery(lease.offsets[receipt])) for lease, receipt in self._valid(receipts)]

    def finish(self, cursor: QueueCursor, offset: int) -> None:
        self._uncount(cursor.lease_of(offset))
        cursor.finish(offset)

    def release(self, cursor: QueueCursor, offset: int) -> None:
        self._uncount(cursor.lease_of(offset))
        cursor.release(offset)

    def _uncount(self, lease: Lease | None) -> None:
        """A delivery of ``lease`` leaves its member's prefetch window (unless DELIVERED took it out)."""
        if lease is not None and lease.member in self.held_count and not lease.delivered:
            self.held_count[lease.member] -= 1

    def _sweep(self, now: float) -> None:
        if 0 <= now - self._last_sweep < SWEEP_EVERY:
            return
        self._last_sweep = now
        for member in list(self.members.values()):
            if now - member.last_seen > self._config.session_timeout:
                self._drop(member, "delivery.member_expired")
        for group in self.group_table.values():
            for cursor in group.all_cursors():
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
        spent: list[tuple[QueueCursor, int, Record]] = []
        for offset in sorted(offsets):
            message = cursor.delivery(offset) if limit >= 0 else None
            if message is not None and message.delivery_count >= limit:
                cause = (f"delivered {message.delivery_count} times, the last ending without an ack "
                         f"({why}; max_deliveries={limit})")
                spent.append((cursor, offset, _dead_letter(group, message, cause)))
            else:
                self.release(cursor, offset)
        self._move(spent)

    def _take(self, member: Member, max_messages: int, now: float) -> list[DeliveryColumns]:
        """What ``member`` is handed now, one part per queue read (and per queue's messages ready again)."""
        group = self.group_table[member.group]
        room = min(max_messages, member.prefetch - self.held_count[member.ident])
        taken = _Taken()
        for cursor in group.cursors_of(member):
            if len(taken) >= room:
                break
            if any(lease.member != member.ident for lease in cursor.leases):
                continue  # the queue moved here; its previous holder still finishes what it has
            cursor.unpark_due(now)
            if group.ordered:
                self._take_in_order(group, member, cursor, now, taken)
                continue
            if cursor.ready:
                again = [cursor.ready.pop(offset) for offset in sorted(cursor.ready)[: room - len(taken)]]
                taken.add(self._hand_again(member, cursor, again, now))
            while len(taken) < room and self._read(group, member, cursor, room - len(taken), now, taken):
                pass
        return taken.parts


    def _take_in_order(self, group: Group, member: Member, cursor: QueueCursor, now: float,
                       taken: _Taken) -> None:
        """Ordered: the queue's next message only when nothing of it is held or waiting."""
        if cursor.held or cursor.parked:
            return
        if cursor.ready:
            taken.add(self._hand_again(member, cursor, [cursor.ready.pop(min(cursor.ready))], now))
            return
        before = len(taken)
        while len(taken) == before and self._read(group, member, cursor, 1, now, taken):
            pass


    def _read(self, group: Group, member: Member, cursor: QueueCursor, count: int,
              now: float, taken: _Taken) -> bool:
        """Read up to ``count`` new messages of ``cursor``'s queue; False when there are none."""
        batch = self._store.read_batch(cursor.topic, cursor.queue, cursor.next,
                                        max_count=min(count, self._config.read_batch))
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
        taken.add(self._hand_new(member, cursor, batch, now))
        return True


    def _hand_new(self, member: Member, cursor: QueueCursor, batch: StoredBatch,
                  now: float) -> DeliveryColumns:
        """Deliver ``batch`` (read from the store) to ``member``: one lease, one receipt each."""
        offsets, attempts = list(batch.queue_offsets), batch.attempts  # one int per offset, shared by every table
        count = len(offsets)
        if not count:
            return NO_DELIVERIES
        receipts = self._receipt_names(count)
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
        self.held_count[member.ident] += count
        return handed


    def _hand_again(self, member: Member, cursor: QueueCursor, messages: list[Delivery],
                    now: float) -> DeliveryColumns:
        """Deliver again what a lease, a nack or a schedule put back (ready): a new receipt each."""
        receipts = self._receipt_names(len(messages))
        handed = DeliveryColumns.of([m._replace(receipt=receipt, delivery_count=m.delivery_count + 1)
                                     for m, receipt in zip(messages, receipts)])
        cursor.hold(handed, [m.offset for m in messages], receipts, Lease(cursor, member.ident, now + member.lease))
        self.held_count[member.ident] += handed.count
        return handed


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
