"""`Consuming`, the engine's consuming component: fetch with long polling, and every call of a
member, under one lock over `membership.Membership` and `leases.Leases`.

A fetch sweeps first (members silent past the session timeout leave, leases
that ended put their messages back), then takes from the queues the member
holds (a queue that moved to it after a rebalance only once its previous
holder has acked, nacked or lost what it held there, so a queue is never
held by two members and a rebalance delivers nothing twice): messages ready
again first, then parked ones that fell due, then new ones read from the
store, never more than the member's prefetch window leaves room for (paging:
nothing else is read or held). A message whose tag the member does not want
is finished unseen (``UNMATCHED``); one scheduled later is parked until due.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import compress
from typing import TypeVar

import structlog

from broker.delivery.ackjournal import Acked, AckJournal
from broker.delivery.allocation import Strategy
from broker.delivery.config import DeliveryConfig
from broker.delivery.cursor import DELIVER_AT_HEADER, ByteWindow, QueueCursor
from broker.delivery.group import Group, Member
from broker.delivery.leases import Leases
from broker.delivery.membership import Membership
from broker.delivery.offsets import OffsetBook
from broker.delivery.sizes import stored_bytes
from broker.delivery.spill import reload
from broker.delivery.taken import Taken
from broker.delivery.values import Delivery, DeliveryColumns, GroupInfo, QueueLag
from broker.store import Clock, MessageStore, StoredBatch
from broker.store.record import NO_HEADERS

log = structlog.get_logger("broker.delivery")
SWEEP_EVERY = 0.05  # seconds of clock time between sweeps
IDLE_WAIT = 0.05  # the longest a waiting fetch sleeps before it looks at the clock again
T = TypeVar("T")


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
    """The engine's consuming component, under a lock of its own: fetch with long polling, and
    every call of a member, over `membership.Membership` (groups, members, cursors, offsets) and
    `leases.Leases` (receipts, prefetch windows, the ends of a delivery), which it calls under
    that lock and which own their state.

    It reads the store and asks the publishing side for a topic's queue count (``queues``). The
    offset book is shared with `reading.Positions` and `admin.DeadLetters`, which are handed this
    lock. ``acks``: the ack journal under ``sync`` (`ackjournal`), ``acked_before`` what it replayed.
    """

    def __init__(self, store: MessageStore, offsets: OffsetBook, config: DeliveryConfig, clock: Clock,
                 strategy: Strategy, queues: Callable[[str], int], wakes: Wakes,
                 acks: AckJournal | None, acked_before: Acked) -> None:
        self._store = store
        self._offsets = offsets
        self._config = config
        self._clock = clock
        self._wakes = wakes
        self._acks = acks
        self.lock = threading.RLock()
        self.leases = Leases(store, config, queues, wakes.notify)
        self.membership = Membership(store, offsets, config, clock, strategy, queues, self.leases,
                                     acks, acked_before)
        self._last_sweep = float("-inf")

    # -- groups and members -------------------------------------------------------

    def join(self, group: str, topics: Sequence[str], *, broadcast: bool = False,
             from_end: bool = False, prefetch: int | None = None, lease: float | None = None,
             tags: Sequence[str] | None = None, ordered: bool = False,
             from_time: float | None = None) -> str:
        """A new member of ``group`` (see `Broker.join`); names already checked."""
        with self.lock:
            return self.membership.join(group, topics, broadcast=broadcast, from_end=from_end,
                                        prefetch=prefetch, lease=lease, tags=tags, ordered=ordered,
                                        from_time=from_time)

    def leave(self, member: str) -> None:
        with self.lock:
            if self.membership.leave(member):
                self._wakes.notify()

    def assignment(self, member: str) -> list[tuple[str, int]]:
        with self.lock:
            return self.membership.assignment(member)

    def has_members(self, group: str) -> bool:
        """Whether ``group`` has live members: those silent past the session timeout leave first."""
        with self.lock:
            if self.membership.expire(self._clock.monotonic()):
                self._wakes.notify()
            return self.membership.has_members(group)

    def share_window(self, member: str, window: ByteWindow) -> None:
        """``member``'s unacknowledged bodies count in ``window`` (see `Leases.share_window`)."""
        with self.lock:
            self.leases.share_window(member, window)

    def forward(self, group: str, topic: str, offsets: Sequence[int]) -> None:
        """The cursors of ``group``, which has no member, move forward to ``offsets`` of ``topic``
        (the ack journal's record of it made durable by `save_forwarded`)."""
        with self.lock:
            self.membership.forward(group, topic, offsets)

    def save_forwarded(self) -> None:
        """After a position reader's commit: the ack journal's seeks durable first (a crash
        between leaves the journal and the book agreeing, or the journal ahead), then the offsets."""
        self.synced()
        self.save_offsets()

    def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Seek the queues ``member`` holds to the given next offsets (offsets kept by the consumer)."""
        with self.lock:
            journaled = self.membership.commit(member, offsets)
        if journaled:  # `sync`: confirmed once durable
            self.synced()

    def synced(self) -> None:
        """Under ``sync``: return once the acks recorded so far are durable."""
        if self._acks is not None:
            self._acks.synced()

    async def synced_async(self) -> None:
        """`synced` awaited on an event loop."""
        if self._acks is not None:
            await self._acks.synced_async()

    def close(self) -> None:
        """Close the ack journal (after the store's last commit, which writes what it queues)."""
        if self._acks is not None:
            self._acks.close()

    # -- inspection and offsets -------------------------------------------------------

    def pending(self, group: str, topics: Mapping[str, int]) -> int:
        """Messages of ``topics`` (by their queue counts) not yet done by ``group``."""
        with self.lock:
            return self.membership.pending(group, topics)

    def next_due(self, group: str) -> float | None:
        """When (wall time) the earliest parked (delayed or scheduled) message of ``group`` falls due."""
        with self.lock:
            due = self.membership.next_due(group)
            return None if due is None else due - self._clock.monotonic() + self._clock.time()

    def has_group(self, group: str) -> bool:
        """Whether ``group`` is among the groups ``max_groups`` counts (one read: no lock)."""
        return group in self.membership.group_table

    def groups(self) -> list[GroupInfo]:
        with self.lock:
            return self.membership.groups()

    def lag(self, group: str) -> list[QueueLag]:
        with self.lock:
            return self.membership.lag(group)

    def needed(self) -> dict[tuple[str, int], int]:
        """The lowest offset some group still needs per queue, as of the last `save_offsets`
        (the store's retention keeps it)."""
        return self.membership.needed()

    def save_offsets(self) -> None:
        """Record every clustering cursor's committed offset and write the file."""
        with self.lock:
            self.membership.save_offsets()
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
            found = self.membership.member(member)
            self.leases.ack(found, receipts, self.membership.journal(found))
            return True
        finally:
            self.lock.release()

    def give_back(self, receipts: Sequence[str]) -> None:
        """The held deliveries ``receipts`` name never reached their client (its fetch was cancelled,
        its connection ended before they were sent): they are delivered again as if they had never
        been handed out, their delivery count unmoved (so not marked redelivered)."""
        with self.lock:
            self.leases.give_back(receipts, None)

    def release(self, member: str, receipts: Sequence[str]) -> None:
        """``member`` says its ``receipts`` never reached the application (fetched ahead and
        not received when it closed): given back as above."""
        with self.lock:
            self.leases.give_back(receipts, self.membership.member(member))

    def delivered(self, member: str, receipts: Sequence[str]) -> None:
        with self.lock:
            self.leases.delivered(self.membership.member(member), receipts)

    def extend(self, member: str, receipts: Sequence[str]) -> None:
        """Still working: the leases of ``receipts`` start again (JetStream's in-progress)."""
        with self.lock:
            found = self.membership.member(member)
            self.leases.extend(found, receipts, self._clock.monotonic() + found.lease)

    def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        with self.lock:
            found = self.membership.member(member)
            delay = max(0.0, delay)
            self.leases.nack(self.membership.group_of(found), found, receipts,
                             self._clock.time() + delay, self._clock.monotonic() + delay)

    def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        with self.lock:
            self.leases.dead_letter(self.membership.member(member), receipts, reason)

    # -- taking, inside the lock ----------------------------------------------------------

    def _take_now(self, member: str, max_messages: int) -> list[DeliveryColumns]:
        found = self.membership.member(member)
        now = self._clock.monotonic()
        if self._sweep(now):
            found = self.membership.member(member)  # unless it was itself swept out
        return self._take(found, max_messages, now)

    def _sweep(self, now: float) -> bool:
        """Members silent too long leave, leases that ended lapse, every ``SWEEP_EVERY``; whether
        it was time."""
        if 0 <= now - self._last_sweep < SWEEP_EVERY:
            return False
        self._last_sweep = now
        if self.membership.expire(now):
            self._wakes.notify()
        self.leases.expire(now, self.membership.leased_cursors())
        return True

    def _take(self, member: Member, max_messages: int, now: float) -> list[DeliveryColumns]:
        """What ``member`` is handed now, one part per queue read (and per queue's messages ready again)."""
        group = self.membership.group_of(member)
        room = min(max_messages, self.leases.room(member))
        byte_room = self.leases.byte_room(member, self._config.max_fetch_bytes)
        if byte_room <= 0:  # its window's bytes are all out: nothing until acks free some
            return []
        taken = Taken(byte_room)
        for cursor in group.cursors_of(member):
            if len(taken) >= room or taken.full:
                break
            if any(lease.member != member.ident for lease in cursor.leases):
                continue  # the queue moved here; its previous holder still finishes what it has
            cursor.unpark_due(now)
            if group.ordered:
                self._take_in_order(group, member, cursor, now, taken)
                continue
            reload(self._store, cursor, room - len(taken))
            if cursor.ready:
                taken.add(self.leases.hand_again(member, cursor, taken.again(cursor, room - len(taken)), now))
            while len(taken) < room and not taken.full and self._read(group, member, cursor,
                                                                      room - len(taken), now, taken):
                pass
        return taken.parts

    def _take_in_order(self, group: Group, member: Member, cursor: QueueCursor, now: float,
                       taken: Taken) -> None:
        """Ordered: the queue's next message only when nothing of it is held or waiting."""
        if cursor.held or cursor.parked:
            return
        reload(self._store, cursor, 1)
        if cursor.ready:
            taken.add(self.leases.hand_again(member, cursor, taken.again(cursor, 1), now))
            return
        before = len(taken)
        while len(taken) == before and self._read(group, member, cursor, 1, now, taken):
            pass

    def _read(self, group: Group, member: Member, cursor: QueueCursor, count: int,
              now: float, taken: Taken) -> bool:
        """Read up to ``count`` new messages of ``cursor``'s queue; False when there are none."""
        batch = self._store.read_batch(cursor.topic, cursor.queue, cursor.next,
                                        max_count=min(count, self._config.read_batch),
                                        max_bytes=taken.max_bytes - taken.bytes_read, or_one=not taken.bytes_read)
        offsets = batch.queue_offsets
        if not offsets:
            return False
        taken.bytes_read += stored_bytes(batch)
        if offsets[0] > cursor.next:
            skipped = cursor.skip_to(offsets[0])
            if skipped:
                log.warning("delivery.gap_skipped", group=group.name, topic=cursor.topic,
                            queue=cursor.queue, skipped=skipped, reason="retention deleted them")
        cursor.next = offsets[-1] + 1
        if member.tags is not None or cursor.acked_ahead or batch.headers.count(NO_HEADERS) != len(offsets):
            batch = _sort_out(member, cursor, batch, now, self._clock.time())
        taken.add(self.leases.hand_new(member, cursor, batch, now))
        return True


def _sort_out(member: Member, cursor: QueueCursor, batch: StoredBatch, now: float, wall: float) -> StoredBatch:
    """What of ``batch`` is delivered now: a tag the member does not want is consumed unseen
    (``UNMATCHED``), a message scheduled later is parked until due, one acked before a restart
    is finished unseen. A due time in the log is wall time (``wall`` now); it is parked on the
    monotonic clock (``now``), so a wall clock step after it is read moves it neither way."""
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
            if float(due) > wall:
                cursor.park(float(due) - wall + now, Delivery(
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
