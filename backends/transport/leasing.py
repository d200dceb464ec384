"""What every leasing transport shares: argument checks, queue routing and the fetch wait.

A *leasing* transport hands each fetched message to one member of a group
for ``lease`` seconds (the visibility timeout). A message neither acked,
nacked nor dead-lettered before the lease ends is due again, with its
delivery count raised: the member is presumed dead. Every member is given
every queue of its topics (the lease, not an assignment, keeps two members
off one message) plus the group's ``%RETRY%<group>`` queue, where replays
meant for the group alone wait. The public operations (`LeasingTransport`,
`LeasingSubscription`) are written once here; a backend (memory, embedded,
redis) implements the private primitives.
"""

from __future__ import annotations

import itertools
import threading
import zlib
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from enum import StrEnum

from backends.clock import Clock, SystemClock
from backends.errors import ReliableError, TransportError
from backends.transport.base import (
    Capabilities,
    SubscribeOptions,
    Subscription,
    Transport,
    log_dead_letter,
    retry_queue_name,
)
from backends.types import DeadLetter, Failure, Message, OutgoingMessage, QueueRef
from backends.values import positive

Position = tuple[int, int]  # (queue, offset)
DEFAULT_QUEUES = 4
DEFAULT_VISIBILITY_TIMEOUT = 30.0
MIN_PAUSE = 0.001  # the shortest wait of a fetch, so a waiting fetch always makes progress


class DeliveryState(StrEnum):
    """Where an outstanding (fetched but not done) message of a group is."""

    IN_FLIGHT = "in_flight"  # leased to a fetcher until its due time
    SCHEDULED = "scheduled"  # nacked or delayed: fetchable again from its due time


