"""The `Transport` protocol: how messages arrive and how consumers acknowledge them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

from backends.types import Failure, Message, OutgoingMessage, QueueRef


class Transport(ABC):
    """Fetch, ack, nack-with-delay, dead-letter and commit offsets for consumer groups.

    Ack types map to methods: ``ack`` is STANDARD, ``nack`` REDELIVERED
    (delivered again after ``delay`` with ``attempt + 1``), ``dead_letter``
    POISON (moved to ``%DLQ%<group>``). A fetched message that is neither
    acked nor nacked (the consumer died) comes back after the transport's
    visibility timeout.
    """

    commits_offsets: bool = False
    """True where the broker keeps a group's position as an offset that `commit` moves
    (then the worker tracks the contiguous watermark of done offsets)."""

    @abstractmethod
    def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> None:
        """Append ``messages`` to ``topic``; a message with ``delay`` is delivered later."""

    @abstractmethod
    def fetch(self, group: str, topic: str, max_messages: int, timeout: float) -> list[Message]:
        """Up to ``max_messages`` due messages, waiting at most ``timeout`` seconds for one."""

    @abstractmethod
    def ack(self, group: str, messages: Sequence[Message]) -> None:
        """STANDARD: the messages are done for ``group``."""

    @abstractmethod
    def nack(self, group: str, message: Message, delay: float) -> None:
        """REDELIVERED: deliver ``message.next_attempt(...)`` again after ``delay`` seconds.

        The caller passes the message as it should be redelivered (attempt and
        first failure time already advanced); the transport stores them.
        """

    @abstractmethod
    def dead_letter(self, group: str, message: Message, failure: Failure) -> None:
        """POISON: never deliver ``message`` to ``group`` again; keep it in ``%DLQ%<group>``."""

    @abstractmethod
    def pending(self, group: str, topic: str) -> int:
        """Messages of ``topic`` not yet done for ``group``, scheduled redeliveries included."""

    def next_due(self, group: str, topic: str) -> float | None:
        """When the earliest scheduled (delayed) message becomes due, or None if none is."""
        return None

    def commit(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        """Record consumed offsets (next offset to read); a no-op where acks are offsets."""

    def seek(self, group: str, offsets: Mapping[QueueRef, int]) -> None:
        """Resume ``group`` from ``offsets`` (kept by the consumer); ignored where unsupported."""

    def close(self) -> None:
        """Release connections and files."""
