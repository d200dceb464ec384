"""Messages a group keeps by offset (parked until due, or spilled by a group that emptied) cost a
few bytes each, not a Python tuple each.

Kept as ``(due, offset, deliveries)`` tuples in a heap, a parked message held about 130 bytes
(measured with tracemalloc: 128.8 bytes each for 200,000 scheduled messages), so ten million
tiny messages scheduled for tomorrow held 1.3 GB in every group reading their topic; an emptied
group's ``(offset, deliveries)`` tuples 64 bytes each. Both are columns of machine numbers now
(`broker.delivery.waiting`): 21 and 17 bytes a message, measured alike.
"""

from __future__ import annotations

import gc
import heapq
import random
import tracemalloc
from collections.abc import Callable

from broker.delivery.config import DeliveryConfig
from broker.delivery.engine import Broker
from broker.delivery.values import OutgoingMessage
from broker.delivery.waiting import Parked
from broker.store.clock import FakeClock

MESSAGES = 20_000


def retained(step: Callable[[], None]) -> int:
    """Bytes of Python objects ``step`` leaves allocated."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        step()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_a_scheduled_message_waits_in_a_group_as_about_twenty_bytes(tmp_path, unique) -> None:
    clock = FakeClock()
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1), clock=clock)
    try:
        later = clock.time() + 3600
        broker.publish(unique, [OutgoingMessage(b"x", deliver_at=later) for _ in range(MESSAGES)])
        member = broker.join(unique, [unique], prefetch=1000)
        cursor = broker.consuming.membership.group_table[unique].cursors[(unique, 0)]

        def park() -> None:
            while len(cursor.parked) < MESSAGES:
                assert broker.fetch(member, 1000, 0) == []

        kept = retained(park)
        assert kept / MESSAGES < 32, kept / MESSAGES  # a tuple each: 129 bytes (measured 21 now)
        clock.advance(3601)
        due = 0
        while fetched := broker.fetch(member, 1000, 0):
            due += len(fetched)
            broker.ack(member, [d.receipt for d in fetched])
        assert due == MESSAGES and len(cursor.parked) == len(cursor.spilled) == 0
    finally:
        broker.close()


def test_an_emptied_group_keeps_what_it_held_as_a_few_bytes_a_message(tmp_path, unique) -> None:
    broker = Broker(tmp_path / "broker", DeliveryConfig(queues=1, prefetch=MESSAGES))
    try:
        broker.publish(unique, [OutgoingMessage(b"x") for _ in range(MESSAGES)])
        member = broker.join(unique, [unique])
        held = 0
        while held < MESSAGES:
            held += len(broker.fetch(member, MESSAGES, 0))
        kept = retained(lambda: broker.leave(member))  # what it held is spilled: offsets and counts
        assert kept / MESSAGES < 32, kept / MESSAGES  # a tuple each: 64 bytes (measured 17 now)
        cursor = broker.consuming.membership.group_table[unique].cursors[(unique, 0)]
        assert sorted(cursor.spilled) == [(offset, 1) for offset in range(MESSAGES)]
        assert kept / MESSAGES < 20, kept / MESSAGES  # a tuple each: 100 bytes
    finally:
        broker.close()


def test_parked_messages_come_out_earliest_first_as_from_a_heap_of_tuples() -> None:
    """`Parked` against `heapq` on tuples: pushes and partial pops, and a drop below an offset."""
    rng, parked, reference = random.Random(7), Parked(), []
    for step in range(3000):
        due, offset = rng.choice([rng.random() * 100, 50.0]), step  # ties too
        parked.push(due, offset, step % 5)
        heapq.heappush(reference, (due, offset, step % 5))
        if step % 400 == 399:
            now = rng.random() * 100
            popped = []
            while reference and reference[0][0] <= now:
                popped.append(heapq.heappop(reference)[1:])
            assert sorted(parked.pop_due(now)) == sorted(popped)  # the same ones (they go to spilled, by offset)
            assert parked.next_due() == (reference[0][0] if reference else None)
    parked.drop_below(1500)
    reference = [entry for entry in reference if entry[1] >= 1500]
    assert sorted(parked) == sorted(reference)
    dues = dict((o, d) for d, o, _ in reference)
    assert [dues[o] for o, _ in parked.pop_due(1000.0)] == sorted(dues.values())  # earliest first
