"""How a group's queues are spread over its members: RocketMQ's allocation strategies.

A strategy is any callable ``(queues, members) -> {member: [queue, ...]}``:
``queues`` and ``members`` arrive sorted, every queue goes to exactly one
member (a queue is never held by two), and the same inputs always give the
same answer, so every member computes the same assignment.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Callable, Mapping, Sequence

QueueKey = tuple[str, int]
Assignment = dict[str, list[QueueKey]]
Strategy = Callable[[Sequence[QueueKey], Sequence[str]], Assignment]


def averagely(queues: Sequence[QueueKey], members: Sequence[str]) -> Assignment:
    """Contiguous blocks: member *i* of *n* takes the *i*-th slice (RocketMQ's default)."""
    result: Assignment = {member: [] for member in members}
    if not members:
        return result
    size, extra = divmod(len(queues), len(members))
    start = 0
    for index, member in enumerate(members):
        count = size + (1 if index < extra else 0)
        result[member] = list(queues[start:start + count])
        start += count
    return result


def averagely_by_circle(queues: Sequence[QueueKey], members: Sequence[str]) -> Assignment:
    """Dealt like cards: queue *k* goes to member *k mod n*."""
    result: Assignment = {member: [] for member in members}
    for index, queue in enumerate(queues):
        if members:
            result[members[index % len(members)]].append(queue)
    return result


class ConsistentHash:
    """A hash ring with ``virtual_nodes`` points per member: a member joining or leaving
    moves only the queues next to its points."""

    def __init__(self, virtual_nodes: int = 10) -> None:
        self.virtual_nodes = virtual_nodes

    def __call__(self, queues: Sequence[QueueKey], members: Sequence[str]) -> Assignment:
        result: Assignment = {member: [] for member in members}
        if not members:
            return result
        ring = sorted((_hash(f"{member}#{n}"), member) for member in members
                      for n in range(self.virtual_nodes))
        points = [point for point, _ in ring]
        for queue in queues:
            at = bisect.bisect(points, _hash(f"{queue[0]}@{queue[1]}")) % len(ring)
            result[ring[at][1]].append(queue)
        return result


class ByConfiguration:
    """Queues named per member; a queue nobody names goes averagely to the members."""

    def __init__(self, plan: Mapping[str, Sequence[QueueKey]]) -> None:
        self.plan = {member: [tuple(q) for q in queues] for member, queues in plan.items()}

    def __call__(self, queues: Sequence[QueueKey], members: Sequence[str]) -> Assignment:
        result: Assignment = {member: [] for member in members}
        taken: set[QueueKey] = set()
        for member in members:
            for queue in self.plan.get(member, []):
                if queue in queues and queue not in taken:
                    result[member].append(queue)  # type: ignore[arg-type]
                    taken.add(queue)  # type: ignore[arg-type]
        rest = [queue for queue in queues if queue not in taken]
        for member, extra in averagely(rest, members).items():
            result[member].extend(extra)
        return result


class ByMachineRoom:
    """Members take queues of their own machine room first; queues of a room without
    members are shared by everyone (RocketMQ's machine-room nearby allocation)."""

    def __init__(self, room_of_member: Callable[[str], str], room_of_queue: Callable[[QueueKey], str],
                 within: Strategy = averagely) -> None:
        self.room_of_member = room_of_member
        self.room_of_queue = room_of_queue
        self.within = within

    def __call__(self, queues: Sequence[QueueKey], members: Sequence[str]) -> Assignment:
        result: Assignment = {member: [] for member in members}
        rooms: dict[str, list[str]] = {}
        for member in members:
            rooms.setdefault(self.room_of_member(member), []).append(member)
        orphans: list[QueueKey] = []
        for room in sorted({self.room_of_queue(queue) for queue in queues}):
            local = [queue for queue in queues if self.room_of_queue(queue) == room]
            if room not in rooms:
                orphans.extend(local)
                continue
            for member, part in self.within(local, rooms[room]).items():
                result[member].extend(part)
        for member, part in self.within(sorted(orphans), members).items():
            result[member].extend(part)
        return result


def _hash(text: str) -> int:
    return zlib.crc32(text.encode())


STRATEGIES: dict[str, Strategy] = {
    "averagely": averagely,
    "averagely_by_circle": averagely_by_circle,
    "consistent_hash": ConsistentHash(),
}
"""The strategies a setting can name; `ByConfiguration` and `ByMachineRoom` take arguments."""
