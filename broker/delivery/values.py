"""The values the delivery engine takes and gives: what a producer sends, where it went, what a member receives.

They are shared by the engine, its in-process users (`broker.embedded`, the
framework's `embedded://` transport) and the server, which turns them into
frames of its two protocols.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OutgoingMessage:
    """A message to publish; a non-empty ``message_id`` lets the engine drop a resent duplicate."""

    body: bytes
    key: str = ""
    tag: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    message_id: str = ""
    queue: int | None = None
    deliver_at: float = 0.0
    """Seconds since the epoch before which the message is not delivered (0: at once)."""


@dataclass(frozen=True)
class Placement:
    """Where a published message went; ``duplicate`` if the engine already had its id."""

    topic: str
    queue: int
    offset: int
    message_id: str
    duplicate: bool = False


@dataclass(frozen=True)
class Delivery:
    """One message handed to a group member; ``delivery_count`` is 1 on the first delivery."""

    receipt: str
    topic: str
    queue: int
    offset: int
    message_id: str
    body: bytes
    key: str = ""
    tag: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    delivery_count: int = 1
    published_at: float = 0.0


@dataclass(frozen=True)
class QueueLag:
    """How far a group is behind on one queue of a topic."""

    topic: str
    queue: int
    committed: int
    end: int

    @property
    def lag(self) -> int:
        return self.end - self.committed


@dataclass(frozen=True)
class TopicInfo:
    name: str
    queues: int
    messages: int


@dataclass(frozen=True)
class GroupInfo:
    name: str
    topics: tuple[str, ...]
    members: int
    broadcast: bool