class QueueRouter:
    """Picks a message's queue: ``crc32(key) % queues`` (stable), round-robin without a key."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def queue_for(self, topic: str, key: str | None, queues: int) -> int:
        if key is not None:
            return zlib.crc32(key.encode()) % queues
        counter = self._counters.setdefault(topic, itertools.count())
        return next(counter) % queues


class LeasingTransport(Transport):
    """The `Transport` operations written once over a backend's claim/wait primitives."""

    capabilities = Capabilities(consumer_offsets=True, drain=True, dead_letter_queue=True)

    def __init__(
        self, clock: Clock, queues: int, visibility_timeout: float, poll_interval: float | None
    ) -> None:
        self._clock = clock
        self._queues = positive("transport option queues", queues, integer=True)
        self._visibility_timeout = positive("transport option visibility_timeout", visibility_timeout)
        self._poll_interval = poll_interval
        self._router = QueueRouter()
        self._closed = False
        # re-entrant, so the memory transport can use it as its state lock too
        self._changed = threading.Condition(threading.RLock())
        self._changes = 0

    @property
    def visibility_timeout(self) -> float:
        """Seconds a fetched message stays leased to its member unless the member asks otherwise."""
        return self._visibility_timeout

    def _due_now(self) -> float:
        """The reading due times (leases, nacked and delayed messages) are kept on: the wall
        clock, which every process sharing the backend reads alike. A backend of one process
        measures them on the monotonic clock instead (`MemoryTransport`): a wall clock step
        (an NTP correction, a resumed VM) then moves no lease or delay."""
        return self._clock.time()

    def _wall_time(self, due: float) -> float:
        """``due``, a `_due_now` reading, as wall time (`Subscription.next_due` is one)."""
        return due

    def _send(self, topic: str, messages: Sequence[OutgoingMessage], *, timeout: float | None = None) -> None:
        self._append(topic, messages, self._clock.time(), timeout=timeout)

    def _send_to_group(self, group: str, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        """Append to ``%RETRY%<group>``, which only members of ``group`` read."""
        self._append(retry_queue_name(group), messages, self._clock.time())

    def subscribe(
        self, group: str, topics: Sequence[str], options: SubscribeOptions | None = None
    ) -> LeasingSubscription:
        self._check_open()
        return LeasingSubscription(self, group, topics, options or SubscribeOptions())

    def dead_letter_queue(self, group: str) -> list[Message]:
        """The messages dead-lettered by ``group`` (``%DLQ%<group>``), oldest first, as given."""
        return [record.message for record in self.dead_letter_records(group)]

    @abstractmethod
    def dead_letter_records(self, group: str) -> list[DeadLetter]:
        """``%DLQ%<group>`` with each message's `Failure`, oldest first."""

    def close(self) -> None:
        self._closed = True

    def _wait(self, wake: float | None, version: int, remaining: float, now: float) -> float:
        """Wait for a change or the ``wake`` time, at most ``remaining``; return the seconds spent.

        A fake clock is slept on (it advances, nothing blocks for real); the
        real clock waits on the backend's change signal, polling where other
        processes may publish.
        """
        pause = remaining if wake is None else min(remaining, wake - now)
        pause = min(max(pause, MIN_PAUSE), remaining)
        if not isinstance(self._clock, SystemClock):
            self._clock.sleep(pause)
            return pause
        if self._poll_interval is not None:
            pause = min(pause, self._poll_interval)
        began = self._clock.monotonic()  # a fetch's timeout is a duration: a wall clock step keeps it
        self._wait_for_change(version, pause)
        return max(self._clock.monotonic() - began, MIN_PAUSE)

    # -- primitives, per backend ------------------------------------------------------------

    @abstractmethod
    def _append(self, topic: str, messages: Sequence[OutgoingMessage], now: float, *,
                timeout: float | None = None) -> None:
        """Store ``messages`` on their queues, published at ``now`` (wall time); delayed ones due
        ``delay`` seconds later; a server's requests waiting at most ``timeout`` if given."""

    @abstractmethod
    def _claim(
        self, group: str, topic: str, max_messages: int, now: float, lease: float
    ) -> list[Message]:
        """Atomically lease up to ``max_messages`` due messages until ``now + lease`` (``now``, as
        every due time the primitives take and give, a `_due_now` reading).

        A message claimed again (nacked, or its lease ended) has its delivery
        count (``attempt``) raised by one.
        """

    @abstractmethod
    def _wake_at(self, group: str, topic: str) -> float | None:
        """The earliest time a scheduled message or a lease of ``group`` falls due."""

    @abstractmethod
    def _ack(self, group: str, messages: Sequence[Message]) -> None:
        """Forget ``messages`` for ``group``."""

    @abstractmethod
    def _nack(self, group: str, message: Message, due_at: float, failed_at: float) -> None:
        """Schedule ``message`` for ``group`` at ``due_at``; keep its first failure time."""

    @abstractmethod
    def _dead_letter(self, group: str, message: Message, failure: Failure) -> bool:
        """Move ``message`` to ``%DLQ%<group>``; False if it was no longer outstanding."""

    @abstractmethod
    def _extend(self, group: str, messages: Sequence[Message], until: float) -> None:
        """Extend the leases of ``messages`` still in flight to ``until``."""

    @abstractmethod
    def _pending(self, group: str, topic: str) -> int:
        """Messages of ``topic`` not yet done for ``group``, delayed and scheduled included."""

    @abstractmethod
    def _next_due(self, group: str, topic: str) -> float | None:
        """When the earliest scheduled message of ``topic`` falls due for ``group``."""

    @abstractmethod
    def _queue_count(self, topic: str) -> int:
        """The queues of ``topic`` (created with the default count if it is new)."""

    @abstractmethod
    def _seek(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        """Move ``group``'s cursors to offsets the consumer saved.

        Outstanding messages at or after a cursor are read again; messages in
        flight below it for the first time are done (the saved offset says so)
        and are forgotten; scheduled redeliveries below it stay scheduled, and
        so do redeliveries in flight below it (a position passes a message
        handed back to wait here, which says nothing of it once claimed again).
        """

    @abstractmethod
    def _read_and_leased(self, group: str, topic: str) -> tuple[dict[int, int], list[Position]]:
        """``group``'s cursor per queue of ``topic`` (the next offset to read), and the places of the
        messages in flight (leased to a member, alive or not). Scheduled redeliveries are neither:
        they wait in the transport, whatever is committed."""

    @abstractmethod
    def _commit(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        """Record ``group``'s position per queue (never moving it backwards)."""

    def _signal(self) -> None:
        """Wake fetchers waiting in this process: something may have become fetchable."""
        with self._changed:
            self._changes += 1
            self._changed.notify_all()

    def _version(self) -> int:
        return self._changes

    def _wait_for_change(self, version: int, seconds: float) -> None:
        """Block up to ``seconds`` unless `_signal` was called since ``version`` was read."""
        with self._changed:
            if self._changes == version:
                self._changed.wait(seconds)


class LeasingSubscription(Subscription):
    """A member of a group on a leasing transport: every queue, leases keep members apart."""

    def __init__(
        self,
        transport: LeasingTransport,
        group: str,
        topics: Sequence[str],
        options: SubscribeOptions,
    ) -> None:
        super().__init__(group, [*dict.fromkeys([*topics, retry_queue_name(group)])], options)
        self.capabilities = transport.capabilities
        self._transport = transport
        self._lease = options.lease or transport.visibility_timeout
        self._turn = 0
        self._closed = False
        self.assigned = [
            QueueRef(topic, queue)
            for topic in self.topics
            for queue in range(transport._queue_count(topic))
        ]
        if options.on_assign is not None:
            saved = {ref: offset for ref, offset in options.on_assign(self.assigned).items()
                     if ref in self.assigned}
            if saved:
                transport._seek(group, saved)

    def fetch(self, max_messages: int, timeout: float) -> list[Message]:
        self._check_open()
        self._check_fetch(max_messages)
        transport, remaining = self._transport, max(timeout, 0.0)
        while True:
            version = transport._version()
            now = transport._due_now()
            claimed = self._claim(max_messages, now)
            if claimed or remaining <= 0:
                return claimed
            wakes = [w for t in self.topics if (w := transport._wake_at(self.group, t)) is not None]
            remaining -= transport._wait(min(wakes, default=None), version, remaining, now)

    def ack(self, messages: Sequence[Message]) -> None:
        self._check_open()
        if messages:
            self._transport._ack(self.group, messages)

    def nack(self, message: Message, delay: float) -> None:
        self._check_open()
        if delay < 0:
            raise TransportError(f"nack delay {delay!r}: must be >= 0")
        due_at, failed_at = self._transport._due_now() + delay, self._transport._clock.time()
        self._transport._nack(self.group, message, due_at, message.first_failure_at or failed_at)
        self._transport._signal()

    def dead_letter(self, message: Message, failure: Failure) -> None:
        self._check_open()
        if self._transport._dead_letter(self.group, message, failure):
            log_dead_letter(self.group, message, failure)

    def in_progress(self, messages: Sequence[Message]) -> None:
        self._check_open()
        if messages:
            self._transport._extend(self.group, messages, self._transport._due_now() + self._lease)

    def commit(self, offsets: Mapping[QueueRef, int]) -> None:
        self._check_open()
        if offsets:
            self._transport._commit(self.group, offsets)

    def finished_below(self, in_hand: Mapping[QueueRef, AbstractSet[int]]) -> dict[QueueRef, int]:
        """Every member reads every queue, so a member's own done offsets stop at the first one
        another member took; what the group finished is the transport's to tell: per queue, its
        cursor or, below it, the lowest offset leased to a member, but for this one's ``in_hand``."""
        self._check_open()
        below: dict[QueueRef, int] = {}
        for topic in dict.fromkeys(ref.topic for ref in in_hand):
            cursors, leased = self._transport._read_and_leased(self.group, topic)
            for queue, cursor in cursors.items():
                if (ref := QueueRef(topic, queue)) in in_hand:
                    below[ref] = cursor
            for queue, offset in leased:
                ref = QueueRef(topic, queue)
                if ref in below and offset < below[ref] and offset not in in_hand[ref]:
                    below[ref] = offset
        return below

    def pending(self) -> int:
        self._check_open()
        return sum(self._transport._pending(self.group, topic) for topic in self.topics)

    def next_due(self) -> float | None:
        self._check_open()
        dues = [d for t in self.topics if (d := self._transport._next_due(self.group, t)) is not None]
        return self._transport._wall_time(min(dues)) if dues else None

    def close(self) -> None:
        if not self._closed and self.options.on_revoke is not None:
            self.options.on_revoke(self.assigned)
        self._closed = True

    def _claim(self, max_messages: int, now: float) -> list[Message]:
        """Claim from each topic in turn, starting one further each time, until full.

        A topic whose claim fails does not keep what the others leased from the
        caller: those are leased and counted as delivered already, and raising
        lost them until their lease ended, a delivery spent for each failed
        fetch (on Redis out of memory, every fetch: a claim that moved a lease
        went through, the ``%RETRY%`` queue's first write was refused). Only a
        fetch that claimed nothing raises the (first) error.
        """
        claimed: list[Message] = []
        failed: ReliableError | None = None
        start, self._turn = self._turn, self._turn + 1
        for i in range(len(self.topics)):
            if len(claimed) >= max_messages:
                break
            topic = self.topics[(start + i) % len(self.topics)]
            try:
                claimed += self._transport._claim(
                    self.group, topic, max_messages - len(claimed), now, self._lease
                )
            except ReliableError as exc:
                failed = failed or exc
        if failed is not None and not claimed:
            raise failed
        return claimed

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"subscription of group {self.group!r} is closed")
        self._transport._check_open()
