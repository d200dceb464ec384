"""One member of a Kafka consumer group: assignment, held-back copies, commits, retry topics.

The member reads the group's topics, their ``-delayed-<ms>`` topics and the
group's ``-retry-<group>-<ms>`` topics (`kafka_layout.topics_read`). A copy
read before its due time is held back: its partition is paused, and resumed
from the copy's next offset once the copy is handed out, so a held partition
never buffers more than one record here.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka import Message as KafkaRecord

from backends.clock import Clock
from backends.errors import BackendUnavailableError, TransportError
from backends.transport.base import Capabilities, SubscribeOptions, Subscription, origin_topic
from backends.transport.kafka_client import (
    LibrdkafkaLog,
    Publisher,
    Servers,
    not_a_member,
    raised,
    translate,
)
from backends.transport.kafka_layout import (
    CAPABILITIES,
    DELIVERY_COUNT_HEADER,
    DUE_HEADER,
    Delivered,
    Receipt,
    bucket_ms,
    check_kafka_name,
    copy_headers,
    dead_letter_topic,
    decode_headers,
    due_at,
    encode_headers,
    failure_headers,
    retry_topic,
    to_message,
    topics_read,
)
from backends.transport.kafka_recreated import TopicLives, log_recreated
from backends.types import Failure, Message, QueueRef
from backends.watermark import OffsetWatermark

log = structlog.get_logger(__name__)

HELD_POLL = 0.05
"""Seconds a fetch waits at most per round while a held-back copy may fall due."""


class KafkaSubscription(Subscription):
    """A member of a Kafka consumer group (see `backends.transport.kafka`)."""

    def __init__(
        self,
        group: str,
        topics: Sequence[str],
        options: SubscribeOptions,
        *,
        servers: Servers,
        publisher: Publisher,
        clock: Clock,
        settings: Mapping[str, Any],
    ) -> None:
        super().__init__(group, topics, options)
        check_kafka_name("group", group)
        for topic in self.topics:
            check_kafka_name("topic", topic)
        self.capabilities: Capabilities = CAPABILITIES
        self._publisher = publisher
        self._clock = clock
        self._lock = threading.Lock()
        self._assigned: set[QueueRef] = set()
        self._held: dict[QueueRef, tuple[float, Message]] = {}
        self._done = OffsetWatermark(reads_in_order=True)  # a partition is read in order, by one member
        self._committed: dict[QueueRef, int] = {}
        self._delivered: dict[QueueRef, Delivered] = {}  # notes of earlier owners' unfinished messages
        self._unread: set[QueueRef] = set()  # assigned, their commit's note not read yet
        self._down: KafkaError | None = None
        self._closed = False
        self._request_timeout = settings.get("socket.timeout.ms", 30_000) / 1000
        read = [name for topic in self.topics for name in topics_read(group, topic)]
        for name in read:
            publisher.partitions(name)  # the topics exist before the group asks for them
        self._lives = TopicLives(servers.bootstrap, read, self._request_timeout)
        self._consumer = Consumer(
            {
                "bootstrap.servers": servers.bootstrap,
                "group.id": group,
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
                "partition.assignment.strategy": "roundrobin",
                "error_cb": self._on_error,
                "logger": LibrdkafkaLog(group),
                **settings,
            }
        )
        self._consumer.subscribe(read, on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)

    def fetch(self, max_messages: int, timeout: float) -> list[Message]:
        self._check_fetch(max_messages)
        self._check_open()
        remaining = max(timeout, 0.0)
        while True:
            due = self._release_due()
            wait = 0.0 if due else min(remaining, HELD_POLL) if self._held else remaining
            due += self._read(max_messages - len(due), wait)
            remaining -= wait
            if due or remaining <= 0:
                return due

    def ack(self, messages: Sequence[Message]) -> None:
        """STANDARD: done. Kafka hears of it through a commit: the framework's ``commit``, or
        this member's own commit of its done prefix when it loses the partition or leaves."""
        for message in messages:
            Receipt.of(message)
        self._done.mark_done(messages)

    def nack(self, message: Message, delay: float) -> None:
        """REDELIVERED: a copy to the group's retry topic, due in ``delay`` seconds; then done."""
        receipt = Receipt.of(message)
        if delay < 0:
            raise TransportError(f"nack delay {delay!r}: must be >= 0")
        origin = origin_topic(message)
        extra = {DELIVERY_COUNT_HEADER: str(receipt.attempt)}
        if delay > 0:
            extra[DUE_HEADER] = repr(self._clock.time() + delay)
        target = retry_topic(origin, self.group, bucket_ms(delay))
        self._copy(target, message, copy_headers(message, origin, extra))
        self._done.mark_done([message])
        log.info("transport.nack", group=self.group, topic=origin, retry_topic=target,
                 offset=message.offset, attempt=receipt.attempt, delay=delay)

    def dead_letter(self, message: Message, failure: Failure) -> None:
        """POISON: a copy with its failure to ``<topic>-dlt-<group>``; then done."""
        receipt = Receipt.of(message)
        origin = origin_topic(message)
        extra = {**failure_headers(failure, message), DELIVERY_COUNT_HEADER: str(receipt.attempt - 1)}
        self._copy(dead_letter_topic(origin, self.group), message, copy_headers(message, origin, extra))
        self._done.mark_done([message])
        log.info("transport.dead_letter", group=self.group, topic=origin, queue=message.queue,
                 offset=message.offset, attempt=receipt.attempt, error_type=failure.error_type)

    def commit(self, offsets: Mapping[QueueRef, int]) -> None:
        """Commit the next offsets to read, synchronously, for partitions this member still has."""
        self._check_open()
        with self._lock:
            mine = {ref: offset for ref, offset in offsets.items() if ref in self._assigned}
        lost = sorted(set(offsets) - set(mine))
        if lost:
            log.warning("transport.commit_skipped", group=self.group, queues=[str(ref) for ref in lost])
        self._commit(mine)

    def _commit(self, offsets: Mapping[QueueRef, int], notes: Mapping[QueueRef, Delivered] | None = None) -> bool:
        """Commit ``offsets`` (with the `Delivered` note of each partition that has one below its
        offset); False when the group refused them because this member is not theirs any more (a
        zombie's commit would move the new owner's position: it is logged, not raised)."""
        if not offsets:
            return True
        with self._lock:
            notes = {**self._delivered, **(notes or {})}
        partitions = [TopicPartition(ref.topic, ref.queue, offset, notes[ref].encode())
                      if ref in notes and offset < notes[ref].end else TopicPartition(ref.topic, ref.queue, offset)
                      for ref, offset in offsets.items()]
        try:
            self._consumer.commit(offsets=partitions, asynchronous=False)
        except KafkaException as exc:
            if (error := not_a_member(exc)) is None:
                raise raised(exc, f"commit of group {self.group!r}") from exc
            log.warning("transport.commit_refused", group=self.group, error=error.str(), code=error.name(),
                        offsets={str(ref): offset for ref, offset in sorted(offsets.items())})
            return False
        with self._lock:
            for ref, offset in offsets.items():
                self._committed[ref] = max(self._committed.get(ref, -1), offset)
        return True

    def _uncommitted(self, refs: Sequence[QueueRef]) -> dict[QueueRef, int]:
        """The done prefix of ``refs`` where it moved past the last commit."""
        positions = self._done.committable(refs)
        with self._lock:
            return {ref: offset for ref, offset in positions.items() if offset > self._committed.get(ref, -1)}

    def close(self) -> None:
        """Leave the group: uncommitted messages go to the members that get the partitions."""
        if self._closed:
            return
        self._closed = True
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("transport.close_failed", group=self.group, error=str(exc))

    # reading

    def _read(self, limit: int, wait: float) -> list[Message]:
        try:
            records = self._consumer.consume(limit, wait) if limit > 0 else []
        except KafkaException as exc:
            raise raised(exc, f"fetch for group {self.group!r}") from exc
        except RuntimeError as exc:  # the consumer was closed under us
            raise TransportError(f"kafka: fetch for group {self.group!r}: {exc}") from exc
        recreated = self._lives.found()
        for topic, partitions in recreated.items():
            self._read_again(topic, partitions)
        if self._unread:
            self._read_notes()
        delivered: list[Message] = []
        for record in records:
            if record.topic() in recreated:
                continue  # fetched from a position of the old log: read again from the beginning
            message = self._accept(record)
            if message is not None:
                delivered.append(message)
        if delivered:
            self._down = None
            self._done.fetched(delivered)
        elif self._down is not None:
            raise translate(self._down, f"fetch for group {self.group!r}")
        return delivered

    def _read_notes(self) -> None:
        """The `Delivered` notes committed with the partitions assigned since the last fetch (asked
        here, not in the assignment callback, where librdkafka must not be called back)."""
        with self._lock:
            refs, self._unread = sorted(self._unread), set()
        try:
            found = self._consumer.committed([TopicPartition(ref.topic, ref.queue) for ref in refs],
                                             timeout=self._request_timeout)
        except KafkaException as exc:
            with self._lock:
                self._unread.update(refs)
            raise raised(exc, f"committed offsets of group {self.group!r}") from exc
        notes = {QueueRef(p.topic, p.partition): Delivered.decode(p.metadata) for p in found}
        with self._lock:
            self._delivered.update({ref: note for ref, note in notes.items() if note and ref in self._assigned})

    def _accept(self, record: KafkaRecord) -> Message | None:
        """The record as a deliverable message; None for errors, stale or held-back records."""
        error = record.error()
        if error is not None:
            self._on_error(error)
            return None
        topic, queue, offset = record.topic(), record.partition(), record.offset()
        assert topic is not None and queue is not None and offset is not None
        ref = QueueRef(topic, queue)
        headers = decode_headers(record.headers())
        message = to_message(topic, queue, offset, record.key(), record.value(), headers,
                             record.timestamp()[1], self._delivered.get(ref))
        due = due_at(headers)
        with self._lock:
            if ref in self._held or ref not in self._assigned:
                return None  # fetched before the pause took effect: read again on resume
            wall = self._clock.time()
            if due > wall:  # held on the monotonic clock: a wall clock step from now on moves it neither way
                self._held[ref] = (due - wall + self._clock.monotonic(), message)
                self._consumer.pause([TopicPartition(topic, queue)])
                return None
        return message

    def _read_again(self, topic: str, partitions: int) -> None:
        """``topic`` was created again, with ``partitions``: this member's positions on it are
        offsets of the old log and would skip the new one's first records. Its partitions are read
        from the beginning (the tokens skip what is read twice); those the new log lacks are dropped."""
        with self._lock:
            gone = sorted(ref for ref in self._assigned if ref.topic == topic and ref.queue >= partitions)
            self._assigned.difference_update(gone)
            others = sorted(ref for ref in self._assigned if ref.topic == topic)
            held = [ref for ref in others if self._held.pop(ref, None) is not None]
        positions = self._done.committable([*gone, *others])
        self._forget_progress([*gone, *others])
        try:
            if held:
                self._consumer.resume([TopicPartition(ref.topic, ref.queue) for ref in held])
            for ref in others:
                self._consumer.seek(TopicPartition(ref.topic, ref.queue, OFFSET_BEGINNING))
        except KafkaException as exc:
            raise raised(exc, f"reading {topic!r} again for group {self.group!r}") from exc
        log_recreated(self.group, topic, gone, others, positions)

    def _release_due(self) -> list[Message]:
        """Held-back copies now due, their partitions resumed after them."""
        now = self._clock.monotonic()
        with self._lock:
            due = [ref for ref, (when, _) in self._held.items() if when <= now]
            released = [self._held.pop(ref)[1] for ref in due]
        for message in released:
            partition = TopicPartition(message.topic, message.queue, message.offset + 1)
            self._consumer.resume([partition])
            self._consumer.seek(partition)
        self._done.fetched(released)
        return released

    # group membership, called by librdkafka inside consume()

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        refs = [QueueRef(p.topic, p.partition) for p in partitions]
        saved = dict(self.options.on_assign(refs)) if self.options.on_assign else {}
        for partition, ref in zip(partitions, refs):
            partition.offset = saved.get(ref, OFFSET_INVALID)
        self._forget_progress(refs)
        with self._lock:
            self._assigned.update(refs)
            self._unread.update(refs)
        consumer.assign(partitions)
        log.info("transport.assigned", group=self.group, queues=len(refs), seeked=len(saved))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Before the partitions move: commit their done prefix, and only it. What was fetched and
        not finished is read again by the next owner from there, in partition order, so a key's
        messages keep their order (a copy through the retry topic came after the key's later ones),
        counted by the commit's `Delivered` note."""
        refs = [QueueRef(p.topic, p.partition) for p in partitions]
        if self.options.on_revoke:
            self.options.on_revoke(refs)
        try:
            self._commit_done(self._same_lives(refs))
        except (BackendUnavailableError, TransportError) as exc:  # read again from the last commit
            log.warning("transport.revoke_commit_failed", group=self.group, error=str(exc))
        self._forget(consumer, refs)

    def _commit_done(self, refs: list[QueueRef]) -> None:
        unfinished: dict[QueueRef, list[int]] = {}
        for message in self._done.in_flight(refs):
            unfinished.setdefault(message.ref, []).append(message.offset)
        with self._lock:
            notes = {ref: Delivered.after(self._delivered.get(ref), offsets) for ref, offsets in unfinished.items()}
        self._commit({**self._uncommitted(refs), **self._done.committable(list(notes))}, notes)

    def _same_lives(self, refs: list[QueueRef]) -> list[QueueRef]:
        """``refs`` but those of topics created again: their positions are the old log's, and
        committed they would skip the new log's first records for the next owner."""
        recreated = self._lives.recreated({ref.topic for ref in refs})
        for topic, partitions in recreated.items():
            mine = [ref for ref in refs if ref.topic == topic]
            log_recreated(self.group, topic, [r for r in mine if r.queue >= partitions], [], self._done.committable(mine))
        return [ref for ref in refs if ref.topic not in recreated]

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The partitions are gone already (the session expired): nothing can be committed."""
        refs = [QueueRef(p.topic, p.partition) for p in partitions]
        log.warning("transport.partitions_lost", group=self.group, queues=len(refs))
        with self._lock:
            self._assigned.difference_update(refs)  # the worker's last acks commit nothing of them
        if self.options.on_revoke:
            self.options.on_revoke(refs)
        self._forget(consumer, refs)

    def _forget(self, consumer: Consumer, refs: list[QueueRef]) -> None:
        self._forget_progress(refs)
        with self._lock:
            self._assigned.difference_update(refs)
            for ref in refs:
                self._held.pop(ref, None)
        consumer.unassign()
        log.info("transport.revoked", group=self.group, queues=len(refs))

    def _forget_progress(self, refs: Sequence[QueueRef]) -> None:
        """Another member may read ``refs`` now, from the group's committed offset."""
        self._done.forget(refs)
        with self._lock:
            for ref in refs:
                self._committed.pop(ref, None)
                self._delivered.pop(ref, None)
            self._unread.difference_update(refs)

    def _on_error(self, error: KafkaError) -> None:
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self._down = error
        self._lives.hear(error)  # looked into after consume(): librdkafka aborts on metadata asked in here
        if error.fatal():
            raise translate(error, f"consumer of group {self.group!r}")
        log.warning("transport.kafka_error", group=self.group, error=error.str(), code=error.name())

    def _copy(self, target: str, message: Message, headers: dict[str, str]) -> None:
        record = (message.key, message.payload, encode_headers(headers), int(self._clock.time() * 1000))
        self._publisher.send(target, [record])

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"subscription of group {self.group!r} is closed")

