"""`memory://`: the in-process transport, thread-safe and not durable.

The test helper users run their handlers against, and the reference the
durable transports are checked against by the contract suite. Each queue is
an append-only log (offsets are list indexes); each group keeps a cursor per
queue, its outstanding deliveries, and two heaps (scheduled redeliveries,
leases) ordered by due time. Delayed publishes wait in a per-topic heap and
take their offset when due, as RocketMQ's schedule topic does. Due times are
readings of the monotonic clock: they are durations inside this one process,
which a wall clock step must not stretch or cut short.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import structlog

from backends.clock import SYSTEM_CLOCK, Clock
from backends.errors import TransportError
from backends.transport.leasing import (
    DEFAULT_QUEUES,
    DEFAULT_VISIBILITY_TIMEOUT,
    DeliveryState,
    LeasingTransport,
    Position,
)
from backends.types import DeadLetter, Failure, Message, OutgoingMessage, QueueRef

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Record:
    """A published message as its queue's log keeps it."""

    id: str
    key: str | None
    headers: Mapping[str, str]
    payload: bytes
    published_at: float


@dataclass(slots=True)
class _Delivery:
    """An outstanding message of a group: leased to a fetcher, or scheduled."""

    message: Message
    state: DeliveryState
    due_at: float
    generation: int = 0
    redelivered: bool = False  # nacked or lease ended: the next claim counts a delivery


@dataclass
class _Topic:
    logs: list[list[_Record]]
    delayed: list[tuple[float, int, int, _Record]] = field(default_factory=list)


@dataclass
class _Progress:
    """One group's progress on one topic."""

    cursors: list[int]
    committed: dict[int, int] = field(default_factory=dict)
    outstanding: dict[Position, _Delivery] = field(default_factory=dict)
    scheduled: list[tuple[float, int, Position, int]] = field(default_factory=list)
    leases: list[tuple[float, int, Position, int]] = field(default_factory=list)
    next_queue: int = 0


