"""What every leasing transport shares: argument checks, queue routing and the fetch wait.

A *leasing* transport hands each fetched message to one fetcher of a group
for ``visibility_timeout`` seconds (its lease). A message neither acked,
nacked nor dead-lettered before the lease ends is due again: the consumer is
presumed dead. The public operations are written once here; a backend
(memory, embedded, redis) implements the private primitives.
"""

from __future__ import annotations

import itertools
import os
import threading
import zlib
from abc import abstractmethod
from collections.abc import Sequence
from enum import StrEnum

import structlog

from backends.clock import Clock, SystemClock
from backends.errors import ConfigurationError, TransportError
from backends.transport.base import Transport
from backends.types import DeadLetter, Failure, Message, OutgoingMessage

DEFAULT_QUEUES = 4
DEFAULT_VISIBILITY_TIMEOUT = 30.0
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))  # version and variant bits
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)  # version 4, RFC 4122 variant
MIN_PAUSE = 0.001  # the shortest wait of a fetch, so a waiting fetch always makes progress


class DeliveryState(StrEnum):
    """Where an outstanding (fetched but not done) message of a group is."""

    IN_FLIGHT = "in_flight"  # leased to a fetcher until its due time
    SCHEDULED = "scheduled"  # nacked or delayed: fetchable again from its due time


def dead_letter_queue_name(group: str) -> str:
    """The name of ``group``'s dead-letter queue."""
    return f"%DLQ%{group}"


def log_dead_letter(group: str, message: Message, failure: Failure) -> None:
    """The POISON ack, logged the same way by every transport."""
    structlog.get_logger("backends.transport").info(
        "transport.dead_letter",
        group=group,
        topic=message.topic,
        queue=message.queue,
        offset=message.offset,
        attempt=message.attempt,
        error_type=failure.error_type,
    )


def new_message_id() -> str:
    """A message id for a producer that gave none: a random uuid4, in hex.

    Built from the random bits directly: ``uuid.uuid4().hex`` costs several
    times more, and publishing pays it for every message.
    """
    value = int.from_bytes(os.urandom(16), "big") & _UUID4_CLEAR | _UUID4_SET
    return f"{value:032x}"


class QueueRouter:
    """Picks a message's queue: ``crc32(key) % queues`` (stable), round-robin without a key."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    def queue_for(self, topic: str, key: str | None, queues: int) -> int:
        if key is not None:
            return zlib.crc32(key.encode()) % queues
        counter = self._counters.setdefault(topic, itertools.count())
        return next(counter) % queues


def positive(name: str, value: float) -> float:
    """``value`` if it is a positive number, else a `ConfigurationError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigurationError(
            f"transport option {name}={value!r}: a positive number is required"
        )
    return value


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not name:
        raise TransportError(f"{kind} name {name!r}: a non-empty string is required")


class LeasingTransport(Transport):
    """The `Transport` operations written once over a backend's claim/wait primitives."""

    def __init__(
        self, clock: Clock, queues: int, visibility_timeout: float, poll_interval: float | None
    ) -> None:
        if isinstance(queues, bool) or not isinstance(queues, int) or queues < 1:
            raise ConfigurationError(
                f"transport option queues={queues!r}: an integer >= 1 is required"
            )
        self._clock = clock
        self._queues = queues
        self._visibility_timeout = positive("visibility_timeout", visibility_timeout)
        self._poll_interval = poll_interval
        self._router = QueueRouter()
        self._closed = False
        # re-entrant, so the memory transport can use it as its state lock too
        self._changed = threading.Condition(threading.RLock())
        self._changes = 0

    @property
    def visibility_timeout(self) -> float:
        """Seconds a fetched message stays leased to its fetcher."""
        return self._visibility_timeout

    def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        self._check_open()
        _check_name("topic", topic)
        for message in messages:
            if not isinstance(message.payload, bytes):
                raise TransportError(f"message payload must be bytes, got {type(message.payload)}")
            if message.delay < 0:
                raise TransportError(f"message delay {message.delay!r}: must be >= 0")
        if messages:
            self._append(topic, messages, self._clock.time())

    def fetch(self, group: str, topic: str, max_messages: int, timeout: float) -> list[Message]:
        self._check_open()
        _check_name("group", group)
        _check_name("topic", topic)
        if max_messages < 1:
            raise TransportError(f"max_messages={max_messages!r}: must be >= 1")
        remaining = max(timeout, 0.0)
        while True:
            version = self._version()
            now = self._clock.time()
            claimed = self._claim(group, topic, max_messages, now)
            if claimed or remaining <= 0:
                return claimed
            remaining -= self._pause(group, topic, version, remaining, now)

    def dead_letter_queue(self, group: str) -> list[Message]:
        """The messages dead-lettered by ``group`` (``%DLQ%<group>``), oldest first, as given."""
        return [record.message for record in self.dead_letter_records(group)]

    @abstractmethod
    def dead_letter_records(self, group: str) -> list[DeadLetter]:
        """``%DLQ%<group>`` with each message's `Failure`, oldest first."""

    def close(self) -> None:
        self._closed = True

    def _pause(self, group: str, topic: str, version: int, remaining: float, now: float) -> float:
        """Wait for a change or a due time, at most ``remaining``; return the seconds spent.

        A fake clock is slept on (it advances, nothing blocks for real); the
        real clock waits on the backend's change signal, polling where other
        processes may publish.
        """
        wake = self._wake_at(group, topic)
        pause = remaining if wake is None else min(remaining, wake - now)
        pause = min(max(pause, MIN_PAUSE), remaining)
        if not isinstance(self._clock, SystemClock):
            self._clock.sleep(pause)
            return pause
        if self._poll_interval is not None:
            pause = min(pause, self._poll_interval)
        self._wait_for_change(version, pause)
        return max(self._clock.time() - now, MIN_PAUSE)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{type(self).__name__} is closed")

    @abstractmethod
    def _append(self, topic: str, messages: Sequence[OutgoingMessage], now: float) -> None:
        """Store ``messages`` on their queues (delayed ones due at ``now + delay``)."""

    @abstractmethod
    def _claim(self, group: str, topic: str, max_messages: int, now: float) -> list[Message]:
        """Atomically lease up to ``max_messages`` due messages to the caller."""

    @abstractmethod
    def _wake_at(self, group: str, topic: str) -> float | None:
        """The earliest time a scheduled message or a lease of ``group`` falls due."""

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
