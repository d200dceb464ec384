"""Groups whose members all left cost a sweep nothing.

A group is never deleted: one joined once and left keeps its cursors. The
sweep that lapses expired leases (every fetch, at most every ``SWEEP_EVERY``)
must look only at groups with members, else every fetch of every client pays
for each group ever joined (8,000 such groups made joins crawl).
"""

from __future__ import annotations

from collections.abc import Iterator

from broker.delivery.cursor import QueueCursor
from broker.delivery.group import Group
from broker.store import FakeClock
from tests.broker.delivery.conftest import Open, messages

EMPTY_GROUPS = 40


def test_a_sweep_visits_only_the_cursors_of_groups_with_members(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker(queues=2, lease=5.0, session_timeout=3600.0)
    broker.publish("orders", messages(4))
    for n in range(EMPTY_GROUPS):  # each takes something and leaves it unacknowledged
        member = broker.join(f"gone-{n}", ["orders"])
        assert broker.fetch(member, 10, 0)
        broker.leave(member)
    live = broker.join("live", ["orders"])
    first = broker.fetch(live, 10, 0)
    assert len(first) == 4

    visited: list[QueueCursor] = []
    leases = broker.consuming.leases
    expire = leases.expire

    def counting(now: float, cursors: Iterator[tuple[Group, QueueCursor]]) -> None:
        seen = list(cursors)
        visited.extend(cursor for _, cursor in seen)
        expire(now, iter(seen))

    leases.expire = counting  # type: ignore[method-assign]
    clock.advance(6.0)  # the live member's lease ends: the sweep must still find it
    again = broker.fetch(live, 10, 0)

    assert sorted(d.body for d in again) == sorted(d.body for d in first)
    assert {d.delivery_count for d in again} == {2}
    live_group = broker.consuming.membership.group_table["live"]
    assert visited and set(visited) <= set(live_group.cursors.values())
    assert len(visited) == len(live_group.cursors)  # not the 40 empty groups' cursors too


def test_a_group_emptied_and_joined_again_is_swept_again(open_broker: Open, clock: FakeClock) -> None:
    broker = open_broker(queues=2, lease=5.0, session_timeout=3600.0)
    broker.publish("orders", messages(3))
    member = broker.join("g", ["orders"])
    broker.leave(member)
    member = broker.join("g", ["orders"])
    first = broker.fetch(member, 10, 0)
    assert len(first) == 3
    clock.advance(6.0)
    again = broker.fetch(member, 10, 0)
    assert sorted(d.body for d in again) == sorted(d.body for d in first)
    assert {d.delivery_count for d in again} == {2}
