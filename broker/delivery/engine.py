"""`Broker`: the delivery engine in process, over one `MessageStore` (the `BrokerApi`).

Publishing appends to the store (producer ids de-duplicated within a window:
see `publishing`).
Consuming goes through groups: a member fetches from the queues it holds,
each delivery is leased to it and identified by a receipt; an ack finishes
the offset, a nack copies the message to ``%RETRY%<group>`` to be delivered
after its delay (the delivery count travels with the copy), a dead letter
copies it to ``%DLQ%<group>`` with its cause. Members that stop calling lose
their queues; leases that end put messages back.

`Broker` is the `BrokerApi` over components that own their state, each with
its own lock, talking through methods: `publishing.Publishing` (the topic
table, the de-duplication window, the appends), `consume.Consuming` (fetch
with long polling under the consuming lock, over `membership.Membership`:
groups, members, cursors, the group offsets; and `leases.Leases`: receipts,
prefetch windows, the ends of a delivery), `admin.DeadLetters` (the dead-letter queues and their purge marks) and
`reading.Positions` (reads by position and a stream processor's offsets); the
last two are handed the consuming lock, which guards the offset book they
share. A component never holds its lock while it calls one that may call back
(consuming asks publishing for queue counts, never the reverse: publishing
tells a `consume.Wakes` that messages came).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from itertools import chain
from pathlib import Path

import structlog

from broker.delivery import admin, consume, publishing, reading
from broker.delivery.ackjournal import AckJournal, replay
from broker.delivery.allocation import STRATEGIES, Strategy
from broker.delivery.config import DeliveryConfig
from broker.delivery.dedup import DedupWindow
from broker.delivery.group import ORIGIN_TOPIC, STOMP_TOPIC_PREFIX, retry_topic
from broker.delivery.offsets import OffsetBook
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
from broker.errors import DeliveryError, InvalidNameError
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
        self.store = MessageStore(self.path, store_config or StoreConfig(clock=clock))
        state = self.path / "delivery"
        state.mkdir(exist_ok=True)
        offsets = OffsetBook(state / "offsets.json")
        replayed = replay(state / "acks.journal")
        acked_before = offsets.absorb(replayed.acked, replayed.sought)
        acks = (AckJournal(state / "acks.journal", replayed.length, self.store)
                if self.store.config.flush is FlushPolicy.SYNC else None)  # an ack durable before confirmed
        wakes = consume.Wakes()
        self.publishing = publishing.Publishing(
            self.store, Topics(state / "topics.json", self.config.queues, self.config.queue_selector(clock),
                               self.config.max_topics),
            DedupWindow(clock, self.config.dedup_window, self.config.dedup_entries), clock, self.config,
            wakes.notify)
        self.consuming = consume.Consuming(
            self.store, offsets, self.config, clock, strategy or STRATEGIES[self.config.allocation],
            self.publishing.queues, wakes, acks, acked_before)
        self.dead_letter_queues = admin.DeadLetters(self.store, offsets, self.consuming.lock,
                                                    self.publish_to_group, state / "dlq-settled.json")
        self.positions = reading.Positions(self.store, self.publishing.queues, offsets, self.consuming.lock,
                                           self.consuming.has_members, self.consuming.forward,
                                           self.consuming.save_forwarded,
                                           self.config.max_fetch_bytes)
        self.store.set_retention_guard(self.consuming.needed)
        self._closing = threading.Event()
        self._flusher = threading.Thread(target=self._flush_offsets, name="broker-offsets", daemon=True)
        self._flusher.start()
        log.info("delivery.opened", path=str(self.path), topics=len(self.publishing.known()))

    # -- publishing (see `publishing`) ---------------------------------------------

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
        tagged = [replace(m, queue=0, headers={**m.headers, ORIGIN_TOPIC: topic}) for m in messages]
        return self.append(retry_topic(group), tagged, dedup=False)  # a replay is meant twice

    def append(self, topic: str, messages: Sequence[OutgoingMessage], *,
               dedup: bool = True) -> list[Placement]:
        """Append to any topic (internal ones included); with ``dedup``, ids seen within the
        window are dropped (the first copy's placement comes back, marked duplicate)."""
        return self.publishing.append(topic, messages, dedup=dedup)

    # -- consuming (see `consume`) ----------------------------------------------------

    def fetch(self, member: str, max_messages: int, timeout: float) -> list[Delivery]:
        parts = self.consuming.fetch(member, max_messages, timeout) or []
        return parts[0].deliveries() if len(parts) == 1 else list(chain.from_iterable(p.deliveries() for p in parts))

    def ack(self, member: str, receipts: Sequence[str]) -> None:
        self.consuming.ack(member, receipts)
        self.consuming.synced()

    def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        self.consuming.nack(member, receipts, delay)

    def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        self.consuming.dead_letter(member, receipts, reason)

    def delivered(self, member: str, receipts: Sequence[str]) -> None:
        """DELIVERED: received, not done; they stay leased but leave the prefetch window."""
        self.consuming.delivered(member, receipts)

    def extend(self, member: str, receipts: Sequence[str]) -> None:
        """Still working: the leases of ``receipts`` start again (JetStream's in-progress)."""
        self.consuming.extend(member, receipts)

    def release(self, member: str, receipts: Sequence[str]) -> None:
        """RELEASED: never received (fetched ahead): delivered again, their delivery count unmoved."""
        self.consuming.release(member, receipts)

    # -- groups -----------------------------------------------------------------------

    def join(self, group: str, topics: Sequence[str], *, broadcast: bool = False,
             from_end: bool = False, prefetch: int | None = None, lease: float | None = None,
             tags: Sequence[str] | None = None, ordered: bool = False,
             from_time: float | None = None) -> str:
        """A new member of ``group`` (see `BrokerApi.join`). A new group starts at the first kept
        message, at the end (``from_end``) or at the first message stored at or after
        ``from_time``. ``ordered``: one message of a queue at a time, and a nacked message holds
        its queue until it is redelivered (RocketMQ's orderly consumption)."""
        check_name("group", group, internal=True)  # reading %DLQ%<group> is allowed; writing is not
        if group.startswith(STOMP_TOPIC_PREFIX) and (not broadcast or ordered):
            # a group's kind is fixed by its first member: a clustering one would refuse every
            # STOMP subscription to the topic after it
            raise InvalidNameError(f"group {group!r}: groups starting with {STOMP_TOPIC_PREFIX} are STOMP's "
                                   "/topic/ subscriptions; join one as a broadcasting member, not ordered")
        if not topics:
            raise DeliveryError(f"group {group!r}: join at least one topic")
        for topic in topics:
            check_name("topic", topic, internal=True)
        return self.consuming.join(group, topics, broadcast=broadcast, from_end=from_end,
                                   prefetch=prefetch, lease=lease, tags=tags, ordered=ordered,
                                   from_time=from_time)

    def leave(self, member: str) -> None:
        self.consuming.leave(member)

    def assignment(self, member: str) -> list[tuple[str, int]]:
        return self.consuming.assignment(member)

    def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Seek the queues ``member`` holds to the given next offsets (offsets kept by the consumer)."""
        self.consuming.commit(member, offsets)

    # -- inspection ---------------------------------------------------------------------

    def pending(self, group: str, topics: Sequence[str]) -> int:
        """Messages of ``topics`` (and the group's retry topic) not yet done by ``group``; a
        topic the broker does not hold has none, and asking does not make it."""
        counts = {topic: self.publishing.held_queues(topic) for topic in (*topics, retry_topic(group))}
        return self.consuming.pending(group, counts)

    def next_due(self, group: str) -> float | None:
        """When the earliest parked (delayed or scheduled) message of ``group`` falls due."""
        return self.consuming.next_due(group)

    def topics(self) -> list[TopicInfo]:
        return admin.topics(self.store, self.publishing.known())

    def groups(self) -> list[GroupInfo]:
        return self.consuming.groups()

    def lag(self, group: str) -> list[QueueLag]:
        return self.consuming.lag(group)

    def dlq_list(self, group: str, limit: int = 100, *, body_limit: int | None = None) -> list[Delivery]:
        return self.dead_letter_queues.list(group, limit, body_limit)

    def dlq_replay(self, group: str) -> int:
        """Every dead letter of ``group`` back to the group only; the dead-letter queue is emptied."""
        return self.dead_letter_queues.replay(group)

    def dlq_purge(self, group: str) -> int:
        return self.dead_letter_queues.purge(group)

    def dlq_replay_letters(self, group: str, offsets: Sequence[int]) -> int:
        """The dead letters of ``group`` at ``offsets`` back to the group only; the others stay."""
        return self.dead_letter_queues.settle(group, offsets, replay=True)

    def dlq_purge_letters(self, group: str, offsets: Sequence[int]) -> int:
        return self.dead_letter_queues.settle(group, offsets, replay=False)

    # -- reading by position (see `reading`) -------------------------------------

    def read(self, topic: str, queue: int, offset: int, max_messages: int) -> list[Delivery]:
        return self.positions.read(topic, queue, offset, max_messages)

    def read_columns(self, topic: str, queue: int, offset: int, max_messages: int) -> DeliveryColumns:
        return self.positions.read_columns(topic, queue, offset, max_messages)

    def queue_offsets(self, topic: str) -> list[list[int]]:
        return self.positions.queue_offsets(topic)

    def group_offsets(self, group: str, topic: str) -> list[int | None]:
        """``group``'s committed offset per queue of ``topic``: none for a topic the broker does
        not hold (asking does not make it)."""
        check_name("topic", topic, internal=True)
        return self.positions.group_offsets(group, topic) if self.publishing.has_topic(topic) else []

    def commit_group(self, group: str, topic: str, offsets: Sequence[int]) -> None:
        self.positions.commit_group(group, topic, offsets)

    # -- lifecycle --------------------------------------------------------------------

    def _flush_offsets(self) -> None:
        """Write the offsets every ``offset_flush_interval``; a failed write (a full disk) is
        logged once and tried again at each interval until one succeeds."""
        failing = False
        while not self._closing.wait(self.config.offset_flush_interval):
            try:
                self.save_offsets()
            except OSError as exc:
                if not failing:
                    log.error("delivery.offsets_not_saved", path=str(self.path), error=str(exc),
                              then="tried again every offset_flush_interval")
                failing = True
            else:
                if failing:
                    log.info("delivery.offsets_saved_again", path=str(self.path))
                failing = False

    def save_offsets(self) -> None:
        """Record every clustering cursor's committed offset and write the file."""
        self.consuming.save_offsets()

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._flusher.join()
        try:
            self.save_offsets()
        except OSError as exc:  # acks since the last write come back after a restart: never lost
            log.error("delivery.offsets_not_saved", path=str(self.path), error=str(exc),
                      then="acks since the last write are delivered again after a restart")
        self.store.close()  # its committer's last pass writes what the ack journal still queues
        self.consuming.close()
        log.info("delivery.closed", path=str(self.path))

    def abandon(self) -> None:
        """Stop as a killed process would: no offsets saved, no checkpoint (crash tests)."""
        self._closing.set()
        self._flusher.join()
        self.store._shutdown(clean=False)
        self.consuming.close()

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

