"""Consumer groups: members, their heartbeats, and which member holds which queue.

*Clustering* (the default): each message goes to one member; the group's
queues are spread over its members by an allocation strategy, a queue is
held by one member at a time, and the broker keeps the offsets.
*Broadcasting*: every member reads every queue with cursors of its own, and
keeps its own offsets (`BrokerApi.commit`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from broker.delivery.allocation import QueueKey, Strategy
from broker.delivery.cursor import QueueCursor

RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"
STOMP_TOPIC_PREFIX = "%STOMP%"  # %STOMP%<topic>: the broadcasting group of STOMP's /topic/<topic> subscriptions
# the headers of a group's retry and dead-letter copies: where the message was first
# published (kept through every copy), why it was dead-lettered, after how many deliveries
ORIGIN_TOPIC, ORIGIN_QUEUE, ORIGIN_OFFSET = "x-origin-topic", "x-origin-queue", "x-origin-offset"
DLQ_CAUSE, DELIVERY_COUNT = "x-dlq-cause", "x-delivery-count"

_member_ids = itertools.count(1)


def retry_topic(group: str) -> str:
    return f"{RETRY_PREFIX}{group}"


def dlq_topic(group: str) -> str:
    return f"{DLQ_PREFIX}{group}"


@dataclass
class Member:
    """One consumer of a group: what it reads, its window, when it was last heard of."""

    ident: str
    group: str
    topics: tuple[str, ...]
    prefetch: int
    lease: float
    last_seen: float  # the monotonic clock's reading: a wall clock step expires no member
    tags: frozenset[str] | None = None  # None: every tag
    queues: list[QueueKey] = field(default_factory=list)
    own: dict[QueueKey, QueueCursor] = field(default_factory=dict)  # broadcasting only
    rotation: int = 0

    def wants(self, tag: str) -> bool:
        return self.tags is None or tag in self.tags


class Group:
    """A consumer group: its members and, when clustering, its cursors per queue."""

    def __init__(self, name: str, *, broadcast: bool, strategy: Strategy, ordered: bool = False) -> None:
        self.name = name
        self.broadcast = broadcast
        self.ordered = ordered  # one message of a queue at a time; a failing one holds its queue
        self.strategy = strategy
        self.members: dict[str, Member] = {}
        self.cursors: dict[QueueKey, QueueCursor] = {}  # clustering: shared by the members
        self.generation = 0

    def new_member(self, topics: tuple[str, ...], prefetch: int, lease: float, now: float,
                   tags: frozenset[str] | None) -> Member:
        ident = f"{self.name}/{next(_member_ids)}"
        member = Member(ident, self.name, topics, prefetch, lease, now, tags)
        self.members[ident] = member
        return member

    def topics(self) -> tuple[str, ...]:
        """Every topic a member reads, and the group's retry topic."""
        named = {topic for member in self.members.values() for topic in member.topics}
        return (*sorted(named), retry_topic(self.name))

    def rebalance(self, queues_of: Callable[[str], int]) -> list[QueueKey]:
        """Assign every queue of the group's topics to one member (per topic, among the members
        reading it); the queues that changed hands, whose held messages must go back."""
        self.generation += 1
        if self.broadcast:
            for member in self.members.values():
                member.queues = [(t, q) for t in (*member.topics, retry_topic(self.name))
                                 for q in range(queues_of(t))]
            return []
        before = {queue: member.ident for member in self.members.values() for queue in member.queues}
        for member in self.members.values():
            member.queues = []
        for topic in self.topics():
            readers = sorted(ident for ident, member in self.members.items()
                             if topic in member.topics or topic == retry_topic(self.name))
            queues = [(topic, queue) for queue in range(queues_of(topic))]
            for ident, taken in self.strategy(queues, readers).items():
                self.members[ident].queues.extend(taken)
        after = {queue: member.ident for member in self.members.values() for queue in member.queues}
        return [queue for queue, ident in before.items() if after.get(queue) != ident]

    def cursors_of(self, member: Member) -> Iterator[QueueCursor]:
        """The cursors ``member`` reads now (rotated, so no queue starves the others)."""
        table = member.own if self.broadcast else self.cursors
        keys = [key for key in member.queues if key in table]
        if not keys:
            return iter(())
        member.rotation = (member.rotation + 1) % len(keys)
        return (table[key] for key in keys[member.rotation:] + keys[:member.rotation])

    def all_cursors(self) -> Iterator[QueueCursor]:
        if self.broadcast:
            return (cursor for member in self.members.values() for cursor in member.own.values())
        return iter(self.cursors.values())
