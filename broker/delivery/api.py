"""The delivery engine's one synchronous interface, `BrokerApi`.

Generated from `broker.protocol.operations` by ``python -m broker.protocol.generate``:
edit the operation table (or that module's `LOCAL`), not this file.

Three things implement it: the engine itself, in process (`broker.delivery`),
the client of the broker server (`broker.client`, over TCP or the local
socket of an embedded broker owned by another process), and test doubles.
The framework's broker transport (`backends/transport/broker.py`) is written
once over this interface, so `embedded://DIR` and `reliable://host:port` share
it; the server's asyncio `Engine` (`broker/server/engine.py`) is this
interface run off the event loop.

A group member is a handle (``member``) that `BrokerApi.join` hands out;
every delivery carries an opaque ``receipt`` that the member acks, nacks or
dead-letters. Any call by a member counts as its heartbeat. When a member
leaves, or stops calling for longer than the group's session timeout, what it
held unacknowledged is redelivered to the group.

Calls the engine cannot serve raise `broker.errors.BrokerError` subclasses.
Implementations may add keyword arguments with defaults and further methods;
the calls below keep their meaning everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from broker.delivery.values import (
    Delivery,
    DeliveryColumns,
    GroupInfo,
    OutgoingMessage,
    Placement,
    QueueLag,
    TopicInfo,
)


class BrokerApi(Protocol):
    """Publish, consume as a group member, acknowledge by receipt, inspect."""

    def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        """Append ``messages`` to ``topic`` in order; durable per the flush setting when this returns."""

    def publish_to_group(self, group: str, topic: str,
                         messages: Sequence[OutgoingMessage]) -> list[Placement]:
        """Deliver ``messages`` of ``topic`` to ``group`` only (through ``%RETRY%<group>``)."""

    def join(self, group: str, topics: Sequence[str], *, broadcast: bool = False,
             from_end: bool = False, prefetch: int | None = None, lease: float | None = None,
             tags: Sequence[str] | None = None) -> str:
        """A new member of ``group`` over ``topics``; ``from_end``: a new group starts at the end;
        ``prefetch`` and ``lease`` override the broker's; ``tags``: only these (else UNMATCHED)."""

    def leave(self, member: str) -> None:
        """End ``member``; what it held unacknowledged is redelivered to the group."""

    def fetch(self, member: str, max_messages: int, timeout: float) -> list[Delivery]:
        """Up to ``max_messages``, waiting up to ``timeout`` seconds for the first one."""

    def ack(self, member: str, receipts: Sequence[str]) -> None:
        """STANDARD: these deliveries are done."""

    def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        """REDELIVERED: deliver these again, not before ``delay`` seconds; the delivery count goes up."""

    def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        """POISON: move these to the group's dead-letter queue ``%DLQ%<group>`` with ``reason``."""

    def extend(self, member: str, receipts: Sequence[str]) -> None:
        """Still working on these: their leases start again."""

    def release(self, member: str, receipts: Sequence[str]) -> None:
        """RELEASED: these never reached the application (fetched ahead, not received): delivered
        again as if never handed out, their delivery count unmoved."""

    def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Offsets kept by the consumer: the next offset to read per (topic, queue); seeks there."""

    def assignment(self, member: str) -> list[tuple[str, int]]:
        """The (topic, queue) pairs ``member`` holds now."""

    def pending(self, group: str, topics: Sequence[str]) -> int:
        """Messages of ``topics`` (and the group's retry topic) ``group`` has not finished (a topic
        the broker does not hold has none, and is not made)."""

    def next_due(self, group: str) -> float | None:
        """When the earliest delayed message ``group`` holds back falls due, or None."""

    def read(self, topic: str, queue: int, offset: int, max_messages: int) -> list[Delivery]:
        """Messages of (topic, queue) from ``offset`` on, outside any group (a stream processor)."""

    def read_columns(self, topic: str, queue: int, offset: int,
                     max_messages: int) -> DeliveryColumns:
        """`read` column by column (no `Delivery` per message: a columnar reader's call)."""

    def queue_offsets(self, topic: str) -> list[list[int]]:
        """``[first kept, end]`` per queue of ``topic``."""

    def group_offsets(self, group: str, topic: str) -> list[int | None]:
        """``group``'s committed offset per queue of ``topic`` (None: never committed; no queues for
        a topic the broker does not hold, which is not made)."""

    def commit_group(self, group: str, topic: str, offsets: Sequence[int]) -> None:
        """Record the next offset per queue as ``group``'s (a stream processor's commit)."""

    def topics(self) -> list[TopicInfo]:
        """Every topic with its queue and message counts and the bytes its messages take."""

    def groups(self) -> list[GroupInfo]:
        """Every consumer group the engine knows."""

    def lag(self, group: str) -> list[QueueLag]:
        """``group``'s committed offset against the end of each queue it reads."""

    def dlq_list(self, group: str, limit: int, *, body_limit: int | None = None) -> list[Delivery]:
        """The first ``limit`` messages of ``group``'s dead-letter queue (with ``body_limit``, each
        body cut to its first bytes, its whole size in ``x-dlq-body-size``)."""

    def dlq_replay(self, group: str) -> int:
        """Every dead letter of ``group`` back to the group only, emptying its dead-letter queue; how many."""

    def dlq_purge(self, group: str) -> int:
        """Drop ``group``'s dead letters; how many."""

    def dlq_replay_letters(self, group: str, offsets: Sequence[int]) -> int:
        """The dead letters of ``group`` at ``offsets`` (of ``%DLQ%<group>``) back to the group
        only; the others stay; how many were waiting."""

    def dlq_purge_letters(self, group: str, offsets: Sequence[int]) -> int:
        """Drop the dead letters of ``group`` at ``offsets``; the others stay; how many were waiting."""

    def close(self) -> None:
        """Flush and release what this handle holds."""