class MemoryTransport(LeasingTransport):
    """An in-process `Transport`; ``visibility_timeout`` and ``queues`` as for every transport."""

    def __init__(
        self,
        clock: Clock = SYSTEM_CLOCK,
        *,
        queues: int = DEFAULT_QUEUES,
        visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT,
    ) -> None:
        super().__init__(clock, queues, visibility_timeout, poll_interval=None)
        self._sequence = itertools.count()
        self._topics: dict[str, _Topic] = {}
        self._progress: dict[tuple[str, str], _Progress] = {}
        self._dead: dict[str, list[DeadLetter]] = {}

    def _due_now(self) -> float:
        return self._clock.monotonic()

    def _wall_time(self, due: float) -> float:
        return self._clock.time() + (due - self._clock.monotonic())

    def _ack(self, group: str, messages: Sequence[Message]) -> None:
        with self._changed:
            for message in messages:
                progress = self._progress.get((group, message.topic))
                if progress is not None:
                    progress.outstanding.pop((message.queue, message.offset), None)

    def _nack(self, group: str, message: Message, due_at: float, failed_at: float) -> None:
        with self._changed:
            delivery = self._outstanding(group, message)
            if delivery is None:
                return  # already done for the group: a late nack does not resurrect it
            delivery.message = replace(delivery.message, first_failure_at=failed_at)
            delivery.redelivered = True
            progress = self._progress[(group, message.topic)]
            self._schedule(progress, delivery, DeliveryState.SCHEDULED, due_at)

    def _dead_letter(self, group: str, message: Message, failure: Failure) -> bool:
        with self._changed:
            progress = self._progress.get((group, message.topic))
            if (
                progress is None
                or progress.outstanding.pop((message.queue, message.offset), None) is None
            ):
                return False
            dead = self._dead.setdefault(group, [])
            dead.append(DeadLetter(group, message, None, failure, id=len(dead) + 1))
            return True

    def _extend(self, group: str, messages: Sequence[Message], until: float) -> None:
        with self._changed:
            for message in messages:
                delivery = self._outstanding(group, message)
                if delivery is not None and delivery.state is DeliveryState.IN_FLIGHT:
                    progress = self._progress[(group, message.topic)]
                    self._schedule(progress, delivery, DeliveryState.IN_FLIGHT, until)

    def _commit(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        with self._changed:
            for ref, offset in offsets.items():
                committed = self._progress_of(group, ref.topic, self._topic(ref.topic)).committed
                committed[ref.queue] = max(committed.get(ref.queue, 0), offset)

    def _read_and_leased(self, group: str, topic: str) -> tuple[dict[int, int], list[Position]]:
        with self._changed:
            stored = self._topics.get(topic)
            if stored is None:
                return {}, []
            progress = self._progress_of(group, topic, stored)
            leased = [position for position, delivery in progress.outstanding.items()
                      if delivery.state is DeliveryState.IN_FLIGHT]
            return dict(enumerate(progress.cursors)), leased

    def committed(self, group: str, topic: str) -> dict[int, int]:
        """``group``'s committed position per queue of ``topic`` (what `commit` recorded)."""
        with self._changed:
            progress = self._progress.get((group, topic))
            return dict(progress.committed) if progress is not None else {}

    def _queue_count(self, topic: str) -> int:
        with self._changed:
            return len(self._topic(topic).logs)

    def _pending(self, group: str, topic: str) -> int:
        with self._changed:
            stored = self._topics.get(topic)
            if stored is None:
                return 0
            progress = self._progress_of(group, topic, stored)
            unread = sum(
                len(entries) - cursor for entries, cursor in zip(stored.logs, progress.cursors)
            )
            return unread + len(progress.outstanding) + len(stored.delayed)

    def _next_due(self, group: str, topic: str) -> float | None:
        with self._changed:
            return self._earliest(group, topic, leases=False)

    def _seek(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        with self._changed:
            for ref, offset in offsets.items():
                stored = self._topic(ref.topic)
                if not 0 <= ref.queue < len(stored.logs) or offset < 0:
                    raise TransportError(f"cannot seek {ref} to offset {offset}: no such place")
                progress = self._progress_of(group, ref.topic, stored)
                progress.cursors[ref.queue] = min(offset, len(stored.logs[ref.queue]))
                for position, delivery in list(progress.outstanding.items()):
                    first = delivery.state is DeliveryState.IN_FLIGHT and delivery.message.attempt == 1
                    if position[0] == ref.queue and (position[1] >= offset or first):
                        del progress.outstanding[position]
            self._signal()

    def dead_letter_records(self, group: str) -> list[DeadLetter]:
        with self._changed:
            return list(self._dead.get(group, []))

    # primitives of LeasingTransport

    def _append(self, topic: str, messages: Sequence[OutgoingMessage], now: float, *,
                timeout: float | None = None) -> None:  # in process: nothing to wait on
        with self._changed:
            stored = self._topic(topic)
            for message in messages:
                queue = self._router.queue_for(topic, message.key, len(stored.logs))
                record = _Record(
                    cast(str, message.message_id),  # stamped by Transport.publish
                    message.key,
                    dict(message.headers),
                    message.payload,
                    now,
                )
                if message.delay > 0:
                    due_at = self._due_now() + message.delay
                    heapq.heappush(stored.delayed, (due_at, next(self._sequence), queue, record))
                else:
                    stored.logs[queue].append(record)
            self._signal()

    def _claim(
        self, group: str, topic: str, max_messages: int, now: float, lease: float
    ) -> list[Message]:
        with self._changed:
            stored = self._topics.get(topic)
            if stored is None:
                return []
            self._promote(stored, now)
            progress = self._progress_of(group, topic, stored)
            claimed = self._take_due(progress, progress.scheduled, now, max_messages)
            expired = self._take_due(progress, progress.leases, now, max_messages - len(claimed))
            for delivery in expired:
                delivery.redelivered = True
                log.warning(
                    "transport.lease_expired",
                    group=group,
                    topic=topic,
                    queue=delivery.message.queue,
                    offset=delivery.message.offset,
                    attempt=delivery.message.attempt,
                )
            claimed += expired
            claimed += self._take_fresh(progress, stored, topic, now, max_messages - len(claimed))
            for delivery in claimed:
                if delivery.redelivered:
                    delivery.message = replace(delivery.message, attempt=delivery.message.attempt + 1)
                    delivery.redelivered = False
                self._schedule(progress, delivery, DeliveryState.IN_FLIGHT, now + lease)
            return [delivery.message for delivery in claimed]

    def _wake_at(self, group: str, topic: str) -> float | None:
        with self._changed:
            return self._earliest(group, topic, leases=True)

    # helpers, called with the lock held

    def _topic(self, topic: str) -> _Topic:
        stored = self._topics.get(topic)
        if stored is None:
            stored = self._topics[topic] = _Topic([[] for _ in range(self._queues)])
        return stored

    def _outstanding(self, group: str, message: Message) -> _Delivery | None:
        progress = self._progress.get((group, message.topic))
        return None if progress is None else progress.outstanding.get((message.queue, message.offset))

    def _progress_of(self, group: str, topic: str, stored: _Topic) -> _Progress:
        progress = self._progress.get((group, topic))
        if progress is None:
            progress = self._progress[(group, topic)] = _Progress([0] * len(stored.logs))
        return progress

    def _promote(self, stored: _Topic, now: float) -> None:
        """Append delayed publishes that are due to their queue's log."""
        while stored.delayed and stored.delayed[0][0] <= now:
            _, _, queue, record = heapq.heappop(stored.delayed)
            stored.logs[queue].append(record)

    def _schedule(
        self, progress: _Progress, delivery: _Delivery, state: DeliveryState, due_at: float
    ) -> None:
        delivery.state, delivery.due_at = state, due_at
        delivery.generation += 1
        heap = progress.leases if state is DeliveryState.IN_FLIGHT else progress.scheduled
        position = (delivery.message.queue, delivery.message.offset)
        heapq.heappush(heap, (due_at, next(self._sequence), position, delivery.generation))

    def _valid_top(
        self, progress: _Progress, heap: list[tuple[float, int, Position, int]]
    ) -> float | None:
        """The due time at the top of ``heap``, dropping entries superseded since they were pushed."""
        while heap:
            due_at, _, position, generation = heap[0]
            delivery = progress.outstanding.get(position)
            if delivery is not None and delivery.generation == generation:
                return due_at
            heapq.heappop(heap)
        return None

    def _take_due(self, progress: _Progress, heap: list, now: float, limit: int) -> list[_Delivery]:
        taken: list[_Delivery] = []
        while (
            len(taken) < limit
            and (due_at := self._valid_top(progress, heap)) is not None
            and due_at <= now
        ):
            taken.append(progress.outstanding[heapq.heappop(heap)[2]])
        return taken

    def _take_fresh(
        self, progress: _Progress, stored: _Topic, topic: str, now: float, limit: int
    ) -> list[_Delivery]:
        """Read up to ``limit`` unread messages, one queue after another in turn."""
        taken: list[_Delivery] = []
        queues = len(stored.logs)
        start, progress.next_queue = progress.next_queue, (progress.next_queue + 1) % queues
        while len(taken) < limit:
            before = len(taken)
            for queue in (q % queues for q in range(start, start + queues)):
                offset = progress.cursors[queue]
                if len(taken) < limit and offset < len(stored.logs[queue]):
                    record = stored.logs[queue][offset]
                    progress.cursors[queue] = offset + 1
                    message = Message(
                        record.id,
                        topic,
                        queue,
                        offset,
                        record.payload,
                        record.key,
                        record.headers,
                        published_at=record.published_at,
                    )
                    delivery = _Delivery(message, DeliveryState.IN_FLIGHT, now)
                    progress.outstanding[(queue, offset)] = delivery
                    taken.append(delivery)
            if len(taken) == before:
                break
        return taken

    def _earliest(self, group: str, topic: str, *, leases: bool) -> float | None:
        stored = self._topics.get(topic)
        if stored is None:
            return None
        progress = self._progress_of(group, topic, stored)
        candidates = [self._valid_top(progress, progress.scheduled)]
        if leases:
            candidates.append(self._valid_top(progress, progress.leases))
        if stored.delayed:
            candidates.append(stored.delayed[0][0])
        due = [when for when in candidates if when is not None]
        return min(due) if due else None
