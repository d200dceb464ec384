"""A message scheduled for later waits in a group by its offset, not in memory whole.

A group reading a topic parks each message whose ``x-deliver-at`` lies ahead, and kept it whole
(body, key, headers) until due: a producer scheduling a gigabyte for next year made every group
of the topic hold that gigabyte (measured: one fetch parked 16.7 MB, its ``max_fetch_bytes``,
and each fetch after it as much again). Parked messages are now read from the store when due.
"""

from __future__ import annotations

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import Delivery, OutgoingMessage
from broker.store.clock import FakeClock

BODY = 10_000
SCHEDULED = 300


def test_scheduled_messages_wait_as_offsets_and_come_whole_when_due(tmp_path, unique) -> None:
    clock = FakeClock()
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1, max_fetch_bytes=1_000_000), clock=clock)
    try:
        later = str(clock.time() + 60)
        broker.publish(unique, [OutgoingMessage(f"{n:04}".encode() + b"x" * (BODY - 4), key=str(n),
                                                headers={"x-deliver-at": later, "h": "v"}) for n in range(SCHEDULED)])
        broker.publish(unique, [OutgoingMessage(b"now")])
        member = broker.join(unique, [unique], prefetch=1000)
        got = []
        while not got:  # each fetch reads up to max_fetch_bytes, parking what is not due
            got = broker.fetch(member, 1000, 0)
        assert [d.body for d in got] == [b"now"]
        broker.ack(member, [got[0].receipt])
        cursor = broker.consuming.membership.group_table[unique].cursors[(unique, 0)]
        assert len(cursor.parked) == SCHEDULED  # every one of them read and waiting
        kept = [value for entry in cursor.parked for value in entry]
        assert not any(isinstance(value, (bytes, Delivery)) for value in kept)  # 3 MB of bodies, held
        assert broker.fetch(member, 1000, 0) == []
        clock.advance(61)
        due: list[Delivery] = []
        while fetched := broker.fetch(member, 1000, 0):
            due += fetched
            broker.ack(member, [d.receipt for d in fetched])
        assert sorted(d.body[:4] for d in due) == [f"{n:04}".encode() for n in range(SCHEDULED)]
        assert {(len(d.body), d.delivery_count, tuple(d.headers.items())) for d in due} == {(BODY, 1, (("h", "v"),))}
        assert sorted(int(d.key) for d in due) == list(range(SCHEDULED))
    finally:
        broker.close()
