"""A group whose members all left keeps no message in memory, only offsets and delivery counts.

A group is never deleted, and one that emptied kept what its members had been handed and not
acknowledged (their leases lapse: ready again), bodies, keys and headers, for as long as it
stayed empty. A client joining a new group, fetching a window's worth and hanging up pinned that
much per group: ``max_unacked_bytes`` (64 MiB) times ``max_groups`` (10,000). Now an empty
group's messages are read from the store again when a member comes, counted as redelivered.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.client import Client
from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.server.server import BrokerServer
from broker.store.clock import FakeClock
from tests.broker.server import threaded
from tests.waiting import wait_until

BODY = 64 * 1024
MESSAGES = 16  # 1 MiB a group
GROUPS = 12


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with threaded.serving(tmp_path, FakeClock(), {}, delivery=DeliveryConfig(queues=2)) as started:
        yield started


def engine(server: BrokerServer) -> Broker:
    api = server.engine.api
    assert isinstance(api, Broker)
    return api


def in_memory(server: BrokerServer, groups: list[str]) -> int:
    """Bytes of bodies the groups keep ready to deliver again (held in the server's memory)."""
    table = engine(server).consuming.membership.group_table
    return sum(len(d.body) for name in groups for c in table[name].all_cursors() for d in c.ready.values())


def spilled(server: BrokerServer, groups: list[str]) -> int:
    table = engine(server).consuming.membership.group_table
    return sum(len(c.spilled) for name in groups for c in table[name].all_cursors())


def test_a_client_that_fetches_in_group_after_group_and_hangs_up_pins_no_bodies(server, unique) -> None:
    producer = Client(threaded.native(server))
    producer.publish(unique, [OutgoingMessage(f"{n:04}".encode() + b"x" * (BODY - 4), key=f"{n}",
                                              headers={"h": "v"}) for n in range(MESSAGES)])
    groups = [f"{unique}-{n}" for n in range(GROUPS)]
    for group in groups:  # the hostile client: a window's worth in each group, never acked
        hostile = Client(threaded.native(server))
        got = hostile.fetch(hostile.join(group, [unique], prefetch=1000), 1000, 0.0)
        assert len(got) == MESSAGES
        hostile.close()
    wait_until(lambda: all(not engine(server).consuming.membership.group_table[g].members for g in groups),
               "every member to have left with its connection")
    assert in_memory(server, groups) == 0  # 12 MiB of bodies kept when empty groups held them
    assert spilled(server, groups) == GROUPS * MESSAGES  # each group's lapsed deliveries, by offset
    client = Client(threaded.native(server))  # the owner comes back: everything, once, redelivered
    member = client.join(groups[0], [unique], prefetch=1000)
    again = client.fetch(member, 1000, 0.0)
    assert sorted(d.body[:4] for d in again) == [f"{n:04}".encode() for n in range(MESSAGES)]
    assert {(d.delivery_count, len(d.body), d.headers["h"]) for d in again} == {(2, BODY, "v")}
    assert sorted(int(d.key) for d in again) == list(range(MESSAGES))
    client.ack(member, [d.receipt for d in again])
    assert client.fetch(member, 1000, 0.0) == []
    assert sum(q.lag for q in client.lag(groups[0])) == 0
    client.close()


def test_an_ordered_group_emptied_delivers_its_spilled_messages_in_order(tmp_path: Path, unique) -> None:
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1, max_deliveries=3))
    try:
        broker.publish(unique, [OutgoingMessage(f"{n}".encode()) for n in range(3)])
        member = broker.join(unique, [unique], ordered=True)
        assert [d.body for d in broker.fetch(member, 10, 0)] == [b"0"]
        broker.leave(member)
        member = broker.join(unique, [unique], ordered=True)
        first = broker.fetch(member, 10, 0)
        assert [(d.body, d.delivery_count) for d in first] == [(b"0", 2)]
        broker.leave(member)  # delivered twice now: the third is its last (max_deliveries=3)
        member = broker.join(unique, [unique], ordered=True)
        third = broker.fetch(member, 10, 0)
        assert [(d.body, d.delivery_count) for d in third] == [(b"0", 3)]
        broker.leave(member)  # spent: dead-lettered, not delivered a fourth time
        member = broker.join(unique, [unique], ordered=True)
        seen = []
        while got := broker.fetch(member, 10, 0):
            seen += [(d.body, d.delivery_count) for d in got]
            broker.ack(member, [d.receipt for d in got])
        assert seen == [(b"1", 1), (b"2", 1)]
    finally:
        broker.close()


def test_a_position_reader_moving_an_empty_group_past_its_spilled_messages_drops_them(tmp_path: Path, unique) -> None:
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1))
    try:
        broker.publish(unique, [OutgoingMessage(f"{n}".encode()) for n in range(6)])
        member = broker.join(unique, [unique])
        assert len(broker.fetch(member, 5, 0)) == 5  # 0-4 handed out, never acked
        broker.leave(member)
        cursor = broker.consuming.membership.group_table[unique].cursors[(unique, 0)]
        assert [offset for offset, _ in cursor.spilled] == [0, 1, 2, 3, 4]
        broker.commit_group(unique, unique, [3])  # the reader is done below 3
        member = broker.join(unique, [unique])
        got = broker.fetch(member, 10, 0)
        assert sorted((d.body, d.delivery_count) for d in got) == [(b"3", 2), (b"4", 2), (b"5", 1)]
    finally:
        broker.close()
