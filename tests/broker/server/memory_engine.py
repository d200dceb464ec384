"""TEST ONLY: a minimal in-memory `broker.server.engine.Engine`, NOT the broker's delivery engine.

The server's tests need an engine while the real one (broker/delivery) is
being written; this one keeps one queue per topic in lists, drops resent
message ids, shares a clustering group's messages among its members,
redelivers what a leaving member held, and honours nack delays. It persists
nothing and is not tuned for anything.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker.server.engine import (
    Delivery,
    GroupInfo,
    OutgoingMessage,
    Placement,
    QueueLag,
    TopicInfo,
)
from broker.server.errors import RequestError


@dataclass
class _Group:
    name: str
    topics: tuple[str, ...]
    broadcast: bool
    next: dict[str, int]
    ready: list[tuple[float, str, int]] = field(default_factory=list)  # (not before, topic, offset)
    counts: dict[tuple[str, int], int] = field(default_factory=dict)
    members: int = 0
    dead: list[tuple[str, int, str]] = field(default_factory=list)
    acked: set[tuple[str, int]] = field(default_factory=set)


@dataclass
class _Member:
    group: _Group
    inflight: dict[str, tuple[str, int]] = field(default_factory=dict)


class MemoryEngine:
    """TEST ONLY (see module docstring)."""

    def __init__(self) -> None:
        self.log: dict[str, list[tuple[str, OutgoingMessage]]] = {}
        self._ids: dict[str, dict[str, int]] = {}
        self._groups: dict[str, _Group] = {}
        self._members: dict[str, _Member] = {}
        self._serial = itertools.count(1)
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def publish(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Placement]:
        log, ids = self.log.setdefault(topic, []), self._ids.setdefault(topic, {})
        placed = []
        for message in messages:
            message_id = message.message_id or f"m{next(self._serial)}"
            if message_id in ids:
                placed.append(Placement(topic, 0, ids[message_id], message_id, duplicate=True))
                continue
            ids[message_id] = len(log)
            log.append((message_id, message))
            placed.append(Placement(topic, 0, len(log) - 1, message_id))
        self._wake()
        return placed

    async def join(self, group: str, topics: Sequence[str], *, broadcast: bool = False,
                   from_end: bool = False) -> str:
        member = f"member-{next(self._serial)}"
        name = f"{group}#{member}" if broadcast else group
        start = {t: len(self.log.get(t, [])) if from_end else 0 for t in topics}
        state = self._groups.setdefault(name, _Group(group, tuple(topics), broadcast, start))
        state.members += 1
        self._members[member] = _Member(state)
        return member

    def _member(self, member: str) -> _Member:
        try:
            return self._members[member]
        except KeyError:
            raise RequestError(f"unknown member {member!r}") from None

    async def leave(self, member: str) -> None:
        state = self._members.pop(member, None)
        if state is None:
            return
        state.group.members -= 1
        state.group.ready.extend((0.0, t, o) for t, o in state.inflight.values())
        self._wake()

    async def fetch(self, member: str, max_messages: int, timeout: float) -> list[Delivery]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            state = self._member(member)
            taken = self._take(state, max_messages, loop.time())
            wait = deadline - loop.time()
            if taken or wait <= 0:
                return taken
            pending = [when - loop.time() for when, _, _ in state.group.ready]
            wait = min([wait, *(p for p in pending if p > 0)])
            try:
                await asyncio.wait_for(self._changed.wait(), wait)
            except TimeoutError:
                pass

    def _take(self, state: _Member, max_messages: int, now: float) -> list[Delivery]:
        group, places = state.group, []
        for entry in sorted(group.ready):
            if len(places) < max_messages and entry[0] <= now:
                group.ready.remove(entry)
                places.append(entry[1:])
        for topic in group.topics:
            end = len(self.log.get(topic, []))
            while len(places) < max_messages and group.next[topic] < end:
                places.append((topic, group.next[topic]))
                group.next[topic] += 1
        return [self._deliver(state, topic, offset) for topic, offset in places]

    def _deliver(self, state: _Member, topic: str, offset: int) -> Delivery:
        count = state.group.counts[topic, offset] = state.group.counts.get((topic, offset), 0) + 1
        receipt = f"r{next(self._serial)}"
        state.inflight[receipt] = (topic, offset)
        message_id, message = self.log[topic][offset]
        return Delivery(receipt, topic, 0, offset, message_id, message.body, message.key,
                        message.tag, dict(message.headers), count)

    def _settle(self, member: str, receipts: Sequence[str]) -> list[tuple[str, int]]:
        state = self._member(member)
        unknown = [r for r in receipts if r not in state.inflight]
        if unknown:
            raise RequestError(f"unknown receipts {unknown} for member {member!r}")
        return [state.inflight.pop(r) for r in receipts]

    async def ack(self, member: str, receipts: Sequence[str]) -> None:
        self._member(member).group.acked.update(self._settle(member, receipts))

    async def nack(self, member: str, receipts: Sequence[str], delay: float) -> None:
        group = self._member(member).group
        when = asyncio.get_running_loop().time() + delay
        group.ready.extend((when, t, o) for t, o in self._settle(member, receipts))
        self._wake()

    async def dead_letter(self, member: str, receipts: Sequence[str], reason: str) -> None:
        group = self._member(member).group
        group.dead.extend((t, o, reason) for t, o in self._settle(member, receipts))

    async def commit(self, member: str, offsets: Mapping[tuple[str, int], int]) -> None:
        group = self._member(member).group
        for (topic, _queue), offset in offsets.items():
            group.next[topic] = offset

    async def topics(self) -> list[TopicInfo]:
        return [TopicInfo(name, 1, len(log)) for name, log in sorted(self.log.items())]

    async def groups(self) -> list[GroupInfo]:
        return [GroupInfo(g.name, g.topics, g.members, g.broadcast) for g in self._groups.values()]

    async def lag(self, group: str) -> list[QueueLag]:
        if group not in self._groups:
            raise RequestError(f"unknown group {group!r}")
        state = self._groups[group]
        return [QueueLag(t, 0, state.next[t], len(self.log.get(t, []))) for t in state.topics]

    def dead_letters(self, group: str) -> list[tuple[str, int, str]]:
        return self._groups[group].dead
