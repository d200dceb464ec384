"""Commit strategies: when the worker acknowledges done messages, and the offset watermark.

`OffsetWatermark` is defined in `backends.watermark`, so a transport that keeps
its own done prefix (Kafka) uses the same one; it is re-exported here.

A strategy is told which messages are done and decides when to call ``ack``
(a function acking a list of messages with the transport). ``tick`` lets a
time-based strategy flush on its interval; ``flush`` acks everything pending
(idle, shutdown). ``in_transaction`` asks the pipeline to store offsets in
the same database transaction as the token and the handler's writes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from backends.types import Message
from backends.watermark import OffsetWatermark
from reliable.errors import ConfigurationError

__all__ = ["STRATEGIES", "Ack", "Async", "Batch", "CommitStrategy", "OffsetWatermark", "PerMessage",
           "Transactional", "commit_strategy"]

Ack = Callable[[Sequence[Message]], None]

log = structlog.get_logger("reliable.commit")


class CommitStrategy:
    """Per message: ack each message as soon as it is done (the base behaviour)."""

    name = "per_message"
    in_transaction = False

    def done(self, messages: Sequence[Message], ack: Ack, now: float) -> None:
        if messages:
            ack(messages)

    def tick(self, ack: Ack, now: float) -> None:
        """Called by the worker loop between fetches."""

    def flush(self, ack: Ack) -> None:
        """Ack everything still pending."""

    def close(self) -> None:
        """Stop background work (after a final flush)."""

    def forget(self) -> None:
        """Drop held acks: the membership that fetched those messages is gone (an outage), so
        they come back to the group and are skipped by their tokens."""


class PerMessage(CommitStrategy):
    """Ack every message when it is done."""


class Transactional(CommitStrategy):
    """Offsets are saved in the handler's transaction; acks follow the commit at once."""

    name = "transactional"
    in_transaction = True


@dataclass
class Batch(CommitStrategy):
    """Ack in batches: when ``size`` are pending or ``interval`` seconds passed (optimizeAck)."""

    size: int = 100
    interval: float = 1.0
    name = "batch"
    _pending: list[Message] = field(default_factory=list)
    _since: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.size < 1 or self.interval <= 0:
            raise ConfigurationError(
                f"commit batch size={self.size}, interval={self.interval} not allowed; "
                "expected size >= 1 and interval > 0"
            )

    def done(self, messages: Sequence[Message], ack: Ack, now: float) -> None:
        with self._lock:
            self._pending.extend(messages)
            if self._since is None:
                self._since = now
            due = len(self._pending) >= self.size
        if due:
            self.flush(ack)

    def tick(self, ack: Ack, now: float) -> None:
        if self._since is not None and now - self._since >= self.interval:
            self.flush(ack)

    def flush(self, ack: Ack) -> None:
        with self._lock:
            pending, self._pending, self._since = self._pending, [], None
        if pending:
            ack(pending)

    def forget(self) -> None:
        with self._lock:
            self._pending, self._since = [], None


class Async(CommitStrategy):
    """Ack on a background thread so the handler loop never waits for the transport."""

    name = "async"

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Ack, Sequence[Message]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="reliable-async-ack", daemon=True)
        self._thread.start()

    def done(self, messages: Sequence[Message], ack: Ack, now: float) -> None:
        if messages:
            self._queue.put((ack, list(messages)))

    def flush(self, ack: Ack) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.join()
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            ack, messages = item
            try:
                ack(messages)
            except Exception as exc:  # an ack lost here means a redelivery, never a loss
                log.error("async_ack_failed", count=len(messages), error=str(exc))
            finally:
                self._queue.task_done()
        self._queue.task_done()


STRATEGIES = ("per_message", "batch", "async", "transactional")


def commit_strategy(name: str, batch_size: int = 100, interval: float = 1.0) -> CommitStrategy:
    """The strategy named in the settings file or on the decorator."""
    if name == "per_message":
        return PerMessage()
    if name == "batch":
        return Batch(size=batch_size, interval=interval)
    if name == "async":
        return Async()
    if name == "transactional":
        return Transactional()
    raise ConfigurationError(f"commit strategy {name!r} is not allowed; expected one of {', '.join(STRATEGIES)}")
