"""`Broker`: the delivery engine in process, over one `MessageStore` (the `BrokerApi`).

Publishing appends to the store (producer ids de-duplicated within a window:
see `publishing`).
Consuming goes through groups: a member fetches from the queues it holds,
each delivery is leased to it and identified by a receipt; an ack finishes
the offset, a nack copies the message to ``%RETRY%<group>`` to be delivered
after its delay (the delivery count travels with the copy), a dead letter
copies it to ``%DLQ%<group>`` with its cause. Members that stop calling lose
their queues; leases that end put messages back. One lock guards the
delivery state; appends of publishes run outside it. Two parts are
components of their own, handed what they read and importing no engine:
`admin.DeadLetters` (the dead-letter queues and their purge marks) and
`reading.Positions` (reads by position and a stream processor's offsets).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import chain
from pathlib import Path

import structlog

from broker.delivery import admin, consume, publishing, reading
from broker.delivery.ackjournal import COMPACT_BYTES, AckJournal, replay
from broker.delivery.allocation import STRATEGIES, Strategy
from broker.delivery.config import DeliveryConfig
from broker.delivery.cursor import QueueCursor, ReceiptNames, Receipts
from broker.delivery.dedup import DedupWindow
from broker.delivery.group import Group, Member, retry_topic
from broker.delivery.offsets import OffsetBook
from broker.delivery.selection import selector
from broker.delivery.topics import Topics, check_name
from broker.delivery.values import (
    Delivery,
    DeliveryColumns,
    GroupInfo,
    MessageColumns,
    OutgoingMessage,
    Placement,
    PlacementColumns,
    QueueLag,
    TopicInfo,
)
from broker.errors import DeliveryError, UnknownMemberError
from broker.store import Clock, MessageStore, StoreConfig
from broker.store.clock import SYSTEM_CLOCK
from broker.store.config import FlushPolicy

log = structlog.get_logger("broker.delivery")


class Broker:
    """Topics, groups and deliveries over the store in ``path``; one process opens it."""

    def __init__(self, path: str | Path, config: DeliveryConfig | None = None, *,
                 store_config: StoreConfig | None = None, clock: Clock = SYSTEM_CLOCK,
                 strategy: Strategy | None = None) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = config or DeliveryConfig()
        self.clock = clock
        self.strategy = strategy or STRATEGIES[self.config.allocation]
        self.store = MessageStore(self.path, store_config or StoreConfig(clock=clock))
        state = self.path / "delivery"
        state.mkdir(exist_ok=True)
        self.offsets = OffsetBook(state / "offsets.json")
        replayed = replay(state / "acks.journal")
        self.acked_before = self.offsets.absorb(replayed.acked, replayed.sought)  # taken by `_cursor`
        self.acks = (AckJournal(state / "acks.journal", replayed.length, self.store)
                     if self.store.config.flush is FlushPolicy.SYNC else None)
        """Under ``sync``, where an ack is made durable before it is confirmed (`ackjournal`)."""
        self.wakes = consume.Wakes()
        self.publishing = publishing.Publishing(
            self.store, Topics(state / "topics.json", self.config.queues, selector(self.config, clock)),
            DedupWindow(clock, self.config.dedup_window, self.config.dedup_entries), clock, self.config,
            self.wakes.notify)
        self.group_table: dict[str, Group] = {}
        self.members: dict[str, Member] = {}
        self.cursor_ids = itertools.count(1)
        self.cursor_by_id: dict[int, QueueCursor] = {}
        self.held_count: dict[str, int] = {}
        self.receipts: Receipts = {}  # the lease of every held delivery, by receipt
        self.receipt_names = ReceiptNames()
        self.lock = threading.RLock()
        self.last_sweep = float("-inf")
        self.dead_letter_queues = admin.DeadLetters(self.store, self.offsets, self.lock, self.publish_to_group)
        self.positions = reading.Positions(self.store, self.publishing.queues, self.offsets, self.lock,
                                           lambda group: group in self.group_table, self.save_offsets)
        self._needed: dict[tuple[str, int], int] = self.offsets.lowest_needed()
        self.store.set_retention_guard(lambda: dict(self._needed))
        self._closing = threading.Event()
        self._flusher = threading.Thread(target=self._flush_offsets, name="broker-offsets", daemon=True)
        self._flusher.start()
        log.info("delivery.opened", path=str(self.path), topics=len(self.publishing.known()))

    # -- publishing -----------------------------------------------------------

    def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        check_name("topic", topic)
        return self.append(topic, messages)

    def publish_columns(self, topic: str, messages: MessageColumns,
                        batches: Sequence[publishing.Batch] = ()) -> PlacementColumns:
        """`publish` column by column, as the server takes a publish's table (no object per
        message); ``batches``: the batch ids that name the messages (`publishing`)."""
        check_name("topic", topic)
        return self.publishing.append_columns(topic, messages, batches=batches)

    def publish_to_group(self, group: str, topic: str,
                         messages: Sequence[OutgoingMessage]) -> list[Placement]:
        """Deliver ``messages`` of ``topic`` to ``group`` only, through ``%RETRY%<group>``."""
        check_name("group", group)
        check_name("topic", topic)
        tagged = [replace(m, queue=0, headers={**m.headers, consume.ORIGIN_TOPIC: topic}) for m in messages]
        return self.append(retry_topic(group), tagged, dedup=False)  # a replay is meant twice

    def append(self, topic: str, messages: Sequence[OutgoingMessage], *,
               dedup: bool = True) -> list[Placement]:
        """Append to any topic (internal ones included); with ``dedup``, ids seen within the
        window are dropped (the first copy's placement comes back, marked duplicate)."""
        return self.publishing.append(topic, messages, dedup=dedup)

    # -- consuming (see `consume`) ----------------------------------------------

    def fetch(self, member: str, max_messages: int, timeout: float) -> list[Delivery]:
        parts = consume.fetch(self, member, max_messages, timeout) or []
        return parts[0].deliveries() if len(parts) == 1 else list(chain.from_iterable(p.deliveries() for p in parts))

    def ack(self, member: str, receipts: Sequence[str]) -> None:
        consume.ack(self, member, receipts)
        if self.acks is not None:
            self.acks.synced()

    def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        consume.nack(self, member, receipts, delay)

    def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        consume.dead_letter(self, member, receipts, reason)

    def delivered(self, member: str, receipts: Sequence[str]) -> None:
        """DELIVERED: received, not done; they stay leased but leave the prefetch window."""
        consume.delivered(self, member, receipts)

    def extend(self, member: str, receipts: Sequence[str]) -> None:
        """Still working: the leases of ``receipts`` start again (JetStream's in-progress)."""
        consume.extend(self, member, receipts)

    def release(self, cursor: QueueCursor, offset: int) -> None:
        consume.release(self, cursor, offset)

    # -- groups ---------------------------------------------------------------

    def join(self, group: str, topics: Sequence[str], *, broadcast: bool = False,
             from_end: bool = False, prefetch: int | None = None, lease: float | None = None,
             tags: Sequence[str] | None = None, ordered: bool = False,
             from_time: float | None = None) -> str:
        """A new member of ``group`` (see `BrokerApi.join`). A new group starts at the first kept
        message, at the end (``from_end``) or at the first message stored at or after
        ``from_time``. ``ordered``: one message of a queue at a time, and a nacked message holds
        its queue until it is redelivered (RocketMQ's orderly consumption)."""
        check_name("group", group, internal=True)  # reading %DLQ%<group> is allowed; writing is not
        if not topics:
            raise DeliveryError(f"group {group!r}: join at least one topic")
        for topic in topics:
            check_name("topic", topic, internal=True)
        with self.lock:
            existing = self.group_table.get(group)
            if existing is not None and (existing.broadcast, existing.ordered) != (broadcast, ordered):
                kind = "broadcasting" if existing.broadcast else "clustering"
                kind += ", ordered" if existing.ordered else ""
                raise DeliveryError(f"group {group!r} is {kind}; a member cannot join it otherwise")
            found = existing or Group(group, broadcast=broadcast, strategy=self.strategy, ordered=ordered)
            self.group_table[group] = found
            member = found.new_member(tuple(topics), prefetch or self.config.prefetch,
                                      lease or self.config.lease, self.clock.time(),
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

    def member(self, ident: str) -> Member:
        """The live member ``ident`` (its heartbeat noted), or `UnknownMemberError`."""
        found = self.members.get(ident)
        if found is None:
            raise UnknownMemberError(f"member {ident!r} is not in its group (it left or timed out)")
        found.last_seen = self.clock.time()
        return found

    def _drop(self, member: Member, event: str) -> None:
        group = self.group_table[member.group]
        # every cursor: a queue that moved away at a rebalance may still hold its messages
        owned = member.own.values() if group.broadcast else group.cursors.values()
        for cursor in list(owned):
            for lease in [lease for lease in cursor.leases if lease.member == member.ident]:
                consume.lapse(self, group, cursor, lease.offsets.values(), "its member left")
        del group.members[member.ident]
        del self.members[member.ident]
        self.held_count.pop(member.ident, None)
        self._rebalance(group, from_end=False)
        log.info(event, group=member.group, member=member.ident)
        self.wakes.notify()

    def _rebalance(self, group: Group, from_end: bool, from_time: float | None = None) -> None:
        moved = group.rebalance(self.publishing.queues)
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
        saved = None if group.broadcast else self.offsets.get((group.name, topic, queue))
        if saved is None and from_time is not None:
            saved = self.positions.first_at(topic, queue, from_time)
        if saved is None:
            saved = self.store.max_offset(topic, queue) if from_end else self.store.min_offset(topic, queue)
        cursor = QueueCursor(next(self.cursor_ids), topic, queue, saved, self.receipts)
        if not group.broadcast:
            cursor.acked_ahead = self.acked_before.pop((group.name, topic, queue), set())
        self.cursor_by_id[cursor.ident] = cursor
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
                    self.offsets.put((group.name, *key), int(offset))
                    if self.acks is not None:  # what was acked before no longer counts at a restart
                        self.acks.record((group.name, *key), int(offset))
        if self.acks is not None and not group.broadcast:  # `sync`: confirmed once durable
            self.acks.synced()

    # -- inspection -------------------------------------------------------------

    def pending(self, group: str, topics: Sequence[str]) -> int:
        """Messages of ``topics`` (and the group's retry topic) not yet done by ``group``."""
        with self.lock:
            found = self.group_table.get(group)
            total = 0
            for topic in (*topics, retry_topic(group)):
                for queue in range(self.publishing.queues(topic)):
                    end = self.store.max_offset(topic, queue)
                    cursor = found.cursors.get((topic, queue)) if found and not found.broadcast else None
                    if cursor is not None:
                        total += cursor.pending(end)
                        continue
                    saved = self.offsets.get((group, topic, queue))
                    total += end - (saved if saved is not None else self.store.min_offset(topic, queue))
            return total

    def next_due(self, group: str) -> float | None:
        """When the earliest parked (delayed or scheduled) message of ``group`` falls due."""
        with self.lock:
            found = self.group_table.get(group)
            dues = [d for c in (found.all_cursors() if found else ()) if (d := c.next_due()) is not None]
            return min(dues) if dues else None

    def topics(self) -> list[TopicInfo]:
        return admin.topics(self.store, self.publishing.known())

    def groups(self) -> list[GroupInfo]:
        with self.lock:
            return admin.groups(self.offsets, self.group_table)

    def lag(self, group: str) -> list[QueueLag]:
        with self.lock:
            return admin.lag(self.store, self.offsets, group, self.group_table.get(group))

    def dlq_list(self, group: str, limit: int = 100) -> list[Delivery]:
        return self.dead_letter_queues.list(group, limit)

    def dlq_replay(self, group: str) -> int:
        """Every dead letter of ``group`` back to the group only; the dead-letter queue is emptied."""
        return self.dead_letter_queues.replay(group)

    def dlq_purge(self, group: str) -> int:
        return self.dead_letter_queues.purge(group)

    # -- reading by position (see `reading`) -------------------------------------

    def read(self, topic: str, queue: int, offset: int, max_messages: int) -> list[Delivery]:
        return self.positions.read(topic, queue, offset, max_messages)

    def read_columns(self, topic: str, queue: int, offset: int, max_messages: int) -> DeliveryColumns:
        return self.positions.read_columns(topic, queue, offset, max_messages)

    def queue_offsets(self, topic: str) -> list[list[int]]:
        return self.positions.queue_offsets(topic)

    def group_offsets(self, group: str, topic: str) -> list[int | None]:
        return self.positions.group_offsets(group, topic)

    def commit_group(self, group: str, topic: str, offsets: Sequence[int]) -> None:
        self.positions.commit_group(group, topic, offsets)

    # -- lifecycle ------------------------------------------------------------

    def _flush_offsets(self) -> None:
        while not self._closing.wait(self.config.offset_flush_interval):
            self.save_offsets()

    def save_offsets(self) -> None:
        """Record every clustering cursor's committed offset and write the file."""
        with self.lock:
            for group in self.group_table.values():
                if not group.broadcast:
                    for (topic, queue), cursor in group.cursors.items():
                        self.offsets.put((group.name, topic, queue), cursor.committed)
            needed = self.offsets.lowest_needed()
            if self.acks is not None and self.acks.size > COMPACT_BYTES:
                self.offsets.flush()  # the committed offsets first: the new journal holds only what is above
                self.acks.compact({**self.acked_before, **{
                    (group.name, *key): cursor.done | cursor.acked_ahead for group in self.group_table.values()
                    if not group.broadcast for key, cursor in group.cursors.items()}})
        self._needed = needed
        self.offsets.flush()

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._flusher.join()
        self.save_offsets()
        self.store.close()  # its committer's last pass writes what the ack journal still queues
        if self.acks is not None:
            self.acks.close()
        log.info("delivery.closed", path=str(self.path))

    def abandon(self) -> None:
        """Stop as a killed process would: no offsets saved, no checkpoint (crash tests)."""
        self._closing.set()
        self._flusher.join()
        self.store._shutdown(clean=False)
        if self.acks is not None:
            self.acks.close()

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

