"""Commit strategies: when the worker acknowledges done messages, and the offset watermark.

A strategy is told which messages are done and decides when to call ``ack``
(a function acking a list of messages with the transport). ``tick`` lets a
time-based strategy flush on its interval; ``flush`` acks everything pending
(idle, shutdown). ``in_transaction`` asks the pipeline to store offsets in
the same database transaction as the token and the handler's writes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from backends.types import Message, QueueRef
from reliable.errors import ConfigurationError

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


class OffsetWatermark:
    """The contiguous prefix of done offsets per queue, for concurrent workers.

    Offsets are registered as fetched and marked done in any order; only the
    offset below which everything is done may be committed or saved, so a
    saved position never passes a message still in flight.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: dict[QueueRef, int] = {}
        self._done: dict[QueueRef, set[int]] = {}
        self._reported: dict[QueueRef, int] = {}

    def fetched(self, messages: Iterable[Message]) -> None:
        with self._lock:
            for m in messages:
                current = self._next.get(m.ref)
                if current is None or m.offset < current:
                    self._next[m.ref] = m.offset
                self._done.setdefault(m.ref, set())
                self._reported.setdefault(m.ref, m.offset)

    def mark_done(self, messages: Iterable[Message]) -> dict[QueueRef, int]:
        """Mark ``messages`` done; return the queues whose position moved since last reported.

        A message may be marked twice (saved with its transaction, then acked);
        the second time changes nothing.
        """
        advanced: dict[QueueRef, int] = {}
        with self._lock:
            for ref, offsets in _offsets_by_queue(messages).items():
                position = self._next.get(ref)
                if position is not None:  # else revoked: not ours
                    self._done[ref].update(filter(position.__le__, offsets))
            for ref, done in self._done.items():
                position = self._next[ref]
                while position in done:
                    done.discard(position)
                    position += 1
                self._next[ref] = position
                if position > self._reported.get(ref, position):
                    self._reported[ref] = advanced[ref] = position
        return advanced

    def positions_if_done(self, messages: Iterable[Message]) -> dict[QueueRef, int]:
        """Where the queues of ``messages`` would stand once they are done too (nothing changes)."""
        extra = _offsets_by_queue(messages)
        positions: dict[QueueRef, int] = {}
        with self._lock:
            for ref, offsets in extra.items():
                if ref not in self._next:
                    continue
                done, position = self._done[ref], self._next[ref]
                while position in done or position in offsets:
                    position += 1
                positions[ref] = position
        return positions

    def start(self, positions: Mapping[QueueRef, int]) -> None:
        """Start queues at known positions (resumed from saved offsets): everything below is done."""
        with self._lock:
            for ref, offset in positions.items():
                self._next[ref] = self._reported[ref] = offset
                self._done[ref] = set()

    def forget(self, queues: Iterable[QueueRef]) -> None:
        """Drop ``queues`` (revoked, or assigned afresh): their next fetch starts them again."""
        with self._lock:
            for ref in queues:
                self._next.pop(ref, None)
                self._done.pop(ref, None)
                self._reported.pop(ref, None)

    def committable(self) -> dict[QueueRef, int]:
        with self._lock:
            return dict(self._next)


def _offsets_by_queue(messages: Iterable[Message]) -> dict[QueueRef, set[int]]:
    found: dict[QueueRef, set[int]] = {}
    for m in messages:
        found.setdefault(QueueRef(m.topic, m.queue), set()).add(m.offset)
    return found
