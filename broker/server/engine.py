"""What the server needs from the delivery engine: the `Engine` protocol and its values.

The server speaks two protocols on the network and turns every request into
one call of this interface; the engine owns topics, groups, offsets,
redelivery and de-duplication. A group member is a handle (``member``) the
engine hands out on `Engine.join`; every delivery carries an opaque
``receipt`` that the member acks, nacks or dead-letters. When a connection
ends, the server calls `Engine.leave` for each of its members, and the
engine redelivers whatever they held unacknowledged.

Calls the engine cannot serve raise `broker.errors.BrokerError` subclasses
(`RequestError` for an unknown member or receipt); the server reports them to
the client and keeps the connection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from broker.delivery.values import (
    Delivery,
    GroupInfo,
    OutgoingMessage,
    Placement,
    QueueLag,
    TopicInfo,
)

__all__ = ["Delivery", "Engine", "GroupInfo", "OutgoingMessage", "Placement", "QueueLag", "TopicInfo"]


class Engine(Protocol):
    """The delivery engine as the server drives it; every call may be awaited concurrently."""

    async def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        """Append ``messages`` to ``topic`` in order; durable when this returns."""

    async def join(self, group: str, topics: Sequence[str], *, broadcast: bool = False,
                   from_end: bool = False) -> str:
        """A new member of ``group`` over ``topics``; ``from_end``: a new group starts at the end."""

    async def leave(self, member: str) -> None:
        """End ``member``; what it held unacknowledged is redelivered to the group."""

    async def fetch(self, member: str, max_messages: int, timeout: float) -> list[Delivery]:
        """Up to ``max_messages``, waiting up to ``timeout`` seconds for the first one."""

    async def ack(self, member: str, receipts: Sequence[str]) -> None:
        """STANDARD: these deliveries are done."""

    async def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        """REDELIVERED: deliver these again, not before ``delay`` seconds."""

    async def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        """POISON: move these to the group's dead-letter queue with ``reason``."""

    async def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Offsets kept by the consumer (broadcasting): the next offset to read per (topic, queue)."""

    async def topics(self) -> list[TopicInfo]:
        """Every topic with its queue and message counts."""

    async def groups(self) -> list[GroupInfo]:
        """Every consumer group the engine knows."""

    async def lag(self, group: str) -> list[QueueLag]:
        """``group``'s committed offset against the end of each queue it reads."""
